"""The research agent's tools: each an object with a `name`, the `schema` offered to
the model (OpenAI's function format), whether one research may use it (`offered`)
and an async `run` that does what a call asks and says, in words for the model,
what it found. `Tools` holds them, in the order they are offered; the agent asks it
for the schemas of a research and runs every call through it. Adding a tool is
registering an object (`Tools.register`); tools that come and go (an MCP server's,
`mcp_tools.McpTools`) are a set registered whole (`Tools.register_set`).

A tool's `run` records what it found in the `Research` it is given (`keep`) and
streams its work as steps (`Steps`): every step that starts ends, `done` or
`failed`, also when the call is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol
from urllib.parse import urlsplit

import json_repair
import orjson

from ..config import ReaderSettings, SearchSettings, UploadSettings
from ..errors import AppError, SearchError
from ..files.service import FileService
from ..model import ToolCall, ToolTurn
from ..results import RECENCY, SearchFilters, SearchResult, in_domain
from ..search.base import SearchScope
from ..search.web import PROVIDER_LABELS, Progress, WebSearch, until_deadline
from ..store import FileRecord
from ..timings import Timings
from .modes import ACADEMIC, DISCUSSIONS

log = logging.getLogger("app.research")

RESULT_CHARS = 300  # of each result, told back to the model
READ_CHARS = 6000  # of a page read, kept for the answer
MAX_READS = 3
MAX_URL_CHARS = 2048  # a longer address (from the model) is not read


@dataclass
class Steps:
    """Numbered `progress` steps of one answer (PROTOCOL §3 `step`). Each one's event
    stays well under `limit` bytes (`stream.max_event_bytes`): its line and its fields
    are cut to fit, whatever the model asked for."""

    out: Progress
    limit: int = 262144
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _running: set[str] = field(default_factory=set)

    def start(self, kind: str, text: str, **fields: Any) -> dict[str, Any]:
        step = {"id": f"{kind}-{next(self._ids)}", "kind": kind, "status": "running", **fields}
        step = self._bounded(step)
        self._running.add(step["id"])
        self.out.emit("progress", data=self._line(text), step=step)
        return step

    def end(self, step: dict[str, Any], text: str, status: str = "done", **fields: Any) -> None:
        self._running.discard(step["id"])
        ended = self._bounded({**step, "status": status, **fields})
        self.out.emit("progress", data=self._line(text), step=ended)

    @contextlib.contextmanager
    def running(self, kind: str, text: str, **fields: Any) -> Iterator[dict[str, Any]]:
        """A step that ends whatever happens: one its body did not end (cut off by the
        budget, cancelled, failed) is ended `failed` on the way out."""
        step = self.start(kind, text, **fields)
        try:
            yield step
        finally:
            if step["id"] in self._running:
                self.end(step, f"{kind} stopped", "failed")

    def _line(self, text: str) -> str:
        chars = max(80, min(600, self.limit // 24))  # at most 6 bytes a character in JSON
        return text if len(text) <= chars else text[: chars - 1] + "…"

    def _bounded(self, step: dict[str, Any]) -> dict[str, Any]:
        """`step` within a third of the event's limit: its texts and lists cut shorter
        until it fits (in the end only its id, kind and status)."""
        room = self.limit // 3
        if len(orjson.dumps(step)) <= room:
            return step
        cap = 2000
        while cap >= 20:
            cut = {k: _cut(v, cap) for k, v in step.items()}
            if len(orjson.dumps(cut)) <= room:
                return cut
            cap //= 2
        return {k: step[k] for k in ("id", "kind", "status")}


@dataclass
class Research:
    """One answer's research: what it may use and what it found."""

    question: str
    steps: Steps
    kinds: tuple[str, ...]  # the sources it may use: web, academic, discussions, files
    scope: SearchScope | None  # the mode's restricted web, if any
    files: Sequence[FileRecord]
    collections: Callable[[str], Awaitable[list[SearchResult]]] | None
    deadline: float
    filters: SearchFilters | None = None  # what every web search and read is kept to
    found: dict[str, SearchResult] = field(default_factory=dict)
    searches: int = 0
    reads: int = 0  # pages the model asked to read (pasted ones are not counted)
    searched: set[str] = field(default_factory=set)  # "files", "collection"
    #: the MCP servers the request named (`sources: ["mcp:<name>"]`), beside the default ones
    servers: frozenset[str] = frozenset()
    #: where the time of its searches and reads is recorded
    timings: Timings = field(default_factory=Timings)
    #: the first round's model call, made before the research (`Researcher.plan_ahead`)
    planned: asyncio.Task[ToolTurn] | None = None
    #: page reads that go on beside the next round, awaited before the answer
    reading: list[asyncio.Task[str]] = field(default_factory=list)
    #: web searches started before the research (the question searched while it was
    #: classified), by query: a `web_search` of that query takes its results
    prefetched: dict[str, asyncio.Future[list[SearchResult]]] = field(default_factory=dict)

    def allows(self, url: str) -> bool:
        """Whether a web page passes the request's domain filter."""
        return self.filters is None or self.filters.allows_domain(url)

    def keep(self, results: Sequence[SearchResult]) -> list[SearchResult]:
        new = []
        for r in results:
            if not (r.file_id or r.collection_id) and not self.allows(r.url):
                continue  # a page of an excluded domain never becomes a source
            key = source_key(r)
            if key not in self.found or (r.content and not self.found[key].content):
                self.found[key] = r
                new.append(r)
        return new


