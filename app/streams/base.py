"""In-flight generations: the registry (who runs what, cancel) and the event log (resume).

A `StreamHub` holds, per chat, the handle of the generation running for it,
delivers cancels to the process that owns it, and keeps each generation's
numbered events so that any client (on any process, for `redis://`) can
replay them from a sequence number and follow them live.

A generation writes through a `LogWriter`, which numbers its events and
appends them to its `GenerationLog`. Writing is synchronous and never
blocks: the generation goes on and readers catch up at their own pace.
A reader that is caught up and can write at once is handed each released
event in the call that released it (`Push`), with no task woken per event.
Backends (`memory://`, `redis://`) are siblings: both keep this process's
part in a `LocalRegistry`; the Redis one also shares it with other processes.
"""

from __future__ import annotations

import abc
import asyncio
from array import array
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, overload

from orjson import dumps, loads

from ..errors import Conflict, RateLimited
from ..events import EVENT_TYPES, TERMINAL, Event, Handle

#: called with each numbered event a log receives (the Redis backend queues it, and
#: releases it to readers once Redis has acknowledged the write that holds it)
Sink = Callable[["GenerationLog", Event], None]
#: a reader's way to take a batch of released events now, in the call that released
#: them: True when it took all of them, False (nothing taken) when it cannot now
Push = Callable[[list[Event]], bool]


class LoggedEvents(Sequence[Event]):
    """A log's numbered events, kept as bytes and numbers: each one's type (a code),
    time, and data as JSON in one buffer; its seq is its place (`events[i].seq ==
    i + 1`). An `Event` read from it is made then.

    Kept one per token for replay, `Event`s were objects the collector tracks, and
    their data dicts and times objects every collection that reached them visited:
    at 1,000 streams every young collection scanned the tokens written since the
    last one, and the older ones all of them, the event loop stopped meanwhile. A
    buffer and arrays hold no objects, so the collector never sees the tokens, and
    each costs about 50 bytes here instead of 330. The events readers have not been
    handed yet (`tail`) are kept as they came too, for the readers that have caught up
    to be handed those. An event whose type is not one of the protocol's, or whose
    data JSON cannot hold, is kept as it came."""

    __slots__ = ("chat_id", "message_id", "spans", "times", "blob", "odd", "tail", "settled")

    def __init__(self, chat_id: str, message_id: str) -> None:
        self.chat_id = chat_id
        self.message_id = message_id
        #: per event, where its data ends in `blob` (shifted left 8 bits) and the code
        #: of its type in the low 8 bits: its place in EVENT_TYPES, or _ODD
        self.spans = array("Q")
        self.times = array("d")
        self.blob = bytearray()
        self.odd: dict[int, Event] = {}
        #: the events from index `settled` on, as they came (see `settle`)
        self.tail: list[Event] = []
        self.settled = 0

    def append(self, event: Event) -> None:
        code = _CODES.get(event.type, _ODD)
        blob = self.blob
        if code != _ODD:
            try:
                blob += dumps(event.data)
            except TypeError:  # orjson's: a lone surrogate, a value it does not know
                code = _ODD
        if code == _ODD:
            self.odd[len(self.spans)] = event
        self.spans.append(len(blob) << 8 | code)
        self.times.append(event.ts)
        self.tail.append(event)

    def settle(self, upto: int) -> None:
        """The events before index `upto` have been handed to the readers that were
        caught up: they need not be kept as objects any more."""
        if upto > self.settled:
            del self.tail[: upto - self.settled]
            self.settled = upto

    def between(self, start: int, stop: int) -> list[Event]:
        """`self[start:stop]` for 0 <= start <= stop <= len(self): the push path's."""
        settled = self.settled
        if start >= settled:
            return self.tail[start - settled : stop - settled]
        return [self._make(i) for i in range(start, stop)]

    def terminal(self, index: int) -> bool:
        """Whether the event at `index` is a terminal one."""
        code = self.spans[index] & 255
        return code in _TERMINAL or (code == _ODD and self.odd[index].terminal)

    def of_type(self, type: str, start: int = 0) -> list[Event]:
        """The events of one type from index `start` on (only those are made)."""
        found = [i for i, e in self.odd.items() if i >= start and e.type == type]
        code = _CODES.get(type, _ODD)
        if code != _ODD:
            spans = self.spans
            found.extend(i for i in range(start, len(spans)) if spans[i] & 255 == code)
        return [self._make(i) for i in sorted(found)]

    def cut(self, size: int) -> None:
        """Keep only the first `size` events: never fewer than readers were handed."""
        del self.spans[size:], self.times[size:], self.tail[size - self.settled :]
        del self.blob[self.spans[-1] >> 8 if size else 0 :]
        self.odd = {i: e for i, e in self.odd.items() if i < size}

    def _make(self, i: int) -> Event:
        if i >= self.settled:
            return self.tail[i - self.settled]
        span = self.spans[i]
        if span & 255 == _ODD:
            return self.odd[i]
        data = loads(self.blob[self.spans[i - 1] >> 8 if i else 0 : span >> 8])
        return Event(
            EVENT_TYPES[span & 255], self.chat_id, self.message_id, data, i + 1, self.times[i]
        )

    def __len__(self) -> int:
        return len(self.spans)

    @overload
    def __getitem__(self, index: int) -> Event: ...

    @overload
    def __getitem__(self, index: slice) -> list[Event]: ...

    def __getitem__(self, index: int | slice) -> Event | list[Event]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self.spans))
            if step == 1:
                return self.between(start, max(start, stop))
            return [self._make(i) for i in range(start, stop, step)]
        return self._make(range(len(self.spans))[index])  # IndexError as a list's

    def __iter__(self) -> Iterator[Event]:
        return iter(self.between(0, len(self.spans)))


