"""Tavily: `POST {tavily.base_url}/search` with a bearer key.

Focus modes that keep to some sources pass `include_domains`; the search filters are
Tavily's own `include_domains` / `exclude_domains`, `time_range` (an hour asks for a
day) and `start_date` / `end_date`; images come with `include_images`; news is
`topic: "news"` (Tavily has no videos, and no picture per news item, so discover may
be empty with it).
"""

from __future__ import annotations

from typing import Any

import httpx

from ..config import TavilySettings
from ..errors import SearchError
from ..results import SearchResult
from .base import MediaResult, NewsItem, SearchProvider, SearchQuery, absolute, results_from, text


class TavilySearch(SearchProvider):
    name = "Tavily"
    honours = frozenset({"domains", "recency", "dates"})

    def __init__(self, http: httpx.AsyncClient, settings: TavilySettings) -> None:
        super().__init__(http)
        self.settings = settings

    async def _search(self, **body: Any) -> dict[str, Any]:
        if not self.settings.api_key:
            raise SearchError("no Tavily API key is configured (tavily.api_key)")
        request = self.http.build_request(
            "POST",
            self.settings.base_url.rstrip("/") + "/search",
            json={"search_depth": "basic", **body},
            headers={"Authorization": f"Bearer {self.settings.api_key}"},
        )
        answer = await self._json(request)
        if not isinstance(answer, dict):
            raise SearchError("Tavily answered with an unexpected body")
        return answer

    @property
    def endpoint(self) -> str:
        return self.settings.base_url

    async def find(self, query: SearchQuery) -> list[SearchResult]:
        body: dict[str, Any] = {"query": query.text, "max_results": query.limit}
        if query.scope is not None and query.scope.sites:
            body["include_domains"] = list(query.scope.sites)
        if (filters := query.filters) is not None:
            if filters.include:
                body["include_domains"] = list(filters.include)
            if filters.exclude:
                body["exclude_domains"] = list(filters.exclude)
            if filters.recency:
                body["time_range"] = "day" if filters.recency == "hour" else filters.recency
            if filters.after:
                body["start_date"] = filters.after.isoformat()
            if filters.before:
                body["end_date"] = filters.before.isoformat()
        answer = await self._search(**body)
        return results_from(
            answer.get("results"),
            title="title",
            url="url",
            snippet="content",
            provider=self.name,
            published="published_date",
        )[: query.limit]

    async def images(self, query: str, limit: int) -> list[MediaResult]:
        answer = await self._search(
            query=query, max_results=1, include_images=True, include_image_descriptions=True
        )
        found = []
        for image in answer.get("images") or []:
            url = absolute(image.get("url") if isinstance(image, dict) else image)
            title = text(image.get("description")) if isinstance(image, dict) else ""
            if url:
                found.append(MediaResult(title or query, url, url))
        return found[:limit]

    async def news(self, query: str, limit: int) -> list[NewsItem]:
        answer = await self._search(query=query, max_results=limit, topic="news")
        return [
            NewsItem(r.title, r.url, r.snippet, "")
            for r in results_from(
                answer.get("results"),
                title="title",
                url="url",
                snippet="content",
                provider=self.name,
            )
        ][:limit]
