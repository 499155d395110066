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
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from ..errors import AppError, StreamError
from ..llm import Message
from ..protocol import ChatRequest
from ..search.base import SearchResult
from ..search.web import context_of, source_entries
from ..store import Chat, StoredMessage
from ..streams import Handle, LogWriter
from .modes import MODES, PLAIN_PROMPT, SourceJob

if TYPE_CHECKING:
    from .service import ChatService

log = logging.getLogger("app.chat")
generation_log = logging.getLogger("app.generation")

REWRITE_MIN_CHARS = 30
STORE_RETRY_DELAYS = (0.2, 0.5, 1.0, None)  # then give up and say so
TITLE_MAX_CHARS = 80


class Generation:
    """Owned by the service; `run()` is its task."""

    def __init__(
        self,
        service: ChatService,
        request: ChatRequest,
        handle: Handle,
        chat: Chat | None,
        out: LogWriter,
    ) -> None:
        self.service = service
        self.request = request
        self.handle = handle
        self.chat = chat
        self.new_chat = chat is None
        self.out = out
        self.needs_title = False
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.answer_saved = False
        self.rewritten: str | None = None
        self.accepted_at = time.monotonic()
        self.first_token_at = 0.0
        self.work = asyncio.get_running_loop().create_task(
            self._generate(), name=f"answer-{handle.answer_id}"
        )

    def request_cancel(self) -> None:
        """Stop the body (the model request is closed); safe to call more than once."""
        self.work.cancel()

    async def run(self) -> None:
        """Wait for the body, then save and end the stream. Cancelling `run()` itself
        (the loop shutting down) cancels the body, still saves, and re-raises."""
        self.service.metrics.generations_active.inc()
        timed_out = interrupted = False
        try:
            async with asyncio.timeout(self.service.settings.llm.timeout_seconds):
                await asyncio.wait([self.work])
        except TimeoutError:
            timed_out = True
        except asyncio.CancelledError:
            interrupted = True
        if not self.work.done():
            self.work.cancel()
            await asyncio.wait([self.work])
        error = self._outcome()
        if timed_out and error is None:
            error = StreamError("the answer did not finish within llm.timeout_seconds")
        status = "cancelled" if self.work.cancelled() else "completed"
        try:
            await asyncio.shield(self._finish(status, error))
        finally:
            self.service.metrics.generations_active.dec()
        if interrupted:
            raise asyncio.CancelledError

    def _outcome(self) -> AppError | None:
        """The body's error, if it failed."""
        if self.work.cancelled():
            return None
        exc = self.work.exception()
        if exc is None or isinstance(exc, AppError):
            return exc
        log.error("generation %s failed", self.handle.answer_id, exc_info=exc)
        return AppError(f"internal error: {type(exc).__name__}")

    async def _generate(self) -> None:
        svc, req = self.service, self.request
        await self._save_chat()
        if req.history is not None:
            history = list(req.history)
        elif self.new_chat:
            history = []  # nothing to read back
        else:
            history = await svc.stored_history(self.handle.chat_id)
        if len(req.content) > REWRITE_MIN_CHARS or history:
            self.rewritten = await svc.rewrite(req.content, history)
            if self.rewritten:
                self.out.emit("rewrited", content=self.rewritten)
        await self._save_question("streaming")

        system = await self._system_prompt(self.rewritten or req.content)
        messages: list[Message] = [{"role": "system", "content": system}]
        messages.extend({"role": role, "content": text} for role, text in history)
        messages.append({"role": "user", "content": req.content})

        emit, content, reasoning = self.out.emit, self.content, self.reasoning
        emit("message", data="")
        requested = time.monotonic()
        async for delta in svc.llm.stream(messages):
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
            else:
                self.out.keepalive()

    async def _save_chat(self) -> None:
        if self.chat is not None:
            return
        svc, req, h = self.service, self.request, self.handle
        title = req.content.strip().splitlines()[0][:TITLE_MAX_CHARS]
        self.chat = Chat(h.chat_id, h.user_id, title, req.focus_mode, time.time())
        # the small model names the chat once the answer is out, not while it starts
        self.needs_title = await svc.store.create_chat(self.chat)

    async def _save_question(self, answer_status: str) -> None:
        """Save the question and the answer's row (once; also when cancelled early)."""
        if self.answer_saved:
            return
        req, h = self.request, self.handle
        now = time.time()
        question = StoredMessage(
            h.question_id, h.chat_id, "user", req.content, now, rewritten=self.rewritten
        )
        # after its question, whatever the ids (clients may pick them)
        answer = StoredMessage(
            h.answer_id,
            h.chat_id,
            "assistant",
            "",
            now + 0.000001,
            status=answer_status,
            reply_to=h.question_id,
        )
        await self.service.store.add_messages([question, answer])
        self.answer_saved = True

    async def _system_prompt(self, question: str) -> str:
        svc, req = self.service, self.request
        mode = MODES[req.focus_mode]
        date = datetime.now(UTC).isoformat(timespec="seconds")
        if mode.sources is None:
            return svc.prompts.render(mode.prompt, date=date)
        if not mode.sources.applies(req):
            return svc.prompts.render(PLAIN_PROMPT, date=date)
        job = SourceJob(self.out, question, req, svc.search, svc.research)
        results = await mode.sources.find(job)
        if not results:
            self.out.emit("progress", data="answering without sources")
            return svc.prompts.render(PLAIN_PROMPT, date=date)
        await self._send_sources(results)
        return svc.prompts.render(mode.prompt, date=date, context=context_of(results))

    async def _send_sources(self, results: list[SearchResult]) -> None:
        """Save the sources on the question, then send them with the "All Sources" link."""
        svc, h = self.service, self.handle
        entries = source_entries(results)
        await svc.store.set_sources(h.question_id, entries)
        host = svc.public_host(self.request.host)
        all_sources = {
            "metadata": {"title": "All Sources", "url": f"//{host}/sources/{h.question_id}"}
        }
        self.out.emit("sources", data=[*entries, all_sources])

    async def _finish(self, status: str, error: AppError | None) -> None:
        svc, h = self.service, self.handle
        final = status if error is None else "failed"
        for delay in STORE_RETRY_DELAYS:
            try:
                await self._save_chat()
                await self._save_question(final)
                await svc.store.finish_message(
                    h.answer_id,
                    content="".join(self.content),
                    reasoning="".join(self.reasoning),
                    status=final,
                )
                break
            except Exception as exc:  # any store failure: retry briefly, then report it
                if delay is None:
                    log.exception("saving answer %s failed", h.answer_id)
                    if error is None:
                        error = AppError("the answer could not be saved")
                else:
                    log.warning("saving answer %s failed (%r); retrying", h.answer_id, exc)
                    await asyncio.sleep(delay)
        if error is not None:
            terminal = self.out.next("error", key=error.key, data=error.message)
            svc.metrics.errors.labels(error.key).inc()
        else:
            terminal = self.out.next("messageEnd", status=status, questionMessageId=h.question_id)
        await svc.hub.finish(h, terminal)
        self._record(final, error)
        if self.needs_title:
            svc.spawn(svc.make_title(h.chat_id, self.request.content))

    def _record(self, status: str, error: AppError | None) -> None:
        """One metrics update and one structured log line per generation."""
        metrics, req, h = self.service.metrics, self.request, self.handle
        duration = time.monotonic() - self.accepted_at
        metrics.generations.labels(status).inc()
        metrics.generation_duration.observe(duration)
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
