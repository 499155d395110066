"""SearxNG: `GET {searxng.url}/search?q=…&format=json` (JSON output enabled on the instance)."""

from __future__ import annotations

import httpx

from ..config import SearxngSettings
from ..errors import SearchError
from .base import SearchProvider, SearchResult, results_from


class SearxngSearch(SearchProvider):
    name = "SearxNG"

    def __init__(self, http: httpx.AsyncClient, settings: SearxngSettings) -> None:
        super().__init__(http)
        self.settings = settings

    async def search(self, query: str, limit: int) -> list[SearchResult]:
        if not self.settings.url:
            raise SearchError("no SearxNG instance is configured (searxng.url)")
        request = self.http.build_request(
            "GET", self.settings.url.rstrip("/") + "/search", params={"q": query, "format": "json"}
        )
        body = await self._json(request)
        items = body.get("results") if isinstance(body, dict) else None
        return results_from(items, title="title", url="url", snippet="content", provider=self.name)[
            :limit
        ]
