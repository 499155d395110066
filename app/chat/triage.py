"""Before an answer's research: whether and where to search (the classifier), with
what the research would start with started while it decides.

A `Triage` belongs to one generation. `decide` writes the `classify` step (and
`rewrited`, for a follow-up made standalone); what it started ahead is taken by the
research (`take`), or dropped (`drop`) — cancelled, never awaited. `drop` is safe to
call at any time, and more than once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..collections.service import CollectionSearch
from ..protocol import ChatRequest, mcp_servers_named
from ..results import SearchResult
from ..store import FileRecord
from ..streams import LogWriter
from ..timings import Timings
from .agent import Planned, budget_of
from .classify import SOURCE_KINDS, Decision, classify, heuristic
from .modes import WebSources
from .services import Services

#: a question this long, or with a conversation before it, is worth a rewrite
REWRITE_MIN_CHARS = 30


class Triage:
    """The classifier's decision for one generation, and the searches started ahead."""

    def __init__(
        self,
        services: Services,
        request: ChatRequest,
        out: LogWriter,
        timings: Timings,
        files: list[FileRecord],
        collections: CollectionSearch | None,
    ) -> None:
        self.services = services
        self.request = request
        self.out = out
        self.timings = timings
        self.files = files
        self.collections = collections
        #: the question's web search, started while the classifier decides (speed's
        #: first question): taken by the research, or cancelled
        self._ahead: dict[str, asyncio.Future[list[SearchResult]]] = {}
        self._ahead_span: dict[str, Any] = {}
        #: the research's first round, started while the classifier decides (the first
        #: question of a mode with rounds): taken by the research, or cancelled
        self._planned: Planned | None = None

    async def decide(self, sources: WebSources, history: list[tuple[str, str]]) -> Decision:
        """Whether and where to search (PROTOCOL §3 `classify` step). A mode kept to
        some sources (academicSearch, …) searches only there; `speed` asks the model
        only when a rewrite would have been asked for (a long question, or a chat with
        history), so its first token comes no later than before."""
        svc, req = self.services, self.request
        allowed: tuple[str, ...] = ("web",) if sources.scope is not None else SOURCE_KINDS
        kinds = tuple(k for k in req.sources if k in SOURCE_KINDS)  # not `mcp:<name>`
        if kinds:
            # a mode that fixes its sources wins over the request's list (PROTOCOL §1)
            allowed = tuple(k for k in allowed if k in kinds) or allowed[:1]
        if not self.files:
            # no files to search: never another kind instead, which the request did not allow
            allowed = tuple(k for k in allowed if k != "files")
        worth_asking = req.optimization_mode != "speed" or (
            len(req.content) > REWRITE_MIN_CHARS or bool(history)
        )
        if not allowed:
            decision = Decision(req.content, skip_search=True, sources=())
            self.out.emit(
                "progress",
                data="no search: the request allows only files, and it has none",
                step={"id": "classify-0", "kind": "classify", "status": "done", **decision.step()},
            )
            return decision
        if worth_asking:
            if not history:  # a follow-up needs its standalone question first
                self._start(sources, allowed)
            with self.timings.span("classify"):
                decision = await classify(
                    svc.llm,
                    svc.prompts,
                    req.content,
                    history,
                    allowed,
                    timeout=svc.settings.research.classify_seconds,
                )
            if decision.skip_search or decision.question != req.content:
                self.drop()  # not needed, or made for another question
            elif "web" not in decision.sources and self._ahead:
                self.drop()  # a web search, where other kinds of sources are asked
        else:
            decision = heuristic(req.content, allowed)
        if decision.rewritten:
            self.out.emit("rewrited", content=decision.question)
        if decision.asked or decision.skip_search:
            text = (
                "no search needed"
                if decision.skip_search
                else "searching " + ", ".join(decision.sources)
            )
            self.out.emit(
                "progress",
                data=text,
                step={"id": "classify-0", "kind": "classify", "status": "done", **decision.step()},
            )
        return decision

    def _start(self, sources: WebSources, allowed: tuple[str, ...]) -> None:
        """Start, to run while the classifier decides, what the research would start
        with for the question as asked: its web search (a budget of one round: speed),
        else its first round's model call. Neither writes an event: the research shows
        it as its own when it takes it, and one not taken is cancelled, never awaited."""
        svc, req = self.services, self.request
        researcher = svc.researcher
        mode = sources.budget or req.optimization_mode
        guess = heuristic(req.content, allowed)
        if guess.skip_search:
            return  # a greeting: the classifier does not even ask the model
        kinds = guess.sources
        if budget_of(researcher.settings, mode).rounds > 1:
            self._planned = researcher.plan_ahead(
                self.out,
                req.content,
                mode,
                kinds=kinds,
                scope=sources.scope,
                files=self.files if "files" in kinds else (),
                collections=self.collections,
                timings=self.timings,
                servers=mcp_servers_named(req.sources),
            )
            return
        if "web" not in kinds:
            return
        web, query = researcher.web, req.content[:400]  # as the research's search cuts it

        span = self.timings.start("search", query=query[:100], speculative=True)

        async def search() -> list[SearchResult]:
            try:
                return await web.provider.search(
                    query, web.limit(req.search), sources.scope, req.search
                )
            finally:
                self.timings.end(span)

        ahead = asyncio.ensure_future(search())
        ahead.add_done_callback(_retrieved)
        self._ahead[query] = ahead
        self._ahead_span = span

    def take(self) -> tuple[dict[str, asyncio.Future[list[SearchResult]]], Planned | None]:
        """What was started ahead, for the research: the searches by query, and the
        first round; what is taken is no longer dropped here."""
        ahead, self._ahead = self._ahead, {}
        planned, self._planned = self._planned, None
        return ahead, planned

    def drop(self) -> None:
        """Cancel what was started ahead, unless the research took it."""
        for search in self._ahead.values():
            search.cancel()
            self._ahead_span["dropped"] = True
        self._ahead.clear()
        if self._planned is not None:
            self._planned.drop()
            self._planned = None


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A search started ahead fails where it is awaited; one never awaited (cancelled
    or dropped) fails quietly."""
    if not task.cancelled():
        task.exception()
