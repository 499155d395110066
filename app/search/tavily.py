"""Tavily: `POST {tavily.base_url}/search` with a bearer key."""

from __future__ import annotations

import httpx

from ..config import TavilySettings
from ..errors import SearchError
from .base import SearchProvider, SearchResult, results_from


class TavilySearch(SearchProvider):
    name = "Tavily"

    def __init__(self, http: httpx.AsyncClient, settings: TavilySettings) -> None:
        super().__init__(http)
        self.settings = settings

    async def search(self, query: str, limit: int) -> list[SearchResult]:
        if not self.settings.api_key:
            raise SearchError("no Tavily API key is configured (tavily.api_key)")
        request = self.http.build_request(
            "POST",
            self.settings.base_url.rstrip("/") + "/search",
            json={"query": query, "max_results": limit, "search_depth": "basic"},
            headers={"Authorization": f"Bearer {self.settings.api_key}"},
        )
        body = await self._json(request)
        items = body.get("results") if isinstance(body, dict) else None
        return results_from(items, title="title", url="url", snippet="content", provider=self.name)[
            :limit
        ]
