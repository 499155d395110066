"""The webSearch pipeline: search, rank and read by optimization mode, then the prompt.

    speed     the provider's results as they are (snippets), nothing read
    balanced  ranked by embeddings; the best page read in full
    quality   the small model picks at most 6; all of them read, concurrently

Failures degrade: a provider that fails or finds nothing leaves the answer
without sources (a `progress` event says why); a page that cannot be read
keeps its snippet; the whole of search and reading is bounded by
`search.timeout_seconds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Coroutine
from typing import Any, NamedTuple, Protocol, TypeVar
from urllib.parse import urlsplit

import httpx

from ..chores import cancel_and_wait
from ..config import Settings
from ..errors import AppError, SearchError
from ..model import ChatModel, Embedder
from ..prompts import Prompts
from ..results import SearchFilters, SearchResult
from .base import MediaResult, NewsItem, SearchProvider
from .ddgs import DdgsSearch
from .demo import DemoSearch
from .google import GoogleSearch
from .rank import rank_by_embeddings, select_with_model
from .reader import Reader, open_reader
from .searxng import SearxngSearch
from .tavily import TavilySearch

log = logging.getLogger("app.search")
T = TypeVar("T")

QUALITY_PICKS = 6
DISCOVER_SECONDS = 300.0
DISCOVER_TOPICS = ("technology", "science", "artificial intelligence", "world news")
SNIPPET_CHARS = 500
CONTEXT_CHARS_PER_SOURCE = 6000
PROBE_SECONDS = 5.0
PROVIDER_LABELS = {"tavily": "Tavily", "searxng": "SearxNG", "google": "Google", "ddgs": "keyless"}
#: `search.contextSize` → (share of `search.max_results` searched, characters of each
#: source the model is given)
CONTEXT_SHARES = {
    "low": (0.5, 2000),
    "medium": (1.0, CONTEXT_CHARS_PER_SOURCE),
    "high": (1.5, 12000),
}


def context_chars(filters: SearchFilters | None) -> int:
    """How much of each source the model is given, by `contextSize`."""
    return CONTEXT_SHARES[(filters and filters.context_size) or "medium"][1]


def kept(
    results: list[SearchResult], filters: SearchFilters, honoured: frozenset[str]
) -> tuple[list[SearchResult], list[str]]:
    """The results that pass the filters, and what could not be checked: the domains
    always (a provider's own filter is not trusted to be exact), the dates of those
    results that have one. A result without a date passes a date filter that the
    provider did not apply itself, and that is said."""
    passed = [r for r in results if filters.allows_domain(r.url)]
    unchecked = []
    if filters.dated:
        dated = [r for r in passed if filters.allows_date(r.date) is not False]
        undated = sum(1 for r in dated if not r.date)
        needs = "recency" if filters.recency and not (filters.after or filters.before) else "dates"
        exact = needs in honoured and filters.recency != "hour"
        if undated and not exact:
            unchecked.append(f"{undated} result{'s' if undated != 1 else ''} without a date")
        passed = dated
    return passed, unchecked


class Progress(Protocol):
    """Where the pipeline reports: the generation's `LogWriter`."""

    def emit(self, type: str, **data: object) -> object: ...


def search_problem(settings: Settings) -> str | None:
    """Why web search cannot work as configured (said once at start), or None."""
    provider = settings.search.provider
    if provider == "tavily" and not settings.tavily.api_key:
        return "search.provider is tavily but no key is set (TAVILY_API_KEY)"
    if provider == "searxng" and not settings.searxng.url:
        return "search.provider is searxng but no instance is set (SEARXNG_URL)"
    if provider == "google" and not (settings.google.api_key and settings.google.cse_id):
        return "search.provider is google but GOOGLE_API_KEY and GOOGLE_CSE_ID are not both set"
    if choose_provider(settings).name == "ddgs" and importlib.util.find_spec("ddgs") is None:
        return "the keyless search library is not installed (pip install ddgs)"
    return None


class ProviderChoice(NamedTuple):
    name: str
    #: why, for the start-up line: "auto: no Tavily key, SearxNG URL set → searxng"
    reason: str


def choose_provider(settings: Settings) -> ProviderChoice:
    """The provider `search.provider` means: itself, or for `auto` the first one
    configured of tavily, searxng and google, else ddgs (keyless)."""
    provider = settings.search.provider
    if provider != "auto":
        return ProviderChoice(provider, f"search.provider = {provider}")
    google = settings.google
    no_google = (
        "no Google CSE id"
        if google.api_key
        else "no Google key"
        if google.cse_id
        else "no Google key or CSE id"
    )
    said = []
    for name, configured, yes, no in (
        ("tavily", bool(settings.tavily.api_key), "Tavily key set", "no Tavily key"),
        ("searxng", bool(settings.searxng.url), "SearxNG URL set", "no SearxNG URL"),
        ("google", bool(google.api_key and google.cse_id), "Google key and CSE id set", no_google),
    ):
        said.append(yes if configured else no)
        if configured:
            return ProviderChoice(name, f"auto: {', '.join(said)} → {name}")
    return ProviderChoice("ddgs", f"auto: {', '.join(said)} → ddgs")


def open_provider(settings: Settings, http: httpx.AsyncClient) -> SearchProvider:
    """The provider `choose_provider` names; `ValueError` for an unknown one."""
    provider = choose_provider(settings).name
    if provider == "tavily":
        return TavilySearch(http, settings.tavily)
    if provider == "searxng":
        return SearxngSearch(http, settings.searxng)
    if provider == "google":
        return GoogleSearch(http, settings.google)
    if provider == "ddgs":
        return DdgsSearch(http, settings.ddgs, timeout=settings.search.timeout_seconds)
    if provider == "demo":
        return DemoSearch(http)
    raise ValueError(
        f"unsupported search.provider {provider!r}: use auto, tavily, searxng, google, ddgs or demo"
    )


class WebSearch:
    def __init__(
        self,
        settings: Settings,
        *,
        llm: ChatModel,
        embedder: Embedder,
        prompts: Prompts,
        provider: SearchProvider | None = None,
        reader: Reader | None = None,
    ) -> None:
        self.settings = settings
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.search.timeout_seconds, connect=10.0)
        )
        self.provider = provider or open_provider(settings, self.http)
        self.reader = reader or open_reader(settings.reader, self.http)
        self.llm = llm
        self.embedder = embedder
        self.prompts = prompts
        self._discovered: tuple[float, list[NewsItem] | None] = (0.0, None)
        self._notes = itertools.count(1)  # the ids of the notes' steps
        self._discovering = asyncio.Lock()

    async def aclose(self) -> None:
        await self.reader.aclose()
        await self.http.aclose()

    async def probe(self) -> str | None:
        """Why web search cannot work from here (its service cannot even be connected
        to: offline, a wrong address), in words; None when it can be. Nothing is
        searched: a connection is opened and closed."""
        url = urlsplit(self.provider.endpoint)
        if not url.hostname:
            return None
        port = url.port or (443 if url.scheme == "https" else 80)
        who = f"the {PROVIDER_LABELS.get(self.provider.name, self.provider.name)} search service"
        try:
            async with asyncio.timeout(PROBE_SECONDS):
                _, writer = await asyncio.open_connection(url.hostname, port)
        except socket.gaierror:
            return (
                f"{who} cannot be reached: its address does not resolve — is this server offline?"
            )
        except ConnectionRefusedError:
            return f"{who} refused the connection: nothing listens at its address"
        except TimeoutError:
            return f"{who} did not answer: this server may be offline"
        except OSError:
            return f"{who} cannot be reached from this server"
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return None

    # -- images, videos, news: what the provider has, [] rather than an error ------------------

    async def images(self, query: str, limit: int = 12) -> list[MediaResult]:
        return await self._media(self.provider.images(query, limit), "images")

    async def videos(self, query: str, limit: int = 12) -> list[MediaResult]:
        return await self._media(self.provider.videos(query, limit), "videos")

    async def discover(self) -> list[NewsItem]:
        """Recent news on a few broad topics, for a discover page; kept for
        `DISCOVER_SECONDS` (one provider call per topic per period, per process)."""
        cached_at, items = self._discovered
        if items is not None and time.monotonic() - cached_at < DISCOVER_SECONDS:
            return items
        async with self._discovering:
            cached_at, items = self._discovered
            if items is not None and time.monotonic() - cached_at < DISCOVER_SECONDS:
                return items
            found = await asyncio.gather(
                *(self._media(self.provider.news(t, 10), "news") for t in DISCOVER_TOPICS)
            )
            seen: set[str] = set()
            items = []
            for item in (i for topic in zip(*found, strict=False) for i in topic):
                if item.url not in seen:
                    seen.add(item.url)
                    items.append(item)
            self._discovered = (time.monotonic(), items)
            return items

    async def _media(self, call: Awaitable[list[T]], what: str) -> list[T]:
        try:
            async with asyncio.timeout(self.settings.search.timeout_seconds):
                return await call
        except (SearchError, TimeoutError) as exc:
            log.info("%s search failed: %s", what, getattr(exc, "message", "timeout"))
            return []

    def limit(self, filters: SearchFilters | None) -> int:
        """How many results a search asks for: `search.max_results`, by `contextSize`."""
        share = CONTEXT_SHARES[(filters and filters.context_size) or "medium"][0]
        return max(1, round(self.settings.search.max_results * share))

    def keep_to(
        self, out: Progress, results: list[SearchResult], filters: SearchFilters | None
    ) -> list[SearchResult]:
        """The results that pass `filters` (see `kept`); what could not be checked is
        said in a `progress` event with a `search` step of its own (status `done`, its
        text as `note`)."""
        if filters is None:
            return results
        results, unchecked = kept(results, filters, self.provider.honours)
        provider = PROVIDER_LABELS.get(self.provider.name, self.provider.name)
        for what in unchecked:
            note = f"{self.provider.name} cannot filter by date: {what} kept"
            # a step, so that the clients that show only steps (/v1) show it too
            step = {"id": f"note-{next(self._notes)}", "kind": "search", "status": "done"}
            out.emit("progress", data=note, step={**step, "provider": provider, "note": note})
        return results

    async def refine(
        self,
        out: Progress,
        question: str,
        mode: str,
        results: list[SearchResult],
        deadline: float,
        picks: int = QUALITY_PICKS,
    ) -> list[SearchResult]:
        """What the optimization mode does with search results: `balanced` ranks them
        by embeddings and reads the best page, `quality` has the small model pick at
        most `picks` and reads them all; `speed` keeps them as they are. Nothing runs
        past the loop time `deadline`: a pick not made by then is the search's order."""
        if mode == "balanced":
            try:
                results = await rank_by_embeddings(self.embedder, question, results)
            except AppError as exc:
                out.emit(
                    "progress", data=f"ranking unavailable ({exc.message}); using the search order"
                )
            return await self._read(out, results, 1, deadline)
        if mode == "quality":
            out.emit("progress", data=f"choosing the best of {len(results)} results")
            try:
                async with asyncio.timeout_at(deadline):
                    chosen = await select_with_model(
                        self.llm, self.prompts, question, results, picks
                    )
            except TimeoutError:
                out.emit("progress", data="no time left to choose; using the search order")
                chosen = results[:picks]
            return await self._read(out, chosen, len(chosen), deadline)
        return results

    async def _read(
        self, out: Progress, results: list[SearchResult], count: int, deadline: float
    ) -> list[SearchResult]:
        """Read the first `count` results concurrently until the deadline; a page that
        fails or is too late keeps its snippet."""
        out.emit("progress", data=f"reading {count} page{'s' if count != 1 else ''}")
        timeout = self.settings.reader.timeout_seconds
        pages = await until_deadline(
            [self.read_page(r.url, timeout) for r in results[:count]], deadline
        )
        read = list(results)
        for i, page in enumerate(pages):
            if page:
                read[i] = results[i].with_content(page)
        failed = count - sum(1 for r in read[:count] if r.content)
        if failed:
            out.emit(
                "progress",
                data=f"{failed} of {count} pages could not be read; using their snippets",
            )
        return read

    async def read_page(self, url: str, timeout: float) -> str:
        """A page's text; "" when it cannot be read in time (logged by host)."""
        try:
            async with asyncio.timeout(timeout):
                return await self.reader.read(url)
        except (SearchError, TimeoutError) as exc:
            what = getattr(exc, "message", None) or "timeout"
            log.info("reading a page of %s failed: %s", urlsplit(url).hostname, what)
            return ""


