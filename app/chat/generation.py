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
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import orjson

from ..chores import Chores
from ..collections.service import CollectionSearch, with_collections
from ..config import Settings
from ..errors import AppError, StreamError, Unavailable
from ..events import Handle
from ..files.service import FileService
from ..llm import ChatModel, Message
from ..metrics import Metrics
from ..prompts import Prompts
from ..protocol import ChatRequest
from ..search.base import SearchResult
from ..search.web import (
    CONTEXT_CHARS_PER_SOURCE,
    SNIPPET_CHARS,
    WebSearch,
    context_chars,
    context_of,
    source_entries,
)
from ..store import Checkpoint, FileRecord, Saved, Store, Usage
from ..streams import LogWriter, StreamHub
from .agent import Researcher, context_tokens
from .classify import SOURCE_KINDS, Decision, classify, heuristic
from .history import make_title, rewrite, stored_history, suggest
from .keeper import AnswerKeeper, Progress, steps_of
from .modes import MODES, PLAIN_PROMPT, WebSources

log = logging.getLogger("app.chat")
generation_log = logging.getLogger("app.generation")

REWRITE_MIN_CHARS = 30
IMAGES = 6  # images found for an answer that asks for them


@dataclass(frozen=True, slots=True)
class Services:
    """What a generation uses, and nothing more: the model and prompts, the sources
    (web, research, files), where its answer goes (the store for its question's
    sources, the keeper for the answer, the hub for the end), how to sign a sources
    link, where background chores run, and the metrics."""

    settings: Settings
    llm: ChatModel
    prompts: Prompts
    search: WebSearch
    researcher: Researcher
    files: FileService
    store: Store
    keeper: AnswerKeeper
    hub: StreamHub
    metrics: Metrics
    chores: Chores
    #: the "All Sources" link of a question, for a request that came to a host
    sources_link: Callable[[str, str], str]


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
        self.extras: dict[str, Any] = {}  # what `messageEnd` adds: images, related questions
        self.prompt_chars = 0
        self.accepted_at = time.monotonic()
        self.first_token_at = 0.0
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
            self.rewritten = await rewrite(svc.llm, svc.prompts, req.content, history)
            if self.rewritten:
                self.out.emit("rewrited", content=self.rewritten)

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
            self.extras["relatedQuestions"] = await self._related(history)

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
        svc, req = self.services, self.request
        system = await self._system_prompt(question)
        history = fit_history(history, system, req.content, self._room())
        messages: list[Message] = [{"role": "system", "content": system}]
        messages.extend({"role": role, "content": text} for role, text in history)
        messages.append({"role": "user", "content": req.content})

        self.prompt_chars = sum(len(m["content"]) for m in messages)
        emit, content, reasoning = self.out.emit, self.content, self.reasoning
        emit("message", data="")
        requested = time.monotonic()
        async for delta in svc.llm.stream(messages, model=req.model):
            if not self.first_token_at and delta.kind != "keepalive":
                self.first_token_at = time.monotonic()
                svc.metrics.upstream_latency.observe(self.first_token_at - requested)
                svc.metrics.time_to_first_token.observe(self.first_token_at - self.accepted_at)
            kind = delta.kind
            if kind == "content":
                content.append(delta.text)
                emit("message", data=delta.text)
            elif kind == "reasoning":
                reasoning.append(delta.text)
                emit("reasoning", data=delta.text)
            elif kind == "usage":
                self.counted = delta.usage
            else:
                self.out.keepalive()

    async def _classify(self, sources: WebSources, history: list[tuple[str, str]]) -> Decision:
        """Whether and where to search (PROTOCOL §3 `classify` step). A mode kept to
        some sources (academicSearch, …) searches only there; `speed` asks the model
        only when a rewrite would have been asked for (a long question, or a chat with
        history), so its first token comes no later than before."""
        svc, req = self.services, self.request
        allowed: tuple[str, ...] = ("web",) if sources.scope is not None else SOURCE_KINDS
        if req.sources:
            allowed = tuple(k for k in allowed if k in req.sources) or allowed[:1]
        if not self.files:
            allowed = tuple(k for k in allowed if k != "files") or ("web",)
        worth_asking = req.optimization_mode != "speed" or (
            len(req.content) > REWRITE_MIN_CHARS or bool(history)
        )
        if worth_asking:
            decision = await classify(
                svc.llm,
                svc.prompts,
                req.content,
                history,
                allowed,
                timeout=svc.settings.research.classify_seconds,
            )
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

    def _room(self) -> int:
        """The characters the answer's prompt may hold: the model's window less room for
        the answer, at about three characters a token (a cautious count)."""
        tokens = context_tokens(self.services.settings)
        return max(4000, (tokens - min(8192, tokens // 4)) * 3)

    async def _system_prompt(self, question: str) -> str:
        """The mode's prompt with the sources it found (and the request's extra
        instructions). Web results and passages of the chat's files are ranked
        together; with web search off (copilot off, or a mode without it) the files
        alone are the sources."""
        system = await self._grounded_prompt(question)
        if self.request.instructions:
            system += self.services.prompts.render(
                "instructions", instructions=self.request.instructions
            )
        return system

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
        results = []
        if web and mode.sources is not None and self.decision is not None:
            results = await svc.researcher.find_sources(
                self.out,
                question,
                mode.sources.budget or req.optimization_mode,
                kinds=self.decision.sources,
                scope=mode.sources.scope,
                urls=self.decision.urls,
                files=self.files if "files" in self.decision.sources else (),
                collections=self.collections,
                filters=req.search,
            )
        if self.files:
            results = await self._with_files(question, results)
        if self.collections is not None:
            results = await with_collections(self.out, self.collections, question, results)
        if not results:
            self.out.emit("progress", data="answering without sources")
            return svc.prompts.render(PLAIN_PROMPT, date=date)
        prompt = mode.prompt if web else "files_response"
        bare = svc.prompts.render(prompt, date=date, context="")
        chars = context_chars(req.search)
        results = fit_sources(results, self._room() - len(bare) - len(req.content), chars)
        await self._send_sources(results)
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
                **({"usage": usage.to_json()} if usage else {}),
                **self.extras,
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

    def _usage(self) -> Usage | None:
        """What the answer cost: the model's own count, else an estimate (about four
        characters a token); None when the model was never asked."""
        model = self.request.model or self.services.settings.llm.model
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
                }
            },
        )


