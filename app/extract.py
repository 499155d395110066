"""Text out of a file, page by page: PDF (pypdf), DOCX (python-docx), HTML (its main
text, as the page reader takes it too: `extract_main_text`), plain text and Markdown;
for uploads and knowledge collections alike, and chunked by tokens (`chunk_pages`).

Extraction is CPU work on input nobody vetted, so it never runs in the server's
process: `extract()` runs this module as a child process (`python -m
app.extract`), with the file on stdin, a CPU-time limit, an address-space
limit and a lower priority than the server's (on a shared core, streams go
first), and kills it at the deadline. A zip bomb, a PDF that loops, a crash —
each costs one child, never the event loop or the server.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from .errors import BadRequest

#: extension → what it is read as
KINDS = {
    "pdf": "pdf",
    "docx": "docx",
    "txt": "text",
    "md": "text",
    "markdown": "text",
    "html": "html",
    "htm": "html",
}
MEMORY_BYTES = 1024 * 1024 * 1024  # the child's address space
DOCX_EXPANDED_BYTES = 200 * 1024 * 1024  # a DOCX that unpacks to more is refused
DOCX_RATIO = 200  # … or that unpacks to more than this many times its size


TOKEN = re.compile(r"\w+|[^\w\s]")
#: what a page's main text is read without
_DROP = "script, style, noscript, template, svg, nav, header, footer, aside, form, iframe, button"
_BLANKS = re.compile(r"\n{3,}")


@dataclass(frozen=True, slots=True)
class Chunk:
    n: int
    page: int  # 1-based
    text: str


@dataclass(frozen=True, slots=True)
class Extracted:
    """A file's text as chunks, and its number of pages (1 for formats without pages)."""

    pages: int
    chunks: list[Chunk]


class Unreadable(BadRequest):
    """The file is of a known kind but cannot be read (broken, encrypted, empty)."""

    status = 422


def cited_page(kind: str, page: int) -> int:
    """The page a passage of a `kind` file is cited with: its page (1-based) in a
    format that has pages (PDF), 0 — no page — in one that has none."""
    return page if kind == "pdf" else 0


def kind_of(name: str) -> str:
    """What a file is read as, from its name; `BadRequest` (415) for another type."""
    extension = name.rsplit(".", 1)[-1].lower() if "." in name else ""
    kind = KINDS.get(extension)
    if kind is None:
        raise BadRequest(
            f"{name!r}: only {', '.join(sorted(set(KINDS) - {'htm', 'markdown'}))} files can be"
            " uploaded",
            status=415,
        )
    return kind


async def extract(
    name: str, data: bytes, *, max_pages: int, timeout: float, chunk_tokens: int, overlap: int
) -> Extracted:
    """The text of a file as chunks (see `chunk_pages`), read in a child process.
    Raises `BadRequest`: 415 a type it does not read, 413 too many pages or too large
    unpacked, 422 broken, encrypted, without text, or not read within `timeout` s."""
    kind = kind_of(name)
    args = [kind, str(max_pages), str(max(1, int(timeout))), str(chunk_tokens), str(overlap)]
    try:
        answer = await run_child(args, [data], timeout)
    except TimeoutError as exc:
        raise Unreadable(f"{name!r} took longer than {timeout:g} s to read") from exc
    except orjson.JSONDecodeError as exc:
        raise Unreadable(f"{name!r} could not be read (the reader stopped)") from exc
    if "error" in answer:
        raise (Unreadable if answer["status"] == 422 else BadRequest)(
            f"{name!r}: {answer['error']}", status=answer["status"]
        )
    chunks = [Chunk(n, page, text) for n, (page, text) in enumerate(answer["chunks"])]
    if not chunks:
        raise Unreadable(f"{name!r} has no text (a scan, or an empty file)")
    return Extracted(answer["pages"], chunks)


