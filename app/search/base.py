"""Web search: the provider interface and what a search returns."""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass, replace
from typing import Any

import httpx

from ..errors import SearchError

log = logging.getLogger("app.search")


@dataclass(frozen=True, slots=True)
class SearchResult:
    """One hit. `content` is the page's text once read (else empty: use `snippet`).
    A passage of an uploaded file has its `file_id` (and `page`, 1-based, in a PDF);
    its `url` is "File", as the Perplexica UI expects of file sources. A passage of a
    knowledge collection has its `collection_id` and `document_id` (and `page`)."""

    title: str
    url: str
    snippet: str = ""
    content: str = ""
    file_id: str = ""
    page: int = 0
    #: a passage of a knowledge collection: its collection and document
    collection_id: str = ""
    document_id: str = ""
    score: float = 0.0

    @property
    def text(self) -> str:
        return self.content or self.snippet

    def with_content(self, content: str) -> SearchResult:
        return replace(self, content=content)


@dataclass(frozen=True, slots=True)
class SearchScope:
    """A web search kept to some sources: SearxNG runs `engines`, the others search
    `sites` (a focus mode such as academicSearch or redditSearch)."""

    name: str
    engines: tuple[str, ...] = ()
    sites: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class MediaResult:
    """An image, or a video: `img_src` the picture (a video's thumbnail), `url` the page
    it is on, `iframe_src` a video's embeddable player."""

    title: str
    url: str
    img_src: str
    iframe_src: str = ""


@dataclass(frozen=True, slots=True)
class NewsItem:
    title: str
    url: str
    content: str
    thumbnail: str


class SearchProvider(abc.ABC):
    """A web search API. `search` raises `SearchError` (no key, unreachable, non-2xx,
    unexpected body); an empty list means it found nothing. Images, videos and news
    are [] for a provider that has none of them."""

    name: str

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    @property
    def endpoint(self) -> str:
        """A URL whose host the provider talks to (what the start-up check connects
        to); "" for one that needs no network."""
        return ""

    @abc.abstractmethod
    async def search(
        self, query: str, limit: int, scope: SearchScope | None = None
    ) -> list[SearchResult]: ...

    async def images(self, query: str, limit: int) -> list[MediaResult]:
        return []

    async def videos(self, query: str, limit: int) -> list[MediaResult]:
        return []

    async def news(self, query: str, limit: int) -> list[NewsItem]:
        return []

    async def _json(self, request: httpx.Request) -> Any:
        """Send and decode, mapping every transport and status failure to SearchError."""
        # logged: the provider and its host, never the URL (a key and the user's
        # question are in its query string) nor what the provider answered
        try:
            response = await self.http.send(request)
        except httpx.HTTPError as exc:
            log.warning(
                "%s is unreachable (%s at %s)", self.name, type(exc).__name__, request.url.host
            )
            raise SearchError(f"{self.name} is unreachable") from exc
        if response.status_code >= 400:
            log.warning("%s answered %d", self.name, response.status_code)
            raise SearchError(f"{self.name} answered {response.status_code}")
        try:
            return response.json()
        except ValueError as exc:
            raise SearchError(f"{self.name} answered with a body that is not JSON") from exc


def text(value: Any) -> str:
    """A field of a provider's answer as text ("" for a missing or non-string one)."""
    return value if isinstance(value, str) else ""


def absolute(url: Any) -> str:
    """An absolute http(s) URL, or "" (a page may only load those)."""
    url = text(url)
    if url.startswith("//"):
        url = "https:" + url
    return url if url.startswith(("http://", "https://")) else ""


def site_query(query: str, scope: SearchScope | None) -> str:
    """The query kept to the scope's sites with `site:` operators (providers without
    engines)."""
    if scope is None or not scope.sites:
        return query
    return f"{query} ({' OR '.join(f'site:{site}' for site in scope.sites)})"


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
