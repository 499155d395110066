"""The one retrieval path: hybrid search over spaces of the engine, for knowledge
collections and for a user's uploads alike.

    BM25        each space's own statistics (the engine's `lexical`); the spaces' lists
                merged into one ranking by score (`by_score`), so a collection with
                nothing relevant does not rank its best weak match beside another's
                best answer
    dense       the question's embedding, nearest by cosine (`nearest`), when an
                embeddings model is configured and answers; merged across spaces by
                cosine, which one model makes comparable
    fusion      reciprocal rank (`fuse`) of those two rankings, the dense one weighted
                by `collections.dense_weight`
    rerank      the fused candidates sent to `collections.rerank.url`, when set

Cancelling is safe at any step: engine calls run in threads whose results are
dropped, and the embeddings and rerank requests are closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import replace

import httpx
import numpy as np

from ..config import CollectionSettings
from ..errors import AppError
from ..model import Embedder
from .base import Engine, Hit

log = logging.getLogger("app.collections")


def fuse(
    rankings: Sequence[Sequence[Hit]], k: int = 60, weights: Sequence[float] | None = None
) -> list[Hit]:
    """Reciprocal rank fusion: each passage scores Σ w / (k + rank) over the rankings
    it is in (rank from 1, `w` the ranking's weight, 1 by default); best first, ties
    in first-seen order. The fused score replaces the engines' scores, which are not
    on one scale."""
    scores: dict[tuple[str, str, int], float] = {}
    hits: dict[tuple[str, str, int], Hit] = {}
    for i, ranking in enumerate(rankings):
        weight = weights[i] if weights is not None else 1.0
        for rank, hit in enumerate(ranking, start=1):
            scores[hit.key] = scores.get(hit.key, 0.0) + weight / (k + rank)
            hits.setdefault(hit.key, hit)
    order = sorted(scores, key=lambda key: -scores[key])
    return [replace(hits[key], score=scores[key]) for key in order]


def by_score(rankings: Sequence[Sequence[Hit]], limit: int) -> list[Hit]:
    """Several spaces' rankings of one kind as one, best score first (ties in the
    order given): BM25 over each space's statistics, or cosine, is on one scale."""
    merged = [hit for ranking in rankings for hit in ranking]
    return sorted(merged, key=lambda hit: -hit.score)[:limit]


class Reranker:
    """A Jina/Cohere-style rerank endpoint: `POST url {model, query, documents, top_n}`
    → `{"results": [{"index", "relevance_score"}]}`. Raises nothing: a reranker that
    fails leaves the order as it was (and says so in the log)."""

    def __init__(self, url: str, model: str, api_key: str, timeout: float) -> None:
        self.url = url
        self.model = model
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(timeout=timeout, headers=headers)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def rerank(self, query: str, hits: list[Hit]) -> list[Hit]:
        if len(hits) < 2:
            return hits
        body = {
            "model": self.model,
            "query": query,
            "documents": [h.passage.text for h in hits],
            "top_n": len(hits),
        }
        try:
            response = await self.http.post(self.url, json=body)
            response.raise_for_status()
            results = response.json()["results"]
            order = [(int(r["index"]), float(r["relevance_score"])) for r in results]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.warning("rerank failed (%s); keeping the fused order", type(exc).__name__)
            return hits
        seen = {i for i, _ in order if 0 <= i < len(hits)}
        ranked = [replace(hits[i], score=s) for i, s in order if 0 <= i < len(hits)]
        return ranked + [h for i, h in enumerate(hits) if i not in seen]


class Retriever:
    def __init__(self, settings: CollectionSettings, *, engine: Engine, embedder: Embedder) -> None:
        self.settings = settings
        self.engine = engine
        self.embedder = embedder
        rerank = settings.rerank
        self.reranker = (
            Reranker(rerank.url, rerank.model, rerank.api_key, rerank.timeout_seconds)
            if rerank.url
            else None
        )

    async def aclose(self) -> None:
        if self.reranker is not None:
            await self.reranker.aclose()

    async def search(
        self,
        spaces: Sequence[str],
        query: str,
        limit: int,
        documents: Sequence[str] | None = None,
    ) -> list[Hit]:
        """The `limit` best passages of these spaces for `query` (kept to `documents`
        when given): each space's BM25 ranking and, with embeddings, its nearest
        passages, fused, then reranked when a reranker is set."""
        if not spaces:
            return []
        depth = max(limit, self.settings.candidates)

        async def dense() -> list[Hit]:
            if not self.embedder.configured:
                return []
            try:
                vector = (await self.embedder.embed([query]))[0]
            except AppError as exc:
                log.info("query not embedded (%s): ranking passages with BM25", exc.message)
                return []
            near = [self.engine.nearest(s, vector, depth, documents) for s in spaces]
            return by_score(await asyncio.gather(*near), depth)

        lexical, nearest = await asyncio.gather(
            asyncio.gather(*(self.engine.lexical(s, query, depth, documents) for s in spaces)),
            dense(),
        )
        rankings = [by_score(lexical, depth)]
        if nearest:
            rankings.append(nearest)
        fused = fuse(rankings, self.settings.rrf_k, [1.0, self.settings.dense_weight])
        if self.reranker is not None:
            fused = await self.reranker.rerank(query, fused[: limit * 3])
        return fused[:limit]


async def embed_texts(embedder: Embedder, texts: Sequence[str], batch: int) -> np.ndarray | None:
    """The texts' embeddings, `batch` per request, as one float32 matrix; None without
    an embeddings model. Raises the model's `AppError`."""
    if not embedder.configured or not texts:
        return None
    size = max(1, batch)
    parts = [await embedder.embed(list(texts[i : i + size])) for i in range(0, len(texts), size)]
    return np.vstack(parts).astype(np.float32)


async def reembed(engine: Engine, embedder: Embedder, spaces: Sequence[str], batch: int) -> int:
    """Embed every passage of these spaces again with the configured model (after the
    model changed), one space at a time; returns how many passages. Every vector of a
    space is made before the space is changed, and the engine swaps them in at once
    (`set_vectors`): searches meanwhile rank with the old vectors, and a model or a
    process that fails leaves the space as it was. Without an embeddings model the
    vectors are removed (BM25 alone ranks)."""
    count = 0
    for space in spaces:
        passages = await engine.passages(space)
        if not passages:
            continue
        vectors = await embed_texts(embedder, [p.text for p in passages], batch)
        await engine.set_vectors(space, passages, vectors)
        count += len(passages)
    return count
