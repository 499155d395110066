"""`search.provider = "demo"`: made-up results for trying the server offline with the
demo model (`python -m app --demo`). Each result is labelled a demo and points at a
real encyclopaedia search for the question."""

from __future__ import annotations

from urllib.parse import quote_plus

from ..model import topic_of
from ..results import SearchResult
from .base import SearchProvider, SearchQuery


class DemoSearch(SearchProvider):
    """A few made-up results about the query, each pointing at a real search for it."""

    name = "demo"

    async def find(self, query: SearchQuery) -> list[SearchResult]:
        topic = topic_of(query.text)
        q = quote_plus(query.text)
        where = [
            ("Wikipedia", f"https://en.wikipedia.org/w/index.php?search={q}"),
            ("Wikinews", f"https://en.wikinews.org/w/index.php?search={q}"),
            ("Wiktionary", f"https://en.wiktionary.org/w/index.php?search={q}"),
            ("Wikibooks", f"https://en.wikibooks.org/w/index.php?search={q}"),
            ("Wikiversity", f"https://en.wikiversity.org/w/index.php?search={q}"),
        ]
        facts = [
            f"{topic.capitalize()} is described here in general terms, as an encyclopaedia "
            "would introduce it. This is a demo result.",
            f"Recent news about {topic} would be summarised here. This is a demo result.",
            f"The words around {topic} and what they mean. This is a demo result.",
            f"A longer guide to {topic}, chapter by chapter. This is a demo result.",
            f"Course notes that teach {topic} from the start. This is a demo result.",
        ]
        return [
            SearchResult(title=f"{topic.capitalize()} — {site} (demo)", url=url, snippet=fact)
            for (site, url), fact in zip(where, facts, strict=True)
        ][: query.limit]
