"""An answer's system prompt: the mode's prompt with the sources found for its
question (the research's, the request's files and collections), fitted to the model's
window, and made again shorter when the model refuses it as too long.

A `Grounding` belongs to one generation. Finding the sources writes their progress
and the `sources` event; the sources are saved on the question then, or, with the
store away, kept in `unsaved_sources` to be saved with the answer.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

from ..collections.service import CollectionSearch, with_collections
from ..errors import Unavailable
from ..events import Handle
from ..model import tokens_in
from ..protocol import ChatRequest, mcp_servers_named
from ..results import SearchResult
from ..search.web import context_chars, context_of, source_entries
from ..store import FileRecord
from ..streams import LogWriter
from ..timings import Timings
from .agent import context_tokens
from .classify import Decision
from .fitting import MESSAGE_TOKENS, fit_event, fit_sources, unique
from .modes import MODES, PLAIN_PROMPT
from .services import Services
from .triage import Triage


class Grounding:
    """The system prompt of one generation's answer, and what it was made of."""

    def __init__(
        self,
        services: Services,
        request: ChatRequest,
        handle: Handle,
        out: LogWriter,
        timings: Timings,
        files: list[FileRecord],
        collections: CollectionSearch | None,
        triage: Triage,
    ) -> None:
        self.services = services
        self.request = request
        self.handle = handle
        self.out = out
        self.timings = timings
        self.files = files
        self.collections = collections
        #: what the research started ahead, taken when it searches
        self.triage = triage
        #: the sources sent, when the store was away to save them on the question
        self.unsaved_sources: list[dict[str, object]] | None = None
        #: what the system prompt was made of, to make it again shorter: its prompt's
        #: name, date and sources, and how much of each source
        self._made: tuple[str, str, list[SearchResult], int] | None = None

    async def system_prompt(self, question: str, decision: Decision | None) -> str:
        """The mode's prompt with the sources it found (and the request's extra
        instructions). Web results and passages of the chat's files are ranked
        together; with web search off (copilot off, or a mode without it) the files
        alone are the sources."""
        return await self._grounded_prompt(question, decision) + self.instructions()

    def room(self) -> int:
        """The tokens (`tokens_in`) the answer's prompt may hold: the model's window
        less room for the answer (a quarter of it, at most 8,192)."""
        tokens = context_tokens(self.services.settings)
        return max(0, tokens - min(self.answer_tokens(), tokens // 4))

    def answer_tokens(self) -> int:
        """The room an answer is given in the model's window."""
        most = self.services.settings.llm.max_output_tokens
        return min(most, 8192) if most > 0 else 8192

    def shorter(
        self, system: str, history: list[tuple[str, str]], sent: int, window: int | None
    ) -> tuple[str, int] | None:
        """The system prompt and room of a retry after a prompt of `sent` tokens was
        refused: within `window` (less room for the answer) when the model named it,
        else half of what was sent; None when the question alone would not fit, or
        there is nothing to leave out."""
        room = sent // 2
        if window:
            room = min(room, window - min(self.answer_tokens(), window // 4))
        question = tokens_in(self.request.content) + 2 * MESSAGE_TOKENS
        if question + tokens_in(self.instructions()) >= room:
            return None
        shorter = self._shorter_prompt(room)
        if shorter is None and not history:
            return None  # nothing would be shorter
        return shorter or system, room

    def instructions(self) -> str:
        if not self.request.instructions:
            return ""
        return self.services.prompts.render("instructions", instructions=self.request.instructions)

    def _shorter_prompt(self, room: int) -> str | None:
        """The system prompt again with half its sources (half of the one source's
        text, when it has one), and no more than fit in `room`; None when it has
        none."""
        if self._made is None:
            return None
        prompt, date, results, chars = self._made
        if len(results) > 1:
            results = results[: len(results) // 2]
        else:
            results = [replace(r, content=r.text[: len(r.text) // 2]) for r in results]
        bare = self.services.prompts.render(prompt, date=date, context="")
        results = fit_sources(results, self._left_for_sources(bare, room), chars)
        self._made = (prompt, date, results, chars)
        context = context_of(results, chars)
        return self.services.prompts.render(prompt, date=date, context=context) + (
            self.instructions()
        )

    def _left_for_sources(self, bare: str, room: int) -> int:
        """What `room` leaves for the sources beside the prompt `bare` (without them),
        the request's instructions and its question."""
        return (
            room
            - tokens_in(bare)
            - tokens_in(self.instructions())
            - tokens_in(self.request.content)
            - 2 * MESSAGE_TOKENS
        )

    async def _grounded_prompt(self, question: str, decision: Decision | None) -> str:
        svc, req = self.services, self.request
        mode = MODES[req.focus_mode]
        date = datetime.now(UTC).isoformat(timespec="seconds")
        web = mode.sources is not None and mode.sources.applies(req)
        if decision is not None and decision.skip_search:
            web = False
        if not web and not self.files and self.collections is None:
            prompt = PLAIN_PROMPT if mode.sources is not None else mode.prompt
            return svc.prompts.render(prompt, date=date)
        pinned: list[SearchResult] = []  # pasted pages: first, whatever is ranked after them
        results: list[SearchResult] = []
        searched: frozenset[str] = frozenset()
        if web and mode.sources is not None and decision is not None:
            ahead, planned = self.triage.take()
            with self.timings.span("research"):
                gathered = await svc.researcher.find_sources(
                    self.out,
                    question,
                    mode.sources.budget or req.optimization_mode,
                    kinds=decision.sources,
                    scope=mode.sources.scope,
                    urls=decision.urls,
                    files=self.files if "files" in decision.sources else (),
                    collections=self.collections,
                    filters=req.search,
                    timings=self.timings,
                    prefetched=ahead,
                    planned=planned,
                    servers=mcp_servers_named(req.sources),
                )
            pinned = gathered.results[: gathered.pinned]
            results = gathered.results[gathered.pinned :]
            searched = gathered.searched
        # the request's files and collections, searched for the question unless the
        # research did so itself (its passages are among its results already)
        if self.files and "files" not in searched:
            results = await self._with_files(question, results)
        if self.collections is not None and "collection" not in searched:
            results = await with_collections(self.out, self.collections, question, results)
        results = unique([*pinned, *results])
        if not results:
            self.out.emit("progress", data="answering without sources")
            return svc.prompts.render(PLAIN_PROMPT, date=date)
        prompt = mode.prompt if web else "files_response"
        bare = svc.prompts.render(prompt, date=date, context="")
        chars = context_chars(req.search)
        results = fit_sources(results, self._left_for_sources(bare, self.room()), chars)
        if not results:
            self.out.emit("progress", data="answering without sources: no room for them")
            return svc.prompts.render(PLAIN_PROMPT, date=date)
        await self._send_sources(results)
        self._made = (prompt, date, results, chars)
        return svc.prompts.render(prompt, date=date, context=context_of(results, chars))

    async def _with_files(self, question: str, web: list[SearchResult]) -> list[SearchResult]:
        svc = self.services
        names = ", ".join(f.name for f in self.files[:3]) + ("…" if len(self.files) > 3 else "")
        self.out.emit("progress", data=f"searching your files: {names}")
        k = svc.settings.uploads.passages
        passages = await svc.files.passages(self.files, question, k)
        return await svc.files.rank_together(question, web, passages, k + len(web))

    async def _send_sources(self, results: list[SearchResult]) -> None:
        """Save the sources on the question, then send them with the "All Sources" link.
        A store that is away does not stop the answer: they are saved with it."""
        svc, h = self.services, self.handle
        entries = fit_event(source_entries(results), svc.settings.stream.max_event_bytes)
        try:
            await svc.store.set_sources(h.question_id, entries)
        except Unavailable:
            self.unsaved_sources = entries
        link = svc.sources_link(h.question_id, self.request.host)
        all_sources = {"metadata": {"title": "All Sources", "url": link}}
        self.out.emit("sources", data=[*entries, all_sources])
