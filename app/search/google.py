"""Google Custom Search: `GET {google.base_url}/customsearch/v1?key=…&cx=…&q=…`."""

from __future__ import annotations

import httpx

from ..config import GoogleSettings
from ..errors import SearchError
from .base import SearchProvider, SearchResult, results_from


class GoogleSearch(SearchProvider):
    name = "Google"

    def __init__(self, http: httpx.AsyncClient, settings: GoogleSettings) -> None:
        super().__init__(http)
        self.settings = settings

    async def search(self, query: str, limit: int) -> list[SearchResult]:
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
            },
        )
        body = await self._json(request)
        if not isinstance(body, dict):
            raise SearchError("Google answered with an unexpected body")
        # no "items" at all is how Google says "no results"
        return results_from(
            body.get("items", []), title="title", url="link", snippet="snippet", provider=self.name
        )[:limit]
