"""The embedded engine: Tantivy (a Lucene-like search library, in-process) for BM25,
and the passages with their embeddings in a SQLite file beside it, ranked by cosine
with numpy over a matrix kept in memory per space.

The matrices of the spaces searched last stay in memory, at most `vector_cache_bytes`
of them together (the least recently searched are let go). A write moves its space's
version on; the next search of it reads only the rows added since (a delete, or new
vectors, has it read the space again). One space is read at a time, on a connection
of its own, so a big read holds up no other search of the engine.

    <folder>/passages.db        space, document, n → page, title, url, text, vector
    <folder>/<space>/           one Tantivy index per space (its own BM25 statistics)

Tantivy scores with BM25 (k1 = 1.2, b = 0.75, Lucene's idf) and answers top-k with
block-max WAND, so a query of common words does not score every passage (measured in
`bench/collections.py`). A space's index has one writer at a time: writers of this
process queue on a lock, another process's writer is waited for (Tantivy's lock file).
Readers see a commit at once in this process and within a moment in others.
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tantivy

from ..scoring import terms, top, unit_rows
from ..store.sqlite import reopen_pause
from .base import EngineError, Hit, Passage, ThreadedEngine, url_path
from .vectors import Vectors

WRITER_HEAP_BYTES = 64 * 1024 * 1024
WRITER_WAIT_SECONDS = 30.0
SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS passages (
    space TEXT NOT NULL,
    document_id TEXT NOT NULL,
    n INTEGER NOT NULL,
    page INTEGER NOT NULL,
    title TEXT NOT NULL,
    url TEXT NOT NULL,
    text TEXT NOT NULL,
    vector BLOB,
    PRIMARY KEY (space, document_id, n)
);
CREATE TABLE IF NOT EXISTS versions (space TEXT PRIMARY KEY, version INTEGER NOT NULL);
"""
#: `removed` moves on with a write that took rows away or changed vectors: a cached
#: matrix can then not be brought up to date by appending the rows added since
ADD_REMOVED = "ALTER TABLE versions ADD COLUMN removed INTEGER NOT NULL DEFAULT 0"


def _schema() -> tantivy.Schema:
    builder = tantivy.SchemaBuilder()
    builder.add_text_field("doc", stored=True, tokenizer_name="raw")
    builder.add_integer_field("n", stored=True, indexed=False)
    builder.add_text_field("text", stored=False, tokenizer_name="default")
    return builder.build()


