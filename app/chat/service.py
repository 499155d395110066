"""The chat service: every chat operation, whatever the transport.

`start()` checks what can only be checked against state (ownership, a
generation already running, the model configured), registers the chat, then
runs the generation as its own task and returns its handle. `relay()` turns
the generation's log into one client's chunks through an `Encoder` (SSE
bytes, WebSocket frames, …): the service never knows which transport it
feeds. A generation survives its clients: only `cancel()` (from any process)
or the deadline stops it, and it always saves what it has and ends with
exactly one terminal event (`messageEnd` or `error`).

Every operation on a chat goes through `authorize(owner, user)` (`app.ownership`):
only a chat's owner may read, delete, cancel, resume it, open its sources,
regenerate in it or post into it.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from ..chores import Chores
from ..collections.service import CollectionService
from ..config import DEFAULT_PROVIDER, Settings
from ..errors import AppError, BadRequest, ConfigError, Conflict, Forbidden, NotFound, Unavailable
from ..events import Event, Handle
from ..files.service import FileService
from ..ids import Snowflake
from ..mcp_client import McpServers
from ..metrics import Metrics
from ..model import ChatModel
from ..model.providers import ModelRegistry
from ..ownership import authorize
from ..prompts import Prompts
from ..protocol import ChatRequest, Encoder, parse_event_id
from ..search.web import WebSearch
from ..store import Chat, FileRecord, Store, StoredMessage, Usage
from ..streams import LogWriter, StreamHub
from .agent import Researcher
from .generation import Generation
from .history import TITLE_MAX_CHARS, stored_history, suggest
from .keeper import AnswerKeeper
from .services import Services

log = logging.getLogger("app.chat")

NO_MODEL = "no model key is configured: set llm.api_key (LLM_API_KEY)"
COUNT_EVERY = 32  # events a relay sends between updates of its metric

Chunk = TypeVar("Chunk")  # what an encoder makes: bytes, frames, …


class ChatService:
    def __init__(
        self,
        settings: Settings,
        *,
        store: Store,
        hub: StreamHub,
        llm: ChatModel,
        prompts: Prompts,
        ids: Snowflake,
        search: WebSearch,
        files: FileService,
        metrics: Metrics,
        collections: CollectionService | None = None,
        mcp: McpServers | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.hub = hub
        self.llm = llm
        self.prompts = prompts
        self.ids = ids
        self.search = search
        self.files = files
        self.collections = collections
        #: the configured MCP servers whose tools the research agent may call
        self.mcp = mcp
        self.metrics = metrics
        self.chores = Chores("chat service")
        self.keeper = AnswerKeeper(
            store,
            hub,
            checkpoint_interval=settings.stream.flush_interval_ms / 1000,
            sweep_interval=min(2.0, settings.stream.handle_ttl_seconds / 3),
        )
        self.services = Services(
            settings=settings,
            llm=llm,
            prompts=prompts,
            search=search,
            researcher=Researcher(
                settings, llm=llm, prompts=prompts, web=search, files=files, mcp=mcp
            ),
            files=files,
            store=store,
            keeper=self.keeper,
            hub=hub,
            metrics=metrics,
            chores=self.chores,
            sources_link=self.sources_link,
        )
        #: the models answers may choose (PROTOCOL §13), listed in the background
        self.models = ModelRegistry(settings, llm)
        self._generations: dict[str, Generation] = {}
        self._starting = 0  # starts under way: places taken under the process's cap
        self._runs: dict[str, asyncio.Task[None]] = {}  # answer id → its `run()`
        self._link_key = b""
        self.accepting = True
        #: why the model, or web search, cannot be used at all, as found at start (or None);
        #: a model without a key is said at once, and stays said
        self.model_problem = None if llm.configured else NO_MODEL
        self.search_problem: str | None = None

    # -- generations -------------------------------------------------------------

    async def start(self, request: ChatRequest) -> Handle:
        """Begin a generation; returns once its question is saved and its task started.

        In order: the chat's owner and the request's files are checked, the chat is
        claimed in the registry (`Conflict` while it runs a generation,
        `RateLimited` past the cap), then the question and the answer's row are
        saved in one transaction — the store's unique key makes a `messageId` sent
        twice at once (a double click, two processes) start one answer, and
        `Conflict` the other. A `messageId` that is a question of this chat already
        regenerates it: its answer and every later message go, and it is answered
        again from the chat's history before it (PROTOCOL §1). Raises `AppError`;
        then nothing was started.
        """
        if not self.accepting:
            raise Unavailable("the server is restarting; try again", retry_after=1)
        cap = self.settings.limits.max_generations_per_process
        if cap and len(self._generations) + self._starting >= cap:
            raise Unavailable(
                f"this server is answering {cap} questions already; try again shortly",
                retry_after=2,
            )
        # the place is taken now, before the first await: a burst of starts cannot all
        # pass the check above while none has been added yet
        self._starting += 1
        try:
            return await self._start(request)
        finally:
            self._starting -= 1

    async def _start(self, request: ChatRequest) -> Handle:
        """`start` once its place under the process's cap is taken; the generation is
        in `_generations` when it returns."""
        services, request = self._chosen(request)
        chat_id = request.chat_id or self.ids.next_str()
        question_id = request.message_id or self.ids.next_str()
        chat = await self.store.get_chat(chat_id) if request.chat_id else None
        if chat is not None:
            authorize(chat.user_id, request.user_id)
        asked = await self.store.get_message(question_id) if request.message_id else None
        if asked is not None and (asked.chat_id != chat_id or asked.role != "user"):
            raise Conflict("message.messageId is used in another chat")
        files = await self.files.usable(request.user_id, request.files)
        if chat is not None:
            known = {f.id for f in files}
            attached = (await self.store.chat_files([chat_id])).get(chat_id, [])
            files += [f for f in attached if f.id not in known and f.status == "ready"]
        knowledge = None
        if request.collections and self.collections is not None:
            readable = await self.collections.usable(request.user_id, request.collections)
            knowledge = self.collections.searcher(readable)
        handle = Handle(
            chat_id=chat_id,
            answer_id=self.ids.next_str(),
            question_id=question_id,
            user_id=request.user_id,
            question=request.content,
        )
        log_ = await self.hub.register(
            handle,
            functools.partial(self._cancel_here, handle.answer_id),
            cap_key=request.cap_key or f"user:{request.user_id}",
            max_running=self.settings.limits.max_concurrent_generations,
        )
        now = time.time()
        title = request.content.strip().splitlines()[0][:TITLE_MAX_CHARS]
        question = StoredMessage(question_id, chat_id, "user", request.content, now)
        if asked is not None:  # keeps its place in the chat; its text may be edited
            question = replace(question, created_at=asked.created_at)
        try:
            created = await self.store.begin_answer(
                chat or Chat(chat_id, request.user_id, title, request.focus_mode, now),
                question,
                # after its question, whatever the ids (clients may pick them)
                StoredMessage(
                    handle.answer_id,
                    chat_id,
                    "assistant",
                    "",
                    max(now, question.created_at + 0.000001),
                    status="streaming",
                    reply_to=question_id,
                ),
                regenerate=asked is not None,
                files=list(request.files),
            )
        except BaseException:
            await self.hub.abandon(handle)
            raise
        generation = Generation(
            services,
            request,
            handle,
            new_chat=created,
            out=LogWriter(log_),
            files=files,
            regenerate=asked is not None,
            collections=knowledge,
        )
        self._generations[handle.answer_id] = generation
        self.keeper.track(generation)
        run = asyncio.create_task(generation.run(), name=f"generation-{handle.answer_id}")
        self._runs[handle.answer_id] = run
        run.add_done_callback(functools.partial(self._ended, handle.answer_id))
        return handle

    def _chosen(self, request: ChatRequest) -> tuple[Services, ChatRequest]:
        """What the request's model (`chatModel`, PROTOCOL §13) changes of the services
        its generation uses: that model answers and its provider's small model (else
        the default's) does the small tasks. `BadRequest` naming what exists for an
        unknown one, `ConfigError` for a provider without a key."""
        default = self.models.providers[DEFAULT_PROVIDER]
        if request.provider is None and (
            request.model is None or request.model in default.model_ids()
        ):
            if not self.llm.configured:
                raise ConfigError(
                    "no model is configured: set llm.api_key (LLM_API_KEY)", status=503
                )
            return self.services, request
        choice = self.models.choose(request.provider, request.model, restricted=request.restricted)
        if not choice.llm.configured:
            raise ConfigError(f"provider {choice.provider} has no api_key", status=503)
        # its window and output cap are the provider's
        settings = replace(self.settings, llm=choice.settings)
        services = replace(
            self.services,
            settings=settings,
            llm=choice.llm,
            researcher=self.services.researcher.using(choice.llm, settings),
        )
        return services, replace(request, provider=choice.provider, model=choice.model)

    async def relay(
        self,
        handle: Handle,
        encoder: Encoder[Chunk],
        after_seq: int = 0,
        write: Callable[[Chunk], bool] | None = None,
    ) -> AsyncIterator[Chunk]:
        """The generation's events after `after_seq`, encoded, live, until its end.

        A client that fell behind gets what piled up in one chunk of at most
        `stream.max_queue_events` events. Closing the iterator (the client went)
        is safe: the generation is not affected.

        `write` is the connection's way to write a chunk at once, or to say (False,
        nothing written) that it cannot now. With it, a caught-up relay of a
        generation of this process writes each event in the call that releases it,
        and yields nothing for it; from the first chunk `write` refuses, chunks are
        yielded again, that one first: the client gets every event once, in order.
        The iterator still ends after the terminal event.
        """
        sent = self.metrics.events_sent.labels(encoder.name)
        first = encoder.preamble(handle)
        if first is not None:
            yield first
        cap = max(1, self.settings.stream.max_queue_events)
        seq = after_seq
        counted = 0  # events sent, added to the metric every COUNT_EVERY (it costs a lock)
        unsent: Chunk | None = None  # encoded for `write`, refused by it: goes out first
        unsent_upto = 0  # the seq of its last event

        def pushed(batch: list[Event]) -> bool:
            nonlocal seq, counted, unsent, unsent_upto
            if len(batch) > cap or write is None:
                return False
            chunk = encoder.encode(batch)
            if chunk is not None and not write(chunk):
                if batch[0].seq:  # a keep-alive is simply encoded again
                    unsent, unsent_upto = chunk, batch[-1].seq
                return False
            seq = batch[-1].seq or seq
            counted += len(batch)
            if counted >= COUNT_EVERY:
                sent.inc(counted)
                counted = 0
            return True

        try:
            push = pushed if write is not None else None
            async for batch in self.hub.subscribe(handle, after_seq, push):
                if unsent is not None:  # the log hands those events over again
                    held, unsent = unsent, None
                    taken = unsent_upto - batch[0].seq + 1
                    seq = unsent_upto
                    counted += taken
                    yield held
                    batch = batch[taken:]
                    if not batch:
                        continue
                seq = batch[-1].seq or seq
                for start in range(0, len(batch), cap):
                    part = batch[start : start + cap] if len(batch) > cap else batch
                    chunk = encoder.encode(part)
                    counted += len(part)
                    if counted >= COUNT_EVERY:
                        sent.inc(counted)
                        counted = 0
                    if chunk is not None:
                        yield chunk
        except AppError as exc:  # the registry failed under us: still end with an event
            data = {"key": exc.key, "data": exc.message}
            chunk = encoder.encode(
                [Event("error", handle.chat_id, handle.answer_id, data, seq + 1)]
            )
            if chunk is not None:
                yield chunk
        finally:
            if counted:
                sent.inc(counted)

    async def find_resumable(
        self, chat_id: str | None, user_id: str, last_event_id: str | None
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
        authorize(handle.user_id, user_id)
        self.metrics.resumes.inc()
        return handle, seq

    async def ended_by(self, handle: Handle, seq: int) -> bool:
        """Whether the generation has ended at or before event `seq` (a resume from
        there would get nothing). A log this process keeps says so at once; for
        another process's, the registry says whether it still runs (one round trip),
        and only an ended one's events are read."""
        local = self.hub.local.log(handle.answer_id)
        if local is not None:
            events = local.events
            return local.finished and bool(events) and seq >= events[-1].seq
        (state,) = await self.hub.states([(handle.chat_id, handle.answer_id)])
        if state != "gone":
            return False
        logged = await self.hub.logged(handle.answer_id)
        return bool(logged) and logged[-1].terminal and seq >= logged[-1].seq

    async def cancel(self, chat_id: str, user_id: str) -> Handle:
        """Stop the generation running for `chat_id`, wherever it runs."""
        handle = await self.hub.lookup(chat_id)
        if handle is None:
            raise NotFound("nothing is being generated for this chat")
        authorize(handle.user_id, user_id)
        await self.hub.cancel(handle)
        self.metrics.cancels.inc()
        return handle

    async def ended(self, handle: Handle) -> None:
        """Until a generation this process runs has ended: its answer saved (or left to
        the keeper) and its terminal event written. At once for one it does not run.
        Cancelling is safe: the generation is not affected."""
        run = self._runs.get(handle.answer_id)
        if run is not None:
            await asyncio.wait([run])

    def stop_here(self, handle: Handle) -> None:
        """Cancel a generation of this process at once (its client went away and wants
        no more of it: the OpenAI-compatible API); nothing when it has ended."""
        self._cancel_here(handle.answer_id)

    def _ended(self, answer_id: str, run: asyncio.Task[None]) -> None:
        self._runs.pop(answer_id, None)
        self._generations.pop(answer_id, None)
        self.keeper.untrack(answer_id)
        if not run.cancelled() and run.exception() is not None:
            log.error("generation %s failed", answer_id, exc_info=run.exception())

    def _cancel_here(self, answer_id: str) -> None:
        """The hub's call when a cancel for a generation of this process arrives."""
        generation = self._generations.get(answer_id)
        if generation is not None:
            generation.request_cancel()

    # -- chats ------------------------------------------------------------------------

    def sign(self, question_id: str) -> str:
        """The signature of a question's sources link: a capability to open those
        sources, and nothing else, without a key."""
        digest = hmac.new(self._link_key, question_id.encode(), hashlib.sha256)
        return digest.hexdigest()[:32]

    def mcp_servers(self) -> list[dict[str, Any]]:
        """The configured MCP servers, their statuses and tools (never a URL or header)."""
        return self.mcp.listing() if self.mcp is not None else []

    def sources_link(self, question_id: str, request_host: str) -> str:
        """The signed "All Sources" link of a question (host-relative, `//host/…`)."""
        host = self.public_host(request_host)
        return f"//{host}/sources/{question_id}?sig={self.sign(question_id)}"

    async def list_chats(
        self, user_id: str, limit: int = 100
    ) -> tuple[list[Chat], dict[str, list[FileRecord]]]:
        """The user's chats, newest first, and the files attached to each."""
        chats = await self.store.list_chats(user_id, limit)
        return chats, await self.store.chat_files([c.id for c in chats])

    async def owned_chat(self, chat_id: str, user_id: str) -> Chat:
        """A chat its user may act on. NotFound / Forbidden."""
        chat = await self.store.get_chat(chat_id)
        if chat is None:
            raise NotFound("no such chat")
        authorize(chat.user_id, user_id)
        return chat

    async def open_chat(
        self, chat_id: str, user_id: str
    ) -> tuple[Chat, list[StoredMessage], list[FileRecord]]:
        """A chat, its messages in order, and its files."""
        chat = await self.owned_chat(chat_id, user_id)
        files = (await self.store.chat_files([chat.id])).get(chat.id, [])
        return chat, await self.store.list_messages(chat.id), files

    async def delete_chat(self, chat_id: str, user_id: str) -> None:
        """Delete a chat and its messages; Conflict while it generates."""
        chat = await self.owned_chat(chat_id, user_id)
        if await self.hub.lookup(chat.id) is not None:
            raise Conflict("a generation is running for this chat: cancel it first")
        await self.store.delete_chat(chat.id)

    async def question_sources(
        self, question_id: str, user_id: str, sig: str | None = None
    ) -> StoredMessage:
        """A question with its saved sources, for its owner or for a signed link
        (`sig`, see `sign`). NotFound / Forbidden."""
        if sig is not None and not hmac.compare_digest(
            sig.encode(), self.sign(question_id).encode()
        ):
            raise Forbidden("this sources link is not valid")
        message = await self.store.get_message(question_id)
        if message is None or message.role != "user":
            raise NotFound("no such question")
        if sig is None:
            chat = await self.store.get_chat(message.chat_id)
            if chat is None:
                raise NotFound("no such question")
            authorize(chat.user_id, user_id)
        return message

    async def chat_history(self, chat_id: str, user_id: str) -> list[tuple[str, str]]:
        """The stored conversation of a chat its user may read."""
        await self.owned_chat(chat_id, user_id)
        return await stored_history(self.store, chat_id)

    async def suggestions(
        self, history: Sequence[tuple[str, str]], chosen: tuple[str, str] | None = None
    ) -> list[str]:
        """3 to 5 follow-up questions for a conversation (small model): of the chosen
        model's provider (`chosen`: provider, model), else the default's."""
        llm = self.models.choose(*chosen).llm if chosen is not None else self.llm
        if not llm.configured:
            raise ConfigError("no model is configured: set llm.api_key (LLM_API_KEY)", status=503)
        return await suggest(llm, self.prompts, history)

    async def usage(self, user_id: str, since: float = 0.0) -> list[Usage]:
        """What the user's answers cost since `since`, per model."""
        return await self.store.usage(user_id, since)

    async def _probe(self) -> None:
        """Once at start: can the model and the web search be reached at all? Logged,
        and said by `/readyz` and `/api/config` before the first question (the server
        stays ready: either may come back)."""
        search, model = await asyncio.gather(
            self.search.probe(), self.llm.probe() if self.llm.configured else _none()
        )
        self.search_problem, self.model_problem = search, model or self.model_problem
        if model:
            log.warning("the model cannot be used: %s", model)
        if search:
            log.warning("web search will not work: %s; answers come without sources", search)

    async def health(self) -> dict[str, str]:
        """The backends that do not answer, with why (empty when all do)."""
        failing = {}
        for name, backend in (("store", self.store), (self.hub.name, self.hub)):
            try:
                await backend.ping()
            except Exception as exc:  # any failure means "not ready"; say which
                failing[name] = exc.message if isinstance(exc, AppError) else "not answering"
        return failing

    def public_host(self, request_host: str) -> str:
        """The host of links the server hands out: `server.public_url`, else the request's Host."""
        public = self.settings.server.public_url
        if public:
            return public.split("://", 1)[-1].rstrip("/")
        return request_host or "127.0.0.1"

    # -- lifecycle --------------------------------------------------------------------

    async def open(self) -> None:
        """Load what the deployment shares (the link key) and start the keeper (whose
        sweeper first closes what a crash left)."""
        self._link_key = (await self.store.secret("sources-links")).encode()
        await self.keeper.open()
        self.chores.spawn(self._probe(), name="probe")
        self.models.open(self.chores)

    async def sweep(self) -> int:
        """Close what dead processes left (see `AnswerKeeper.sweep`)."""
        return await self.keeper.sweep()

    def running(self) -> int:
        return len(self._generations)

    async def drain(self, grace: float) -> None:
        """Stop accepting generations; let the running ones finish for `grace` seconds,
        then cancel the rest — each saves its partial answer as `cancelled` and
        ends its stream with `messageEnd` — and wait until all have ended."""
        self.accepting = False
        running = [g.work for g in self._generations.values()]
        if running and grace > 0:
            await asyncio.wait(running, timeout=grace)
        self.hurry()
        if self._runs:
            await asyncio.wait(list(self._runs.values()), timeout=10)
        for run in list(self._runs.values()):  # stuck past all that: stop waiting for them
            run.cancel()
        if self._runs:
            await asyncio.wait(list(self._runs.values()), timeout=5)

    def hurry(self) -> None:
        """Cancel every running generation now (a drain waiting on them ends sooner)."""
        for generation in list(self._generations.values()):
            generation.request_cancel()

    async def aclose(self, grace: float = 0.0) -> None:
        """Drain (see `drain`), let the keeper make a last attempt at saving what the
        store did not take, then stop background chores."""
        await self.drain(grace)
        await self.keeper.aclose()
        await self.chores.aclose()
        await self.models.aclose()


async def _none() -> None:
    return None
