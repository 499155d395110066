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
from typing import Any

from ..collections.service import CollectionSearch
from ..config import DEFAULT_PROVIDER
from ..errors import AppError, StreamError
from ..events import Handle
from ..model import ContextTooLong, Delta, Message, tokens_in
from ..protocol import ChatRequest
from ..store import Checkpoint, FileRecord, Saved, Usage
from ..streams import LogWriter
from ..timings import Timings
from .classify import Decision
from .fitting import (
    MESSAGE_TOKENS,
    estimate_tokens,
    fit_history,
    text_chars,
    too_long,
)
from .grounding import Grounding
from .history import make_title, rewrite, stored_history, suggest
from .keeper import Progress, steps_of
from .modes import MODES, WebSources
from .services import Services
from .triage import REWRITE_MIN_CHARS, Triage

log = logging.getLogger("app.chat")
generation_log = logging.getLogger("app.generation")

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
        self.counted: dict[str, Any] | None = None  # the model's `usage`
        #: the model stopped at `llm.max_output_tokens`: the answer is whole but cut
        self.truncated = False
        self.extras: dict[str, Any] = {}  # what `messageEnd` adds: images, related questions
        self.prompt_chars = 0
        self.accepted_at = time.monotonic()
        self.first_token_at = 0.0
        self._requested = 0.0  # when the answer was asked of the model
        #: the spans of its stages, sent in `messageEnd` and logged
        self.timings = Timings(self.accepted_at)
        self._model_span: dict[str, Any] = {}
        #: the classifier's decision, and what the research would start with, started
        #: while it decides
        self._triage = Triage(services, request, out, self.timings, self.files, collections)
        #: the system prompt, with the sources found for the question
        self._prompt = Grounding(
            services, request, handle, out, self.timings, self.files, collections, self._triage
        )
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
            self._triage.drop()
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
            self.decision = await self._triage.decide(mode.sources, history)
            if self.decision.rewritten:
                self.rewritten = self.decision.question
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
        system = await self._prompt.system_prompt(question, self.decision)
        room = self._prompt.room()
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
                shorter = (
                    None if attempt else self._prompt.shorter(system, history, sent, exc.window)
                )
                if shorter is None:
                    raise too_long(exc, sent) from exc
                log.info("the model refused the prompt as too long: once more, shorter")
                system, room = shorter

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
            sources=self._prompt.unsaved_sources,
            usage=usage,
            steps=steps_of(self.out.log.events.of_type("progress")),
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


def _log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("ending a generation failed", exc_info=task.exception())