async def extract_many(
    items: Sequence[tuple[str, bytes]],
    *,
    max_pages: int,
    timeout: float,
    chunk_tokens: int,
    overlap: int,
) -> list[Extracted | BadRequest]:
    """Several files read in one child process (one start-up instead of one per file:
    a zipped folder of notes is mostly start-ups otherwise), each file's chunks or the
    `BadRequest` that refuses it, in order. `timeout` is per file. When the child
    fails as a whole (a file that loops or takes all its memory), each file is read
    again alone, so one bad file costs only itself."""
    if len(items) == 1:
        name, data = items[0]
        try:
            return [
                await extract(
                    name,
                    data,
                    max_pages=max_pages,
                    timeout=timeout,
                    chunk_tokens=chunk_tokens,
                    overlap=overlap,
                )
            ]
        except BadRequest as exc:
            return [exc]
    out: list[Extracted | BadRequest | None] = []
    frames = [len(items).to_bytes(4, "big")]
    for name, data in items:
        try:
            kind = kind_of(name)
        except BadRequest as exc:
            out.append(exc)
            kind = "text"
            data = b""
        else:
            out.append(None)
        frames += [kind.encode().ljust(8), len(data).to_bytes(8, "big"), data]
    budget = timeout * len(items)
    args = ["batch", str(max_pages), str(max(1, int(budget))), str(chunk_tokens), str(overlap)]
    try:
        answers = await run_child(args, frames, budget)
        if not isinstance(answers, list) or len(answers) != len(items):
            raise ValueError("short answer")
    except (TimeoutError, ValueError, orjson.JSONDecodeError):
        answers = None
    results: list[Extracted | BadRequest] = []
    for i, (name, data) in enumerate(items):
        refused = out[i]
        if refused is not None:
            results.append(refused)
        elif answers is None:
            alone = await extract_many(
                [(name, data)],
                max_pages=max_pages,
                timeout=timeout,
                chunk_tokens=chunk_tokens,
                overlap=overlap,
            )
            results.append(alone[0])
        else:
            try:
                results.append(_extracted(name, answers[i]))
            except BadRequest as exc:
                results.append(exc)
    return results


async def run_child(args: Sequence[str], data: list[bytes], timeout: float) -> Any:
    """The JSON that `python -m app.extract ARGS` writes for `data` (joined) on its
    stdin; raises `TimeoutError` (the child killed) after `timeout` s, and
    `orjson.JSONDecodeError` when the child wrote no JSON (it crashed). Joining the
    input and decoding the answer happen in the thread too: for a batch they are
    megabytes. The child is started and waited
    on in a thread with the standard library's `subprocess` (vfork: a couple of ms
    whatever the server's size): uvloop's spawn forks, which copies the page tables of
    the whole server with the event loop held — ~150 ms at 1.5 GB, a stall of every
    stream. Cancelling is safe: the child is killed (at the latest at `timeout`)."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        return await asyncio.to_thread(_run_child, list(args), data, timeout, started)
    except subprocess.TimeoutExpired as exc:
        raise TimeoutError from exc
    except asyncio.CancelledError:
        for child in started:
            child.kill()  # its thread's communicate() then returns, and reaps it
        raise


def _run_child(
    args: list[str], data: list[bytes], timeout: float, started: list[subprocess.Popen[bytes]]
) -> Any:
    child = subprocess.Popen(
        [sys.executable, "-m", "app.extract", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    started.append(child)
    try:
        out, _ = child.communicate(b"".join(data), timeout)
        return orjson.loads(out)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def _extracted(name: str, answer: dict[str, object]) -> Extracted:
    """A child's answer for one file: its chunks, or the `BadRequest` it said."""
    if "error" in answer:
        status = int(answer["status"])  # type: ignore[call-overload]
        raise (Unreadable if status == 422 else BadRequest)(
            f"{name!r}: {answer['error']}", status=status
        )
    pairs = answer["chunks"]
    assert isinstance(pairs, list)
    chunks = [Chunk(n, page, text) for n, (page, text) in enumerate(pairs)]
    if not chunks:
        raise Unreadable(f"{name!r} has no text (a scan, or an empty file)")
    return Extracted(int(answer["pages"]), chunks)  # type: ignore[call-overload]


def chunk_pages(pages: Sequence[str], size: int, overlap: int) -> list[Chunk]:
    """Each page's text as windows of `size` tokens overlapping by `overlap`; a chunk
    never crosses a page, so every passage can be cited with its page. Tokens are
    words and punctuation marks: close to what a model's tokenizer counts for prose,
    with no tokenizer to download."""
    step = size - max(0, min(overlap, size - 1))
    chunks: list[Chunk] = []
    for number, page in enumerate(pages, start=1):
        spans = [(m.start(), m.end()) for m in TOKEN.finditer(page)]
        start = 0
        while start < len(spans):
            window = spans[start : start + size]
            chunks.append(Chunk(len(chunks), number, page[window[0][0] : window[-1][1]]))
            if start + size >= len(spans):
                break
            start += step
    return chunks