def _log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("ending a generation failed", exc_info=task.exception())


def estimate_tokens(chars: int) -> int:
    """Tokens in so many characters of text, roughly (for a model that does not count)."""
    return (chars + 3) // 4


def fit_sources(
    results: list[SearchResult], room: int, chars: int = CONTEXT_CHARS_PER_SOURCE
) -> list[SearchResult]:
    """The sources, in order, within `room` characters of context: each at most
    `chars`; the one that does not fit is cut, and the rest left out (a pasted page,
    first, always stays)."""
    kept: list[SearchResult] = []
    for r in results:
        room -= 40  # its "source N <url>" line
        text = r.text[:chars]
        if len(text) > room:
            if room < 200 and kept:
                break
            text = text[: max(room, 200)]
        room -= len(text)
        kept.append(r if text == r.text else replace(r, content=text))
    return kept


def fit_history(
    history: list[tuple[str, str]], system: str, question: str, room: int
) -> list[tuple[str, str]]:
    """The latest turns that fit beside the prompt and the question."""
    room -= len(system) + len(question)
    kept: list[tuple[str, str]] = []
    for role, text in reversed(history):
        room -= len(text)
        if room < 0:
            break
        kept.append((role, text))
    return kept[::-1]


def fit_event(entries: list[dict[str, object]], limit: int) -> list[dict[str, object]]:
    """Sources whose event stays under `limit` bytes: passages shortened, then the last
    sources left out (the answer's context is not affected: only what is sent)."""
    budget = limit - 2048  # the event's other fields and the "All Sources" entry
    size = len(orjson.dumps(entries))
    if size <= budget:
        return entries
    cut = [
        {**e, "pageContent": str(e.get("pageContent", ""))[: SNIPPET_CHARS // 2]} for e in entries
    ]
    while cut and len(orjson.dumps(cut)) > budget:
        cut.pop()
    return cut
