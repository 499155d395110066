"""Your own documents: upload, index, list, delete, and the passages that answer a question.

An upload is read and chunked by tokens, with the page each chunk is on, in a
child process (`app/extract.py`: CPU work stays off the event loop), embedded in batches
through the configured embeddings model (when there is one), put in the collections
engine as a document of its owner's private space (`uploads-<userId>`), and stored —
file, chunks and vectors in one transaction, so a file is either ready or failed,
never half there. A question over some files is the collections' one retrieval path
(`collections/retrieval.py`) kept to those files: BM25 over the statistics of all the
owner's uploads and, with embeddings, the nearest passages, fused. An upload made
before the engine held uploads is put in it from the store the first time it is asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..chores import Chores
from ..collections.base import Passage as IndexedPassage
from ..collections.retrieval import Retriever
from ..config import UploadSettings
from ..errors import AppError, BadRequest, NotFound
from ..extract import Extracted, cited_page, extract, kind_of
from ..ids import Snowflake
from ..model import Embedder
from ..ownership import authorize
from ..results import SearchResult
from ..scoring import Bm25Index, bm25_scores, cosines
from ..store import FileRecord, Store, StoredChunk

log = logging.getLogger("app.files")

STOPPED = "the server stopped while reading this file; upload it again"


def uploads_space(user_id: str) -> str:
    """The engine space of a user's uploads (collection ids are digits: no clash)."""
    return f"uploads-{user_id}"


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
        retriever: Retriever,
        indexer: str = "",
    ) -> None:
        self.settings = settings
        self.store = store
        self.embedder = embedder
        self.ids = ids
        self.retriever = retriever
        #: this process's worker lease token, kept with the uploads it reads: one left
        #: `indexing` by a process that died is swept as `failed`
        self.indexer = indexer
        self._in_engine: set[str] = set()  # files known to be in the engine
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
        try:
            await self._put_in_engine(record, stored)
        except AppError as exc:
            failed = replace(record, status="failed", error=f"indexing failed: {exc.message}")
            await self.store.finish_file(failed, [])
            raise
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

    async def _put_in_engine(self, record: FileRecord, chunks: Sequence[StoredChunk]) -> None:
        """The file's chunks (with their vectors, when all have them) in its owner's space."""
        passages = [
            IndexedPassage(
                record.id, c.n, cited_page(record.kind, c.page), record.name, "File", c.text
            )
            for c in chunks
        ]
        matrix = None
        widths = {len(c.vector) for c in chunks if c.vector is not None}
        if chunks and len(widths) == 1 and all(c.vector is not None for c in chunks):
            raw = np.frombuffer(b"".join(c.vector or b"" for c in chunks), dtype=np.float32)
            matrix = raw.reshape(len(chunks), -1)
        await self.retriever.engine.add(uploads_space(record.user_id), passages, matrix)
        self._in_engine.add(record.id)

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
        authorize(record.user_id, user_id, "file")
        return record

    async def list_files(self, user_id: str) -> list[FileRecord]:
        return await self.store.list_files(user_id)

    async def delete(self, user_id: str, file_id: str) -> None:
        await self.owned(user_id, file_id)
        await self.retriever.engine.delete_documents(uploads_space(user_id), [file_id])
        await self.store.delete_file(file_id)
        self._in_engine.discard(file_id)

    async def usable(self, user_id: str, file_ids: Sequence[str]) -> list[FileRecord]:
        """The files a chat request names, checked: each exists, is the user's and is
        ready. `BadRequest` naming the first that is not (PROTOCOL §1)."""
        records = []
        for file_id in file_ids:
            record = await self.store.get_file(file_id)
            refusal = BadRequest(f"files: {file_id!r} is not one of your uploads")
            if record is None:
                raise refusal
            authorize(record.user_id, user_id, refusal=refusal)
            if record.status != "ready":
                raise BadRequest(f"files: {record.name!r} is {record.status}, not ready")
            records.append(record)
        return records

    # -- retrieval --------------------------------------------------------------------------

    async def passages(self, files: Sequence[FileRecord], query: str, k: int) -> list[Passage]:
        """The `k` passages of `files` that best answer `query`, best first (scores are
        the fusion's: comparable among passages only)."""
        if not files:
            return []
        for record in files:
            await self._ensure_in_engine(record)
        spaces = sorted({uploads_space(f.user_id) for f in files})
        hits = await self.retriever.search(spaces, query, k, documents=[f.id for f in files])
        return [
            Passage(
                SearchResult(
                    title=h.passage.title,
                    url="File",
                    snippet=h.passage.text,
                    file_id=h.passage.document_id,
                    page=h.passage.page,
                ),
                h.score,
            )
            for h in hits
        ]

    async def _ensure_in_engine(self, record: FileRecord) -> None:
        """An upload older than the engine's uploads spaces goes in once, from the store."""
        if record.id in self._in_engine:
            return
        if not await self.retriever.engine.has_document(uploads_space(record.user_id), record.id):
            chunks = await self.store.file_chunks(record.id)
            if chunks:
                await self._put_in_engine(record, chunks)
        self._in_engine.add(record.id)

    async def rank_together(
        self, query: str, web: list[SearchResult], passages: list[Passage], limit: int
    ) -> list[SearchResult]:
        """Web results and file passages in one ranking by how well each answers
        `query` (the same scorer for both), the best `limit`."""
        if not web:
            return [p.result for p in passages[:limit]]
        texts = [f"{r.title}\n{r.snippet}" for r in web]
        try:
            vectors = await self.embedder.embed(
                [query, *texts, *(p.result.snippet for p in passages)]
            )
            scores = cosines(vectors[0], vectors[1:])
            web_scores, file_scores = scores[: len(web)], scores[len(web) :]
        except AppError:  # no embeddings model (or it failed): BM25 over all of them
            everything = texts + [p.result.snippet for p in passages]
            (lexical,) = bm25_scores([Bm25Index(everything)], query)
            web_scores, file_scores = lexical[: len(web)].tolist(), lexical[len(web) :].tolist()
        ranked = sorted(
            zip(web_scores + file_scores, web + [p.result for p in passages], strict=True),
            key=lambda pair: -pair[0],
        )
        return [result for _, result in ranked[:limit]]


def clean_name(name: str) -> str:
    """A file name without its path, control characters or excess length."""
    name = name.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(ch for ch in name if ch.isprintable()).strip()
    return name[-200:] or "file"
