"""Imports into knowledge collections: documents recorded at once, then read, chunked,
embedded and indexed in the background, their progress followed, and those a dead
process left `indexing` swept.

An import answers at once: every document of the request is recorded — `indexing`,
or `failed` with why when it is refused by name (`archive.py`) — and then read,
chunked (in a child process, `app/extract.py`), embedded in batches (when an
embeddings model is configured) and indexed in the background, a few documents at a
time per process. A document is searchable once all its passages are in the engine,
and `ready` after that; one that fails leaves nothing in the engine. The event loop
only waits: reading runs in child processes, the engine in threads.

Deleting races with indexing, and loses nowhere: a delete removes the store's row
first and then the passages, and a batch re-reads its rows after it put its passages
in the engine, taking back those whose document (or collection) went meanwhile.
Whichever finishes last removes what the other left. Documents a stopped or dead
process left `indexing` are failed and their passages taken back (`sweep`).

Who may import into which collection is the service's to check (`service.py`): the
importer is handed collections its caller may change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..chores import Chores
from ..config import CollectionSettings, UploadSettings
from ..errors import AppError, BadRequest, NotFound, RateLimited, Unavailable
from ..extract import Chunk, chunk_pages, cited_page, clean, extract_many
from ..ids import Snowflake
from ..model import Embedder
from ..search.reader import Reader
from ..store import DocumentRecord, Store
from .archive import Entry, Refusal, discard, entries, new_spool, remove_spool
from .base import Engine, Passage
from .retrieval import embed_texts

log = logging.getLogger("app.collections")

MAX_URLS = 100
BATCH_FILES = 32  # documents read by one child process and indexed in one commit
BATCH_BYTES = 16 * 1024 * 1024
STOPPED = "the server stopped while importing this document; add it again"
FAILED = "internal error while indexing"
SWEEP_SECONDS = 10.0
SWEEP_GRACE = 30.0  # seconds a document is `indexing` before a sweep may fail it
IMPORT_RETRY_SECONDS = 10  # Retry-After of an import refused for the imports running
PROGRESS_FALLBACK_SECONDS = 2.0  # a watcher reads the store at least this often


@dataclass(frozen=True, slots=True)
class Progress:
    """An import: how many documents it has, how many have ended, which failed."""

    total: int
    done: int
    failed: list[dict[str, Any]]

    @property
    def ended(self) -> bool:
        return self.done >= self.total

    def to_json(self) -> dict[str, Any]:
        return {"done": self.done, "total": self.total, "failed": self.failed}


@dataclass(eq=False)
class ImportSlot:
    """One import counted against `collections.max_imports*` from its request until its
    last batch has ended: the request holds it, and each batch it starts."""

    key: str
    counts: dict[str, int]
    holders: int = 1
    released: bool = field(default=False)

    def hold(self) -> None:
        self.holders += 1

    def release(self) -> None:
        self.holders -= 1
        if self.holders <= 0 and not self.released:
            self.released = True
            self.counts[self.key] -= 1
            if not self.counts[self.key]:
                del self.counts[self.key]
            self.counts[""] -= 1


class Importer:
    """The imports of this process: how many run (per user or address, and in all),
    the spool folder their files wait in, the batches indexing them, and who watches
    their progress."""

    def __init__(
        self,
        settings: CollectionSettings,
        uploads: UploadSettings,
        *,
        store: Store,
        engine: Engine,
        embedder: Embedder,
        reader: Reader,
        ids: Snowflake,
        indexer: str = "",
    ) -> None:
        self.settings = settings
        self.uploads = uploads
        self.store = store
        self.engine = engine
        self.embedder = embedder
        self.reader = reader
        self.ids = ids
        self._chores = Chores("collections")
        #: this process's worker lease token, kept with the documents it imports: one
        #: left `indexing` by a process that died is swept as `failed`
        self.indexer = indexer
        self._importing = asyncio.Semaphore(max(1, settings.import_concurrency))
        #: imports running, per user (or address) and in all (key "")
        self._imports: dict[str, int] = {"": 0}
        #: import id → an event set (and replaced) whenever one of its documents ends here
        self._changed: dict[str, asyncio.Event] = {}
        self._watchers: dict[str, int] = {}
        self._spool: Path | None = None

    async def open(self) -> None:
        """Make the spool folder and start the sweep of documents left `indexing`."""
        self._spool = await asyncio.to_thread(new_spool, self.settings.spool_dir)
        self._chores.loop("document sweeper", self._sweeper)

    async def aclose(self) -> None:
        """Stop the imports still running: each marks its documents `failed` (add them
        again) and takes their passages back, within a moment; what is left is swept."""
        await self._chores.aclose()
        if self._spool is not None:
            await asyncio.to_thread(remove_spool, self._spool)

    async def _sweeper(self) -> None:
        while True:
            try:
                await self.sweep()
            except AppError as exc:
                log.info("document sweep skipped: %s", exc.message)
            await asyncio.sleep(SWEEP_SECONDS)

    async def sweep(self, grace: float = SWEEP_GRACE) -> int:
        """Fail the documents a process that died left `indexing` (its worker lease ran
        out), and take their passages out of the engine: a batch killed between putting
        its passages in and marking them `ready` leaves them there. Any process may run
        it at any time (each document is claimed by one). Returns how many."""
        swept = await self.store.fail_orphaned_documents(STOPPED, time.time() - grace)
        by_collection: dict[str, list[str]] = {}
        for collection_id, document_id in swept:
            by_collection.setdefault(collection_id, []).append(document_id)
        for collection_id, ids in by_collection.items():
            await self.engine.delete_documents(collection_id, ids)
        if swept:
            log.info("failed %d documents left indexing by a stopped process", len(swept))
        return len(swept)

    @contextlib.asynccontextmanager
    async def importing(self, key: str) -> AsyncIterator[ImportSlot]:
        """Room for one more import of `key` (a user, or with auth off an address):
        `RateLimited` (429) past `max_imports_per_user` of theirs, `Unavailable` (503)
        past `max_imports` of this process, both with a Retry-After — before the
        request's body is read. The slot is held until the import's last batch ends."""
        if self._imports.get(key, 0) >= max(1, self.settings.max_imports_per_user):
            raise RateLimited(
                "you have imports running; wait for one to end",
                retry_after=IMPORT_RETRY_SECONDS,
            )
        if self._imports[""] >= max(1, self.settings.max_imports):
            raise Unavailable(
                "the server is busy with imports; try again shortly",
                retry_after=IMPORT_RETRY_SECONDS,
            )
        self._imports[key] = self._imports.get(key, 0) + 1
        self._imports[""] += 1
        slot = ImportSlot(key, self._imports)
        try:
            yield slot
        finally:
            slot.release()

    async def import_files(
        self, collection_id: str, files: Sequence[tuple[str, BinaryIO]], slot: ImportSlot
    ) -> tuple[str, list[DocumentRecord]]:
        """Record every document of `files` (a zip's files each), copied into the spool
        folder, and index them in the background; returns the import's id and its
        documents (refused ones `failed`). `BadRequest` when there are no files, or
        when every one of them was refused (the first refusal's status, naming them)."""
        if not files:
            raise BadRequest("send the files as multipart form parts named 'files'")
        found, refused = await asyncio.to_thread(self._spool_files, files)
        try:
            return await self._start(collection_id, found, refused, [], slot)
        except BaseException:
            await asyncio.to_thread(discard, found)
            raise

    def _spool_files(
        self, files: Sequence[tuple[str, BinaryIO]]
    ) -> tuple[list[Entry], list[Refusal]]:
        if self._spool is None:
            raise Unavailable("the collections service is not open")
        found: list[Entry] = []
        refused: list[Refusal] = []
        budget = self.settings.max_import_bytes
        try:
            for name, upload in files:
                more, no = entries(
                    name,
                    upload,
                    self._spool,
                    max_file_bytes=self.uploads.max_file_bytes,
                    max_total_bytes=max(0, budget - sum(e.size for e in found)),
                    max_files=max(0, self.settings.max_import_files - len(found)),
                )
                found += more
                refused += no
        except BaseException:
            discard(found)
            raise
        return found, refused

    async def import_urls(
        self, collection_id: str, urls: Any, slot: ImportSlot
    ) -> tuple[str, list[DocumentRecord]]:
        """Record a document per URL and read them with the reader in the background."""
        if not isinstance(urls, list) or not urls or len(urls) > MAX_URLS:
            raise BadRequest(f"urls must be a list of 1 to {MAX_URLS} http(s) URLs")
        good, refused = [], []
        for url in urls:
            if isinstance(url, str) and url.lower().startswith(("http://", "https://")):
                good.append(url[:4096])
            else:
                refused.append(Refusal(str(url)[:300], "not an http(s) URL", 400))
        return await self._start(collection_id, [], refused, list(dict.fromkeys(good)), slot)

    async def _start(
        self,
        collection_id: str,
        found: list[Entry],
        refused: list[Refusal],
        urls: list[str],
        slot: ImportSlot,
    ) -> tuple[str, list[DocumentRecord]]:
        import_id = self.ids.next_str()
        now = time.time()
        items: dict[str, Entry | str] = {}
        records: list[DocumentRecord] = []
        queue: list[Entry | str] = [*found, *urls]
        for item in queue:
            title, kind, size = (
                (item.title, item.kind, item.size) if isinstance(item, Entry) else (item, "url", 0)
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
            items[record.id] = item
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
        limit = self.settings.max_documents
        counted = sum(
            1 for d in await self.store.list_documents(collection_id) if d.status != "failed"
        )
        if not items or counted >= limit:  # nothing to index: record nothing, say why
            if not records:
                raise BadRequest("the import has no documents")
            if items:
                raise BadRequest(f"the collection has its {limit} documents", status=413)
            first = records[0]
            names = "; ".join(f"{r.title!r}: {r.error}" for r in records[:10])
            raise BadRequest(f"no document could be imported: {names}", status=first.code or 400)
        # counted again in the store's transaction: concurrent imports cannot pass it
        stored = await self.store.add_documents(records, self.indexer, limit)
        queued = [(r, items[r.id]) for r in stored if r.status == "indexing"]
        refused_now = [items.get(r.id) for r in stored if r.status == "failed"]
        await asyncio.to_thread(discard, [e for e in refused_now if isinstance(e, Entry)])
        batch: list[tuple[DocumentRecord, Entry | str]] = []
        size = 0
        for record, item in queued:
            batch.append((record, item))
            size += item.size if isinstance(item, Entry) else BATCH_BYTES
            if len(batch) >= BATCH_FILES or size >= BATCH_BYTES:
                self._spawn(batch, slot)
                batch, size = [], 0
        if batch:
            self._spawn(batch, slot)
        return import_id, stored

    def _spawn(self, batch: list[tuple[DocumentRecord, Entry | str]], slot: ImportSlot) -> None:
        slot.hold()
        self._chores.spawn(self._index(batch, slot))

    async def _index(
        self, batch: list[tuple[DocumentRecord, Entry | str]], slot: ImportSlot
    ) -> None:
        """Read, chunk, embed and index some documents, then mark them `ready` — or
        each that fails `failed` with why, with nothing of it left in the engine. The
        documents that were read go into the engine together (one commit). A server
        that stops meanwhile, or an error of ours, marks the batch's documents still
        `indexing` as failed and takes their passages back."""
        try:
            await self._index_batch(batch)
        except asyncio.CancelledError:
            stopped = [replace(r, status="failed", error=STOPPED, code=503) for r, _ in batch]
            with contextlib.suppress(AppError, TimeoutError):
                async with asyncio.timeout(2.0):
                    await asyncio.shield(self._fail_unfinished(stopped))
            raise
        except Exception as exc:
            log.error("indexing a batch of %d documents failed", len(batch), exc_info=exc)
            why = exc.message if isinstance(exc, AppError) else FAILED
            code = exc.status if isinstance(exc, AppError) else 500
            failed = [replace(r, status="failed", error=why, code=code) for r, _ in batch]
            try:
                await self._fail_unfinished(failed)
            except AppError as again:  # the sweep fails them once this process is gone
                log.warning("documents left indexing: %s", again.message)
        finally:
            await asyncio.to_thread(discard, [e for _, e in batch if isinstance(e, Entry)])
            self._ended({r.import_id for r, _ in batch})
            slot.release()

    async def _fail_unfinished(self, records: list[DocumentRecord]) -> None:
        """Mark those of `records` still `indexing` failed, as each says, once their
        passages are out of the engine."""
        unfinished = []
        for record in records:
            current = await self.store.get_document(record.id)
            if current is not None and current.status == "indexing":
                unfinished.append(record)
        if not unfinished:
            return
        await self.engine.delete_documents(unfinished[0].collection_id, [r.id for r in unfinished])
        for record in unfinished:
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
            collection_id = read[0][0].collection_id
            everything = [p for _, _, passages in read for p in passages]
            try:  # the batch's passages together: fewer, fuller requests to the model
                vectors = await self._embed([p.text for p in everything])
            except Exception as exc:
                for record, *_ in read:
                    await self._failed(record, exc)
                return
            try:
                await self.engine.add(collection_id, everything, vectors)
            except Exception as exc:
                for record, *_ in read:
                    await self._failed(record, exc)
                return
            read = await self._still_there(collection_id, read)
            for record, pages, passages in read:
                ready = replace(record, status="ready", pages=pages, chunks=len(passages))
                await self.store.finish_document(ready)
            log.info(
                "documents indexed",
                extra={
                    "fields": {
                        "collectionId": collection_id,
                        "documents": len(read),
                        "chunks": len(everything),
                        "embedded": vectors is not None,
                        "ms": round((time.monotonic() - started) * 1000, 1),
                    }
                },
            )

    async def _still_there(
        self, collection_id: str, read: list[tuple[DocumentRecord, int, list[Passage]]]
    ) -> list[tuple[DocumentRecord, int, list[Passage]]]:
        """Those of `read` whose document is still in the store, read after their
        passages went in: the passages of the others (deleted meanwhile, with their
        collection or alone) are taken back out."""
        if await self.store.get_collection(collection_id) is None:
            await self.engine.drop(collection_id)
            return []
        kept: list[tuple[DocumentRecord, int, list[Passage]]] = []
        gone: list[tuple[DocumentRecord, int, list[Passage]]] = []
        for item in read:
            (kept if await self.store.get_document(item[0].id) is not None else gone).append(item)
        if gone:
            await self.engine.delete_documents(collection_id, [r.id for r, *_ in gone])
        return kept

    async def _failed(self, record: DocumentRecord, exc: Exception) -> None:
        if not isinstance(exc, AppError):
            log.error("indexing document %s failed", record.id, exc_info=exc)
            exc = AppError(FAILED)
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
        extracted = []
        if files:
            data = await asyncio.to_thread(lambda: [(e.title, e.read()) for _, e in files])
            extracted = await extract_many(
                data,
                max_pages=u.max_pages,
                timeout=u.extract_timeout_seconds,
                chunk_tokens=u.chunk_tokens,
                overlap=u.chunk_overlap_tokens,
            )
            del data
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

    def _ended(self, import_ids: set[str]) -> None:
        """Wake the watchers of these imports (some of their documents ended)."""
        for import_id in import_ids:
            event = self._changed.pop(import_id, None)
            if event is not None:
                event.set()

    async def progress(self, collection_id: str, import_id: str) -> Progress:
        total, done, failed = await self.store.import_progress(collection_id, import_id)
        if not total:
            raise NotFound("no such import")
        return Progress(
            total,
            done,
            [
                {"name": r.title, "error": r.error, "status": r.code, "documentId": r.id}
                for r in failed
            ],
        )

    async def follow(self, collection_id: str, import_id: str) -> AsyncGenerator[Progress, None]:
        """The import's progress now, then each time it changed, until it has ended.
        A batch of this process that ends wakes its watchers at once; the store is
        read again at least every `PROGRESS_FALLBACK_SECONDS` (another process may run
        the import), and once per wake for every watcher. Cancelling is safe."""
        progress = await self.progress(collection_id, import_id)
        yield progress
        self._watchers[import_id] = self._watchers.get(import_id, 0) + 1
        try:
            while not progress.ended:
                event = self._changed.setdefault(import_id, asyncio.Event())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(PROGRESS_FALLBACK_SECONDS):
                        await event.wait()
                now = await self.progress(collection_id, import_id)
                if now != progress:
                    progress = now
                    yield progress
        finally:
            self._watchers[import_id] -= 1
            if not self._watchers[import_id]:
                del self._watchers[import_id]
                self._changed.pop(import_id, None)


def _passages(record: DocumentRecord, chunks: Sequence[Chunk]) -> list[Passage]:
    url = record.url or "File"
    return [
        Passage(record.id, c.n, cited_page(record.kind, c.page), record.title, url, c.text)
        for c in chunks
    ]
