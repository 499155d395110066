"""The server engine: Milvus, with dense vectors and its built-in BM25 (a sparse vector
made by a BM25 function from the text, scored over the collection's statistics).

`milvus:////abs/file.db` runs Milvus Lite embedded in that file (one process; what the
tests run); `milvus://host:19530` (or `milvus+https://host`) talks to a Milvus server
or cluster — the same code, so a deployment that outgrows one machine changes a URL.
A query string may carry `token` and `db`. Each space is one Milvus collection
(`sc_<hex of the space>`), so BM25 statistics are per knowledge collection, with
"Session" consistency: a process reads its own writes at once, other processes within
Milvus's staleness bound. The client is synchronous; every call runs in a thread.

Every passage of a space is read with a query iterator (Milvus refuses a query whose
offset + limit passes 16,384). New vectors for a space are written into a new
collection (`sn_…`) that then takes the space's name (the old one renamed `so_…` for
that moment, then dropped); `open` finishes a swap a stopped process left halfway.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np

from ..scoring import BM25_B, BM25_K1, terms, unit_rows
from .base import EngineError, Hit, Passage, ThreadedEngine

TEXT_CHARS = 65535
PAGE_ROWS = 1000
FIELDS = ["doc", "n", "page", "title", "url", "text"]


PREFIX = "sc_"
NEW, OLD = "sn_", "so_"  # a space's vectors being replaced: the new copy, the old one


def _name(space: str, prefix: str = PREFIX) -> str:
    """A Milvus collection name (letters, digits, '_') that gives the space back."""
    return prefix + space.encode().hex()


def _space(name: str) -> str:
    return bytes.fromhex(name[len(PREFIX) :]).decode()


def _quoted(values: Sequence[str]) -> str:
    return "[" + ", ".join('"' + v.replace("\\", "").replace('"', "") + '"' for v in values) + "]"


class MilvusEngine(ThreadedEngine):
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        options = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        if parts.netloc:
            scheme = "https" if parts.scheme.endswith("+https") else "http"
            self.uri = f"{scheme}://{parts.netloc}"
        else:
            self.uri = parts.path  # a Milvus Lite file
        self.token = options.get("token", "")
        self.db = options.get("db", "")
        self.client: Any = None
        self._lock = threading.Lock()
        self._dims: dict[str, int] = {}

    async def open(self) -> None:
        await asyncio.to_thread(self._open)

    def _open(self) -> None:
        try:
            from pymilvus import MilvusClient
        except ImportError as exc:  # an optional dependency
            raise EngineError(
                "pymilvus is not installed (pip install 'searchchat[milvus]')"
            ) from exc
        kwargs: dict[str, Any] = {"uri": self.uri}
        if self.token:
            kwargs["token"] = self.token
        if self.db:
            kwargs["db_name"] = self.db
        try:
            self.client = MilvusClient(**kwargs)
        except Exception as exc:  # pymilvus raises many kinds
            raise EngineError(f"Milvus cannot be reached: {type(exc).__name__}") from exc
        self._finish_swaps()

    def _finish_swaps(self) -> None:
        """A swap of vectors cut short: the old copy back where the space has none, and
        every leftover copy dropped."""
        names = set(self._call("list_collections"))
        for name in sorted(names):
            if name.startswith(OLD):
                current = PREFIX + name[len(OLD) :]
                if current in names:
                    self._call("drop_collection", name)
                else:
                    self._call("rename_collection", name, current)
                    self._call("load_collection", current)
            elif name.startswith(NEW):
                self._call("drop_collection", name)

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await asyncio.to_thread(client.close)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.client is None:
            raise EngineError("the collections engine is closed")
        try:
            return getattr(self.client, method)(*args, **kwargs)
        except EngineError:
            raise
        except Exception as exc:  # pymilvus's MilvusException and gRPC errors
            raise EngineError(f"Milvus failed: {exc}") from exc

    def _exists(self, space: str) -> bool:
        return bool(self._call("has_collection", _name(space)))

    def _create(self, space: str, dims: int | None, prefix: str = PREFIX) -> None:
        from pymilvus import DataType, Function, FunctionType

        schema = self._call("create_schema", auto_id=False)
        schema.add_field("pk", DataType.VARCHAR, is_primary=True, max_length=160)
        schema.add_field("doc", DataType.VARCHAR, max_length=128)
        schema.add_field("n", DataType.INT64)
        schema.add_field("page", DataType.INT64)
        schema.add_field("title", DataType.VARCHAR, max_length=1024)
        schema.add_field("url", DataType.VARCHAR, max_length=4096)
        schema.add_field("text", DataType.VARCHAR, max_length=TEXT_CHARS, enable_analyzer=True)
        schema.add_field("sparse", DataType.SPARSE_FLOAT_VECTOR)
        schema.add_function(
            Function(
                name="bm25",
                function_type=FunctionType.BM25,
                input_field_names=["text"],
                output_field_names=["sparse"],
            )
        )
        index = self._call("prepare_index_params")
        index.add_index(
            "sparse",
            index_type="SPARSE_INVERTED_INDEX",
            metric_type="BM25",
            params={"bm25_k1": BM25_K1, "bm25_b": BM25_B},
        )
        if dims:
            schema.add_field("dense", DataType.FLOAT_VECTOR, dim=dims)
            index.add_index("dense", index_type="AUTOINDEX", metric_type="COSINE")
        self._call(
            "create_collection",
            _name(space, prefix),
            schema=schema,
            index_params=index,
            consistency_level="Session",
        )

    def _dims_of(self, space: str) -> int:
        """The width of the space's dense vectors; 0 when it has none."""
        if space not in self._dims:
            described = self._call("describe_collection", _name(space))
            dims = 0
            for f in described.get("fields", []):
                if f.get("name") == "dense":
                    dims = int(f.get("params", {}).get("dim", 0))
            self._dims[space] = dims
        return self._dims[space]

    def _add(self, space: str, passages: list[Passage], vectors: np.ndarray | None) -> None:
        if not passages:
            return
        with self._lock:
            if not self._exists(space):
                self._create(space, vectors.shape[1] if vectors is not None else None)
                self._dims.pop(space, None)
        dims = self._dims_of(space)
        ids = sorted({p.document_id for p in passages})
        self._call("delete", _name(space), filter=f"doc in {_quoted(ids)}")
        rows = _rows(passages, vectors, dims)
        try:
            for start in range(0, len(rows), PAGE_ROWS):
                self._call("insert", _name(space), rows[start : start + PAGE_ROWS])
        except BaseException:
            self._call("delete", _name(space), filter=f"doc in {_quoted(ids)}")
            raise

    async def delete_documents(self, space: str, document_ids: Sequence[str]) -> None:
        if document_ids:
            await asyncio.to_thread(self._delete, space, list(document_ids))

    def _delete(self, space: str, ids: list[str]) -> None:
        if self._exists(space):
            self._call("delete", _name(space), filter=f"doc in {_quoted(ids)}")

    async def drop(self, space: str) -> None:
        await asyncio.to_thread(self._drop, space)

    def _drop(self, space: str) -> None:
        if self._exists(space):
            self._call("drop_collection", _name(space))
        self._dims.pop(space, None)

    def _search(
        self, space: str, data: Any, field: str, limit: int, documents: Sequence[str] | None
    ) -> list[Hit]:
        if documents == [] or not self._exists(space):
            return []
        kwargs: dict[str, Any] = {}
        if documents is not None:
            kwargs["filter"] = f"doc in {_quoted(documents)}"
        found = self._call(
            "search",
            _name(space),
            data=[data],
            anns_field=field,
            limit=limit,
            output_fields=FIELDS,
            search_params={"metric_type": "BM25" if field == "sparse" else "COSINE"},
            **kwargs,
        )
        hits = []
        for hit in found[0] if found else []:
            e = hit["entity"]
            passage = Passage(
                e["doc"], int(e["n"]), int(e["page"]), e["title"], e["url"], e["text"]
            )
            # Milvus Lite reports BM25 as a negative distance; the order is right either way
            hits.append(Hit(space, passage, abs(float(hit["distance"]))))
        return hits

    async def lexical(
        self, space: str, query: str, limit: int, documents: Sequence[str] | None = None
    ) -> list[Hit]:
        if not terms(query):
            return []
        return await asyncio.to_thread(self._search, space, query, "sparse", limit, documents)

    def _nearest(
        self, space: str, vector: np.ndarray, limit: int, documents: Sequence[str] | None
    ) -> list[Hit]:
        if not self._exists(space) or self._dims_of(space) != np.asarray(vector).shape[-1]:
            return []
        return self._search(space, unit_rows(vector)[0].tolist(), "dense", limit, documents)

    async def passages(self, space: str) -> list[Passage]:
        return await asyncio.to_thread(self._passages, space)

    def _passages(self, space: str) -> list[Passage]:
        if not self._exists(space):
            return []
        out: list[Passage] = []
        pages = self._call(
            "query_iterator",
            _name(space),
            batch_size=PAGE_ROWS,
            filter='doc != ""',
            output_fields=FIELDS,
        )
        try:
            while True:
                try:
                    rows = pages.next()
                except Exception as exc:  # pymilvus's MilvusException and gRPC errors
                    raise EngineError(f"Milvus failed: {exc}") from exc
                if not rows:
                    break
                out += [
                    Passage(r["doc"], int(r["n"]), int(r["page"]), r["title"], r["url"], r["text"])
                    for r in rows
                ]
        finally:
            pages.close()
        return sorted(out, key=lambda p: (p.document_id, p.n))

    async def set_vectors(
        self, space: str, passages: Sequence[Passage], vectors: np.ndarray | None
    ) -> None:
        await asyncio.to_thread(self._set_vectors, space, list(passages), vectors)

    def _set_vectors(self, space: str, passages: list[Passage], vectors: np.ndarray | None) -> None:
        """The passages with their new vectors written into a new collection, which
        then takes the space's name: the old one answers searches until then."""
        if vectors is not None and len(vectors) != len(passages):
            raise ValueError(f"{len(vectors)} vectors for {len(passages)} passages")
        if not self._exists(space):
            return
        dims = vectors.shape[1] if vectors is not None and len(passages) else None
        new, old = _name(space, NEW), _name(space, OLD)
        with self._lock:
            if self._call("has_collection", new):
                self._call("drop_collection", new)
            self._create(space, dims, NEW)
            try:
                rows = _rows(passages, vectors, dims or 0)
                for start in range(0, len(rows), PAGE_ROWS):
                    self._call("insert", new, rows[start : start + PAGE_ROWS])
                self._call("flush", new)
            except BaseException:
                self._call("drop_collection", new)
                raise
            self._call("rename_collection", _name(space), old)
            self._call("rename_collection", new, _name(space))
            self._call("load_collection", _name(space))  # a renamed one may be released
            self._call("drop_collection", old)
            self._dims.pop(space, None)

    async def has_vectors(self, space: str) -> bool:
        return await asyncio.to_thread(lambda: self._exists(space) and self._dims_of(space) > 0)

    async def has_document(self, space: str, document_id: str) -> bool:
        def found() -> bool:
            if not self._exists(space):
                return False
            rows = self._call(
                "query", _name(space), filter=f"doc in {_quoted([document_id])}", limit=1
            )
            return bool(rows)

        return await asyncio.to_thread(found)

    async def spaces(self) -> list[str]:
        names = await asyncio.to_thread(self._call, "list_collections")
        return sorted(_space(n) for n in names if n.startswith(PREFIX))


def _rows(passages: Sequence[Passage], vectors: np.ndarray | None, dims: int) -> list[Any]:
    """The passages as rows of a space's collection (zero vectors where a passage has
    none of the collection's width)."""
    rows = []
    for i, p in enumerate(passages):
        row: dict[str, Any] = {
            "pk": f"{p.document_id}:{p.n}",
            "doc": p.document_id,
            "n": p.n,
            "page": p.page,
            "title": p.title[:1024],
            "url": p.url[:4096],
            "text": p.text[:TEXT_CHARS],
        }
        if dims:
            row["dense"] = (
                unit_rows(vectors[i])[0].tolist()
                if vectors is not None and vectors.shape[1] == dims
                else [0.0] * dims
            )
        rows.append(row)
    return rows