def clean(text: str) -> str:
    text = text.replace("\x00", "")
    text = re.sub(r"[ \t\u00a0]+", " ", text)
    return re.sub(r"\n\s*\n\s*\n+", "\n\n", text).strip()


# -- the child -----------------------------------------------------------------------------


class Refused(Exception):
    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


def read(kind: str, data: bytes, max_pages: int) -> list[str]:
    if not data:
        raise Refused("the file is empty", 400)
    if kind == "pdf":
        return read_pdf(data, max_pages)
    if kind == "docx":
        return [read_docx(data)]
    text = decode(data)
    if kind == "html":
        return [extract_main_text(text)]
    return [text]


def read_pdf(data: bytes, max_pages: int) -> list[str]:
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise Refused("the PDF is encrypted")
        if len(reader.pages) > max_pages:
            raise Refused(f"the PDF has {len(reader.pages)} pages, more than {max_pages}", 413)
        return [page.extract_text() or "" for page in reader.pages]
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise Refused(f"the PDF cannot be read ({type(exc).__name__})") from exc


def read_docx(data: bytes) -> str:
    import docx

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            expanded = sum(info.file_size for info in archive.infolist())
    except zipfile.BadZipFile as exc:
        raise Refused("the DOCX is not a valid document") from exc
    if expanded > DOCX_EXPANDED_BYTES or expanded > DOCX_RATIO * max(len(data), 1):
        raise Refused(f"the DOCX unpacks to {expanded} bytes (a zip bomb?)", 413)
    try:
        document = docx.Document(io.BytesIO(data))
    except Exception as exc:  # python-docx raises many kinds for a broken file
        raise Refused("the DOCX is not a valid document") from exc
    parts = [p.text for p in document.paragraphs]
    for table in document.tables:
        for row in table.rows:
            parts.append(" | ".join(cell.text for cell in row.cells))
    return "\n".join(parts)


def extract_main_text(html: str) -> str:
    """The readable text of a page: its title, then `<article>`/`<main>` (else the
    body) without scripts, navigation, headers, footers and forms."""
    from selectolax.lexbor import LexborHTMLParser

    tree = LexborHTMLParser(html)
    title_node = tree.css_first("title")
    title = title_node.text(strip=True) if title_node else ""
    for node in tree.css(_DROP):
        node.decompose()
    root = tree.css_first("article") or tree.css_first("main") or tree.body
    text = root.text(separator="\n", strip=True) if root else ""
    text = _BLANKS.sub("\n\n", text)
    return f"{title}\n\n{text}".strip() if title and not text.startswith(title) else text


def decode(data: bytes) -> str:
    """Text in UTF-8 (or UTF-16 with its byte-order mark), else Latin-1; a file with NUL
    bytes in it is not text."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError as exc:
            raise Refused("the file is not text") from exc
    if b"\x00" in data[:65536]:
        raise Refused("the file is not text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def main() -> None:
    import resource

    kind, max_pages, cpu_seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    chunk_tokens, overlap = int(sys.argv[4]), int(sys.argv[5])
    os.nice(10)  # background work: on a busy core the server's streams go first
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    if kind == "batch":
        stream = sys.stdin.buffer
        answers = []
        for _ in range(int.from_bytes(stream.read(4), "big")):
            each = stream.read(8).decode().strip()
            data = stream.read(int.from_bytes(stream.read(8), "big"))
            answers.append(_answer(each, data, max_pages, chunk_tokens, overlap))
        sys.stdout.buffer.write(orjson.dumps(answers))
        return
    data = sys.stdin.buffer.read()
    sys.stdout.buffer.write(orjson.dumps(_answer(kind, data, max_pages, chunk_tokens, overlap)))


def _answer(kind: str, data: bytes, max_pages: int, chunk_tokens: int, overlap: int) -> object:
    """One file's chunks as the child answers them, or its error and status."""
    try:
        pages = [clean(page) for page in read(kind, data, max_pages)]
        chunks = chunk_pages(pages, chunk_tokens, overlap)
        answer: dict[str, object] = {
            "pages": len(pages),
            "chunks": [(c.page, c.text) for c in chunks],
        }
    except Refused as exc:
        answer = {"error": str(exc), "status": exc.status}
    except MemoryError:
        answer = {"error": "the file takes too much memory to read", "status": 413}
    return answer


if __name__ == "__main__":
    main()
