"""What one import request holds: its files, a `.zip` opened into the files of its
folder tree (each titled by its path inside the zip), each checked before anything
is read — so a bad entry is refused by name and the rest of the import goes on.

Refused (each a `Refusal` with the HTTP status a client would get alone):
a path that climbs out of the zip (`../`, absolute, a drive) 400, a symlink 400, an
encrypted entry 422, a type that is not read 415, an entry or an import larger than
the limits 413, an entry that unpacks to more than `MAX_RATIO` times its packed size
(a zip bomb) 413. The bytes read from an entry never exceed what its header declared
and the limit: a header that lies cannot make it read more.
"""

from __future__ import annotations

import io
import posixpath
import stat
import zipfile
from dataclasses import dataclass

from ..errors import BadRequest
from ..files.extract import kind_of

MAX_RATIO = 200
MAX_ENTRY_TITLE = 300


@dataclass(frozen=True, slots=True)
class Entry:
    """A file to make a document of: its title (a name, or a path in a zip), kind, bytes."""

    title: str
    kind: str
    data: bytes


@dataclass(frozen=True, slots=True)
class Refusal:
    title: str
    error: str
    status: int
    size: int = 0


def entries(
    name: str, data: bytes, *, max_file_bytes: int, max_total_bytes: int, max_files: int
) -> tuple[list[Entry], list[Refusal]]:
    """The documents in one uploaded file (a zip: its files), and what was refused."""
    if not name.lower().endswith(".zip"):
        try:
            kind = kind_of(name)
        except BadRequest as exc:
            return [], [Refusal(name, exc.message, exc.status, len(data))]
        if len(data) > max_file_bytes:
            return [], [Refusal(name, f"larger than {max_file_bytes} bytes", 413, len(data))]
        return [Entry(name, kind, data)], []
    return _unzip(name, data, max_file_bytes, max_total_bytes, max_files)


def _unzip(
    name: str, data: bytes, max_file_bytes: int, max_total_bytes: int, max_files: int
) -> tuple[list[Entry], list[Refusal]]:
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        return [], [Refusal(name, "not a valid zip file", 422, len(data))]
    found: list[Entry] = []
    refused: list[Refusal] = []
    total = 0
    with archive:
        for info in archive.infolist():
            if info.is_dir():
                continue
            title = f"{name}/{info.filename}"[-MAX_ENTRY_TITLE:]
            path = info.filename.replace("\\", "/")
            parts = path.split("/")
            if path.startswith("/") or ".." in parts or (len(path) > 1 and path[1] == ":"):
                refused.append(Refusal(title, "a path that leaves the folder (refused)", 400))
                continue
            clean = posixpath.normpath(path)
            if any(p.startswith(".") or p == "__MACOSX" for p in clean.split("/")):
                continue  # hidden files and macOS resource forks are no documents
            title = clean[-MAX_ENTRY_TITLE:]
            if stat.S_ISLNK(info.external_attr >> 16):
                refused.append(Refusal(title, "a symbolic link (refused)", 400))
                continue
            if info.flag_bits & 0x1:
                refused.append(Refusal(title, "encrypted (refused)", 422, info.compress_size))
                continue
            try:
                kind = kind_of(clean)
            except BadRequest as exc:
                refused.append(Refusal(title, exc.message, exc.status, info.file_size))
                continue
            if info.file_size > max_file_bytes:
                refused.append(
                    Refusal(title, f"larger than {max_file_bytes} bytes", 413, info.file_size)
                )
                continue
            if info.file_size > MAX_RATIO * max(info.compress_size, 1) and info.file_size > 1 << 20:
                refused.append(
                    Refusal(
                        title,
                        f"unpacks to {info.file_size} bytes from {info.compress_size}"
                        " (a zip bomb?)",
                        413,
                        info.file_size,
                    )
                )
                continue
            if total + info.file_size > max_total_bytes:
                refused.append(
                    Refusal(
                        title, f"the import passes {max_total_bytes} bytes", 413, info.file_size
                    )
                )
                continue
            if len(found) >= max_files:
                refused.append(Refusal(title, f"more than {max_files} files in one import", 413))
                continue
            try:
                with archive.open(info) as member:
                    body = member.read(min(info.file_size, max_file_bytes) + 1)
            except (zipfile.BadZipFile, OSError, RuntimeError, NotImplementedError) as exc:
                refused.append(Refusal(title, f"cannot be unpacked ({type(exc).__name__})", 422))
                continue
            if len(body) > info.file_size:
                refused.append(Refusal(title, "larger than its zip entry says", 413))
                continue
            total += len(body)
            found.append(Entry(title, kind, body))
    return found, refused