_CODES: Final = {name: code for code, name in enumerate(EVENT_TYPES)}
_TERMINAL: Final = frozenset(_CODES[name] for name in TERMINAL)
_ODD: Final = 255


class GenerationLog:
    """The numbered events of one generation, kept in this process.

    `events[i].seq == i + 1`. Readers see `events[:durable]`: without a sink every
    event is released as it is appended; with one, the sink's owner releases them
    (`release`) once they are durable, so no reader is ever shown an event that a
    crash could take back. Keep-alives are not stored: they bump a counter that
    live readers turn into a keep-alive event.
    """

    __slots__ = (
        "handle",
        "events",
        "durable",
        "keepalives",
        "finished",
        "_waiters",
        "_pushed",
        "_sink",
        "_add",
    )

    def __init__(self, handle: Handle, sink: Sink | None = None) -> None:
        self.handle = handle
        self.events = LoggedEvents(handle.chat_id, handle.answer_id)
        self.durable = 0
        self.keepalives = 0
        self.finished = False
        self._waiters: list[asyncio.Future[None]] = []
        self._pushed: list[_Pushed] = []
        self._sink = sink
        #: what keeps a numbered event (nothing, once the log `fail`ed)
        self._add: Callable[[Event], None] = self.events.append

    def append(self, event: Event) -> None:
        if event.seq:
            self._add(event)
            if event.terminal:
                self.finished = True
            if self._sink is not None:
                self._sink(self, event)
                return
            events = self.events
            self.durable = durable = len(events.spans)
            if self._waiters or self._pushed:
                self._wake()
            del events.tail[: durable - events.settled]  # `settle`, inline: once a token
            events.settled = durable
            return
        self.keepalives += 1
        if self._waiters or self._pushed:
            self._wake()

    def release(self, upto: int) -> None:
        """Readers may see the events up to seq `upto`: they are durable."""
        if upto > self.durable:
            self.durable = min(upto, len(self.events))
            if self._waiters or self._pushed:
                self._wake()
            self.events.settle(self.durable)

    def end(self, terminal: Event) -> None:
        """Append the terminal event, and release every event (the hub made them
        durable — or, with its backend away, the store holds the answer)."""
        self.events.append(terminal)
        self.durable = len(self.events)
        self.finished = True
        if self._waiters or self._pushed:
            self._wake()
        self.events.settle(self.durable)

    def fail(self, error: Event) -> None:
        """End the log with `error` (numbered right after the last released event)
        in place of what was not released yet: readers get what they were shown,
        then `error`. What the generation appends afterwards is dropped."""
        self.events.cut(self.durable)
        self.events.append(error)
        self._add = _dropped
        self._sink = None
        self.durable = len(self.events)
        self.finished = True
        if self._waiters or self._pushed:
            self._wake()
        self.events.settle(self.durable)

    @property
    def shown(self) -> list[Event]:
        """The events readers may see (all of them, once it has ended)."""
        return self.events.between(0, self.durable)

    def _wake(self) -> None:
        if self._pushed:
            self._push()
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Until the next append or release (cancelling is safe). A bare future per
        reader: the cheapest wake-up asyncio has."""
        waiter = (loop or asyncio.get_running_loop()).create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def _push(self) -> None:
        """Hand what was released since to each pushed reader; one that cannot take it
        goes back to its `follow` loop, from where it was."""
        events, durable = self.events, self.durable
        for reader in self._pushed[:]:
            position = reader.position
            if position < durable:
                batch = events.between(position, durable)
                if not reader.offer(batch):
                    self._detach(reader)
                    continue
                reader.position = durable
                if batch[-1].terminal:
                    self._detach(reader)
                    continue
            if reader.keepalives != self.keepalives:
                if not reader.offer([self._keepalive()]):
                    self._detach(reader)
                    continue
                reader.keepalives = self.keepalives

    def _detach(self, reader: _Pushed) -> None:
        self._pushed.remove(reader)
        if not reader.back.done():
            reader.back.set_result(None)

    def _keepalive(self) -> Event:
        durable, h = self.durable, self.handle
        ts = self.events.times[durable - 1] if durable else 0.0
        return Event("keep-alive", h.chat_id, h.answer_id, seq=0, ts=ts)

    async def follow(self, after_seq: int, push: Push | None = None) -> AsyncIterator[list[Event]]:
        """Batches of released events after `after_seq`, live, until the terminal one.

        With `push`, a caught-up reader is handed what is released next through `push`,
        in the call that releases it, instead of being woken for it; when `push` cannot
        take a batch (or raises), the reader is yielded it from here, as without `push`,
        in order after what `push` took: nothing is lost, repeated or reordered. The
        iterator ends once `push` has taken the terminal event. Cancelling is safe."""
        position = after_seq
        seen_keepalives = self.keepalives
        loop = asyncio.get_running_loop()  # once: asking for it costs a system call
        events = self.events
        while True:
            durable = self.durable
            if position < durable:
                batch = events.between(position, durable)
                position = durable
                yield batch
                if batch[-1].terminal:
                    return
                continue
            if self.finished and position >= len(events):
                return
            if self.keepalives != seen_keepalives:
                seen_keepalives = self.keepalives
                yield [self._keepalive()]
                continue
            if push is None:
                await self.wait(loop)
                continue
            reader = _Pushed(position, seen_keepalives, push, loop.create_future())
            self._pushed.append(reader)
            try:
                await reader.back
            finally:
                if reader in self._pushed:
                    self._pushed.remove(reader)
            position, seen_keepalives = reader.position, reader.keepalives
            if position and events.terminal(position - 1):
                return


class _Pushed:
    """A reader of a log being pushed its events: where it is, and how to get it back
    to its `follow` loop (`back`)."""

    __slots__ = ("position", "keepalives", "push", "back")

    def __init__(
        self, position: int, keepalives: int, push: Push, back: asyncio.Future[None]
    ) -> None:
        self.position = position
        self.keepalives = keepalives
        self.push = push
        self.back = back

    def offer(self, batch: list[Event]) -> bool:
        try:
            return self.push(batch)
        except Exception:  # noqa: BLE001 - its follow loop meets it again, where it belongs
            return False


def _dropped(event: Event) -> None:
    """Where a failed log's further events go."""


