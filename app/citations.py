"""An answer's `[N]` citation markers and web sources, as the OpenAI APIs show them
(`url_citation` annotations, the web pages searched). Pure functions: a leaf."""

from __future__ import annotations

import re
from typing import Any

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
