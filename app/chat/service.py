"""The chat service: one request in, one generation's events out, whatever the transport.

`start()` checks what can only be checked against state (ownership, a
generation already running, the model configured), then runs the generation
as its own task and returns its handle. `relay()` feeds one client's
`Emitter` from the generation's log; `dispatch()` is the two in a row.
A generation survives its clients: only `cancel()` (from any process) or the
deadline stops it, and it always saves what it has and ends with exactly one
terminal event (`messageEnd` or `error`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from datetime import UTC, datetime
from typing import Any

from ..config import Settings
from ..errors import AppError, BadRequest, ConfigError, Forbidden, NotFound, StreamError
from ..ids import Snowflake
from ..llm import LLMClient, Message
from ..metrics import Metrics
from ..prompts import Prompts, answer_lines
from ..protocol import ChatRequest, Event, parse_event_id
from ..search.base import SearchResult
from ..search.web import WebSearch, context_of, source_entries
from ..store import Chat, Store, StoredMessage
from ..streams import Handle, StreamHub
from ..transport.emitter import Emitter, RecordingEmitter
from .modes import MODES, PLAIN_PROMPT, FocusMode
from .research import DeepResearch

log = logging.getLogger("app.chat")
generation_log = logging.getLogger("app.generation")

REWRITE_MIN_CHARS = 30
STORE_RETRY_DELAYS = (0.2, 0.5, 1.0, None)  # then give up and say so
HISTORY_MESSAGES = 20
TITLE_MAX_CHARS = 80


class ChatService:
    def __init__(
        self,
        settings: Settings,
        *,
        store: Store,
        hub: StreamHub,
        llm: LLMClient,
        prompts: Prompts,
        ids: Snowflake,
        search: WebSearch,
        research: DeepResearch,
        metrics: Metrics,
    ) -> None:
        self.settings = settings
        self.store = store
        self.hub = hub
        self.llm = llm
        self.prompts = prompts
        self.ids = ids
        self.search = search
        self.research = research
        self.metrics = metrics
        self._tasks: set[asyncio.Task[Any]] = set()
        self._generations: dict[str, Generation] = {}
        self.accepting = True
        hub.on_lost = self._close_lost

    # -- the public operations --------------------------------------------------

    async def dispatch(self, request: ChatRequest, emitter: Emitter) -> Handle:
        """Start a generation for `request` and relay it to `emitter` until it ends."""
        handle = await self.start(request)
        await self.relay(handle, emitter)
        return handle

    async def start(self, request: ChatRequest) -> Handle:
        """Begin a generation; returns once it runs. Raises `AppError` (nothing started)."""
        if not self.accepting:
            raise AppError("the server is shutting down", status=503)
        if not self.llm.configured:
            raise ConfigError("no model is configured: set llm.api_key (LLM_API_KEY)", status=503)
        chat_id = request.chat_id or self.ids.next_str()
        question_id = request.message_id or self.ids.next_str()
        chat = await self.store.get_chat(chat_id) if request.chat_id else None
        if chat is not None and chat.user_id != request.user_id:
            raise Forbidden("this chat belongs to another user")
        if request.message_id and await self.store.get_message(question_id):
            raise BadRequest("message.messageId is already used")
        handle = Handle(
            chat_id=chat_id,
            answer_id=self.ids.next_str(),
            question_id=question_id,
            user_id=request.user_id,
            question=request.content,
            process=self.hub.process,
        )
        generation = Generation(self, request, handle, chat)
        log_ = await self.hub.register(
            handle,
            generation.request_cancel,
            max_per_user=self.settings.limits.max_concurrent_generations,
        )
        generation.out = RecordingEmitter(log_)
        task = asyncio.create_task(generation.run(), name=f"generation-{handle.answer_id}")
        generation.task = task
        self._generations[handle.answer_id] = generation
        task.add_done_callback(lambda _: self._generations.pop(handle.answer_id, None))
        return handle

    async def relay(self, handle: Handle, emitter: Emitter, after_seq: int = 0) -> None:
        """Feed `emitter` the generation's events after `after_seq`, until its end.

        Raises what the emitter raises when its client goes; cancelling is safe
        (the generation is not affected).
        """
        await emitter.open(handle)
        async for batch in self.follow(handle, after_seq):
            await emitter.emit(batch)

    async def follow(self, handle: Handle, after_seq: int = 0) -> AsyncIterator[list[Event]]:
        """The generation's events after `after_seq` in batches, live, until its end.

        A client that fell behind gets what piled up in one batch, of at most
        `stream.max_queue_events` events (one write each)."""
        cap = max(1, self.settings.stream.max_queue_events)
        async for batch in self.hub.subscribe(handle, after_seq):
            if len(batch) <= cap:
                yield batch
            else:
                for start in range(0, len(batch), cap):
                    yield batch[start : start + cap]

    async def find_resumable(
        self, chat_id: str | None, user_id: str | None, last_event_id: str | None
    ) -> tuple[Handle, int]:
        """The generation to resume and the seq to resume after. NotFound / Forbidden."""
        answer_id, seq = parse_event_id(last_event_id)
        if answer_id is not None:
            handle = await self.hub.find(answer_id)
            if handle is not None and chat_id is not None and handle.chat_id != chat_id:
                handle = None
        elif chat_id is not None:
            handle = await self.hub.latest(chat_id)
        else:
            raise BadRequest("resume needs chatId or Last-Event-ID")
        if handle is None:
            raise NotFound(
                "no generation to resume for this chat (finished and expired, or never started)"
            )
        if user_id is not None and handle.user_id != user_id:
            raise Forbidden("this chat belongs to another user")
        self.metrics.resumes.inc()
        return handle, seq

    async def cancel(self, chat_id: str, user_id: str | None) -> Handle:
        """Stop the generation running for `chat_id`, wherever it runs."""
        handle = await self.hub.lookup(chat_id)
        if handle is None:
            raise NotFound("nothing is being generated for this chat")
        if user_id is not None and handle.user_id != user_id:
            raise Forbidden("this chat belongs to another user")
        await self.hub.cancel(handle)
        self.metrics.cancels.inc()
        return handle

    async def suggestions(self, history: Sequence[tuple[str, str]]) -> list[str]:
        """3 to 5 follow-up questions for a conversation (small model)."""
        if not self.llm.configured:
            raise ConfigError("no model is configured: set llm.api_key (LLM_API_KEY)", status=503)
        prompt = self.prompts.render(
            "suggestions", history=format_history(history[-HISTORY_MESSAGES:])
        )
        text = await self.llm.complete([{"role": "user", "content": prompt}])
        return answer_lines(text)[:5]

    async def stored_history(self, chat_id: str) -> list[tuple[str, str]]:
        messages = await self.store.list_messages(chat_id)
        pairs = [
            (m.role, m.content)
            for m in messages
            if m.content and (m.role == "user" or m.status in ("completed", "cancelled"))
        ]
        return pairs[-HISTORY_MESSAGES:]

    def public_host(self, request_host: str) -> str:
        """The host of links the server hands out: `server.public_url`, else the request's Host."""
        public = self.settings.server.public_url
        if public:
            return public.split("://", 1)[-1].rstrip("/")
        return request_host or "127.0.0.1"

    async def _close_lost(self, handle: Handle, logged: list[Event]) -> None:
        """Save what a generation whose process died had logged, as `failed` (once)."""
        answer = await self.store.get_message(handle.answer_id)
        if answer is None or answer.status != "streaming":
            return
        content = "".join(e.data.get("data", "") for e in logged if e.type == "message")
        reasoning = "".join(e.data.get("data", "") for e in logged if e.type == "reasoning")
        await self.store.finish_message(
            handle.answer_id, content=content, reasoning=reasoning, status="failed"
        )

    def running(self) -> int:
        return len(self._generations)

    async def drain(self, grace: float) -> None:
        """Stop accepting generations; let the running ones finish for `grace` seconds,
        then cancel the rest — each saves its partial answer as `cancelled` and
        ends its stream with `messageEnd` — and wait until all have ended."""
        self.accepting = False
        running = [g.task for g in self._generations.values() if g.task is not None]
        if running and grace > 0:
            await asyncio.wait(running, timeout=grace)
        for generation in list(self._generations.values()):
            generation.request_cancel()
        running = [g.task for g in self._generations.values() if g.task is not None]
        if running:
            await asyncio.wait(running, timeout=10)

    async def aclose(self, grace: float = 0.0) -> None:
        """Drain (see `drain`), then stop background chores."""
        await self.drain(grace)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)

    # -- helpers ------------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run a background chore (title) owned by the service; its errors are logged."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._chore_done)
        return task

    def _chore_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task failed: %r", task.exception())

    async def make_title(self, chat_id: str, question: str) -> None:
        prompt = self.prompts.render("title", question=question)
        try:
            title = await self.llm.complete([{"role": "user", "content": prompt}], max_tokens=30)
        except AppError as exc:
            log.info("title for chat %s not made: %s", chat_id, exc.message)
            return
        title = (answer_lines(title) or [""])[0].strip("\"'“”")
        if title:
            await self.store.set_title(chat_id, title[:TITLE_MAX_CHARS])

    async def rewrite(self, question: str, history: Sequence[tuple[str, str]]) -> str | None:
        """The standalone form of `question`, or None when it needs none (or the model failed)."""
        prompt = self.prompts.render(
            "rewrite_question", history=format_history(history) or "(none)", question=question
        )
        try:
            text = await self.llm.complete([{"role": "user", "content": prompt}], max_tokens=200)
        except AppError as exc:
            log.info("rewrite skipped: %s", exc.message)
            return None
        text = text.strip().strip("\"'“”").strip()
        if not text or text.lower().strip(" .") == "not_needed" or text == question:
            return None
        return text