class LogWriter:
    """What a generation writes through: numbers its events and appends them to its
    log. Never blocks."""

    __slots__ = ("log", "chat_id", "message_id", "seq")

    def __init__(self, log: GenerationLog) -> None:
        self.log = log
        self.chat_id = log.handle.chat_id
        self.message_id = log.handle.answer_id
        self.seq = 0

    def emit(self, type: str, **data: Any) -> None:
        self.seq += 1
        self.log.append(Event(type, self.chat_id, self.message_id, data, self.seq))

    def next(self, type: str, **data: Any) -> Event:
        """The next numbered event, not yet appended (the terminal one goes through
        `StreamHub.finish`)."""
        self.seq += 1
        return Event(type, self.chat_id, self.message_id, data, self.seq)

    def keepalive(self) -> None:
        self.log.append(Event("keep-alive", self.chat_id, self.message_id))


@dataclass(frozen=True, slots=True)
class Running:
    """A generation this process runs: its handle, how to cancel it, and the key its
    concurrency cap counts it under (the user with auth on, else the client address)."""

    handle: Handle
    on_cancel: Callable[[], None]
    cap_key: str


class LocalRegistry:
    """This process's part of a hub: the generations it runs (with their cancel
    callbacks) and the logs it keeps, each for `replay_ttl` seconds after its end."""

    def __init__(self, replay_ttl: float) -> None:
        self.replay_ttl = replay_ttl
        self._running: dict[str, Running] = {}
        self._logs: dict[str, GenerationLog] = {}
        self._latest: dict[str, str] = {}
        self._expiry: dict[str, asyncio.TimerHandle] = {}

    def check_free(self, handle: Handle, cap_key: str, max_running: int) -> None:
        """Conflict when the chat runs a generation here; RateLimited past the cap."""
        if handle.chat_id in self._running:
            raise already_running()
        if max_running and self.count(cap_key) >= max_running:
            raise too_many(max_running)

    def count(self, cap_key: str) -> int:
        return sum(1 for r in self._running.values() if r.cap_key == cap_key)

    def add(self, log: GenerationLog, on_cancel: Callable[[], None], cap_key: str) -> None:
        handle = log.handle
        self._running[handle.chat_id] = Running(handle, on_cancel, cap_key)
        self._logs[handle.answer_id] = log
        self._latest[handle.chat_id] = handle.answer_id

    def release(self, handle: Handle, *, keep_log: bool = True) -> None:
        """The chat is free again; its log stays for `replay_ttl` (or goes at once)."""
        entry = self._running.get(handle.chat_id)
        if entry is not None and entry.handle.answer_id == handle.answer_id:
            del self._running[handle.chat_id]
        if not keep_log:
            self._expire(handle)
        elif handle.answer_id in self._logs and handle.answer_id not in self._expiry:
            loop = asyncio.get_running_loop()
            self._expiry[handle.answer_id] = loop.call_later(self.replay_ttl, self._expire, handle)

    def _expire(self, handle: Handle) -> None:
        timer = self._expiry.pop(handle.answer_id, None)
        if timer is not None:
            timer.cancel()
        self._logs.pop(handle.answer_id, None)
        if self._latest.get(handle.chat_id) == handle.answer_id:
            del self._latest[handle.chat_id]

    def cancel(self, answer_id: str) -> bool:
        """Cancel a generation of this process; False when it does not run here."""
        log = self._logs.get(answer_id)
        entry = self._running.get(log.handle.chat_id) if log else None
        if entry is None or entry.handle.answer_id != answer_id:
            return False
        entry.on_cancel()
        return True

    def running(self) -> list[Running]:
        return list(self._running.values())

    def entry(self, chat_id: str) -> Running | None:
        return self._running.get(chat_id)

    def kept_logs(self) -> list[GenerationLog]:
        """Every log this process holds: of running generations and of ended ones still
        kept for replay."""
        return list(self._logs.values())

    def runs(self, answer_id: str) -> bool:
        log = self._logs.get(answer_id)
        entry = self._running.get(log.handle.chat_id) if log else None
        return entry is not None and entry.handle.answer_id == answer_id

    def lookup(self, chat_id: str) -> Handle | None:
        entry = self._running.get(chat_id)
        return entry.handle if entry else None

    def log(self, answer_id: str) -> GenerationLog | None:
        return self._logs.get(answer_id)

    def latest(self, chat_id: str) -> Handle | None:
        answer_id = self._latest.get(chat_id)
        log = self._logs.get(answer_id) if answer_id else None
        return log.handle if log else None

    def close(self) -> None:
        for timer in self._expiry.values():
            timer.cancel()
        self._expiry.clear()


