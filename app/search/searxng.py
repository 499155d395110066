"""SearxNG: `GET {searxng.url}/search?q=…&format=json` (JSON output enabled on the instance).

Focus modes that keep to some sources pass SearxNG engines (`engines=arxiv,…`);
recency is its `time_range` (day, week, month, year: an hour asks for a day); it has
no domain or date-range parameters, so those are applied to its results (which carry
`publishedDate` when the engine gives one). Images, videos and news are its `images`,
`videos` and `news` categories.
"""

from __future__ import annotations

from typing import Any

import httpx

from ..config import SearxngSettings
from ..errors import SearchError
from .base import (
    MediaResult,
    NewsItem,
    SearchFilters,
    SearchProvider,
    SearchResult,
    SearchScope,
    absolute,
    results_from,
    site_query,
    text,
)


class SearxngSearch(SearchProvider):
    name = "SearxNG"
    honours = frozenset({"recency"})

    def __init__(self, http: httpx.AsyncClient, settings: SearxngSettings) -> None:
        super().__init__(http)
        self.settings = settings

    async def _results(self, **params: str) -> list[Any]:
        if not self.settings.url:
            raise SearchError("no SearxNG instance is configured (searxng.url)")
        request = self.http.build_request(
            "GET", self.settings.url.rstrip("/") + "/search", params={**params, "format": "json"}
        )
        body = await self._json(request)
        items = body.get("results") if isinstance(body, dict) else None
        if not isinstance(items, list):
            raise SearchError("SearxNG answered without a result list")
        return [item for item in items if isinstance(item, dict)]

    @property
    def endpoint(self) -> str:
        return self.settings.url

    async def search(
        self,
        query: str,
        limit: int,
        scope: SearchScope | None = None,
        filters: SearchFilters | None = None,
    ) -> list[SearchResult]:
        params = {"q": query}
        if scope is not None and scope.engines:
            params["engines"] = ",".join(scope.engines)
        elif scope is not None:  # a site named, no engine for it: `site:` in the query
            params["q"] = site_query(query, scope)
        if filters is not None and filters.recency:
            params["time_range"] = "day" if filters.recency == "hour" else filters.recency
        items = await self._results(**params)
        return results_from(
            items,
            title="title",
            url="url",
            snippet="content",
            provider=self.name,
            published="publishedDate",
        )[:limit]

    async def images(self, query: str, limit: int) -> list[MediaResult]:
        found = []
        for item in await self._results(q=query, categories="images"):
            img = absolute(item.get("img_src")) or absolute(item.get("thumbnail_src"))
            if img and absolute(item.get("url")):
                found.append(MediaResult(text(item.get("title")), item["url"], img))
        return found[:limit]

    async def videos(self, query: str, limit: int) -> list[MediaResult]:
        found = []
        for item in await self._results(q=query, categories="videos"):
            thumbnail = absolute(item.get("thumbnail")) or absolute(item.get("img_src"))
            player = absolute(item.get("iframe_src"))
            if thumbnail and player and absolute(item.get("url")):
                found.append(MediaResult(text(item.get("title")), item["url"], thumbnail, player))
        return found[:limit]

    async def news(self, query: str, limit: int) -> list[NewsItem]:
        found = []
        for item in await self._results(q=query, categories="news"):
            url = absolute(item.get("url"))
            thumbnail = absolute(item.get("thumbnail")) or absolute(item.get("img_src"))
            if url:
                found.append(
                    NewsItem(text(item.get("title")), url, text(item.get("content")), thumbnail)
                )
        return found[:limit]
