"""Your own documents: upload, index, list, delete, and the passages that answer a question.

An upload is read and chunked by tokens, with the page each chunk is on, in a
child process (`extract.py`: CPU work stays off the event loop), embedded in batches through the configured
embeddings model (when there is one), and stored — file, chunks and vectors in
one transaction, so a file is either ready or failed, never half there. A
question over some files ranks their chunks by cosine similarity to the
question's embedding, or by BM25 without an embeddings model. Each file's
matrix (or index) is kept in memory, least recently used out, so asking about a
300-page PDF costs about what asking about a note does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..chores import Chores
from ..config import UploadSettings
from ..errors import AppError, BadRequest, Forbidden, NotFound
from ..ids import Snowflake
from ..llm import Embedder
from ..search.base import SearchResult
from ..store import FileRecord, Store, StoredChunk
from .extract import Extracted, extract, kind_of
from .index import Bm25Index, bm25_scores, top, unit_rows

log = logging.getLogger("app.files")

CACHE_BYTES = 512 * 1024 * 1024
STOPPED = "the server stopped while reading this file; upload it again"


@dataclass(slots=True)
class Loaded:
    """A file's chunks ready to rank: unit vectors, or a BM25 index."""

    record: FileRecord
    texts: list[str]
    pages: list[int]
    matrix: np.ndarray | None
    bm25: Bm25Index | None = None

    @property
    def size(self) -> int:
        text = sum(len(t) for t in self.texts)
        return text + (self.matrix.nbytes if self.matrix is not None else 0)


@dataclass(frozen=True, slots=True)
class Passage:
    result: SearchResult
    score: float