# -- the registry ---------------------------------------------------------------------------


class Tool(Protocol):
    """One tool the model may call. One whose class says `overlaps = True` (reading
    pages) may still run while the next round is asked (`Tools.overlaps`)."""

    @property
    def name(self) -> str: ...

    @property
    def schema(self) -> dict[str, Any]:
        """What the model is offered: `{"type": "function", "function": {...}}`."""
        ...

    def offered(self, job: Research) -> bool:
        """Whether `job` may use it (what its request allows)."""
        ...

    async def run(self, job: Research, args: dict[str, Any]) -> str:
        """Do what a call with `args` (parsed, perhaps missing some) asks; what came of
        it, in words for the model. Failures are said, not raised."""
        ...


class ToolSet(Protocol):
    """Tools that come and go (an MCP server's, as it lists them): asked for its
    schemas per research, and for a call of one of its names."""

    def schemas(self, job: Research) -> list[dict[str, Any]]:
        """The schemas of its tools `job` may use now."""
        ...

    def owns(self, name: str) -> bool:
        """Whether `name` is one of its tools' (whether or not it is offered now)."""
        ...

    async def run(self, job: Research, name: str, args: dict[str, Any]) -> str:
        """As `Tool.run`, for its tool `name`."""
        ...


class Tools:
    """The tools of the research agent, by name, in the order they are offered; then
    those of the tool sets (`register_set`)."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        self._sets: list[ToolSet] = []
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        """Add `tool`, offered after those registered before it. `ValueError` for a
        name taken already."""
        if tool.name in self._tools:
            raise ValueError(f"a tool named {tool.name!r} is registered already")
        self._tools[tool.name] = tool

    def register_set(self, tools: ToolSet) -> None:
        """Add a set of tools, offered after the single ones; a name of a single tool
        is never one of its."""
        self._sets.append(tools)

    def schemas(self, job: Research) -> list[dict[str, Any]]:
        """The schemas of the tools `job` may use, to offer the model."""
        mine = [tool.schema for tool in self._tools.values() if tool.offered(job)]
        theirs = [s for tools in self._sets for s in tools.schemas(job)]
        return mine + [s for s in theirs if s["function"]["name"] not in self._tools]

    def overlaps(self, call: ToolCall) -> bool:
        """Whether the next round may be asked while `call` still runs: a tool whose
        `overlaps` is true (reading pages), whose answer the model can do without."""
        return bool(getattr(self._tools.get(call.name), "overlaps", False))

    async def run(self, job: Research, call: ToolCall) -> str:
        """Run one call; what it found, in words for the model."""
        tool = self._tools.get(call.name)
        if tool is not None:
            return await tool.run(job, _arguments(call.arguments))
        for tools in self._sets:
            if tools.owns(call.name):
                return await tools.run(job, call.name, _arguments(call.arguments))
        return f"there is no tool {call.name[:40]!r} here"


def function_schema(name: str, description: str, **params: dict[str, Any]) -> dict[str, Any]:
    """A tool's schema; a parameter is required unless it says `"optional": True`."""
    required = [k for k, v in params.items() if not v.pop("optional", False)]
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": params, "required": required},
        },
    }


