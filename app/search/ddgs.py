"""ddgs: keyless web search (`ddgs.DDGS`, the metasearch library that succeeded
`duckduckgo-search`): text, images, videos and news.

The library is synchronous and scrapes several public search services, so a call
runs in one of a few threads of this provider's own, bounded by the search timeout
(the library's own timeout is per request, and `backend = "auto"` makes several
rounds of them). Its services rate-limit and block freely: every failure becomes a
`SearchError` in plain words, which the pipeline turns into a `progress` event.

Answers are cached for `ddgs.cache_seconds`, keyed by (kind, query as sent, limit, time limit);
concurrent callers of the same key share one call. Failures are not cached.
Focus modes that keep to some sources, and the domain filters, add `site:` and
`-site:` operators to the query; recency is the library's `timelimit` (d, w, m, y: an
hour asks for a day). It has no date ranges, and gives no dates for text results.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import httpx

from ..config import DdgsSettings
from ..errors import SearchError
from ..results import SearchResult
from .base import (
    MediaResult,
    NewsItem,
    SearchProvider,
    SearchQuery,
    absolute,
    pixels,
    site_query,
    text,
)

log = logging.getLogger("app.search")

#: the most answers kept (the oldest go first)
CACHE_ENTRIES = 256
#: calls in flight at once; more wait their turn (a hung call holds its thread until
#: the library gives up, and must not take the event loop's default executor with it)
THREADS = 4

Key = tuple[str, str, int, str]


class DdgsClient(Protocol):
    """What is used of `ddgs.DDGS`: each method blocks, returns a list of dicts and
    raises `ddgs.exceptions.DDGSException` (or, from a broken page parser, anything)."""

    def text(self, query: str, **kwargs: Any) -> list[dict[str, Any]]: ...
    def images(self, query: str, **kwargs: Any) -> list[dict[str, Any]]: ...
    def videos(self, query: str, **kwargs: Any) -> list[dict[str, Any]]: ...
    def news(self, query: str, **kwargs: Any) -> list[dict[str, Any]]: ...


def new_client(settings: DdgsSettings) -> DdgsClient:
    """A `ddgs.DDGS` for one call: it keeps engine objects that change per query, so
    one is never shared between threads (making one is cheap)."""
    from ddgs import DDGS

    return DDGS(proxy=settings.proxy or None, timeout=settings.timeout_seconds)


class DdgsSearch(SearchProvider):
    name = "ddgs"
    honours = frozenset({"domains", "recency"})

    def __init__(
        self,
        http: httpx.AsyncClient,
        settings: DdgsSettings,
        *,
        timeout: float,
        factory: Callable[[DdgsSettings], DdgsClient] | None = None,
    ) -> None:
        """`timeout` bounds each call, whatever the library does; `factory` makes the
        client of one call (default `new_client`). `http` is unused: the library has
        its own client."""
        super().__init__(http)
        self.settings = settings
        self.timeout = timeout
        self.factory = factory or new_client
        self._threads = concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="ddgs")
        self._cache: collections.OrderedDict[Key, tuple[float, list[dict[str, Any]]]] = (
            collections.OrderedDict()
        )
        self._flights: dict[Key, asyncio.Future[list[dict[str, Any]]]] = {}

    @property
    def endpoint(self) -> str:
        return "https://html.duckduckgo.com"  # the library's first service

    async def find(self, query: SearchQuery) -> list[SearchResult]:
        found = []
        recency = query.filters.recency if query.filters is not None else ""
        limit_to = {"hour": "d"}.get(recency, recency[:1])
        words = site_query(query.text, query.scope, query.filters)
        for item in await self._ask("text", words, query.limit, timelimit=limit_to):
            url = absolute(item.get("href"))
            if url:
                found.append(
                    SearchResult(
                        title=text(item.get("title")) or url,
                        url=url,
                        snippet=text(item.get("body")),
                    )
                )
        return found[: query.limit]

    async def images(self, query: str, limit: int) -> list[MediaResult]:
        found = []
        for item in await self._ask("images", query, limit):
            page = absolute(item.get("url"))
            picture = absolute(item.get("image")) or absolute(item.get("thumbnail"))
            if page and picture:
                width, height = pixels(item.get("width")), pixels(item.get("height"))
                found.append(MediaResult(text(item.get("title")), page, picture, "", width, height))
        return found[:limit]

    async def videos(self, query: str, limit: int) -> list[MediaResult]:
        found = []
        for item in await self._ask("videos", query, limit):
            page = absolute(item.get("content"))
            player = absolute(item.get("embed_url"))
            sizes = item.get("images")
            sizes = sizes if isinstance(sizes, dict) else {}
            picture = absolute(sizes.get("large")) or absolute(sizes.get("medium"))
            if page and player and picture:
                found.append(MediaResult(text(item.get("title")), page, picture, player))
        return found[:limit]

    async def news(self, query: str, limit: int) -> list[NewsItem]:
        found = []
        for item in await self._ask("news", query, limit):
            url = absolute(item.get("url"))
            if url:
                found.append(
                    NewsItem(
                        text(item.get("title")) or url,
                        url,
                        text(item.get("body")),
                        absolute(item.get("image")),
                    )
                )
        return found[:limit]

    # -- one call of the library, cached and shared -----------------------------------------

    async def _ask(
        self, kind: str, query: str, limit: int, timelimit: str = ""
    ) -> list[dict[str, Any]]:
        """The library's answer for `kind` ("text", "images", …), from the cache when
        fresh, else from the call in flight for the same key, else from a new call.

        Raises `SearchError`. Cancelling is safe: the shared call goes on for the other
        callers (its result is cached), and ends within `timeout` in any case.
        """
        key = (kind, query, limit, timelimit)
        cached = self._cache.get(key)
        if cached is not None and time.monotonic() < cached[0]:
            return cached[1]
        flight = self._flights.get(key)
        if flight is None:
            flight = asyncio.ensure_future(self._call(kind, query, limit, timelimit))
            self._flights[key] = flight
            flight.add_done_callback(functools.partial(self._landed, key))
        return await asyncio.shield(flight)

    def _landed(self, key: Key, flight: asyncio.Future[list[dict[str, Any]]]) -> None:
        del self._flights[key]
        # retrieving the exception here keeps a failure that no caller awaited any
        # more (all cancelled) from being reported as never retrieved
        if flight.cancelled() or flight.exception() is not None:
            return
        self._cache[key] = (time.monotonic() + self.settings.cache_seconds, flight.result())
        self._cache.move_to_end(key)
        now = time.monotonic()
        for old in [k for k, (until, _) in self._cache.items() if until <= now]:
            del self._cache[old]
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)

    async def _call(
        self, kind: str, query: str, limit: int, timelimit: str
    ) -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout):
                items = await loop.run_in_executor(
                    self._threads, functools.partial(self._blocking, kind, query, limit, timelimit)
                )
        except TimeoutError as exc:
            log.warning("ddgs %s search timed out after %.0f s", kind, self.timeout)
            raise SearchError("the keyless search services did not answer in time") from exc
        # the library runs a dozen page scrapers, any of which may raise anything when
        # a service changes its pages: all of it is this provider failing
        except Exception as exc:
            # the class only: the library's messages carry URLs with the query in them
            log.warning("ddgs %s search failed: %s", kind, type(exc).__name__)
            raise SearchError(plain_words(exc)) from exc
        if not isinstance(items, list):
            raise SearchError("the keyless search answered with something other than results")
        return [item for item in items if isinstance(item, dict)]

    def _blocking(self, kind: str, query: str, limit: int, timelimit: str) -> list[dict[str, Any]]:
        """One call of the library, in a thread of this provider's."""
        client = self.factory(self.settings)
        method: Callable[..., list[dict[str, Any]]] = getattr(client, kind)
        return method(
            query,
            region=self.settings.region,
            safesearch=self.settings.safesearch,
            max_results=limit,
            backend=self.settings.backend,
            **({"timelimit": timelimit} if timelimit else {}),
        )


def plain_words(exc: BaseException) -> str:
    """What a failure of the library means, for a user (no class names, no URLs).

    The library keeps the last engine's error as the argument of the one it raises,
    and says "No results found." when every service it asked answered with nothing,
    which is what services that refuse a client do."""
    try:
        from ddgs.exceptions import DDGSException, RatelimitException, TimeoutException
    except ImportError:
        return "the keyless search library (ddgs) is not installed"
    causes = [exc, *(a for a in exc.args if isinstance(a, BaseException))]
    if any(isinstance(c, RatelimitException) for c in causes):
        return "the keyless search services are rate-limiting this server; try again in a minute"
    if any(isinstance(c, TimeoutException) for c in causes):
        return "the keyless search services did not answer in time"
    if isinstance(exc, DDGSException) and str(exc) == "No results found.":
        return "the keyless search services found nothing, or are refusing this server"
    if isinstance(exc, DDGSException):
        return (
            "the keyless search services cannot be reached: this server may be offline, "
            "or they are blocking it"
        )
    return "the keyless search failed on an answer it could not read"
