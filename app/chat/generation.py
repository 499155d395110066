"""One answer being generated, as its own task.

The service registers the generation's chat first, then builds the
`Generation` complete and starts `run()`. `run()` runs the body (`_generate`)
as a child task: a cancel cancels that child only, so `run()` always gets to
save what was generated and to write exactly one terminal event
(`messageEnd` or `error`), whatever ended the body. A cancel that lands
before the body's first step simply means it never starts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from ..collections.service import CollectionSearch, with_collections
from ..config import DEFAULT_PROVIDER
from ..errors import AppError, StreamError, Unavailable
from ..events import Handle
from ..model import ContextTooLong, Delta, Message, tokens_in
from ..protocol import ChatRequest, mcp_servers_named
from ..results import SearchResult
from ..search.web import (
    context_chars,
    context_of,
    source_entries,
)
from ..store import Checkpoint, FileRecord, Saved, Usage
from ..streams import LogWriter
from ..timings import Timings
from .agent import Planned, budget_of, context_tokens
from .classify import SOURCE_KINDS, Decision, classify, heuristic
from .fitting import (
    MESSAGE_TOKENS,
    estimate_tokens,
    fit_event,
    fit_history,
    fit_sources,
    text_chars,
    too_long,
    unique,
)
from .history import make_title, rewrite, stored_history, suggest
from .keeper import Progress, steps_of
from .modes import MODES, PLAIN_PROMPT, WebSources
from .services import Services

log = logging.getLogger("app.chat")
generation_log = logging.getLogger("app.generation")

REWRITE_MIN_CHARS = 30
IMAGES = 6  # images found for an answer that asks for them
RELATED_CHARS = 300  # of each related question


class Generation:
    """Owned by the service; `run()` is its task."""

    def __init__(
        self,
        services: Services,
        request: ChatRequest,
        handle: Handle,
        *,
        new_chat: bool,
        out: LogWriter,
        files: list[FileRecord] | None = None,
        regenerate: bool = False,
        collections: CollectionSearch | None = None,
    ) -> None:
        self.services = services
        self.request = request
        self.handle = handle
        self.new_chat = new_chat
        self.out = out
        self.files = files or []
        self.collections = collections
        self.regenerate = regenerate
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.rewritten: str | None = None
        self.decision: Decision | None = None
        self.unsaved_sources: list[dict[str, object]] | None = None
        self.counted: dict[str, Any] | None = None  # the model's `usage`
        #: the model stopped at `llm.max_output_tokens`: the answer is whole but cut
        self.truncated = False
        self.extras: dict[str, Any] = {}  # what `messageEnd` adds: images, related questions
        #: what the system prompt was made of, to make it again shorter: its prompt's
        #: name, date and sources, and how much of each source
        self._grounding: tuple[str, str, list[SearchResult], int] | None = None
        self.prompt_chars = 0
        self.accepted_at = time.monotonic()
        self.first_token_at = 0.0
        self._requested = 0.0  # when the answer was asked of the model
        #: the spans of its stages, sent in `messageEnd` and logged
        self.timings = Timings(self.accepted_at)
        self._model_span: dict[str, Any] = {}
        #: the question's web search, started while the classifier decides (speed's
        #: first question): taken by the research, or cancelled
        self._ahead: dict[str, asyncio.Future[list[SearchResult]]] = {}
        self._ahead_span: dict[str, Any] = {}
        #: the research's first round, started while the classifier decides (the first
        #: question of a mode with rounds): taken by the research, or cancelled
        self._planned: Planned | None = None
        #: the rewrite of a question that nothing searches for, made beside the answer
        self._rewriting: asyncio.Future[None] | None = None
        self._most = text_chars(services.settings.stream.max_event_bytes)
        self._progress = Progress()
        self.work = asyncio.get_running_loop().create_task(
            self._generate(), name=f"answer-{handle.answer_id}"
        )

    @property
    def answer_id(self) -> str:
        return self.handle.answer_id

    def progress(self) -> tuple[int, Checkpoint]:
        """The seq of the last event written so far, and the answer as far as it got
        (what a checkpoint saves); it costs what was written since the last call."""
        progress = self._progress
        progress.update(self.content, self.reasoning, self.out.log.events)
        return self.out.seq, Checkpoint(
            self.handle.answer_id, progress.content, progress.reasoning, list(progress.steps)
        )

    def request_cancel(self) -> None:
        """Stop the body (the model request is closed); safe to call more than once."""
        self.work.cancel()

    async def run(self) -> None:
        """Wait for the body (at most `llm.timeout_seconds`), then save and end the
        stream — in a task of its own that a cancel of `run()` (the loop shutting
        down, cancelled twice even) cannot interrupt: the body is cancelled, the
        answer still saved and the terminal event still written."""
        metrics = self.services.metrics
        metrics.generations_active.inc()
        deadline = asyncio.timeout(self.services.settings.llm.timeout_seconds)
        try:
            async with deadline:
                await asyncio.wait([self.work])
        except TimeoutError:
            pass
        finally:
            self.work.cancel()  # nothing when it has ended
            ending = asyncio.ensure_future(self._end(timed_out=deadline.expired()))
            ending.add_done_callback(_log_failure)
            ending.add_done_callback(lambda _: metrics.generations_active.dec())
            await asyncio.shield(ending)

    async def _end(self, *, timed_out: bool) -> None:
        await asyncio.wait([self.work])
        error = self._outcome()
        if timed_out and self.work.cancelled():
            error = StreamError("the answer did not finish within llm.timeout_seconds")
        await self._finish("cancelled" if self.work.cancelled() else "completed", error)

    def _outcome(self) -> AppError | None:
        """The body's error, if it failed."""
        if self.work.cancelled():
            return None
        exc = self.work.exception()
        if exc is None or isinstance(exc, AppError):
            return exc
        log.error("generation %s failed", self.handle.answer_id, exc_info=exc)
        return AppError("internal error")

    async def _generate(self) -> None:
        try:
            await self._generate_answer()
        finally:
            self._drop_ahead()
            if self._rewriting is not None:
                self._rewriting.cancel()

    async def _generate_answer(self) -> None:
        svc, req = self.services, self.request
        if req.history is not None and not self.regenerate:
            history = list(req.history)
        elif self.new_chat:
            history = []  # nothing to read back
        else:
            history = await stored_history(
                svc.store, self.handle.chat_id, before=self.handle.question_id
            )
        mode = MODES[req.focus_mode]
        if isinstance(mode.sources, WebSources) and mode.sources.applies(req):
            self.decision = await self._classify(mode.sources, history)
        elif len(req.content) > REWRITE_MIN_CHARS or history:
            if self.files or self.collections is not None or req.images:
                await self._rewrite(history)  # what they search for
            else:
                # the answer is asked with the question as written: nothing waits for it
                self._rewriting = asyncio.ensure_future(self._rewrite(history))

        question = self.rewritten or req.content
        images = asyncio.ensure_future(svc.search.images(question, IMAGES)) if req.images else None
        try:
            await self._answer(question, history)
        except BaseException:
            if images is not None:
                images.cancel()
                await asyncio.gather(images, return_exceptions=True)
            raise
        if images is not None:
            self.extras["images"] = [
                {"image_url": i.img_src, "origin_url": i.url, "title": i.title}
                | ({"height": i.height, "width": i.width} if i.width and i.height else {})
                for i in await images
            ]
        if req.related:
            related = await self._related(history)
            self.extras["relatedQuestions"] = [q[:RELATED_CHARS] for q in related]
        if self._rewriting is not None:
            await self._rewriting  # saved with the answer

    async def _rewrite(self, history: list[tuple[str, str]]) -> None:
        """The standalone question (`rewritten`), sent as `rewrited` when it differs."""
        svc, req = self.services, self.request
        with self.timings.span("rewrite"):
            self.rewritten = await rewrite(
                svc.llm,
                svc.prompts,
                req.content,
                history,
                timeout=svc.settings.research.classify_seconds,
            )
        if self.rewritten:
            self.out.emit("rewrited", content=self.rewritten)

    async def _related(self, history: list[tuple[str, str]]) -> list[str]:
        """Follow-up questions to the answer; none when the model cannot say."""
        svc, req = self.services, self.request
        turns = [*history, ("user", req.content), ("assistant", "".join(self.content))]
        try:
            return await suggest(svc.llm, svc.prompts, turns)
        except AppError as exc:
            log.info("related questions not made: %s", exc.message)
            return []

    async def _answer(self, question: str, history: list[tuple[str, str]]) -> None:
        """Stream the answer. A model that refuses the prompt as longer than its window
        (its window smaller than `llm.context_tokens` says, or a count of ours too
        low; refused with a 400, or an empty 200 as llama.cpp's server sends) is asked
        once more, before anything of the answer came, within the window it named
        (else half the room): fewer sources, less of the conversation. When even that
        cannot be, or is refused again, the answer ends with an error that names the
        window."""
        system = await self._system_prompt(question)
        room = self._room()
        self.out.emit("message", data="")
        for attempt in range(2):
            messages = self._messages(system, history, room)
            self.prompt_chars = sum(len(m["content"]) for m in messages)
            try:
                await self._stream(messages)
                return
            except ContextTooLong as exc:
                if self.first_token_at:
                    raise
                sent = sum(tokens_in(m["content"]) + MESSAGE_TOKENS for m in messages)
                shorter = None if attempt else self._shorter(system, history, sent, exc.window)
                if shorter is None:
                    raise too_long(exc, sent) from exc
                log.info("the model refused the prompt as too long: once more, shorter")
                system, room = shorter

    def _shorter(
        self, system: str, history: list[tuple[str, str]], sent: int, window: int | None
    ) -> tuple[str, int] | None:
        """The system prompt and room of a retry after a prompt of `sent` tokens was
        refused: within `window` (less room for the answer) when the model named it,
        else half of what was sent; None when the question alone would not fit, or
        there is nothing to leave out."""
        room = sent // 2
        if window:
            room = min(room, window - min(self._answer_tokens(), window // 4))
        question = tokens_in(self.request.content) + 2 * MESSAGE_TOKENS
        if question + tokens_in(self._instructions()) >= room:
            return None
        shorter = self._shorter_system_prompt(room)
        if shorter is None and not history:
            return None  # nothing would be shorter
        return shorter or system, room

    def _answer_tokens(self) -> int:
        """The room an answer is given in the model's window."""
        most = self.services.settings.llm.max_output_tokens
        return min(most, 8192) if most > 0 else 8192

    def _messages(self, system: str, history: list[tuple[str, str]], room: int) -> list[Message]:
        req = self.request
        history = fit_history(history, system, req.content, room)
        messages: list[Message] = [{"role": "system", "content": system}]
        messages.extend({"role": role, "content": text} for role, text in history)
        messages.append({"role": "user", "content": req.content})
        return messages

    async def _stream(self, messages: list[Message]) -> None:
        """The model's answer, relayed as it comes: each delta is written to the log
        by `_take`, called by the model client as it reads them (on a direct
        connection, in the callback that read the bytes: no task wakes per token)."""
        self._requested = time.monotonic()
        with self.timings.span("modelFirstByte") as self._model_span:
            await self.services.llm.answer(messages, self._take, model=self.request.model)

    def _take(self, delta: Delta) -> None:
        """One delta of the answer into the log. A piece of text too big for one event
        (a model's whole answer in one chunk, say) goes out in several: the only cost
        on the path of a token is its length compared."""
        kind = delta.kind
        if not self.first_token_at and kind != "keepalive":
            svc = self.services
            self.first_token_at = now = time.monotonic()
            svc.metrics.upstream_latency.observe(now - self._requested)
            svc.metrics.time_to_first_token.observe(now - self.accepted_at)
            self.timings.end(self._model_span, at=now)
            self.timings.mark("firstToken", at=now)
        if kind == "content":
            self.content.append(delta.text)
            if len(delta.text) <= self._most:
                self.out.emit("message", data=delta.text)
            else:
                self._emit_in_pieces("message", delta.text)
        elif kind == "reasoning":
            self.reasoning.append(delta.text)
            if len(delta.text) <= self._most:
                self.out.emit("reasoning", data=delta.text)
            else:
                self._emit_in_pieces("reasoning", delta.text)
        elif kind == "usage":
            self.counted = delta.usage
        elif kind == "finish":
            self.truncated = self.truncated or delta.text == "length"
        else:
            self.out.keepalive()

    def _emit_in_pieces(self, type: str, text: str) -> None:
        most = self._most
        for i in range(0, len(text), most):
            self.out.emit(type, data=text[i : i + most])

    async def _classify(self, sources: WebSources, history: list[tuple[str, str]]) -> Decision:
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
                self._start_ahead(sources, allowed)
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
                self._drop_ahead()  # not needed, or made for another question
            elif "web" not in decision.sources and self._ahead:
                self._drop_ahead()  # a web search, where other kinds of sources are asked
        else:
            decision = heuristic(req.content, allowed)
        if decision.rewritten:
            self.rewritten = decision.question
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

    def _start_ahead(self, sources: WebSources, allowed: tuple[str, ...]) -> None:
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

    def _drop_ahead(self) -> None:
        """Cancel what was started ahead, unless the research took it."""
        for search in self._ahead.values():
            search.cancel()
            self._ahead_span["dropped"] = True
        self._ahead.clear()
        if self._planned is not None:
            self._planned.drop()
            self._planned = None

    def _room(self) -> int:
        """The tokens (`tokens_in`) the answer's prompt may hold: the model's window
        less room for the answer (a quarter of it, at most 8,192)."""
        tokens = context_tokens(self.services.settings)
        return max(0, tokens - min(self._answer_tokens(), tokens // 4))

    async def _system_prompt(self, question: str) -> str:
        """The mode's prompt with the sources it found (and the request's extra
        instructions). Web results and passages of the chat's files are ranked
        together; with web search off (copilot off, or a mode without it) the files
        alone are the sources."""
        return await self._grounded_prompt(question) + self._instructions()

    def _instructions(self) -> str:
        if not self.request.instructions:
            return ""
        return self.services.prompts.render("instructions", instructions=self.request.instructions)

    def _shorter_system_prompt(self, room: int) -> str | None:
        """The system prompt again with half its sources (half of the one source's
        text, when it has one), and no more than fit in `room`; None when it has
        none."""
        if self._grounding is None:
            return None
        prompt, date, results, chars = self._grounding
        if len(results) > 1:
            results = results[: len(results) // 2]
        else:
            results = [replace(r, content=r.text[: len(r.text) // 2]) for r in results]
        bare = self.services.prompts.render(prompt, date=date, context="")
        results = fit_sources(results, self._left_for_sources(bare, room), chars)
        self._grounding = (prompt, date, results, chars)
        context = context_of(results, chars)
        return self.services.prompts.render(prompt, date=date, context=context) + (
            self._instructions()
        )

    def _left_for_sources(self, bare: str, room: int) -> int:
        """What `room` leaves for the sources beside the prompt `bare` (without them),
        the request's instructions and its question."""
        return (
            room
            - tokens_in(bare)
            - tokens_in(self._instructions())
            - tokens_in(self.request.content)
            - 2 * MESSAGE_TOKENS
        )

    async def _grounded_prompt(self, question: str) -> str:
        svc, req = self.services, self.request
        mode = MODES[req.focus_mode]
        date = datetime.now(UTC).isoformat(timespec="seconds")
        web = mode.sources is not None and mode.sources.applies(req)
        if self.decision is not None and self.decision.skip_search:
            web = False
        if not web and not self.files and self.collections is None:
            prompt = PLAIN_PROMPT if mode.sources is not None else mode.prompt
            return svc.prompts.render(prompt, date=date)
        pinned: list[SearchResult] = []  # pasted pages: first, whatever is ranked after them
        results: list[SearchResult] = []
        searched: frozenset[str] = frozenset()
        if web and mode.sources is not None and self.decision is not None:
            ahead, self._ahead = self._ahead, {}
            planned, self._planned = self._planned, None
            with self.timings.span("research"):
                gathered = await svc.researcher.find_sources(
                    self.out,
                    question,
                    mode.sources.budget or req.optimization_mode,
                    kinds=self.decision.sources,
                    scope=mode.sources.scope,
                    urls=self.decision.urls,
                    files=self.files if "files" in self.decision.sources else (),
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
        results = fit_sources(results, self._left_for_sources(bare, self._room()), chars)
        if not results:
            self.out.emit("progress", data="answering without sources: no room for them")
            return svc.prompts.render(PLAIN_PROMPT, date=date)
        await self._send_sources(results)
        self._grounding = (prompt, date, results, chars)
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

    async def _finish(self, status: str, error: AppError | None) -> None:
        """Save the answer, then end the stream. A store that is away does not hold the
        client up: the client gets its usual end, and the keeper saves the answer as
        soon as the store is back (the events stay in the log meanwhile)."""
        svc, h = self.services, self.handle
        final = status if error is None else "failed"
        usage = self._usage()
        saved = Saved(
            content="".join(self.content),
            reasoning="".join(self.reasoning),
            status=final,
            question_id=h.question_id,
            rewritten=self.rewritten,
            sources=self.unsaved_sources,
            usage=usage,
            steps=steps_of(self.out.log.events),
            truncated=self.truncated and error is None,
            error={"key": error.key, "data": error.message} if error is not None else None,
        )
        if error is not None:
            terminal = self.out.next("error", key=error.key, data=error.message)
            svc.metrics.errors.labels(error.key).inc()
        else:
            terminal = self.out.next(
                "messageEnd",
                status=status,
                questionMessageId=h.question_id,
                **({"truncated": True} if self.truncated else {}),
                **({"usage": usage.to_json()} if usage else {}),
                **self._chat_model(),
                **self.extras,
                **({"timings": timings} if (timings := self.timings.to_json()) else {}),
            )
        try:
            await svc.keeper.save(h.answer_id, saved)
        finally:
            svc.keeper.untrack(h.answer_id)
            await svc.hub.finish(h, terminal)
            if svc.keeper.unsaved(h.answer_id):  # its log is what keeps it meanwhile
                await svc.keeper.hold([h.answer_id])
        self._record(final, error)
        if self.new_chat:
            svc.chores.spawn(
                make_title(svc.llm, svc.prompts, svc.store, h.chat_id, self.request.content),
                name=f"title-{h.chat_id}",
            )

    def _chat_model(self) -> dict[str, Any]:
        """`messageEnd`'s `chatModel`: the model that answered (PROTOCOL §13)."""
        req = self.request
        model = req.model or self.services.settings.llm.model
        return {"chatModel": {"provider": req.provider or DEFAULT_PROVIDER, "model": model}}

    def _usage(self) -> Usage | None:
        """What the answer cost: the model's own count, else an estimate (about four
        characters a token); None when the model was never asked. Another provider's
        model is named `@<provider>/<model>` (how the answer's row keeps it)."""
        model = self.request.model or self.services.settings.llm.model
        if self.request.provider not in (None, DEFAULT_PROVIDER):
            model = f"@{self.request.provider}/{model}"
        if self.counted is not None:
            details = self.counted.get("completion_tokens_details") or {}
            return Usage(
                model,
                int(self.counted.get("prompt_tokens") or 0),
                int(self.counted.get("completion_tokens") or 0),
                int(details.get("reasoning_tokens") or 0),
            )
        if not self.prompt_chars:
            return None
        reasoning = estimate_tokens(sum(map(len, self.reasoning)))
        completion = estimate_tokens(sum(map(len, self.content))) + reasoning
        return Usage(model, estimate_tokens(self.prompt_chars), completion, reasoning, True)

    def _record(self, status: str, error: AppError | None) -> None:
        """One metrics update and one structured log line per generation."""
        metrics, req, h = self.services.metrics, self.request, self.handle
        duration = time.monotonic() - self.accepted_at
        metrics.generations.labels(status).inc()
        metrics.generation_duration.observe(duration)
        usage = self._usage()
        if usage is not None:
            metrics.tokens.labels(usage.model, "prompt").inc(usage.prompt_tokens)
            metrics.tokens.labels(usage.model, "completion").inc(usage.completion_tokens)
            metrics.tokens.labels(usage.model, "reasoning").inc(usage.reasoning_tokens)
        generation_log.info(
            "generation",
            extra={
                "fields": {
                    "chatId": h.chat_id,
                    "messageId": h.answer_id,
                    "questionMessageId": h.question_id,
                    "transport": req.transport,
                    "focusMode": req.focus_mode,
                    "optimizationMode": req.optimization_mode,
                    "status": status,
                    "errorKey": error.key if error else None,
                    "durationMs": round(duration * 1000, 1),
                    "firstTokenMs": round((self.first_token_at - self.accepted_at) * 1000, 1)
                    if self.first_token_at
                    else None,
                    "answerChunks": len(self.content),
                    "answerChars": sum(map(len, self.content)),
                    "reasoningChunks": len(self.reasoning),
                    "events": self.out.seq,
                    "timings": self.timings.to_log(),
                }
            },
        )


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A search started ahead fails where it is awaited; one never awaited (cancelled
    or dropped) fails quietly."""
    if not task.cancelled():
        task.exception()


def _log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("ending a generation failed", exc_info=task.exception())