def _query() -> dict[str, Any]:
    return {"type": "string", "description": "a short search query"}


def _query_of(job: Research, args: dict[str, Any]) -> str:
    return str(args.get("query") or job.question)[:400]


def _searches_web(job: Research) -> bool:
    return not job.kinds or any(k in job.kinds for k in ("web", "academic", "discussions"))


# -- the tools ------------------------------------------------------------------------------


class SearchTheWeb:
    """`web_search` (the mode's web, narrowed to a `site` the model names within it),
    `academic_search` and `discussion_search` (scholarly sources, discussions)."""

    def __init__(
        self,
        web: WebSearch,
        settings: SearchSettings,
        kind: str,
        schema: dict[str, Any],
        scope: SearchScope | None = None,
    ) -> None:
        self.web = web
        self.timeout = settings.timeout_seconds
        self.kind = kind  # "web", "academic" or "discussions"
        self.schema = schema
        self.name: str = schema["function"]["name"]
        self.scope = scope  # None: the mode's own

    def offered(self, job: Research) -> bool:
        if self.kind == "web":
            return "web" in job.kinds or not job.kinds
        return self.kind in job.kinds or ("web" in job.kinds and job.scope is None)

    async def run(self, job: Research, args: dict[str, Any]) -> str:
        scope = self.scope if self.scope is not None else job.scope
        if self.scope is None and isinstance(args.get("site"), str):
            scope = site_scope(args["site"], job.scope)
        filters = job.filters
        recency = args.get("recency")
        if recency in RECENCY and not (filters and filters.dated):
            # the model asked for recent pages; a request's own dates win
            filters = replace(filters or SearchFilters(), recency=recency)
        return await self._search(job, _query_of(job, args), scope, filters)

    async def _search(
        self,
        job: Research,
        query: str,
        scope: SearchScope | None,
        filters: SearchFilters | None,
    ) -> str:
        provider = self.web.provider.name
        where = f" ({scope.name})" if scope else ""
        with job.steps.running(
            "search",
            f"searching the web{where}: {query}",
            query=query,
            provider=PROVIDER_LABELS.get(provider, provider),
        ) as step:
            job.searches += 1
            started = None
            if scope is job.scope and filters is job.filters:
                started = job.prefetched.pop(query, None)
            try:
                async with asyncio.timeout(self.timeout):
                    if started is not None:  # its span is the speculative search's
                        results = await started
                    else:
                        with job.timings.span("search", query=query[:100]):
                            results = await self.web.provider.search(
                                query, self.web.limit(filters), scope, filters
                            )
            except (SearchError, TimeoutError) as exc:
                why = getattr(exc, "message", None) or "timed out"
                log.warning("search failed: %s", why)
                job.steps.end(step, f"web search failed ({why})", "failed", results=0)
                return f"the search failed ({why})"
            results = self.web.keep_to(job.steps.out, results, filters)
            job.keep(results)
            text = "web search found nothing" if not results else f"found {len(results)} results"
            job.steps.end(step, text, results=len(results))
        return _told(results) or "nothing found"


