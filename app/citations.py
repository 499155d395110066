"""An answer's `[N]` citation markers and web sources, as the OpenAI APIs show them
(`url_citation` annotations, the web pages searched). Pure functions: a leaf."""

from __future__ import annotations

import re
from typing import Any

import orjson

#: a `[N]` citation marker in an answer
MARKER = re.compile(r"\[(\d{1,3})\]")


def citations_in(text: str, sources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One `url_citation` per `[N]` marker of `text` that names a source: `start_index`
    and `end_index` the marker's offsets in code points (what Python's `str` indexes,
    so `text[start_index:end_index]` is the marker in the Python SDK; a JavaScript
    client counting UTF-16 units differs after a character outside the BMP), `url` and
    `title` the N-th source's."""
    found = []
    for match in MARKER.finditer(text):
        n = int(match.group(1))
        if 1 <= n <= len(sources):
            meta = sources[n - 1].get("metadata", {})
            found.append(
                {
                    "type": "url_citation",
                    "start_index": match.start(),
                    "end_index": match.end(),
                    "url": meta.get("url", ""),
                    "title": meta.get("title", ""),
                }
            )
    return found


def web_sources(sources: list[dict[str, Any]]) -> list[str]:
    """The URLs of an answer's web pages (not its files' or collections' passages)."""
    urls = []
    for source in sources:
        meta = source.get("metadata", {})
        url = meta.get("url", "")
        if url.startswith(("http://", "https://")) and not (
            meta.get("fileId") or meta.get("collectionId")
        ):
            urls.append(url)
    return urls


def real_sources(sources: list[Any]) -> list[dict[str, Any]]:
    """The sources of a `sources` event but the "All Sources" link (not a source)."""
    return [s for s in sources if s.get("metadata", {}).get("title") != "All Sources"]


def perplexity_sources(sources: list[Any]) -> dict[str, Any]:
    """`citations` (URLs in order, so `[N]` is `citations[N-1]`) and `search_results`
    (`date` and `last_updated` when the provider said), as Perplexity's API returns
    them."""
    real = real_sources(sources)
    results = []
    for s in real:
        meta = s.get("metadata", {})
        result = {"title": meta.get("title", ""), "url": meta.get("url", "")}
        result["snippet"] = s.get("pageContent", "")
        if meta.get("date"):
            result["date"] = meta["date"][:10]
        if meta.get("lastUpdated") or meta.get("date"):
            result["last_updated"] = (meta.get("lastUpdated") or meta["date"])[:10]
        results.append(result)
    return {
        "citations": [s.get("metadata", {}).get("url", "") for s in real],
        "search_results": results,
    }


def fit_sources(sources: dict[str, Any], room: int) -> dict[str, Any]:
    """`citations` and `search_results` within `room` bytes: the snippets shortened,
    then the last sources left out (of both lists, so `[N]` still names the N-th)."""
    results = [{**r, "snippet": str(r.get("snippet", ""))[:200]} for r in sources["search_results"]]
    citations = list(sources["citations"])
    while results and len(orjson.dumps({"c": citations, "s": results})) > room:
        results.pop()
        citations.pop()
    return {"citations": citations, "search_results": results}