class Generation:
    """One answer being generated: runs as its own task, owned by the service."""

    def __init__(
        self, service: ChatService, request: ChatRequest, handle: Handle, chat: Chat | None
    ) -> None:
        self.service = service
        self.request = request
        self.handle = handle
        self.chat = chat
        self.new_chat = chat is None
        self.needs_title = False
        self.out: RecordingEmitter
        self.task: asyncio.Task[None] | None = None
        self.cancel_requested = False
        self.started = False
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.answer_saved = False
        self.rewritten: str | None = None
        self.accepted_at = time.monotonic()
        self.first_token_at = 0.0

    def request_cancel(self) -> None:
        """Called by the hub when a cancel arrives (even before the task started);
        safe to call more than once."""
        if self.cancel_requested:
            return
        self.cancel_requested = True
        # a task cancelled before its first step would never run its cleanup:
        # before then, the flag alone is enough (run() looks at it first)
        if self.started and self.task is not None and not self.task.done():
            self.task.cancel()

    async def run(self) -> None:
        status, error = "failed", None
        external_cancel = False
        self.started = True
        self.service.metrics.generations_active.inc()
        try:
            if self.cancel_requested:  # cancelled before the task first ran
                raise asyncio.CancelledError
            async with asyncio.timeout(self.service.settings.llm.timeout_seconds):
                await self._generate()
            status = "completed"
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.cancel_requested and task is not None:
                if task.cancelling():
                    task.uncancel()
            else:
                external_cancel = True  # shutdown: finish cleanly, then let it propagate
            status = "cancelled"
        except TimeoutError:
            error = StreamError("the model did not finish within llm.timeout_seconds")
        except AppError as exc:
            error = exc
        except Exception as exc:  # a bug: still end the stream and save
            log.exception("generation %s failed", self.handle.answer_id)
            error = AppError(f"internal error: {type(exc).__name__}")
        try:
            await asyncio.shield(self._finish(status, error))
        finally:
            self.service.metrics.generations_active.dec()
        if external_cancel:
            raise asyncio.CancelledError

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
        rewritten = self.rewritten

        mode = MODES[req.focus_mode]
        system = await self._system_prompt(mode, rewritten or req.content)
        messages: list[Message] = [{"role": "system", "content": system}]
        messages.extend({"role": role, "content": text} for role, text in history)
        messages.append({"role": "user", "content": req.content})

        emit, content, reasoning = self.out.emit, self.content, self.reasoning
        emit("message", data="")
        requested = time.monotonic()
        deltas = svc.llm.stream(messages)
        async for delta in deltas:
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
        store, req, h = self.service.store, self.request, self.handle
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
        await store.add_messages([question, answer])
        self.answer_saved = True

    async def _system_prompt(self, mode: FocusMode, question: str) -> str:
        svc, req = self.service, self.request
        date = datetime.now(UTC).isoformat(timespec="seconds")
        if not mode.searches:
            return svc.prompts.render(mode.prompt, date=date)
        if (
            not req.copilot_enabled and not mode.research
        ):  # webSearch with copilot off: the model alone
            return svc.prompts.render(PLAIN_PROMPT, date=date)
        if mode.research:
            results = await svc.research.find_sources(self.out, question)
        else:
            results = await svc.search.find_sources(self.out, question, req.optimization_mode)
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
        self._record(status if error is None else "failed", error)
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


def format_history(history: Sequence[tuple[str, str]]) -> str:
    return "\n".join(
        f"{'human' if role == 'user' else 'assistant'}: {text}" for role, text in history
    )
