"""Knowledge collections (PROTOCOL §12): create, share, import, list, delete, search.

The store keeps what every process must agree on (collections, shares, documents and
their status); the engine (`base.py`) keeps the passages. An import answers at once:
every document of the request is recorded — `indexing`, or `failed` with why when it
is refused by name (`archive.py`) — and then read, chunked (in a child process,
`files/extract.py`), embedded in batches (when an embeddings model is configured) and
indexed in the background, a few documents at a time per process. A document is
searchable once all its passages are in the engine, and `ready` after that; one that
fails leaves nothing in the engine. The event loop only waits: reading runs in child
processes, the engine in threads.

Search is the one retrieval path (`retrieval.py`): BM25 over each collection's own
statistics and, with embeddings, the nearest passages, fused by reciprocal rank, then
reranked by `collections.rerank.url` when one is set.

Who may do what (§7): the owner everything; a user it is shared with may read and
search it (403 for a change); anyone else gets 404, as for a collection that does not
exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..chores import Chores
from ..config import CollectionSettings, UploadSettings
from ..errors import AppError, BadRequest, Forbidden, NotFound
from ..files.extract import Chunk, chunk_pages, clean, extract_many
from ..ids import Snowflake
from ..search.base import SearchResult
from ..search.reader import Reader
from ..store import CollectionRecord, DocumentRecord, Store
from .archive import Entry, Refusal, entries
from .base import Hit, Passage
from .retrieval import Retriever, embed_texts

log = logging.getLogger("app.collections")

MAX_NAME_CHARS = 200
MAX_DESCRIPTION_CHARS = 2000
MAX_SHARED = 100
MAX_URLS = 100
BATCH_FILES = 32  # documents read by one child process and indexed in one commit
BATCH_BYTES = 16 * 1024 * 1024
STOPPED = "the server stopped while importing this document; add it again"


@dataclass(frozen=True, slots=True)
class Progress:
    """An import: how many documents it has, how many have ended, which failed."""

    total: int
    done: int
    failed: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {"done": self.done, "total": self.total, "failed": self.failed}


class CollectionService:
    def __init__(
        self,
        settings: CollectionSettings,
        uploads: UploadSettings,
        *,
        store: Store,
        retriever: Retriever,
        reader: Reader,
        ids: Snowflake,
        indexer: str = "",
    ) -> None:
        self.settings = settings
        self.uploads = uploads
        self.store = store
        self.retriever = retriever
        self.engine = retriever.engine
        self.embedder = retriever.embedder
        self.reader = reader
        self.ids = ids
        self._chores = Chores("collections")
        #: this process's worker lease token, kept with the documents it imports: one
        #: left `indexing` by a process that died is swept as `failed`
        self.indexer = indexer
        self._importing = asyncio.Semaphore(max(1, settings.import_concurrency))

    async def aclose(self) -> None:
        """Stop the imports still running (their documents stay `indexing` until swept)."""
        await self._chores.aclose()

    # -- collections ----------------------------------------------------------------------

    async def create(self, user_id: str, name: Any, description: Any = "") -> CollectionRecord:
        record = CollectionRecord(
            id=self.ids.next_str(),
            owner=user_id,
            name=_text(name, "name", MAX_NAME_CHARS, required=True),
            description=_text(description, "description", MAX_DESCRIPTION_CHARS),
            created_at=time.time(),
        )
        await self.store.add_collection(record)
        return record

    async def readable(self, user_id: str, collection_id: str) -> CollectionRecord:
        """The collection, if `user_id` owns it or it is shared with them; else
        `NotFound` (another user's collection is not even said to exist)."""
        record = await self.store.get_collection(collection_id)
        if record is None or record.owner != user_id and user_id not in record.shared:
            raise NotFound("no such collection")
        return record

    async def owned(self, user_id: str, collection_id: str) -> CollectionRecord:
        """The collection, if `user_id` owns it; `Forbidden` for a user it is shared
        with (read-only), `NotFound` for anyone else."""
        record = await self.readable(user_id, collection_id)
        if record.owner != user_id:
            raise Forbidden("this collection is shared with you read-only")
        return record

    async def listed(self, user_id: str) -> list[CollectionRecord]:
        return await self.store.list_collections(user_id)

    async def update(
        self, user_id: str, collection_id: str, body: dict[str, Any]
    ) -> CollectionRecord:
        record = await self.owned(user_id, collection_id)
        unknown = set(body) - {"name", "description", "shared", "userId"}
        if unknown:
            raise BadRequest(f"cannot change {', '.join(sorted(unknown))}")
        changed = record
        if "name" in body:
            changed = replace(changed, name=_text(body["name"], "name", MAX_NAME_CHARS, True))
        if "description" in body:
            changed = replace(
                changed,
                description=_text(body["description"], "description", MAX_DESCRIPTION_CHARS),
            )
        if "shared" in body:
            changed = replace(changed, shared=_users(body["shared"], user_id))
        await self.store.update_collection(changed)
        return await self.owned(user_id, collection_id)

    async def delete(self, user_id: str, collection_id: str) -> None:
        await self.owned(user_id, collection_id)
        await self.store.delete_collection(collection_id)
        await self.engine.drop(collection_id)

    async def usable(self, user_id: str, collection_ids: Sequence[str]) -> list[CollectionRecord]:
        """The collections a chat request names, checked: `BadRequest` naming the first
        that does not exist or that the user may not read (PROTOCOL §1)."""
        found = []
        for collection_id in collection_ids:
            try:
                found.append(await self.readable(user_id, collection_id))
            except NotFound as exc:
                raise BadRequest(
                    f"collections: {collection_id!r} is not a collection you can read"
                ) from exc
        return found

    # -- documents --------------------------------------------------------------------------

    async def documents(self, user_id: str, collection_id: str) -> list[DocumentRecord]:
        await self.readable(user_id, collection_id)
        return await self.store.list_documents(collection_id)

    async def delete_document(self, user_id: str, collection_id: str, document_id: str) -> None:
        await self.owned(user_id, collection_id)
        record = await self.store.get_document(document_id)
        if record is None or record.collection_id != collection_id:
            raise NotFound("no such document in this collection")
        await self.engine.delete_documents(collection_id, [document_id])
        await self.store.delete_document(document_id)

    async def import_files(
        self, user_id: str, collection_id: str, files: Sequence[tuple[str, bytes]]
    ) -> tuple[str, list[DocumentRecord]]:
        """Record every document of `files` (a zip's files each) and index them in the
        background; returns the import's id and its documents (refused ones `failed`).
        `BadRequest` when there are no files, or when every one of them was refused
        (the first refusal's status, naming them)."""
        await self.owned(user_id, collection_id)
        if not files:
            raise BadRequest("send the files as multipart form parts named 'files'")
        found: list[Entry] = []
        refused: list[Refusal] = []
        budget = self.settings.max_import_bytes
        for name, data in files:
            more, no = await asyncio.to_thread(
                entries,
                name,
                data,
                max_file_bytes=self.uploads.max_file_bytes,
                max_total_bytes=max(0, budget - sum(len(e.data) for e in found)),
                max_files=max(0, self.settings.max_import_files - len(found)),
            )
            found += more
            refused += no
        return await self._start(collection_id, found, refused, [])

    async def import_urls(
        self, user_id: str, collection_id: str, urls: Any
    ) -> tuple[str, list[DocumentRecord]]:
        """Record a document per URL and read them with the reader in the background."""
        await self.owned(user_id, collection_id)
        if not isinstance(urls, list) or not urls or len(urls) > MAX_URLS:
            raise BadRequest(f"urls must be a list of 1 to {MAX_URLS} http(s) URLs")
        good, refused = [], []
        for url in urls:
            if isinstance(url, str) and url.lower().startswith(("http://", "https://")):
                good.append(url[:4096])
            else:
                refused.append(Refusal(str(url)[:300], "not an http(s) URL", 400))
        return await self._start(collection_id, [], refused, list(dict.fromkeys(good)))

    async def _start(
        self, collection_id: str, found: list[Entry], refused: list[Refusal], urls: list[str]
    ) -> tuple[str, list[DocumentRecord]]:
        import_id = self.ids.next_str()
        now = time.time()
        existing = len(await self.store.list_documents(collection_id))
        room = max(0, self.settings.max_documents - existing)
        queued: list[tuple[DocumentRecord, Entry | str]] = []
        records: list[DocumentRecord] = []
        items: list[Entry | str] = [*found, *urls]
        for item in items:
            title, kind, size = (
                (item.title, item.kind, len(item.data))
                if isinstance(item, Entry)
                else (item, "url", 0)
            )
            record = DocumentRecord(
                self.ids.next_str(),
                collection_id,
                import_id,
                title,
                kind,
                size,
                now,
                url="" if isinstance(item, Entry) else item,
            )
            if len(queued) >= room:
                record = replace(
                    record,
                    status="failed",
                    error=f"the collection has its {self.settings.max_documents} documents",
                    code=413,
                )
            else:
                queued.append((record, item))
            records.append(record)
        for r in refused:
            records.append(
                DocumentRecord(
                    self.ids.next_str(),
                    collection_id,
                    import_id,
                    r.title,
                    "",
                    r.size,
                    now,
                    status="failed",
                    error=r.error,
                    code=r.status,
                )
            )
        if not queued:
            if not records:
                raise BadRequest("the import has no documents")
            first = next(r for r in records if r.status == "failed")
            names = "; ".join(f"{r.title!r}: {r.error}" for r in records[:10])
            raise BadRequest(f"no document could be imported: {names}", status=first.code or 400)
        await self.store.add_documents(records, self.indexer)
        batch: list[tuple[DocumentRecord, Entry | str]] = []
        size = 0
        for record, item in queued:
            batch.append((record, item))
            size += len(item.data) if isinstance(item, Entry) else BATCH_BYTES
            if len(batch) >= BATCH_FILES or size >= BATCH_BYTES:
                self._chores.spawn(self._index(batch))
                batch, size = [], 0
        if batch:
            self._chores.spawn(self._index(batch))
        return import_id, records

    async def _index(self, batch: list[tuple[DocumentRecord, Entry | str]]) -> None:
        """Read, chunk, embed and index some documents, then mark them `ready` — or
        each that fails `failed` with why, with nothing of it left in the engine. The
        documents that were read go into the engine together (one commit). A server
        that stops meanwhile marks the batch's documents still `indexing` as failed."""
        try:
            await self._index_batch(batch)
        except asyncio.CancelledError:
            stopped = [replace(r, status="failed", error=STOPPED, code=503) for r, _ in batch]
            with contextlib.suppress(AppError, TimeoutError):
                async with asyncio.timeout(2.0):
                    await asyncio.shield(self._fail_unfinished(stopped))
            raise

    async def _fail_unfinished(self, records: list[DocumentRecord]) -> None:
        for record in records:
            current = await self.store.get_document(record.id)
            if current is not None and current.status == "indexing":
                await self.store.finish_document(record)

    async def _index_batch(self, batch: list[tuple[DocumentRecord, Entry | str]]) -> None:
        async with self._importing:
            started = time.monotonic()
            read: list[tuple[DocumentRecord, int, list[Passage]]] = []
            for record, pages, passages in await self._read(batch):
                if isinstance(passages, AppError):
                    await self._failed(record, passages)
                else:
                    read.append((record, pages, passages))
            if not read:
                return
            everything = [p for _, _, passages in read for p in passages]
            try:  # the batch's passages together: fewer, fuller requests to the model
                vectors = await self._embed([p.text for p in everything])
            except Exception as exc:
                for record, *_ in read:
                    await self._failed(record, exc)
                return
            try:
                await self.engine.add(read[0][0].collection_id, everything, vectors)
            except Exception as exc:
                for record, *_ in read:
                    await self._failed(record, exc)
                return
            for record, pages, passages in read:
                ready = replace(record, status="ready", pages=pages, chunks=len(passages))
                await self.store.finish_document(ready)
            log.info(
                "documents indexed",
                extra={
                    "fields": {
                        "collectionId": read[0][0].collection_id,
                        "documents": len(read),
                        "chunks": len(everything),
                        "embedded": vectors is not None,
                        "ms": round((time.monotonic() - started) * 1000, 1),
                    }
                },
            )

    async def _failed(self, record: DocumentRecord, exc: Exception) -> None:
        if not isinstance(exc, AppError):
            log.error("indexing document %s failed", record.id, exc_info=exc)
            exc = AppError("internal error while indexing")
        failed = replace(record, status="failed", error=exc.message, code=exc.status)
        try:
            await self.engine.delete_documents(record.collection_id, [record.id])
        finally:
            await self.store.finish_document(failed)

    async def _read(
        self, batch: list[tuple[DocumentRecord, Entry | str]]
    ) -> list[tuple[DocumentRecord, int, list[Passage] | AppError]]:
        """Each document's pages and passages, or the error that refuses it: files read
        together in one child process, URLs by the reader."""
        u = self.uploads
        files = [(r, e) for r, e in batch if isinstance(e, Entry)]
        extracted = (
            await extract_many(
                [(e.title, e.data) for _, e in files],
                max_pages=u.max_pages,
                timeout=u.extract_timeout_seconds,
                chunk_tokens=u.chunk_tokens,
                overlap=u.chunk_overlap_tokens,
            )
            if files
            else []
        )
        out: list[tuple[DocumentRecord, int, list[Passage] | AppError]] = []
        for (record, _), got in zip(files, extracted, strict=True):
            if isinstance(got, BadRequest):
                out.append((record, 0, got))
            else:
                out.append((record, got.pages, _passages(record, got.chunks)))
        for record, item in batch:
            if isinstance(item, Entry):
                continue
            try:
                text = clean(await self.reader.read(item))
                chunks = await asyncio.to_thread(
                    chunk_pages, [text], u.chunk_tokens, u.chunk_overlap_tokens
                )
                if not chunks:
                    raise BadRequest(f"{item!r} has no text", status=422)
                out.append((record, 1, _passages(record, chunks)))
            except AppError as exc:
                out.append((record, 0, exc))
        return out

    async def _embed(self, texts: list[str]) -> np.ndarray | None:
        return await embed_texts(self.embedder, texts, self.uploads.embed_batch)

    async def progress(self, user_id: str, collection_id: str, import_id: str) -> Progress:
        await self.readable(user_id, collection_id)
        records = await self.store.list_documents(collection_id, import_id)
        if not records:
            raise NotFound("no such import")
        failed = [
            {"name": r.title, "error": r.error, "status": r.code, "documentId": r.id}
            for r in records
            if r.status == "failed"
        ]
        done = sum(1 for r in records if r.status != "indexing")
        return Progress(len(records), done, failed)

    # -- search -----------------------------------------------------------------------------

    async def search(self, collections: Sequence[str], query: str, limit: int) -> list[Hit]:
        """The `limit` best passages of these collections for `query` (`Retriever`)."""
        return await self.retriever.search(collections, query, limit)

    def searcher(
        self, collections: Sequence[CollectionRecord], limit: int | None = None
    ) -> CollectionSearch:
        return CollectionSearch(self, [c.id for c in collections], limit or self.settings.passages)


@dataclass(frozen=True, slots=True)
class CollectionSearch:
    """`search_collection(query)` for one request: the passages of its collections as
    sources, best first. Small on purpose: the research loop calls it per
    sub-question, and a research agent's tool can call it as it is."""

    service: CollectionService
    collection_ids: list[str]
    limit: int

    async def __call__(self, query: str, limit: int | None = None) -> list[SearchResult]:
        hits = await self.service.search(self.collection_ids, query, limit or self.limit)
        return [as_source(hit) for hit in hits]


async def with_collections(
    out: Any, search: CollectionSearch, question: str, web: list[SearchResult]
) -> list[SearchResult]:
    """The collections' passages for `question` beside the web results, fused by rank
    (the two rankings are on no common scale): the best of each first, in turn."""
    out.emit("progress", data="searching your collections")
    passages = await search(question)
    if not web:
        return passages
    merged = []
    for i in range(max(len(web), len(passages))):
        merged += passages[i : i + 1] + web[i : i + 1]
    return merged


def as_source(hit: Hit) -> SearchResult:
    p = hit.passage
    return SearchResult(
        title=p.title,
        url=p.url or "File",
        snippet=p.text,
        page=p.page,
        collection_id=hit.space,
        document_id=p.document_id,
        score=hit.score,
    )


def _passages(record: DocumentRecord, chunks: Sequence[Chunk]) -> list[Passage]:
    url = record.url or "File"
    return [Passage(record.id, c.n, c.page, record.title, url, c.text) for c in chunks]


def _text(value: Any, name: str, limit: int, required: bool = False) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        raise BadRequest(f"{name} must be a{' non-empty' if required else ''} string")
    text = "".join(ch for ch in value if ch.isprintable()).strip()
    if len(text) > limit:
        raise BadRequest(f"{name} is longer than {limit} characters")
    return text


def _users(value: Any, owner: str) -> tuple[str, ...]:
    from ..protocol import parse_id

    if not isinstance(value, list) or len(value) > MAX_SHARED:
        raise BadRequest(f"shared must be a list of at most {MAX_SHARED} user ids")
    return tuple(dict.fromkeys(u for u in (parse_id(v, "shared[]") for v in value) if u != owner))
