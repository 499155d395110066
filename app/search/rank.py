"""Ranking search results: by embeddings (balanced mode) or by the small model (quality)."""

from __future__ import annotations

import re

import orjson

from ..errors import AppError
from ..model import ChatModel, Embedder
from ..prompts import Prompts
from ..results import SearchResult
from ..scoring import cosines

_OUTPUT = re.compile(r"<output>(.*?)</output>", re.S | re.I)
_NUMBER = re.compile(r"\d+")


async def rank_by_embeddings(
    embedder: Embedder, question: str, results: list[SearchResult]
) -> list[SearchResult]:
    """Results ordered by cosine similarity of question and title+snippet, best first
    (stable for ties). Raises what `Embedder.embed` raises."""
    vectors = await embedder.embed([question, *(f"{r.title}\n{r.snippet}" for r in results)])
    scores = cosines(vectors[0], vectors[1:])
    scored = sorted(enumerate(results), key=lambda pair: -scores[pair[0]])
    return [result for _, result in scored]


async def select_with_model(
    llm: ChatModel, prompts: Prompts, question: str, results: list[SearchResult], limit: int
) -> list[SearchResult]:
    """The results the small model picks, at most `limit`, best first. When it answers
    `not_found`, nothing usable or fails, the provider's first `limit` results."""
    listing = orjson.dumps(
        [
            {"index": i, "title": r.title, "url": r.url, "snippet": r.snippet}
            for i, r in enumerate(results)
        ],
        option=orjson.OPT_INDENT_2,
    ).decode()
    prompt = prompts.render(
        "web_search_select", question=question, search_result=listing, limit=str(limit)
    )
    try:
        answer = await llm.complete([{"role": "user", "content": prompt}], max_tokens=100)
    except AppError:  # the ranking model failed: fall back, never to nothing
        return results[:limit]
    return parse_selection(answer, results, limit)


def parse_selection(answer: str, results: list[SearchResult], limit: int) -> list[SearchResult]:
    match = _OUTPUT.search(answer)
    text = match.group(1) if match else answer
    if "not_found" in text.lower():
        return results[:limit]
    chosen: list[int] = []
    for token in _NUMBER.findall(text):
        index = int(token)
        if index < len(results) and index not in chosen:
            chosen.append(index)
        if len(chosen) == limit:
            break
    return [results[i] for i in chosen] or results[:limit]