class ReadPages:
    """`read_url`: whole pages, where the web may be searched."""

    name = "read_url"
    overlaps = True  # the next round goes on while pages are read
    schema = function_schema(
        "read_url",
        "Read whole pages (at most 3) whose snippets look promising.",
        urls={"type": "array", "items": {"type": "string"}, "maxItems": MAX_READS},
    )

    def __init__(self, web: WebSearch, settings: ReaderSettings) -> None:
        self.web = web
        self.timeout = settings.timeout_seconds

    def offered(self, job: Research) -> bool:
        return _searches_web(job)

    async def run(self, job: Research, args: dict[str, Any]) -> str:
        urls = args.get("urls") or args.get("url") or []
        urls = [urls] if isinstance(urls, str) else urls
        return await self.read(job, [u for u in urls if isinstance(u, str)][:MAX_READS])

    async def read(self, job: Research, urls: list[str]) -> str:
        """Read `urls` (at most `MAX_READS` are asked for) into the research's sources:
        web addresses only, within the request's domain filter; the pages for the model."""
        urls = [
            u
            for u in dict.fromkeys(urls)
            if len(u) <= MAX_URL_CHARS and urlsplit(u).scheme in ("http", "https")
        ]
        excluded = [u for u in urls if not job.allows(u)]
        if excluded:
            # the request's domain filter holds for pages read as for pages searched
            text = f"not reading {_pages(len(excluded))}: excluded by the request's domains"
            step = job.steps.start("read", text, urls=excluded)
            job.steps.end(step, text, "failed", read=0)
            urls = [u for u in urls if u not in excluded]
        if not urls:
            return "no address to read" if not excluded else "those pages may not be read"
        with job.steps.running("read", f"reading {_pages(len(urls))}", urls=urls) as step:
            job.reads += len(urls)
            with job.timings.span("read", pages=len(urls)):
                pages = await until_deadline(
                    [self.web.read_page(u, self.timeout) for u in urls], job.deadline
                )
            read = []
            for url, page in zip(urls, pages, strict=True):
                if page:
                    known = job.found.get(url)
                    title = known.title if known else (urlsplit(url).hostname or url)
                    snippet = known.snippet if known else page[:500]
                    read.append(SearchResult(title, url, snippet, page[:READ_CHARS]))
            job.keep(read)
            failed = len(urls) - len(read)
            text = f"read {_pages(len(read))}" + (f"; {failed} could not be read" if failed else "")
            job.steps.end(step, text, "done" if read else "failed", read=len(read))
        return "\n\n".join(f"{r.url}:\n{r.content[:1500]}" for r in read) or "nothing readable"


class SearchFiles:
    """`search_files`: the passages of the request's files nearest the query."""

    name = "search_files"
    schema = function_schema("search_files", "Search the user's own files.", query=_query())

    def __init__(self, files: FileService, settings: UploadSettings) -> None:
        self.files = files
        self.k = settings.passages

    def offered(self, job: Research) -> bool:
        return bool(job.files)

    async def run(self, job: Research, args: dict[str, Any]) -> str:
        return await passages(job, "files", "your files", _query_of(job, args), self._search(job))

    def _search(self, job: Research) -> Callable[[str], Awaitable[list[SearchResult]]]:
        async def search(query: str) -> list[SearchResult]:
            return [p.result for p in await self.files.passages(job.files, query, self.k)]

        return search


class SearchCollection:
    """`search_collection`: the knowledge collections of the question."""

    name = "search_collection"
    schema = function_schema(
        "search_collection", "Search the knowledge collections of this question.", query=_query()
    )

    def offered(self, job: Research) -> bool:
        return job.collections is not None

    async def run(self, job: Research, args: dict[str, Any]) -> str:
        if job.collections is None:
            return f"there is no tool {self.name!r} here"
        return await passages(
            job, "collection", "collections", _query_of(job, args), job.collections
        )


