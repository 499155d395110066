"""What one import request holds: its files, a `.zip` opened into the files of its
folder tree (each titled by its path inside the zip), each checked before anything
is read — so a bad entry is refused by name and the rest of the import goes on.

Nothing of an import is held in memory: each document's bytes are copied into a file
of the spool folder (an uploaded file straight from the request's own spool, a zip's
entry as it is unpacked), and read back when its batch is indexed.

Refused (each a `Refusal` with the HTTP status a client would get alone):
a path that climbs out of the zip (`../`, absolute, a drive) 400, a symlink 400, an
encrypted entry 422, a type that is not read 415, an entry or an import larger than
the limits 413, a zip bomb 413: an entry that unpacks to more than `MAX_RATIO` times
its packed size, or entries that together would unpack to more than `MAX_RATIO` times
the whole zip (many small entries of nothing). The bytes read from an entry never
exceed what its header declared and the limit: a header that lies cannot make it
read more.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import stat
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

from ..errors import BadRequest
from ..extract import kind_of

MAX_RATIO = 200
#: a zip of less than this unpacked is never a bomb, whatever its ratio
RATIO_FLOOR = 1 << 20
MAX_ENTRY_TITLE = 300
COPY_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class Entry:
    """A file to make a document of: its title (a name, or a path in a zip), kind, and
    its bytes in the spool file `path` (`size` of them), which its reader deletes."""

    title: str
    kind: str
    path: str
    size: int

    def read(self) -> bytes:
        return Path(self.path).read_bytes()

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


@dataclass(frozen=True, slots=True)
class Refusal:
    title: str
    error: str
    status: int
    size: int = 0


def entries(
    name: str,
    upload: BinaryIO,
    spool: Path,
    *,
    max_file_bytes: int,
    max_total_bytes: int,
    max_files: int,
) -> tuple[list[Entry], list[Refusal]]:
    """The documents in one uploaded file (a zip: its files), each copied into a file
    of `spool`, and what was refused. Blocks on disk: run it in a thread."""
    upload.seek(0, os.SEEK_END)
    size = upload.tell()
    upload.seek(0)
    if not name.lower().endswith(".zip"):
        try:
            kind = kind_of(name)
        except BadRequest as exc:
            return [], [Refusal(name, exc.message, exc.status, size)]
        if size > max_file_bytes:
            return [], [Refusal(name, f"larger than {max_file_bytes} bytes", 413, size)]
        if size > max_total_bytes:
            return [], [Refusal(name, f"the import passes its bytes ({size})", 413, size)]
        if max_files <= 0:
            return [], [Refusal(name, "more files than one import takes", 413, size)]
        path = _spooled(spool, upload, size)
        return [Entry(name, kind, path, size)], []
    return _unzip(name, upload, size, spool, max_file_bytes, max_total_bytes, max_files)


def _spooled(spool: Path, source: IO[bytes], limit: int) -> str:
    """A new file of `spool` with at most `limit` (+1) bytes of `source`; its path."""
    handle, path = tempfile.mkstemp(dir=spool, suffix=".part")
    try:
        with os.fdopen(handle, "wb") as out:
            left = limit + 1
            while left > 0:
                chunk = source.read(min(COPY_CHUNK, left))
                if not chunk:
                    break
                out.write(chunk)
                left -= len(chunk)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return path


def _unzip(
    name: str,
    upload: BinaryIO,
    packed: int,
    spool: Path,
    max_file_bytes: int,
    max_total_bytes: int,
    max_files: int,
) -> tuple[list[Entry], list[Refusal]]:
    try:
        archive = zipfile.ZipFile(upload)
    except (zipfile.BadZipFile, OSError):
        return [], [Refusal(name, "not a valid zip file", 422, packed)]
    found: list[Entry] = []
    refused: list[Refusal] = []
    total = 0
    budget = max(MAX_RATIO * max(packed, 1), RATIO_FLOOR)  # unpacked bytes, whole zip
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
            if total + info.file_size > budget:
                refused.append(
                    Refusal(
                        title,
                        f"the zip would unpack to more than {MAX_RATIO} times its"
                        f" {packed} bytes (a zip bomb?)",
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
                    spooled = _spooled(spool, member, min(info.file_size, max_file_bytes))
            except (
                zipfile.BadZipFile,
                OSError,
                RuntimeError,
                NotImplementedError,
                zlib.error,
            ) as exc:
                refused.append(Refusal(title, f"cannot be unpacked ({type(exc).__name__})", 422))
                continue
            size = os.path.getsize(spooled)
            if size > info.file_size:
                os.unlink(spooled)
                refused.append(Refusal(title, "larger than its zip entry says", 413))
                continue
            total += size
            found.append(Entry(title, kind, spooled, size))
    return found, refused


def discard(found: list[Entry]) -> None:
    for entry in found:
        entry.discard()


def new_spool(folder: str) -> Path:
    """A fresh folder for this process's imports (in `folder`, or the system's temp)."""
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="imports-", dir=folder or None))


def remove_spool(spool: Path) -> None:
    shutil.rmtree(spool, ignore_errors=True)
