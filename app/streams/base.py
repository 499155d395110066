"""In-flight generations: the registry (who runs what, cancel) and the event log (resume).

A `StreamHub` holds, per chat, the handle of the generation running for it,
delivers cancels to the process that owns it, and keeps each generation's
numbered events so that any client (on any process, for `redis://`) can
replay them from a sequence number and follow them live.

Writing is synchronous and never blocks: a generation appends to its log and
goes on; readers catch up at their own pace. Implementations: `memory://`
(one process) and `redis://` (many processes).
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from ..protocol import Event


@dataclass(frozen=True, slots=True)
class Handle:
    """What the registry knows of a running generation."""

    chat_id: str
    answer_id: str
    question_id: str
    user_id: str
    question: str
    process: str
    started_at: float = field(default_factory=time.time)


class GenerationLog:
    """The numbered events of one generation, kept in this process.

    `events[i].seq == i + 1`. Keep-alives are not stored: they bump a counter
    that live readers turn into a keep-alive event.
    """

    __slots__ = ("handle", "events", "keepalives", "finished", "_changed")

    def __init__(self, handle: Handle) -> None:
        self.handle = handle
        self.events: list[Event] = []
        self.keepalives = 0
        self.finished = False
        self._changed: asyncio.Event | None = None

    def append(self, event: Event) -> None:
        if event.seq:
            self.events.append(event)
            if event.terminal:
                self.finished = True
        else:
            self.keepalives += 1
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    async def wait(self) -> None:
        """Until the next append (cancelling is safe)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        await self._changed.wait()

    async def follow(self, after_seq: int) -> AsyncIterator[list[Event]]:
        """Batches of events after `after_seq`, live, until the terminal one."""
        position = after_seq
        seen_keepalives = self.keepalives
        while True:
            if position < len(self.events):
                batch = self.events[position:]
                position = len(self.events)
                yield batch
                if batch[-1].terminal:
                    return
                continue
            if self.finished:
                return
            if self.keepalives != seen_keepalives:
                seen_keepalives = self.keepalives
                last = self.events[-1] if self.events else None
                h = self.handle
                yield [
                    Event("keep-alive", h.chat_id, h.answer_id, seq=0, ts=last.ts if last else 0.0)
                ]
                continue
            await self.wait()


class StreamHub(abc.ABC):
    """Registry of running generations plus their event logs."""

    def __init__(self, *, replay_ttl: float, process: str) -> None:
        self.replay_ttl = replay_ttl
        self.process = process
        #: called with a generation found lost (its process died) and the events it
        #: had logged, so its owner's record can be closed; set by the chat service
        self.on_lost: Callable[[Handle, list[Event]], Awaitable[None]] | None = None

    async def open(self) -> None:  # noqa: B027 - optional
        """Connect (and start listening for cancels)."""

    async def close(self) -> None:  # noqa: B027
        """Stop listening and release connections."""

    @abc.abstractmethod
    async def ping(self) -> None:
        """Raise OSError if the backend cannot answer."""

    @abc.abstractmethod
    async def register(
        self, handle: Handle, on_cancel: Callable[[], None], *, max_per_user: int = 0
    ) -> GenerationLog:
        """Claim `handle.chat_id` for a new generation and open its log.

        Raises `BadRequest` when a generation is already running for that chat,
        `RateLimited` when the user already runs `max_per_user` (0: no cap).
        `on_cancel` is called (in this process, on the event loop) when a
        cancel for the chat arrives from any process.
        """

    @abc.abstractmethod
    async def finish(self, handle: Handle, terminal: Event) -> None:
        """End a generation: make `terminal` (its last event) durable, release the
        chat, then hand `terminal` to live readers — so a client that saw the
        end can start the chat's next generation at once. Never raises for an
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
    def subscribe(self, handle: Handle, after_seq: int) -> AsyncIterator[list[Event]]:
        """Batches of the generation's events after `after_seq`, then live ones, until
        its terminal event. A generation lost with its process ends with an
        `error` event (STREAM_ERROR)."""

    async def __aenter__(self) -> StreamHub:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
