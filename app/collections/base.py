"""The collections engine interface: passages in, ranked passages out.

A *space* is one collection's index (named by the collection's id): BM25 statistics
(document frequencies, average length) are those of the whole space, so a term that
is rare in the collection weighs more than a common one, whichever document it is in.
Engines are chosen by URL (`open_engine`, in the package) and hide behind this one
interface; the retrieval path (`retrieval.py`) fuses their two rankings, and the
collection service (`service.py`) owns everything else.

Every method may block on disk or network, so engines run their work in threads
(`asyncio.to_thread`): the event loop, and the streams it serves, never wait on an
index. Errors of an engine's driver leave it as `EngineError` (503 to a client).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import Unavailable


class EngineError(Unavailable):
    """The collections engine failed or cannot be reached."""


@dataclass(frozen=True, slots=True)
class Passage:
    """A chunk of a document as it is indexed; `n` numbers it within the document."""

    document_id: str
    n: int
    page: int
    title: str
    url: str
    text: str


@dataclass(frozen=True, slots=True)
class Hit:
    """A ranked passage of a space; `score` is the engine's (BM25, or cosine)."""

    space: str
    passage: Passage
    score: float

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.space, self.passage.document_id, self.passage.n)


class Engine(abc.ABC):
    """A search engine holding spaces of passages. `open`/`close` (or `async with`)
    bracket its use; every other method needs it open."""

    async def open(self) -> None:  # noqa: B027 - optional for engines without setup
        """Connect, or open the files."""

    async def close(self) -> None:  # noqa: B027
        """Release what `open` took; safe to call twice."""

    async def __aenter__(self) -> Engine:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @abc.abstractmethod
    async def add(
        self, space: str, passages: Sequence[Passage], vectors: np.ndarray | None = None
    ) -> None:
        """Index `passages` (with their embeddings, one row each, when given): all of
        them become searchable together, or — when this raises — none."""

    @abc.abstractmethod
    async def delete_documents(self, space: str, document_ids: Sequence[str]) -> None:
        """Remove every passage of these documents (unknown ones are no error)."""

    @abc.abstractmethod
    async def drop(self, space: str) -> None:
        """Remove the whole space (an unknown one is no error)."""

    @abc.abstractmethod
    async def lexical(
        self, space: str, query: str, limit: int, documents: Sequence[str] | None = None
    ) -> list[Hit]:
        """The `limit` best passages by BM25 over the space's statistics, best first;
        with `documents`, only passages of those documents (statistics unchanged)."""

    @abc.abstractmethod
    async def nearest(
        self, space: str, vector: np.ndarray, limit: int, documents: Sequence[str] | None = None
    ) -> list[Hit]:
        """The `limit` passages whose embeddings are nearest `vector` (cosine), best
        first; [] for a space without embeddings."""

    @abc.abstractmethod
    async def passages(self, space: str) -> list[Passage]:
        """Every passage of the space, by document and number (for re-embedding)."""

    @abc.abstractmethod
    async def set_vectors(
        self, space: str, passages: Sequence[Passage], vectors: np.ndarray | None
    ) -> None:
        """Give these passages of the space new embeddings (one row each; None: none),
        all at once: searches see the old vectors until it returns, and when it raises
        the space is as it was. The width may change; passages of the space not given
        lose theirs. Passages are not changed (their text stays as indexed)."""

    @abc.abstractmethod
    async def has_vectors(self, space: str) -> bool:
        """Whether the space's passages have embeddings."""

    @abc.abstractmethod
    async def has_document(self, space: str, document_id: str) -> bool:
        """Whether any passage of the document is in the space."""

    @abc.abstractmethod
    async def spaces(self) -> list[str]:
        """Every space with passages in it, sorted."""


class ThreadedEngine(Engine):
    """An engine whose calls block (files, an embedded database, a synchronous client):
    `add` and `nearest` run its `_add` and `_nearest` in a worker thread."""

    async def add(
        self, space: str, passages: Sequence[Passage], vectors: np.ndarray | None = None
    ) -> None:
        await asyncio.to_thread(self._add, space, list(passages), vectors)

    async def nearest(
        self, space: str, vector: np.ndarray, limit: int, documents: Sequence[str] | None = None
    ) -> list[Hit]:
        return await asyncio.to_thread(self._nearest, space, vector, limit, documents)

    @abc.abstractmethod
    def _add(self, space: str, passages: list[Passage], vectors: np.ndarray | None) -> None: ...

    @abc.abstractmethod
    def _nearest(
        self, space: str, vector: np.ndarray, limit: int, documents: Sequence[str] | None
    ) -> list[Hit]: ...


def url_path(url: str) -> str:
    """`scheme:///rel` → `rel`; `scheme:////abs` → `/abs`."""
    _, sep, rest = url.partition(":///")
    if not sep or not rest:
        raise ValueError(f"collections URL {url!r} names no path")
    return rest
