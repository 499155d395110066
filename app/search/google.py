"""Google Custom Search: `GET {google.base_url}/customsearch/v1?key=…&cx=…&q=…`.

Focus modes that keep to some sources, and the domain filters, add `site:` and
`-site:` operators to the query; recency is `dateRestrict` (d1, w1, m1, y1: an hour
asks for a day) and a date range `sort=date:r:YYYYMMDD:YYYYMMDD`. A result's dates are
its page's metatags (`pagemap`), else the day Google writes before the snippet.
Images are `searchType=image`, with their sizes (Google has no video or news search
here).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import replace
from datetime import datetime
from typing import Any

import httpx

from ..config import GoogleSettings
from ..errors import SearchError
from ..results import SearchResult
from .base import (
    MediaResult,
    SearchProvider,
    SearchQuery,
    absolute,
    iso_date,
    pixels,
    results_from,
    site_query,
    text,
)

#: the `pagemap.metatags` that carry a page's dates, the most telling first
PUBLISHED_TAGS = ("article:published_time", "og:published_time", "datepublished", "pubdate")
UPDATED_TAGS = ("article:modified_time", "og:updated_time", "datemodified")
#: how Google starts the snippet of a dated page: "Mar 1, 2026 ... "
SNIPPET_DATE = re.compile(r"^([A-Z][a-z]{2} \d{1,2}, \d{4}) \.\.\. ")
#: `recency` → Google's `dateRestrict`
DATE_RESTRICT = {"hour": "d1", "day": "d1", "week": "w1", "month": "m1", "year": "y1"}


class GoogleSearch(SearchProvider):
    name = "Google"
    honours = frozenset({"domains", "recency", "dates"})

    def __init__(self, http: httpx.AsyncClient, settings: GoogleSettings) -> None:
        super().__init__(http)
        self.settings = settings

    async def _items(self, query: str, limit: int, **params: str) -> list[Any]:
        if not (self.settings.api_key and self.settings.cse_id):
            raise SearchError("Google search needs google.api_key and google.cse_id")
        request = self.http.build_request(
            "GET",
            self.settings.base_url.rstrip("/") + "/customsearch/v1",
            params={
                "key": self.settings.api_key,
                "cx": self.settings.cse_id,
                "q": query,
                "num": min(limit, 10),
                **params,
            },
        )
        body = await self._json(request)
        if not isinstance(body, dict):
            raise SearchError("Google answered with an unexpected body")
        # no "items" at all is how Google says "no results"
        items = body.get("items", [])
        return items if isinstance(items, list) else []

    @property
    def endpoint(self) -> str:
        return self.settings.base_url

    async def find(self, query: SearchQuery) -> list[SearchResult]:
        params = {}
        filters = query.filters
        if filters is not None and filters.recency:
            params["dateRestrict"] = DATE_RESTRICT[filters.recency]
        if filters is not None and (filters.after or filters.before):
            start = filters.after.strftime("%Y%m%d") if filters.after else "19700101"
            end = filters.before.strftime("%Y%m%d") if filters.before else "99991231"
            params["sort"] = f"date:r:{start}:{end}"
        words = site_query(query.text, query.scope, filters)
        items = await self._items(words, query.limit, **params)
        found = results_from(
            items, title="title", url="link", snippet="snippet", provider=self.name
        )
        dated = {item.get("link"): item for item in items if isinstance(item, dict)}
        return [dates_of(r, dated.get(r.url)) for r in found][: query.limit]

    async def images(self, query: str, limit: int) -> list[MediaResult]:
        found = []
        for item in await self._items(query, limit, searchType="image"):
            if not isinstance(item, dict):
                continue
            image = item.get("image")
            context = image.get("contextLink") if isinstance(image, dict) else None
            src, page = absolute(item.get("link")), absolute(context)
            size = image if isinstance(image, dict) else {}
            if src:
                found.append(
                    MediaResult(
                        text(item.get("title")),
                        page or src,
                        src,
                        width=pixels(size.get("width")),
                        height=pixels(size.get("height")),
                    )
                )
        return found[:limit]


def dates_of(result: SearchResult, item: Any) -> SearchResult:
    """A result with the dates Google gave its page: the page's own metatags
    (`pagemap.metatags`: published, modified), else the day Google puts before a
    snippet ("Mar 1, 2026 ... "), which is then taken off the snippet."""
    pagemap = item.get("pagemap") if isinstance(item, dict) else None
    tags = pagemap.get("metatags") if isinstance(pagemap, dict) else None
    tags = tags[0] if isinstance(tags, list) and tags and isinstance(tags[0], dict) else {}
    published = next((d for t in PUBLISHED_TAGS if (d := iso_date(tags.get(t)))), "")
    updated = next((d for t in UPDATED_TAGS if (d := iso_date(tags.get(t)))), "")
    snippet = result.snippet
    said = SNIPPET_DATE.match(snippet)
    if said:
        with contextlib.suppress(ValueError):  # not a month's name after all
            day = datetime.strptime(said.group(1), "%b %d, %Y").date().isoformat()
            snippet = snippet[said.end() :]
            published = published or day
    return replace(result, snippet=snippet, date=published, last_updated=updated)