class TantivyEngine(ThreadedEngine):
    def __init__(self, url: str, *, vector_cache_bytes: int = 512 << 20) -> None:
        self.folder = Path(url_path(url))
        self.schema = _schema()
        self._indexes: dict[str, tantivy.Index] = {}
        self._writing: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()  # the maps above, and the SQLite connection
        #: spaces' matrices, least recently searched first, and their bytes together
        self._vectors: OrderedDict[str, Vectors] = OrderedDict()
        self._cached_bytes = 0
        self.vector_cache_bytes = vector_cache_bytes
        self._cache_lock = threading.Lock()
        self._loading = threading.Lock()  # one space read at a time, on `_reader`
        self._db: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None

    async def open(self) -> None:
        await asyncio.to_thread(self._open)

    def _open(self) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            db = self._connect_and_migrate()
            reader = sqlite3.connect(
                self.folder / "passages.db", check_same_thread=False, isolation_level=None
            )
            reader.execute("PRAGMA busy_timeout=10000")
        except (OSError, sqlite3.Error) as exc:
            raise EngineError(f"the collections folder cannot be opened: {exc}") from exc
        self._db, self._reader = db, reader

    def _connect_and_migrate(self) -> sqlite3.Connection:
        """Workers may open one folder at once: the schema is brought up to date in one
        write transaction (closing the connection rolls back one that failed), and
        SQLite's "locked" refusals while a new file is made are retried, as the
        SQLite store does (`reopen_pause`)."""
        attempt = 0
        while True:
            db = sqlite3.connect(
                self.folder / "passages.db", check_same_thread=False, isolation_level=None
            )
            try:
                db.execute("PRAGMA busy_timeout=10000")
                db.execute("PRAGMA journal_mode=WAL")
                db.executescript("BEGIN IMMEDIATE;" + SCHEMA_SQL)
                columns = {row[1] for row in db.execute("PRAGMA table_info(versions)")}
                if "removed" not in columns:
                    db.execute(ADD_REMOVED)
                db.execute("COMMIT")
                return db
            except sqlite3.OperationalError as exc:
                db.close()
                pause = reopen_pause(exc, attempt)
                if pause is None:
                    raise
                time.sleep(pause)
                attempt += 1
            except BaseException:
                db.close()
                raise

    async def close(self) -> None:
        with self._lock, self._loading:
            for connection in (self._db, self._reader):
                if connection is not None:
                    connection.close()
            self._db = self._reader = None
            self._indexes.clear()
            with self._cache_lock:
                self._vectors.clear()
                self._cached_bytes = 0

    # -- the parts ----------------------------------------------------------------------

    def _sql(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        if self._db is None:
            raise EngineError("the collections engine is closed")
        with self._lock:
            try:
                return self._db.execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise EngineError(f"the collections engine failed: {exc}") from exc

    def _index(self, space: str, create: bool) -> tantivy.Index | None:
        with self._lock:
            index = self._indexes.get(space)
            if index is not None:
                return index
            folder = self.folder / _safe(space)
            if not folder.exists():
                if not create:
                    return None
                folder.mkdir(parents=True)
            try:
                index = tantivy.Index(self.schema, path=str(folder), reuse=True)
            except ValueError as exc:
                raise EngineError(f"the index of {space} cannot be opened: {exc}") from exc
            self._indexes[space] = index
            self._writing.setdefault(space, threading.Lock())
            return index

    def _writer(self, index: tantivy.Index) -> tantivy.IndexWriter:
        """A writer, waiting while another process holds the space's lock."""
        deadline = time.monotonic() + WRITER_WAIT_SECONDS
        while True:
            try:
                return index.writer(heap_size=WRITER_HEAP_BYTES, num_threads=1)
            except ValueError as exc:
                if "Lock" not in str(exc) or time.monotonic() > deadline:
                    raise EngineError(f"the index cannot be written: {exc}") from exc
                time.sleep(0.05)

    def _write(self, space: str, change: Any) -> None:
        """Run `change(writer)` and commit, with the space's writer lock held."""
        index = self._index(space, create=True)
        assert index is not None
        with self._writing[space]:
            writer = self._writer(index)
            try:
                change(writer)
                writer.commit()
            except BaseException:
                writer.rollback()
                raise
            finally:
                writer.wait_merging_threads()  # consumes the writer: its lock is let go
            index.reload()

    def _bump(self, db_sql: list[tuple[str, Sequence[Any]]], space: str) -> None:
        """Run statements and move the space's version on, in one transaction; also its
        `removed` count when a DELETE or an UPDATE among them changed a row (a cached
        matrix cannot be brought up to date by appending then)."""
        if self._db is None:
            raise EngineError("the collections engine is closed")
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    removed = 0
                    for sql, params in db_sql:
                        if params and isinstance(params[0], tuple):
                            cursor = self._db.executemany(sql, params)
                        else:
                            cursor = self._db.execute(sql, params)
                        if not sql.startswith("INSERT") and cursor.rowcount > 0:
                            removed = 1
                    self._db.execute(
                        "INSERT INTO versions (space, version, removed) VALUES (?, 1, ?)"
                        " ON CONFLICT (space) DO UPDATE SET version = version + 1,"
                        " removed = removed + excluded.removed",
                        (space, removed),
                    )
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise EngineError(f"the collections engine failed: {exc}") from exc

    # -- the interface ------------------------------------------------------------------

    def _add(self, space: str, passages: list[Passage], vectors: np.ndarray | None) -> None:
        if not passages:
            return
        blobs: list[bytes | None] = (
            [np.asarray(row, dtype=np.float32).tobytes() for row in vectors]
            if vectors is not None
            else [None] * len(passages)
        )
        rows = tuple(
            (space, p.document_id, p.n, p.page, p.title, p.url, p.text, blob)
            for p, blob in zip(passages, blobs, strict=True)
        )
        ids = sorted({p.document_id for p in passages})
        marks = ", ".join("?" * len(ids))
        before = f"DELETE FROM passages WHERE space = ? AND document_id IN ({marks})"
        insert = "INSERT INTO passages VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
        # a document added again is replaced whole (a shorter one leaves no old passages)
        self._bump([(before, (space, *ids)), (insert, rows)], space)

        def change(writer: tantivy.IndexWriter) -> None:
            for document_id in {p.document_id for p in passages}:
                writer.delete_documents_by_term("doc", document_id)
            for p in passages:
                writer.add_document(tantivy.Document(doc=p.document_id, n=p.n, text=p.text))

        try:
            self._write(space, change)
        except BaseException:
            self._forget(space, ids)
            raise

    def _forget(self, space: str, document_ids: Sequence[str]) -> None:
        marks = ", ".join("?" * len(document_ids))
        self._bump(
            [
                (
                    f"DELETE FROM passages WHERE space = ? AND document_id IN ({marks})",
                    (space, *document_ids),
                )
            ],
            space,
        )

    async def delete_documents(self, space: str, document_ids: Sequence[str]) -> None:
        await asyncio.to_thread(self._delete, space, list(document_ids))

    def _delete(self, space: str, document_ids: list[str]) -> None:
        if not document_ids or self._index(space, create=False) is None:
            return

        def change(writer: tantivy.IndexWriter) -> None:
            for document_id in document_ids:
                writer.delete_documents_by_term("doc", document_id)

        self._write(space, change)
        self._forget(space, document_ids)

    async def drop(self, space: str) -> None:
        await asyncio.to_thread(self._drop, space)

    def _drop(self, space: str) -> None:
        with self._lock:
            self._indexes.pop(space, None)
        self._forget_matrix(space)
        self._bump([("DELETE FROM passages WHERE space = ?", (space,))], space)
        shutil.rmtree(self.folder / _safe(space), ignore_errors=True)

    async def lexical(
        self, space: str, query: str, limit: int, documents: Sequence[str] | None = None
    ) -> list[Hit]:
        return await asyncio.to_thread(self._lexical, space, query, limit, documents)

    def _lexical(
        self, space: str, query: str, limit: int, documents: Sequence[str] | None
    ) -> list[Hit]:
        index = self._index(space, create=False)
        words = list(dict.fromkeys(terms(query)))
        if index is None or not words or documents == []:
            return []
        Query, Occur = tantivy.Query, tantivy.Occur
        text = Query.boolean_query(
            [(Occur.Should, Query.term_query(self.schema, "text", w)) for w in words]
        )
        if documents is not None:
            only = Query.const_score_query(
                Query.term_set_query(self.schema, "doc", list(documents)), 0.0
            )
            text = Query.boolean_query([(Occur.Must, text), (Occur.Must, only)])
        searcher = index.searcher()
        found = searcher.search(text, limit).hits
        keys = []
        for score, address in found:
            stored = searcher.doc(address)
            keys.append((stored["doc"][0], int(stored["n"][0]), float(score)))
        return self._hits(space, keys)

    def _hits(self, space: str, keys: list[tuple[str, int, float]]) -> list[Hit]:
        """The passages of these (document, n, score), in the same order (one lookup of
        the primary key each: an OR of them all makes SQLite scan the space)."""
        if self._db is None:
            raise EngineError("the collections engine is closed")
        out = []
        with self._lock:
            try:
                for document_id, n, score in keys:
                    row = self._db.execute(
                        "SELECT document_id, n, page, title, url, text FROM passages"
                        " WHERE space = ? AND document_id = ? AND n = ?",
                        (space, document_id, n),
                    ).fetchone()
                    if row is not None:
                        out.append(Hit(space, Passage(*row), score))
            except sqlite3.Error as exc:
                raise EngineError(f"the collections engine failed: {exc}") from exc
        return out

    def _nearest(
        self, space: str, vector: np.ndarray, limit: int, documents: Sequence[str] | None
    ) -> list[Hit]:
        cached = self._matrix(space)
        if cached.matrix is None or documents == []:
            return []
        query = unit_rows(vector)[0]
        if query.shape[0] != cached.matrix.shape[1]:
            return []  # embedded by another model: `python -m app.collections reembed`
        mask = None
        if documents is not None:
            wanted = set(documents)
            mask = np.fromiter((k[0] in wanted for k in cached.keys), bool, len(cached.keys))
        scores = cached.scores(query, limit, mask)
        keys = [
            (*cached.keys[i], float(scores[i]))
            for i in top(scores, limit).tolist()
            if np.isfinite(scores[i])
        ]
        return self._hits(space, keys)

    def _matrix(self, space: str) -> Vectors:
        """The space's embeddings, brought up to date when a write moved its version on:
        by the rows added since, or read whole after a delete. One space is read at a
        time; a search that finds it being read waits for that read and takes it."""
        rows = self._sql("SELECT version FROM versions WHERE space = ?", (space,))
        version = rows[0][0] if rows else 0
        cached = self._cached(space)
        if cached is not None and cached.version >= version:
            return cached
        with self._loading:
            cached = self._cached(space)
            if cached is not None and cached.version >= version:
                return cached  # read by the search this one waited for
            fresh = self._load(space, cached)
        self._remember(space, fresh)
        return fresh

    def _cached(self, space: str) -> Vectors | None:
        with self._cache_lock:
            cached = self._vectors.get(space)
            if cached is not None:
                self._vectors.move_to_end(space)
            return cached

    def _remember(self, space: str, fresh: Vectors) -> None:
        """Keep `fresh` as the space's matrix, letting the least recently searched go
        past `vector_cache_bytes` (one bigger than that is used, not kept)."""
        with self._cache_lock:
            old = self._vectors.pop(space, None)
            if old is not None:
                self._cached_bytes -= old.nbytes
            if fresh.nbytes > self.vector_cache_bytes:
                return
            self._vectors[space] = fresh
            self._cached_bytes += fresh.nbytes
            while self._cached_bytes > self.vector_cache_bytes:
                _, evicted = self._vectors.popitem(last=False)
                self._cached_bytes -= evicted.nbytes

    def _forget_matrix(self, space: str) -> None:
        with self._cache_lock:
            old = self._vectors.pop(space, None)
            if old is not None:
                self._cached_bytes -= old.nbytes

    def _load(self, space: str, cached: Vectors | None) -> Vectors:
        """Read the space's vectors (those after `cached`'s last row, when nothing was
        removed since it was read) in one read transaction of `_reader`."""
        reader = self._reader
        if reader is None:
            raise EngineError("the collections engine is closed")
        try:
            reader.execute("BEGIN")
            try:
                found = reader.execute(
                    "SELECT version, removed FROM versions WHERE space = ?", (space,)
                ).fetchone()
                version, removed = (found[0], found[1]) if found else (0, 0)
                appending = (
                    cached is not None and cached.removed == removed and cached.buffer is not None
                )
                after = cached.last_rowid if cached is not None and appending else 0
                rows = reader.execute(
                    # NOT INDEXED: the rowid range, not every row of the space
                    "SELECT rowid, document_id, n, vector FROM passages NOT INDEXED"
                    " WHERE rowid > ? AND space = ? AND vector IS NOT NULL ORDER BY rowid",
                    (after, space),
                ).fetchall()
            finally:
                reader.execute("COMMIT")
        except sqlite3.Error as exc:
            raise EngineError(f"the collections engine failed: {exc}") from exc
        last = max([r[0] for r in rows], default=after)
        widths = {len(r[3]) for r in rows}
        keys = [(r[1], r[2]) for r in rows]
        if appending and cached is not None and cached.buffer is not None:
            if not rows:
                return cached.appended(version, last, [], np.empty((0, 0), np.float32))
            if widths == {cached.buffer.shape[1] * 4}:
                raw = np.frombuffer(b"".join(r[3] for r in rows), dtype=np.float32)
                return cached.appended(version, last, keys, unit_rows(raw.reshape(len(rows), -1)))
            return self._load(space, None)  # another width: read it whole
        fresh = Vectors(version, removed, last)
        if rows and len(widths) == 1:
            raw = np.frombuffer(b"".join(r[3] for r in rows), dtype=np.float32)
            fresh = fresh.appended(version, last, keys, unit_rows(raw.reshape(len(rows), -1)))
        return fresh

    async def passages(self, space: str) -> list[Passage]:
        rows = await asyncio.to_thread(
            self._sql,
            "SELECT document_id, n, page, title, url, text FROM passages WHERE space = ?"
            " ORDER BY document_id, n",
            (space,),
        )
        return [Passage(*r) for r in rows]

    async def set_vectors(
        self, space: str, passages: Sequence[Passage], vectors: np.ndarray | None
    ) -> None:
        await asyncio.to_thread(self._set_vectors, space, list(passages), vectors)

    def _set_vectors(self, space: str, passages: list[Passage], vectors: np.ndarray | None) -> None:
        """One transaction: every vector of the space cleared, the new ones written (the
        passages and Tantivy's index are left as they are)."""
        rows: tuple[tuple[Any, ...], ...] = ()
        if vectors is not None:
            rows = tuple(
                (np.asarray(row, dtype=np.float32).tobytes(), space, p.document_id, p.n)
                for p, row in zip(passages, vectors, strict=True)
            )
        statements: list[tuple[str, Sequence[Any]]] = [
            ("UPDATE passages SET vector = NULL WHERE space = ?", (space,))
        ]
        if rows:
            statements.append(
                (
                    "UPDATE passages SET vector = ? WHERE space = ? AND document_id = ? AND n = ?",
                    rows,
                )
            )
        self._bump(statements, space)

    async def has_vectors(self, space: str) -> bool:
        rows = await asyncio.to_thread(
            self._sql,
            "SELECT 1 FROM passages WHERE space = ? AND vector IS NOT NULL LIMIT 1",
            (space,),
        )
        return bool(rows)

    async def has_document(self, space: str, document_id: str) -> bool:
        rows = await asyncio.to_thread(
            self._sql,
            "SELECT 1 FROM passages WHERE space = ? AND document_id = ? LIMIT 1",
            (space, document_id),
        )
        return bool(rows)

    async def spaces(self) -> list[str]:
        rows = await asyncio.to_thread(
            self._sql, "SELECT DISTINCT space FROM passages ORDER BY space"
        )
        return [r[0] for r in rows]


def _safe(space: str) -> str:
    """A space's folder name: ids are letters, digits, '_' and '-' already (anything
    else is replaced, so no name reaches outside the folder)."""
    return "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in space) or "_"
