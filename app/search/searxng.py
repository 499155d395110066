"""SearxNG: `GET {searxng.url}/search?q=…&format=json` (JSON output enabled on the instance).

Focus modes that keep to some sources pass SearxNG engines (`engines=arxiv,…`);
recency is its `time_range` (day, week, month, year: an hour asks for a day). It has
no domain parameters: the domain filters go into the query as `site:` / `-site:`
operators, which the engines that know them (Google, Bing, DuckDuckGo, …) apply, and
are applied to its results again; it has no date range either, so dates are checked
on its results (which carry `publishedDate` when the engine gives one). Images, videos and news are its `images`,
`videos` and `news` categories.
"""

from __future__ import annotations

from typing import Any

import httpx

from ..config import SearxngSettings
from ..errors import SearchError
from ..results import SearchResult
from .base import (
    MediaResult,
    NewsItem,
    SearchProvider,
    SearchQuery,
    absolute,
    pixels,
    results_from,
    site_query,
    text,
)


class SearxngSearch(SearchProvider):
    name = "SearxNG"
    honours = frozenset({"domains", "recency"})

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

    async def find(self, query: SearchQuery) -> list[SearchResult]:
        scope, filters = query.scope, query.filters
        engines = scope.engines if scope is not None else ()
        # the mode's engines, or else its sites as `site:`; the domain filters as `site:`
        # and `-site:` either way (the engines that know the operators apply them)
        params = {"q": site_query(query.text, None if engines else scope, filters)}
        if engines:
            params["engines"] = ",".join(engines)
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
        )[: query.limit]

    async def images(self, query: str, limit: int) -> list[MediaResult]:
        found = []
        for item in await self._results(q=query, categories="images"):
            img = absolute(item.get("img_src")) or absolute(item.get("thumbnail_src"))
            if img and absolute(item.get("url")):
                width, height = resolution(item.get("resolution"))
                found.append(
                    MediaResult(text(item.get("title")), item["url"], img, "", width, height)
                )
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


def resolution(value: Any) -> tuple[int, int]:
    """SearxNG's `resolution` of an image ("1920x1080", "1920 × 1080") as (width,
    height); (0, 0) when it has none."""
    parts = text(value).replace("×", "x").lower().split("x")
    if len(parts) != 2:
        return 0, 0
    width, height = pixels(parts[0]), pixels(parts[1])
    return (width, height) if width and height else (0, 0)
