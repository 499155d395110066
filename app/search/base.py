"""Web search: the provider interface and what a search returns."""

from __future__ import annotations

import abc
from dataclasses import dataclass, replace
from typing import Any

import httpx

from ..errors import SearchError


@dataclass(frozen=True, slots=True)
class SearchResult:
    """One hit. `content` is the page's text once read (else empty: use `snippet`)."""

    title: str
    url: str
    snippet: str = ""
    content: str = ""

    @property
    def text(self) -> str:
        return self.content or self.snippet

    def with_content(self, content: str) -> SearchResult:
        return replace(self, content=content)


class SearchProvider(abc.ABC):
    """A web search API. `search` raises `SearchError` (no key, unreachable, non-2xx,
    unexpected body); an empty list means it found nothing."""

    name: str

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    @abc.abstractmethod
    async def search(self, query: str, limit: int) -> list[SearchResult]: ...

    async def _json(self, request: httpx.Request) -> Any:
        """Send and decode, mapping every transport and status failure to SearchError."""
        try:
            response = await self.http.send(request)
        except httpx.HTTPError as exc:
            raise SearchError(f"{self.name} is unreachable: {exc!r}") from exc
        if response.status_code >= 400:
            raise SearchError(f"{self.name} answered {response.status_code}: {response.text[:200]}")
        try:
            return response.json()
        except ValueError as exc:
            raise SearchError(f"{self.name} answered with a body that is not JSON") from exc


def results_from(
    items: Any, *, title: str, url: str, snippet: str, provider: str
) -> list[SearchResult]:
    """Map a provider's list of dicts onto results, skipping entries without a URL."""
    if not isinstance(items, list):
        raise SearchError(f"{provider} answered without a result list")
    out = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get(url), str) and item[url]:
            out.append(
                SearchResult(
                    title=str(item.get(title) or item[url]),
                    url=item[url],
                    snippet=str(item.get(snippet) or ""),
                )
            )
    return out