class StreamHub(abc.ABC):
    """Registry of running generations plus their event logs."""

    #: which backend, for readiness reports
    name: str
    #: how long a dead process's claim on a chat outlives it (0: claims die with it)
    claim_ttl: float = 0.0
    #: this process's part: the generations it runs and the logs it keeps
    local: LocalRegistry
    #: whether events reach readers only once the hub has made them durable (then a
    #: generation's log holds them back until the hub, or `release_saved`, lets go)
    holds_events: bool = False

    @property
    def degraded(self) -> bool:
        """Whether the hub cannot make events durable now (its backend is away): the
        store's checkpoints are then what lets them through (`release_saved`)."""
        return False

    def release_saved(self, answer_id: str, seq: int) -> None:
        """The store holds a running generation's events up to `seq` (a checkpoint):
        readers may see them."""
        log = self.local.log(answer_id)
        if log is not None:
            log.release(seq)

    async def open(self) -> None:  # noqa: B027 - optional
        """Start background work (listening for cancels)."""

    async def close(self) -> None:  # noqa: B027
        """Stop background work. The hub does not own its connections."""

    @abc.abstractmethod
    async def ping(self) -> None:
        """Raise if the backend cannot answer."""

    async def register(
        self,
        handle: Handle,
        on_cancel: Callable[[], None],
        *,
        cap_key: str = "",
        max_running: int = 0,
    ) -> GenerationLog:
        """Claim `handle.chat_id` for a new generation and open its log.

        Raises `Conflict` when a generation is already running for that chat,
        `RateLimited` when `cap_key` already runs `max_running` (0: no cap),
        `Unavailable` when the registry cannot answer (or is recovering from a
        restart and cannot tell yet). `on_cancel` is called (in this process, on
        the event loop) when a cancel for the chat arrives from any process.
        """
        log, cap_key = await self.claim(handle, cap_key, max_running)
        self.local.add(log, on_cancel, cap_key)
        return log

    @abc.abstractmethod
    async def claim(
        self, handle: Handle, cap_key: str, max_running: int
    ) -> tuple[GenerationLog, str]:
        """`register`'s claim, with its errors: the generation's new log, and the key
        its cap is counted under."""

    @abc.abstractmethod
    async def abandon(self, handle: Handle) -> None:
        """Undo `register` for a generation that never started (no event was written)."""

    @abc.abstractmethod
    async def finish(self, handle: Handle, terminal: Event) -> None:
        """End a generation: make `terminal` (its last event) durable and release the
        chat, then hand `terminal` to live readers — so a client that saw the end
        can start the chat's next generation at once. Never raises for an
        unreachable backend (the claim then expires by itself)."""

    @abc.abstractmethod
    async def lookup(self, chat_id: str) -> Handle | None:
        """The running generation of a chat, if any."""

    @abc.abstractmethod
    async def cancel(self, handle: Handle) -> None:
        """Deliver a cancel to the process running `handle` (this one or another)."""

    @abc.abstractmethod
    async def latest(self, chat_id: str) -> Handle | None:
        """The newest generation of a chat whose events are still kept (running or not)."""

    @abc.abstractmethod
    async def find(self, answer_id: str) -> Handle | None:
        """A generation whose events are still kept, by its answer id."""

    @abc.abstractmethod
    async def states(self, answers: list[tuple[str, str]]) -> list[str]:
        """For each (chat id, answer id): `running` (some process runs it), `gone`
        (none does), or `unknown` (the registry cannot tell now: it is recovering
        from a restart). One round trip for all."""

    @abc.abstractmethod
    async def logged(self, answer_id: str) -> list[Event]:
        """Every event of a generation still kept (what a resuming client would get)."""

    async def logged_many(self, answer_ids: Sequence[str]) -> dict[str, list[Event]]:
        """`logged` of each answer (the sweeper's: a backend may read what they share
        once for all of them)."""
        return {answer_id: await self.logged(answer_id) for answer_id in answer_ids}

    async def orphaned(self, chat_id: str, answer_id: str) -> None:  # noqa: B027
        """An answer whose process died has been saved (see the sweeper): what is kept
        of it expires with the replay TTL from now, as an answer's that ended does."""

    async def hold(self, answer_ids: Sequence[str], seconds: float) -> None:  # noqa: B027
        """Keep what is logged of these ended answers for `seconds` from now, however
        soon it would have expired: the store has not taken them yet, and if this
        process dies before it does, their log is what the sweeper saves them from."""

    @abc.abstractmethod
    async def lead(self, chore: str, ttl: float) -> bool:
        """Whether this process should run a chore that one process of the deployment
        runs at a time (held for `ttl` seconds, renewed by asking again)."""

    @abc.abstractmethod
    def subscribe(
        self, handle: Handle, after_seq: int, push: Push | None = None
    ) -> AsyncIterator[list[Event]]:
        """Batches of the generation's events after `after_seq`, then live ones, until
        its terminal event. A generation lost with its process ends with an
        `error` event (STREAM_ERROR). `push`: see `GenerationLog.follow` (used for
        a generation of this process; others' events all come as batches)."""

    async def __aenter__(self) -> StreamHub:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def already_running() -> Conflict:
    return Conflict("a generation is already running for this chat")


def too_many(cap: int) -> RateLimited:
    return RateLimited(
        f"you already have {cap} answers being generated; wait for one to end", retry_after=5
    )