class Done:
    """`done`: the model says what was found answers the question (the loop ends; it
    runs nothing)."""

    name = "done"
    schema = function_schema("done", "Call when what was found answers the question.")

    def offered(self, job: Research) -> bool:
        return True

    async def run(self, job: Research, args: dict[str, Any]) -> str:
        return f"there is no tool {self.name!r} here"


def research_tools(
    web: WebSearch,
    files: FileService,
    search: SearchSettings,
    reader: ReaderSettings,
    uploads: UploadSettings,
) -> tuple[Tools, ReadPages]:
    """The built-in tools, in the order they are offered; and the page reader among
    them (which also reads the pages a user pasted)."""
    pages = ReadPages(web, reader)
    web_search = function_schema(
        "web_search",
        "Search the web.",
        query=_query(),
        site={"type": "string", "description": "only this site, e.g. arxiv.org", "optional": True},
        recency={
            "type": "string",
            "enum": ["day", "week", "month", "year"],
            "optional": True,
        },
    )
    academic = function_schema(
        "academic_search", "Search scholarly sources (arXiv, Scholar, PubMed).", query=_query()
    )
    discussions = function_schema(
        "discussion_search",
        "Search discussions: forums and Reddit (experiences, opinions).",
        query=_query(),
    )
    tools = Tools(
        [
            SearchTheWeb(web, search, "web", web_search),
            SearchTheWeb(web, search, "academic", academic, ACADEMIC),
            SearchTheWeb(web, search, "discussions", discussions, DISCUSSIONS),
            pages,
            SearchFiles(files, uploads),
            SearchCollection(),
            Done(),
        ]
    )
    return tools, pages


async def passages(
    job: Research,
    kind: str,
    what: str,
    query: str,
    search: Callable[[str], Awaitable[list[SearchResult]]],
) -> str:
    """Passages of the user's files or collections (`kind`, said as `what`) into the
    research's sources; a search that fails ends its step `failed` and says so."""
    job.searched.add(kind)
    with job.steps.running(kind, f"searching {what}: {query}", query=query) as step:
        try:
            passages = await search(query)
        except AppError as exc:
            log.warning("searching %s failed: %s", what, exc.message)
            job.steps.end(step, f"searching {what} failed", "failed", results=0)
            return f"the search failed ({exc.message})"
        job.keep(passages)
        job.steps.end(step, f"found {len(passages)} passages in {what}", results=len(passages))
    return _told(passages) or "nothing found"


def site_scope(site: str, scope: SearchScope | None) -> SearchScope | None:
    """The model's `site` within the mode's restricted web: a site inside it (any site,
    on the open web) narrows the search to that site; one outside it, or no site at
    all, leaves the mode's scope as it is — a mode's restriction is never left."""
    text = site.strip().removeprefix("site:").strip()
    host = (urlsplit(text if "//" in text else "//" + text).hostname or "")[:200]
    if not host:
        return scope
    if scope is None or any(in_domain(host, s) for s in scope.sites):
        return SearchScope(host, sites=(host,))
    return scope


def _arguments(text: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError:
        parsed = json_repair.loads(text)
    return parsed if isinstance(parsed, dict) else {}


def _cut(value: Any, chars: int) -> Any:
    if isinstance(value, str):
        return value[:chars]
    if isinstance(value, list):
        return [_cut(v, chars) for v in value[:10]]
    return value


def _told(results: Sequence[SearchResult]) -> str:
    return "\n".join(f"- {r.title} ({r.url}): {r.text[:RESULT_CHARS]}" for r in results)


def _pages(n: int) -> str:
    return f"{n} page{'s' if n != 1 else ''}"


def source_key(result: SearchResult) -> str:
    """What tells one source from another: its URL, or for a passage its file or
    document and its opening."""
    if result.collection_id:
        return f"{result.collection_id}/{result.document_id}#{result.snippet[:80]}"
    return f"{result.file_id}#{result.snippet[:80]}" if result.file_id else result.url