async def until_deadline(coros: list[Coroutine[Any, Any, T]], deadline: float) -> list[T | None]:
    """Run the coroutines concurrently until the loop time `deadline`; the results in
    order, None for each one that failed (logged) or had not finished (those are
    cancelled)."""
    tasks = [asyncio.create_task(c) for c in coros]
    remaining = max(0.0, deadline - asyncio.get_running_loop().time())
    try:
        done, _ = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
    finally:
        # what is late is cancelled and waited for: no request outlives its search
        await asyncio.shield(cancel_and_wait(tasks))
    results: list[T | None] = []
    for task in tasks:
        if task not in done or task.cancelled():
            results.append(None)
        elif (exc := task.exception()) is not None:
            if isinstance(exc, AppError):
                log.warning("a search step failed: %s", exc.message)
            else:
                log.error("a search step failed", exc_info=exc)
            results.append(None)
        else:
            results.append(task.result())
    return results


def source_entries(results: list[SearchResult]) -> list[dict[str, object]]:
    """Sources as the protocol sends and saves them; a file passage carries its
    `fileId`, a collection's its `collectionId` and `documentId` (and either its
    `page`, in a PDF), and the whole passage as `pageContent`."""
    entries: list[dict[str, object]] = []
    for r in results:
        metadata: dict[str, object] = {"title": r.title, "url": r.url}
        if r.date:
            metadata["date"] = r.date
        if r.last_updated:
            metadata["lastUpdated"] = r.last_updated
        if r.file_id:
            metadata["fileId"] = r.file_id
            if r.page:
                metadata["page"] = r.page
        elif r.collection_id:
            metadata["collectionId"] = r.collection_id
            metadata["documentId"] = r.document_id
            if r.page:  # as a file's: only a format with pages (PDF) has one
                metadata["page"] = r.page
        if r.tool:
            metadata["tool"] = r.tool
        passage = r.file_id or r.collection_id
        text = r.snippet if passage else (r.snippet or r.content)[:SNIPPET_CHARS]
        entries.append({"metadata": metadata, "pageContent": text})
    return entries


def context_of(results: list[SearchResult], chars: int = CONTEXT_CHARS_PER_SOURCE) -> str:
    """'source N <url> <content>' per source, as the original built it (a file
    passage names its file and page instead of a URL), `chars` of each."""
    return "\n".join(
        f"source {i} {cited(r)} {r.text[:chars]}" for i, r in enumerate(results, start=1)
    )


def cited(result: SearchResult) -> str:
    if not (result.file_id or result.collection_id):
        return result.url
    return f"{result.title}" + (f" (page {result.page})" if result.page else "")
