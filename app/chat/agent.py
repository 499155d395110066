"""The research agent: the model gathers an answer's sources with tools, in rounds,
within its optimization mode's budget, and every step is streamed.

    speed      one search of the (standalone) question: no model call before the answer
    balanced   up to `research.balanced_rounds` rounds, `balanced_seconds`
    quality    up to `research.quality_rounds` rounds, `quality_seconds`
    deep       deepResearch: up to `research.deep_rounds` rounds, `deep_seconds`

A round is one model call that asks for tools — `web_search`, `academic_search`,
`discussion_search`, `read_url`, `search_files`, `search_collection`, `done` — and
the calls it made, run concurrently. The loop ends at `done`, at the budget, or when a
round brings nothing. Models without tool calling (a 400 naming tools, or no call
where one was required) get the same loop through a JSON-in-text planner prompt; the
verdict is kept per model for the process. Every model call has a deadline
(`research.round_seconds`, and what is left of the budget); a loop that found nothing
falls back to one plain search, so an answer never waits on a planner that cannot
plan. Pasted URLs are read first and always kept first. The model's calls stay within
what the request allows: only the tools offered run, a `site` narrows the mode's
restricted web and never leaves it, and the request's domain filter holds for every
page read (pasted ones too). Every step that starts ends (`done` or `failed`), also
when it is cut off by the budget or by a cancel. Cancelling is safe at any step: the
calls in flight are closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import json_repair
import orjson

from ..config import Settings
from ..errors import AppError, SearchError
from ..files.service import FileService
from ..llm import ChatModel, ToolCall, ToolsUnsupported, tokens_in
from ..prompts import Prompts
from ..results import RECENCY, SearchFilters, SearchResult, in_domain
from ..search.base import SearchScope
from ..search.web import PROVIDER_LABELS, Progress, WebSearch, until_deadline
from ..store import FileRecord
from .modes import ACADEMIC, DISCUSSIONS

log = logging.getLogger("app.research")

RESULT_CHARS = 300  # of each result, told back to the model
READ_CHARS = 6000  # of a page read, kept for the answer
MAX_READS = 3
MAX_URL_CHARS = 2048  # a longer address (from the model) is not read
MAX_CALLS_PER_ROUND = 5
#: the share of the model's window the rounds' messages may take (the rest is its answer)
PLANNING_SHARE = 0.5


def _function(name: str, description: str, **params: dict[str, Any]) -> dict[str, Any]:
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


TOOLS: dict[str, dict[str, Any]] = {
    "web_search": _function(
        "web_search",
        "Search the web.",
        query=_query(),
        site={"type": "string", "description": "only this site, e.g. arxiv.org", "optional": True},
        recency={
            "type": "string",
            "enum": ["day", "week", "month", "year"],
            "optional": True,
        },
    ),
    "academic_search": _function(
        "academic_search", "Search scholarly sources (arXiv, Scholar, PubMed).", query=_query()
    ),
    "discussion_search": _function(
        "discussion_search",
        "Search discussions: forums and Reddit (experiences, opinions).",
        query=_query(),
    ),
    "read_url": _function(
        "read_url",
        "Read whole pages (at most 3) whose snippets look promising.",
        urls={"type": "array", "items": {"type": "string"}, "maxItems": MAX_READS},
    ),
    "search_files": _function("search_files", "Search the user's own files.", query=_query()),
    "search_collection": _function(
        "search_collection", "Search the knowledge collections of this question.", query=_query()
    ),
    "done": _function("done", "Call when what was found answers the question."),
}


@dataclass(frozen=True, slots=True)
class Budget:
    rounds: int
    seconds: float


def context_tokens(settings: Settings) -> int:
    return settings.research.context_tokens or settings.llm.context_tokens


def budget_of(settings: Settings, mode: str) -> Budget:
    r = settings.research
    if mode == "quality":
        return Budget(r.quality_rounds, r.quality_seconds)
    if mode == "balanced":
        return Budget(r.balanced_rounds, r.balanced_seconds)
    if mode == "deep":
        return Budget(r.deep_rounds, r.deep_seconds)
    return Budget(r.speed_rounds, r.speed_seconds)


@dataclass(frozen=True, slots=True)
class Gathered:
    """What the research found: its sources, the pasted pages first (`pinned` of
    them), and which of the request's own sources the model searched itself
    (`files`, `collection`): those need no second search for the question."""

    results: list[SearchResult]
    pinned: int = 0
    searched: frozenset[str] = frozenset()


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


class Researcher:
    def __init__(
        self,
        settings: Settings,
        *,
        llm: ChatModel,
        prompts: Prompts,
        web: WebSearch,
        files: FileService,
    ) -> None:
        self.settings = settings
        self.llm = llm
        self.prompts = prompts
        self.web = web
        self.files = files
        #: models seen to have no tool calling (for this process): they plan in JSON
        self.no_tools: set[str] = set()

    # -- the loop --------------------------------------------------------------------------

    async def find_sources(
        self,
        out: Progress,
        question: str,
        mode: str,
        *,
        kinds: Sequence[str] = ("web",),
        scope: SearchScope | None = None,
        urls: Sequence[str] = (),
        files: Sequence[FileRecord] = (),
        collections: Callable[[str], Awaitable[list[SearchResult]]] | None = None,
        filters: SearchFilters | None = None,
    ) -> Gathered:
        """The sources for `question`, pasted pages first; none when nothing was found.
        Every web search and every page read is kept to `filters`."""
        budget = budget_of(self.settings, mode)
        loop = asyncio.get_running_loop()
        job = Research(
            question,
            Steps(out, self.settings.stream.max_event_bytes),
            tuple(kinds),
            scope,
            files,
            collections,
            loop.time() + budget.seconds,
            filters,
        )
        if urls:
            await self._read(job, list(urls)[:MAX_READS])
            job.reads = 0  # what the user pasted; the model has read nothing yet
        pinned = list(job.found.values())
        if budget.rounds <= 1:
            await self._first_search(job)
        else:
            await self._rounds(job, budget)
            if not job.searches and len(job.found) == len(pinned):
                await self._first_search(job)  # the planner did nothing: one plain search
            found = list(job.found.values())
            web = [r for r in found[len(pinned) :] if r.url.startswith("http")]
            if not job.reads and web and loop.time() < job.deadline:
                # the model read nothing: ranked and read as the mode does without it
                others = [r for r in found[len(pinned) :] if not r.url.startswith("http")]
                how = "quality" if mode == "deep" else mode  # deep research reads like quality
                refined = await self.web.refine(out, job.question, how, web, job.deadline)
                return Gathered([*pinned, *refined, *others], len(pinned), frozenset(job.searched))
        return Gathered(list(job.found.values()), len(pinned), frozenset(job.searched))

    async def _first_search(self, job: Research) -> None:
        """What speed mode does, and the fallback of a loop that found nothing: the
        question searched where the request allows (web, files, collections)."""
        calls: list[Awaitable[str]] = []
        if any(k in job.kinds for k in ("web", "academic", "discussions")) or not job.kinds:
            tool = "web_search"
            if "web" not in job.kinds and "academic" in job.kinds:
                tool = "academic_search"
            elif "web" not in job.kinds and "discussions" in job.kinds:
                tool = "discussion_search"
            calls.append(self._run(job, ToolCall("first", tool, _args(query=job.question))))
        await asyncio.gather(*calls)

    async def _rounds(self, job: Research, budget: Budget) -> None:
        model = self.settings.llm.model
        tools = self._tools(job)
        messages: list[dict[str, Any]] = [
            {
                "role": "system",
                "content": self.prompts.render(
                    "researcher", date=_today(), rounds=str(budget.rounds), question=job.question
                ),
            },
            {"role": "user", "content": job.question},
        ]
        offered = {t["function"]["name"] for t in tools}
        loop = asyncio.get_running_loop()
        for n in range(1, budget.rounds + 1):
            remaining = job.deadline - loop.time()
            if remaining <= 0:
                step = job.steps.start("round", f"round {n}: out of time", n=n, of=budget.rounds)
                job.steps.end(step, f"round {n}: out of time", "failed", n=n)
                break
            with job.steps.running(
                "round", f"round {n} of {budget.rounds}", n=n, of=budget.rounds
            ) as step:
                ends = loop.time() + min(remaining, self.settings.research.round_seconds)
                calls = await self._plan(job, messages, tools, n, budget, ends, model)
                if calls is None:
                    job.steps.end(step, f"round {n}: the model gave no plan", "failed", n=n)
                    break
                unknown = [c.name for c in calls if c.name not in offered]
                if unknown:  # never run as something else (a web search, say)
                    log.info("round %d: tools not offered left out: %s", n, unknown[:5])
                    calls = [c for c in calls if c.name in offered]
                work = [c for c in calls if c.name != "done"][:MAX_CALLS_PER_ROUND]
                if not work:
                    job.steps.end(step, f"round {n}: enough found", n=n, calls=0)
                    break
                before = len(job.found)
                answers = await until_deadline([self._run(job, c) for c in work], job.deadline)
                if model not in self.no_tools:
                    messages.append(_assistant(work))
                    messages.extend(
                        {"role": "tool", "tool_call_id": c.id, "content": a or "(nothing)"}
                        for c, a in zip(work, answers, strict=True)
                    )
                    _fit(messages, self._planning_tokens())
                job.steps.end(
                    step, f"round {n}: {len(job.found) - before} new sources", n=n, calls=len(work)
                )
            if any(c.name == "done" for c in calls):
                break

    def _tools(self, job: Research) -> list[dict[str, Any]]:
        """The tools of what the request allows: pages are read only where the web may
        be searched."""
        names = ["done"]
        if not job.kinds or any(k in job.kinds for k in ("web", "academic", "discussions")):
            names.append("read_url")
        if "web" in job.kinds or not job.kinds:
            names.append("web_search")
        if "academic" in job.kinds or ("web" in job.kinds and job.scope is None):
            names.append("academic_search")
        if "discussions" in job.kinds or ("web" in job.kinds and job.scope is None):
            names.append("discussion_search")
        if job.files:
            names.append("search_files")
        if job.collections is not None:
            names.append("search_collection")
        return [TOOLS[name] for name in TOOLS if name in names]

    async def _plan(
        self,
        job: Research,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        n: int,
        budget: Budget,
        ends: float,
        model: str,
    ) -> list[ToolCall] | None:
        """This round's calls (a `done` call among them to stop), or None when the model
        could not plan (failed, too late, nothing readable) by the loop time `ends`."""
        if model not in self.no_tools:
            try:
                async with asyncio.timeout_at(ends):
                    turn = await self.llm.tool_turn(messages, tools)
            except ToolsUnsupported:
                log.info("model %s refused tools: it plans in JSON from now on", model)
                self.no_tools.add(model)
            except (AppError, TimeoutError) as exc:
                log.info("round %d failed: %s", n, getattr(exc, "message", "timeout"))
                return None
            else:
                if turn.calls or n > 1:
                    return list(turn.calls)
                log.info("model %s made no tool call where one was required: JSON", model)
                self.no_tools.add(model)
        return await self._plan_in_json(job, tools, n, budget, ends)

    async def _plan_in_json(
        self, job: Research, tools: list[dict[str, Any]], n: int, budget: Budget, ends: float
    ) -> list[ToolCall] | None:
        described = "\n".join(
            f"- {t['function']['name']}"
            f"({', '.join(t['function']['parameters']['properties'])}): "
            f"{t['function']['description']}"
            for t in tools
        )
        found = "\n".join(
            f"- {r.title} ({r.url}): {r.text[:RESULT_CHARS]}"
            for r in list(job.found.values())[-20:]
        )
        prompt = self.prompts.render(
            "planner",
            date=_today(),
            round=str(n),
            rounds=str(budget.rounds),
            tools=described,
            question=job.question,
            found=found or "(nothing yet)",
        )
        try:
            async with asyncio.timeout_at(ends):
                text = await self.llm.complete(
                    [{"role": "user", "content": prompt}], max_tokens=400
                )
        except (AppError, TimeoutError) as exc:
            log.info("planning round %d failed: %s", n, getattr(exc, "message", "timeout"))
            return None
        return parse_plan(text, {t["function"]["name"] for t in tools})

    # -- the tools -------------------------------------------------------------------------

    async def _run(self, job: Research, call: ToolCall) -> str:
        """Run one call; what it found, in words for the model."""
        args = _arguments(call.arguments)
        query = str(args.get("query") or job.question)[:400]
        name = call.name
        if name == "read_url":
            urls = args.get("urls") or args.get("url") or []
            urls = [urls] if isinstance(urls, str) else urls
            return await self._read(job, [u for u in urls if isinstance(u, str)][:MAX_READS])
        if name == "search_files":
            return await self._passages(
                job, "files", "your files", query, lambda q: self._file_passages(job, q)
            )
        if name == "search_collection" and job.collections is not None:
            return await self._passages(job, "collection", "collections", query, job.collections)
        if name not in ("web_search", "academic_search", "discussion_search"):
            return f"there is no tool {name[:40]!r} here"
        scope = job.scope
        if name == "academic_search":
            scope = ACADEMIC
        elif name == "discussion_search":
            scope = DISCUSSIONS
        elif isinstance(args.get("site"), str):
            scope = site_scope(args["site"], job.scope)
        filters = job.filters
        recency = args.get("recency")
        if recency in RECENCY and not (filters and filters.dated):
            # the model asked for recent pages; a request's own dates win
            filters = replace(filters or SearchFilters(), recency=recency)
        return await self._search(job, query, scope, filters)

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
            settings = self.settings.search
            try:
                async with asyncio.timeout(settings.timeout_seconds):
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

    async def _read(self, job: Research, urls: list[str]) -> str:
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
            timeout = self.settings.reader.timeout_seconds
            pages = await until_deadline(
                [self.web.read_page(u, timeout) for u in urls], job.deadline
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

    async def _file_passages(self, job: Research, query: str) -> list[SearchResult]:
        k = self.settings.uploads.passages
        return [p.result for p in await self.files.passages(job.files, query, k)]

    def _planning_tokens(self) -> int:
        """What the rounds' messages may hold."""
        return int(context_tokens(self.settings) * PLANNING_SHARE)

    async def _passages(
        self,
        job: Research,
        kind: str,
        what: str,
        query: str,
        search: Callable[[str], Awaitable[list[SearchResult]]],
    ) -> str:
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