class FileService:
    def __init__(
        self,
        settings: UploadSettings,
        *,
        store: Store,
        embedder: Embedder,
        ids: Snowflake,
        indexer: str = "",
    ) -> None:
        self.settings = settings
        self.store = store
        self.embedder = embedder
        self.ids = ids
        #: this process's worker lease token, kept with the uploads it reads: one left
        #: `indexing` by a process that died is swept as `failed`
        self.indexer = indexer
        self._cache: OrderedDict[str, Loaded] = OrderedDict()
        self._cached_bytes = 0
        self._chores = Chores("uploads")

    async def aclose(self) -> None:
        """Stop reading uploads still being read; each is marked `failed` (upload it
        again) rather than left `indexing`."""
        await self._chores.aclose()

    # -- uploads ----------------------------------------------------------------------------

    async def upload(self, user_id: str, name: str, data: bytes) -> FileRecord:
        """Read, chunk, embed and store a file for `user_id`; returns it `ready`.
        Raises `BadRequest` (4xx) for a file it will not take — then nothing is
        stored — and `AppError` when the embeddings model fails (the record stays,
        `failed`, saying why)."""
        record = self._record(user_id, name, data)
        extracted = await self._extract(record, data)
        await self.store.add_file(record, self.indexer)
        return await self._index(record, extracted)

    async def upload_later(self, user_id: str, name: str, data: bytes) -> FileRecord:
        """Store the file as `indexing` and index it in the background; poll `get` for
        `ready` or `failed` (with why)."""
        record = self._record(user_id, name, data)
        await self.store.add_file(record, self.indexer)
        self._chores.spawn(self._index_later(record, data), name=f"upload-{record.id}")
        return record

    async def _index_later(self, record: FileRecord, data: bytes) -> None:
        try:
            extracted = await self._extract(record, data)
            await self._index(record, extracted)
        except AppError as exc:
            failed = replace(record, status="failed", error=exc.message)
            await self.store.finish_file(failed, [])
        except asyncio.CancelledError:  # the server stops: say so, then stop
            failed = replace(record, status="failed", error=STOPPED)
            with contextlib.suppress(AppError, TimeoutError):
                async with asyncio.timeout(2.0):
                    await asyncio.shield(self.store.finish_file(failed, []))
            raise

    def _record(self, user_id: str, name: str, data: bytes) -> FileRecord:
        name = clean_name(name)
        kind = kind_of(name)
        if len(data) > self.settings.max_file_bytes:
            raise BadRequest(
                f"{name!r} is larger than {self.settings.max_file_bytes} bytes", status=413
            )
        return FileRecord(
            id=self.ids.next_str(),
            user_id=user_id,
            name=name,
            kind=kind,
            size=len(data),
            created_at=time.time(),
        )

    async def _extract(self, record: FileRecord, data: bytes) -> Extracted:
        return await extract(
            record.name,
            data,
            max_pages=self.settings.max_pages,
            timeout=self.settings.extract_timeout_seconds,
            chunk_tokens=self.settings.chunk_tokens,
            overlap=self.settings.chunk_overlap_tokens,
        )

    async def _index(self, record: FileRecord, extracted: Extracted) -> FileRecord:
        started = time.monotonic()
        chunks = extracted.chunks
        vectors: list[bytes | None] = [None] * len(chunks)
        try:
            if self.embedder.configured:
                vectors = list(await self._embed([c.text for c in chunks]))
        except AppError as exc:
            failed = replace(record, status="failed", error=f"embedding failed: {exc.message}")
            await self.store.finish_file(failed, [])
            raise
        stored = [StoredChunk(c.n, c.page, c.text, v) for c, v in zip(chunks, vectors, strict=True)]
        ready = replace(record, status="ready", pages=extracted.pages, chunks=len(chunks))
        await self.store.finish_file(ready, stored)
        log.info(
            "file indexed",
            extra={
                "fields": {
                    "fileId": ready.id,
                    "kind": ready.kind,
                    "bytes": ready.size,
                    "pages": ready.pages,
                    "chunks": ready.chunks,
                    "embedded": self.embedder.configured,
                    "ms": round((time.monotonic() - started) * 1000, 1),
                }
            },
        )
        return ready

    async def _embed(self, texts: list[str]) -> list[bytes]:
        out: list[bytes] = []
        batch = max(1, self.settings.embed_batch)
        for start in range(0, len(texts), batch):
            vectors = await self.embedder.embed(texts[start : start + batch])
            out.extend(row.tobytes() for row in vectors)
        return out

    async def owned(self, user_id: str, file_id: str) -> FileRecord:
        record = await self.store.get_file(file_id)
        if record is None:
            raise NotFound("no such file")
        if record.user_id != user_id:
            raise Forbidden("this file belongs to another user")
        return record

    async def list_files(self, user_id: str) -> list[FileRecord]:
        return await self.store.list_files(user_id)

    async def delete(self, user_id: str, file_id: str) -> None:
        await self.owned(user_id, file_id)
        await self.store.delete_file(file_id)
        self._forget(file_id)

    async def usable(self, user_id: str, file_ids: Sequence[str]) -> list[FileRecord]:
        """The files a chat request names, checked: each exists, is the user's and is
        ready. `BadRequest` naming the first that is not (PROTOCOL §1)."""
        records = []
        for file_id in file_ids:
            record = await self.store.get_file(file_id)
            if record is None or record.user_id != user_id:
                raise BadRequest(f"files: {file_id!r} is not one of your uploads")
            if record.status != "ready":
                raise BadRequest(f"files: {record.name!r} is {record.status}, not ready")
            records.append(record)
        return records

    # -- retrieval --------------------------------------------------------------------------

    async def passages(self, files: Sequence[FileRecord], query: str, k: int) -> list[Passage]:
        """The `k` passages of `files` that best answer `query`, best first."""
        loaded = [await self._load(record) for record in files]
        loaded = [f for f in loaded if f.texts]
        if not loaded:
            return []
        scores = await self._scores(loaded, query)
        flat = np.concatenate(scores)
        owners = np.concatenate([np.full(len(s), i) for i, s in enumerate(scores)])
        offsets = np.concatenate([np.arange(len(s)) for s in scores])
        out = []
        for index in top(flat, k):
            f, n = loaded[int(owners[index])], int(offsets[index])
            if flat[index] <= 0:
                break
            result = SearchResult(
                title=f.record.name,
                url="File",
                snippet=f.texts[n],
                file_id=f.record.id,
                page=f.pages[n] if f.record.kind == "pdf" else 0,
            )
            out.append(Passage(result, float(flat[index])))
        return out

    async def _scores(self, loaded: list[Loaded], query: str) -> list[np.ndarray]:
        if all(f.matrix is not None for f in loaded):
            try:
                vectors = await self.embedder.embed([query])
            except AppError as exc:
                log.info("query not embedded (%s): ranking passages with BM25", exc.message)
            else:
                q = unit_rows(vectors)[0]
                return [f.matrix @ q for f in loaded if f.matrix is not None]
        for f in loaded:
            if f.bm25 is None:
                f.bm25 = Bm25Index(f.texts)
        return bm25_scores([f.bm25 for f in loaded if f.bm25 is not None], query)

    async def rank_together(
        self, query: str, web: list[SearchResult], passages: list[Passage], limit: int
    ) -> list[SearchResult]:
        """Web results and file passages in one ranking by how well each answers
        `query` (the same scorer for both), the best `limit`."""
        if not web:
            return [p.result for p in passages[:limit]]
        texts = [f"{r.title}\n{r.snippet}" for r in web]
        try:
            vectors = await self.embedder.embed([query, *texts])
            matrix = unit_rows(vectors)
            web_scores = (matrix[1:] @ matrix[0]).tolist()
            file_scores = [p.score for p in passages]
        except AppError:  # no embeddings model (or it failed): BM25 over all of them
            everything = texts + [p.result.snippet for p in passages]
            (scores,) = bm25_scores([Bm25Index(everything)], query)
            web_scores, file_scores = scores[: len(web)].tolist(), scores[len(web) :].tolist()
        ranked = sorted(
            zip(web_scores + file_scores, web + [p.result for p in passages], strict=True),
            key=lambda pair: -pair[0],
        )
        return [result for _, result in ranked[:limit]]

    async def _load(self, record: FileRecord) -> Loaded:
        cached = self._cache.get(record.id)
        if cached is not None:
            self._cache.move_to_end(record.id)
            return cached
        chunks = await self.store.file_chunks(record.id)
        matrix = None
        if chunks and all(c.vector is not None for c in chunks):
            raw = np.frombuffer(b"".join(c.vector or b"" for c in chunks), dtype=np.float32)
            matrix = unit_rows(raw.reshape(len(chunks), -1))
        loaded = Loaded(record, [c.text for c in chunks], [c.page for c in chunks], matrix)
        self._cache[record.id] = loaded
        self._cached_bytes += loaded.size
        while self._cached_bytes > CACHE_BYTES and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.size
        return loaded

    def _forget(self, file_id: str) -> None:
        old = self._cache.pop(file_id, None)
        if old is not None:
            self._cached_bytes -= old.size


def clean_name(name: str) -> str:
    """A file name without its path, control characters or excess length."""
    name = name.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(ch for ch in name if ch.isprintable()).strip()
    return name[-200:] or "file"
