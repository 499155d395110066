"""Web search: the provider interface and what a search returns."""

from __future__ import annotations

import abc
import json
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import orjson

from ..cleaning import clean
from ..errors import SearchError
from ..results import SearchFilters, SearchResult

log = logging.getLogger("app.search")


@dataclass(frozen=True, slots=True)
class SearchScope:
    """A web search kept to some sources: SearxNG runs `engines`, the others search
    `sites` (a focus mode such as academicSearch or redditSearch)."""

    name: str
    engines: tuple[str, ...] = ()
    sites: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SearchQuery:
    """One web search as a provider is asked it: the words, the most results wanted,
    the focus mode's scope and the caller's filters (None for none)."""

    text: str
    limit: int
    scope: SearchScope | None = None
    filters: SearchFilters | None = None


@dataclass(frozen=True, slots=True)
class MediaResult:
    """An image, or a video: `img_src` the picture (a video's thumbnail), `url` the page
    it is on, `iframe_src` a video's embeddable player; the picture's `width` and
    `height` in pixels when the provider says (else 0)."""

    title: str
    url: str
    img_src: str
    iframe_src: str = ""
    width: int = 0
    height: int = 0


@dataclass(frozen=True, slots=True)
class NewsItem:
    title: str
    url: str
    content: str
    thumbnail: str


class SearchProvider(abc.ABC):
    """A web search API. `search` raises `SearchError` (no key, unreachable, non-2xx,
    unexpected body); an empty list means it found nothing. Images, videos and news
    are [] for a provider that has none of them.

    `honours` names the filters (`domains`, `recency`, `dates`) the provider applies
    itself when `search` is given them; the pipeline applies the others to the results
    afterwards where it can."""

    name: str
    honours: frozenset[str] = frozenset()

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    @property
    def endpoint(self) -> str:
        """A URL whose host the provider talks to (what the start-up check connects
        to); "" for one that needs no network."""
        return ""

    async def search(
        self,
        query: str,
        limit: int,
        scope: SearchScope | None = None,
        filters: SearchFilters | None = None,
    ) -> list[SearchResult]:
        return await self.find(SearchQuery(query, limit, scope, filters))

    @abc.abstractmethod
    async def find(self, query: SearchQuery) -> list[SearchResult]:
        """What `search` asks of the provider, the arguments in one object."""

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
        except httpx.TimeoutException as exc:  # the client's own timeout: what it was
            log.warning("%s timed out (%s at %s)", self.name, type(exc).__name__, request.url.host)
            raise SearchError(f"{self.name} timed out") from exc
        except httpx.HTTPError as exc:
            log.warning(
                "%s is unreachable (%s at %s)", self.name, type(exc).__name__, request.url.host
            )
            raise SearchError(f"{self.name} is unreachable") from exc
        if response.status_code >= 400:
            log.warning("%s answered %d", self.name, response.status_code)
            raise SearchError(f"{self.name} answered {response.status_code}")
        try:
            return orjson.loads(response.content)
        except orjson.JSONDecodeError:
            pass  # not JSON, or JSON that orjson holds too strictly (a lone surrogate, NaN)
        try:
            return clean(json.loads(response.content))
        except ValueError as exc:
            raise SearchError(f"{self.name} answered with a body that is not JSON") from exc


def text(value: Any) -> str:
    """A field of a provider's answer as text ("" for a missing or non-string one)."""
    return value if isinstance(value, str) else ""


def pixels(value: Any) -> int:
    """A provider's width or height as pixels (0 when there is none)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def absolute(url: Any) -> str:
    """An absolute http(s) URL, or "" (a page may only load those)."""
    url = text(url)
    if url.startswith("//"):
        url = "https:" + url
    return url if url.startswith(("http://", "https://")) else ""


def site_query(query: str, scope: SearchScope | None, filters: SearchFilters | None = None) -> str:
    """The query kept to the scope's sites and the filters' domains with `site:` and
    `-site:` operators (providers without engines or domain parameters)."""
    sites = list(scope.sites) if scope is not None else []
    if filters is not None and filters.include:
        sites = list(filters.include)  # the caller's choice narrows a focus mode's
    if sites:
        query = f"{query} ({' OR '.join(f'site:{site}' for site in sites)})"
    if filters is not None and filters.exclude:
        query += "".join(f" -site:{site}" for site in filters.exclude)
    return query


def results_from(
    items: Any, *, title: str, url: str, snippet: str, provider: str, published: str = ""
) -> list[SearchResult]:
    """Map a provider's list of dicts onto results, skipping entries without a URL;
    `published` names the field of the page's date, if the provider has one."""
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
                    date=iso_date(item.get(published)) if published else "",
                )
            )
    return out


def iso_date(value: Any) -> str:
    """A provider's date as ISO 8601 ("" when there is none, or it is not one): ISO
    already, or RFC 2822 as some feeds write it."""
    value = text(value).strip()
    if not value:
        return ""
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).isoformat()
    except ValueError:
        pass
    from email.utils import parsedate_to_datetime

    try:
        return parsedate_to_datetime(value).isoformat()
    except (TypeError, ValueError):
        return ""