# -- what the planner said ------------------------------------------------------------------


def parse_plan(text: str, tools: set[str]) -> list[ToolCall] | None:
    """The calls of a JSON plan (`{"calls": [...]}`, a bare list, one call, or
    `{"done": true}`), read tolerantly; None when nothing usable is in it."""
    parsed: Any = json_repair.loads(text) if ("{" in text or "[" in text) else None
    if isinstance(parsed, dict) and parsed.get("done") is True and not parsed.get("calls"):
        return [ToolCall("done", "done", "{}")]
    items = parsed.get("calls") if isinstance(parsed, dict) else parsed
    if isinstance(parsed, dict) and "tool" in parsed:
        items = [parsed]
    if not isinstance(items, list):
        return None
    calls = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        name = item.get("tool") or item.get("name")
        args = item.get("args") or item.get("arguments") or {}
        if name in tools and isinstance(args, dict):
            calls.append(ToolCall(f"plan-{i}", str(name), orjson.dumps(args).decode()))
    return calls or None


def _arguments(text: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError:
        parsed = json_repair.loads(text)
    return parsed if isinstance(parsed, dict) else {}


def _args(**values: Any) -> str:
    return orjson.dumps(values).decode()


def _assistant(calls: Sequence[ToolCall]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": c.id or f"call-{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments or "{}"},
            }
            for i, c in enumerate(calls)
        ],
    }


def _fit(messages: list[dict[str, Any]], limit: int) -> None:
    """Keep the rounds' messages within `limit` tokens (`tokens_in`): the oldest tool
    answers are cut short first (their sources are kept; only the model's view of
    them goes)."""
    total = sum(tokens_in(str(m.get("content") or "")) for m in messages)
    for message in messages:
        if total <= limit:
            return
        if message["role"] == "tool" and len(message["content"]) > 80:
            total -= tokens_in(message["content"]) - 10
            message["content"] = "(older results left out)"


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


def _today() -> str:
    return datetime.now(UTC).date().isoformat()


def source_key(result: SearchResult) -> str:
    """What tells one source from another: its URL, or for a passage its file or
    document and its opening."""
    if result.collection_id:
        return f"{result.collection_id}/{result.document_id}#{result.snippet[:80]}"
    return f"{result.file_id}#{result.snippet[:80]}" if result.file_id else result.url
