"""Google Custom Search: `GET {google.base_url}/customsearch/v1?key=…&cx=…&q=…`.

Focus modes that keep to some sources, and the domain filters, add `site:` and
`-site:` operators to the query; recency is `dateRestrict` (d1, w1, m1, y1: an hour
asks for a day) and a date range `sort=date:r:YYYYMMDD:YYYYMMDD`. Images are
`searchType=image` (Google has no video or news search here).
"""

from __future__ import annotations

from typing import Any

import httpx

from ..config import GoogleSettings
from ..errors import SearchError
from .base import (
    MediaResult,
    SearchFilters,
    SearchProvider,
    SearchResult,
    SearchScope,
    absolute,
    results_from,
    site_query,
    text,
)

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

    async def search(
        self,
        query: str,
        limit: int,
        scope: SearchScope | None = None,
        filters: SearchFilters | None = None,
    ) -> list[SearchResult]:
        params = {}
        if filters is not None and filters.recency:
            params["dateRestrict"] = DATE_RESTRICT[filters.recency]
        if filters is not None and (filters.after or filters.before):
            start = filters.after.strftime("%Y%m%d") if filters.after else "19700101"
            end = filters.before.strftime("%Y%m%d") if filters.before else "99991231"
            params["sort"] = f"date:r:{start}:{end}"
        items = await self._items(site_query(query, scope, filters), limit, **params)
        return results_from(
            items, title="title", url="link", snippet="snippet", provider=self.name
        )[:limit]

    async def images(self, query: str, limit: int) -> list[MediaResult]:
        found = []
        for item in await self._items(query, limit, searchType="image"):
            if not isinstance(item, dict):
                continue
            image = item.get("image")
            context = image.get("contextLink") if isinstance(image, dict) else None
            src, page = absolute(item.get("link")), absolute(context)
            if src:
                found.append(MediaResult(text(item.get("title")), page or src, src))
        return found[:limit]
