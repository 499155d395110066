"""Web search: the provider interface and what a search returns."""

from __future__ import annotations

import abc
import json
import logging
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime, time, timedelta
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from ..cleaning import clean
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
    date: str = ""  # when the page was published, ISO 8601, when the provider says
    last_updated: str = ""  # when it last changed, ISO 8601, when the provider says
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


#: `recency` → how far back it reaches
RECENCY = {
    "hour": timedelta(hours=1),
    "day": timedelta(days=1),
    "week": timedelta(weeks=1),
    "month": timedelta(days=31),
    "year": timedelta(days=366),
}
CONTEXT_SIZES = ("low", "medium", "high")  # what each means: `web.CONTEXT_SHARES`


@dataclass(frozen=True, slots=True)
class SearchFilters:
    """What a search is kept to (PROTOCOL §1 `search`, Perplexity's parameters): the
    domains it may (`include`) or may not (`exclude`) come from, how recent a page must
    be (`recency`), published after / before a day, and how much of the web the answer
    reads (`context_size`). Empty means no restriction."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    recency: str = ""
    after: date | None = None
    before: date | None = None
    context_size: str = ""

    @property
    def dated(self) -> bool:
        return bool(self.recency or self.after or self.before)

    def since(self, now: datetime | None = None) -> datetime | None:
        """The first moment a page may be from (UTC): the later of the start of the day
        `after` and `now` less `recency`."""
        moments = []
        if self.after is not None:
            moments.append(datetime.combine(self.after, time(), UTC))
        if self.recency:
            moments.append((now or datetime.now(UTC)) - RECENCY[self.recency])
        return max(moments) if moments else None

    def allows_domain(self, url: str) -> bool:
        host = (urlsplit(url).hostname or "").lower()
        if any(in_domain(host, d) for d in self.exclude):
            return False
        return not self.include or any(in_domain(host, d) for d in self.include)

    def allows_date(self, published: str, now: datetime | None = None) -> bool | None:
        """Whether a page published then passes the date filters; None when its date is
        unknown (or not a date). A date with a time of day is compared to the moment
        (an `hour` keeps what is at most an hour old); a bare day passes `since` when
        that day is (the page may be from any time of it)."""
        moment = moment_of(published)
        if moment is None:
            return None
        timed = len(published.strip()) > 10
        day = moment.astimezone(UTC).date() if timed else moment.date()
        since = self.since(now)
        if since is not None and (moment < since if timed else day < since.date()):
            return False
        return not (self.before and day > self.before)


def in_domain(host: str, domain: str) -> bool:
    """Whether `host` is `domain` or one of its subdomains."""
    return host == domain or host.endswith("." + domain)


def moment_of(value: str) -> datetime | None:
    """An ISO 8601 date ("2026-03-01": its midnight) or date-time ("2026-03-01T10:00:00Z";
    UTC when it names no zone) as an aware datetime; None for anything else."""
    try:
        moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        try:
            moment = datetime.combine(date.fromisoformat(value.strip()[:10]), time())
        except ValueError:
            return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


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

    @abc.abstractmethod
    async def search(
        self,
        query: str,
        limit: int,
        scope: SearchScope | None = None,
        filters: SearchFilters | None = None,
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
