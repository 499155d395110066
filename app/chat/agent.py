"""The research agent: the model gathers an answer's sources with tools, in rounds,
within its optimization mode's budget, and every step is streamed.

    speed      one search of the (standalone) question: no model call before the answer
    balanced   up to `research.balanced_rounds` rounds, `balanced_seconds`
    quality    up to `research.quality_rounds` rounds, `quality_seconds`
    deep       deepResearch: up to `research.deep_rounds` rounds, `deep_seconds`

A round is one model call that asks for tools — `web_search`, `academic_search`,
`discussion_search`, `read_url`, `search_files`, `search_collection`, `done`: objects
held in one registry (`tools.Tools`), with the tools of the configured MCP servers
(`<server>__<tool>`) — and the calls it made, run concurrently; a
page read still running when the round's other calls are done goes on beside the next
round (the model has the page's snippet; the answer gets its text), and every read
has ended, or met the deadline, before the answer is asked. The
loop ends at `done`, at the budget, or when a round brings nothing. Models without tool calling (a 400 naming tools, or no call
where one was required) get the same loop through a JSON-in-text planner prompt; the
verdict is kept per model for the process. Every model call has a deadline
(`research.round_seconds`, and what is left of the budget; a planner asked after a
failed tool call gets a round of its own); a loop that found nothing
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
import copy
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import json_repair
import orjson

from ..chores import cancel_and_wait
from ..config import Settings
from ..errors import AppError
from ..files.service import FileService
from ..mcp_client import McpServers
from ..model import ChatModel, ToolCall, ToolsUnsupported, ToolTurn, tokens_in
from ..prompts import Prompts
from ..results import SearchFilters, SearchResult
from ..search.base import SearchScope
from ..search.web import Progress, WebSearch, until_deadline
from ..store import FileRecord
from ..timings import Timings
from .mcp_tools import McpTools
from .tools import MAX_READS, RESULT_CHARS, Research, Steps, research_tools

log = logging.getLogger("app.research")

MAX_CALLS_PER_ROUND = 5
#: the most a JSON plan may be, in tokens: a few calls, written well within a round's
#: deadline by a slow local model
PLAN_TOKENS = 250
#: the share of the model's window the rounds' messages may take (the rest is its answer)
PLANNING_SHARE = 0.5


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


@dataclass(frozen=True, slots=True)
class Planned:
    """The first round's model call, started before the research (beside the
    classifier) for `question` with the sources `kinds`."""

    question: str
    kinds: tuple[str, ...]
    servers: frozenset[str]
    turn: asyncio.Task[ToolTurn]
    span: dict[str, Any]

    def drop(self) -> None:
        """Not needed after all: cancelled, never awaited."""
        if not self.turn.done():
            self.turn.cancel()
        self.span["dropped"] = True


class Researcher:
    def __init__(
        self,
        settings: Settings,
        *,
        llm: ChatModel,
        prompts: Prompts,
        web: WebSearch,
        files: FileService,
        mcp: McpServers | None = None,
    ) -> None:
        self.settings = settings
        self.llm = llm
        self.prompts = prompts
        self.web = web
        self.files = files
        self.tools, self.pages = research_tools(
            web, files, settings.search, settings.reader, settings.uploads
        )
        if mcp is not None:
            self.tools.register_set(McpTools(mcp))
        #: models seen to have no tool calling (for this process): they plan in JSON
        self.no_tools: set[str] = set()

    def using(self, llm: ChatModel, settings: Settings) -> Researcher:
        """This researcher planning with another model (`settings`: with its `[llm]`);
        its tools and what it learnt of models are shared."""
        other = copy.copy(self)
        other.llm, other.settings = llm, settings
        return other

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
        servers: Sequence[str] = (),
        timings: Timings | None = None,
        prefetched: Mapping[str, asyncio.Future[list[SearchResult]]] | None = None,
        planned: Planned | None = None,
    ) -> Gathered:
        """The sources for `question`, pasted pages first; none when nothing was found.
        Every web search and every page read is kept to `filters`, and timed in
        `timings`; the MCP servers `servers` are offered beside the default ones. A
        search of `prefetched` (by query, started with this `scope` and `filters`) is
        taken when the research asks for it; the others are cancelled, as is a
        `planned` first round (`plan_ahead`) that the research does not take."""
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
            servers=frozenset(servers),
            timings=timings or Timings(),
            prefetched=dict(prefetched or {}),
        )
        fits = planned is not None and (planned.question, planned.kinds, planned.servers) == (
            question,
            job.kinds,
            job.servers,
        )
        if planned is not None and fits:
            job.planned = planned.turn
        try:
            return await self._gather(job, out, mode, budget, urls)
        finally:
            for search in job.prefetched.values():
                search.cancel()  # not needed after all: never awaited
            if planned is not None and not (fits and job.planned is None):
                planned.drop()  # not taken by the first round
            # cut off (a cancel, an error): what still reads is closed, its step ended
            await asyncio.shield(cancel_and_wait(job.reading))

    async def _gather(
        self, job: Research, out: Progress, mode: str, budget: Budget, urls: Sequence[str]
    ) -> Gathered:
        loop = asyncio.get_running_loop()
        if urls:
            await self.pages.read(job, list(urls)[:MAX_READS])
            job.reads = 0  # what the user pasted; the model has read nothing yet
        pinned = list(job.found.values())
        if budget.rounds <= 1:
            await self._first_search(job)
        else:
            await self._rounds(job, budget)
            await until_deadline([_awaited(t) for t in job.reading], job.deadline)
            if not job.searches and len(job.found) == len(pinned):
                await self._first_search(job)  # the planner did nothing: one plain search
            found = list(job.found.values())
            web = [r for r in found[len(pinned) :] if r.url.startswith("http") and not r.tool]
            if not job.reads and web and loop.time() < job.deadline:
                # the model read nothing: ranked and read as the mode does without it
                others = [r for r in found[len(pinned) :] if r not in web]
                how = "quality" if mode == "deep" else mode  # deep research reads like quality
                with job.timings.span("refine"):
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
            calls.append(self.tools.run(job, ToolCall("first", tool, _args(query=job.question))))
        await asyncio.gather(*calls)

    def plan_ahead(
        self,
        out: Progress,
        question: str,
        mode: str,
        *,
        kinds: Sequence[str],
        scope: SearchScope | None,
        files: Sequence[FileRecord],
        collections: Callable[[str], Awaitable[list[SearchResult]]] | None,
        timings: Timings,
        servers: Sequence[str] = (),
    ) -> Planned | None:
        """Start the first round's model call for `question` before the research is
        asked (beside the classifier), for `find_sources(planned=…)` to take when it
        researches the same question with the same sources; None for a budget of one
        round, or a model that plans in JSON. It writes no event: the first round
        shows it as its own when it takes it."""
        budget = budget_of(self.settings, mode)
        research = self.settings.research
        if (
            not research.round_ahead
            or budget.rounds <= 1
            or self.settings.llm.model in self.no_tools
        ):
            return None
        steps = Steps(out, self.settings.stream.max_event_bytes)
        job = Research(
            question,
            steps,
            tuple(kinds),
            scope,
            files,
            collections,
            0.0,
            servers=frozenset(servers),
        )
        messages, tools = self._opening(job, budget)
        span = timings.start("round", n=1, speculative=True)

        async def turn() -> ToolTurn:
            try:
                return await self.llm.tool_turn(messages, tools)
            finally:
                timings.end(span)

        task = asyncio.create_task(turn())
        task.add_done_callback(_retrieved)
        return Planned(question, job.kinds, job.servers, task, span)

    def _opening(
        self, job: Research, budget: Budget
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The first round's messages, and the tools offered in every round."""
        messages: list[dict[str, Any]] = [
            {
                "role": "system",
                "content": self.prompts.render(
                    "researcher", date=_today(), rounds=str(budget.rounds), question=job.question
                ),
            },
            {"role": "user", "content": job.question},
        ]
        return messages, self.tools.schemas(job)

    async def _rounds(self, job: Research, budget: Budget) -> None:
        model = self.settings.llm.model
        messages, tools = self._opening(job, budget)
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
                # a first round started ahead is timed as it was made
                timed = job.planned is None or n > 1
                with job.timings.span("round", n=n) if timed else contextlib.nullcontext():
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
                answers = await self._run(job, work)
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

    async def _run(self, job: Research, calls: Sequence[ToolCall]) -> list[str | None]:
        """A round's calls, run concurrently until the research's deadline; what each
        told the model. A call the next round can do without (a page read: the model
        has the page's snippet, the answer gets its text) that is still running when
        the others are done goes on beside the next round (`job.reading`), and the
        model is told so."""
        tasks = [asyncio.create_task(self.tools.run(job, c)) for c in calls]
        beside = [self.tools.overlaps(c) for c in calls]
        waited = [t for t, b in zip(tasks, beside, strict=True) if not b]
        try:
            answers = await until_deadline([_awaited(t) for t in waited], job.deadline)
        except BaseException:
            await asyncio.shield(cancel_and_wait(tasks))
            raise
        told: list[str | None] = []
        for task, overlaps in zip(tasks, beside, strict=True):
            if not overlaps:
                told.append(answers.pop(0))
            elif not task.done():
                job.reading.append(task)
                told.append("still reading: the pages' text goes to the answer")
            else:
                told.append(_result(task))
        return told

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
        planned, job.planned = job.planned, None
        if model not in self.no_tools:
            try:
                async with asyncio.timeout_at(ends):
                    turn = await (planned or self.llm.tool_turn(messages, tools))
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
        return await self._plan_in_json(job, tools, n, budget)

    async def _plan_in_json(
        self, job: Research, tools: list[dict[str, Any]], n: int, budget: Budget
    ) -> list[ToolCall] | None:
        """The round's calls from a JSON plan in text. The planner has a round's time of
        its own (`research.round_seconds`, within the research's budget), not what a
        failed tool call left of the round; None when it gave no plan in time."""
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
        loop = asyncio.get_running_loop()
        round_ends = loop.time() + self.settings.research.round_seconds
        ends = min(round_ends, job.deadline)
        try:
            async with asyncio.timeout_at(ends):
                # the round's own deadline bounds it, not a short call's usual one: a
                # slow local model given minutes a round may take them to plan
                text = await self.llm.complete(
                    [{"role": "user", "content": prompt}],
                    max_tokens=PLAN_TOKENS,
                    timeout=max(ends - loop.time(), 0.0),
                )
        except AppError as exc:
            log.info("planning round %d failed: %s", n, exc.message)
            return None
        except TimeoutError:
            passed = (
                f"research.round_seconds ({self.settings.research.round_seconds:g} s)"
                if round_ends <= job.deadline
                else f"the research's budget ({budget.seconds:g} s)"
            )
            log.info("planning round %d failed: no plan within %s", n, passed)
            return None
        return parse_plan(text, {t["function"]["name"] for t in tools})

    def _planning_tokens(self) -> int:
        """What the rounds' messages may hold."""
        return int(context_tokens(self.settings) * PLANNING_SHARE)


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


def _retrieved(task: asyncio.Task[Any]) -> None:
    """A call made ahead fails where it is awaited; one never awaited, quietly."""
    if not task.cancelled():
        task.exception()


async def _awaited(task: asyncio.Task[str]) -> str:
    return await task


def _result(task: asyncio.Task[str]) -> str | None:
    """A call's answer; None when it failed (logged)."""
    if task.cancelled():
        return None
    exc = task.exception()
    if exc is None:
        return task.result()
    if isinstance(exc, AppError):
        log.warning("a research call failed: %s", exc.message)
    else:
        log.error("a research call failed", exc_info=exc)
    return None


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


def _today() -> str:
    return datetime.now(UTC).date().isoformat()
