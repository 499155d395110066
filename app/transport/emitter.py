"""The `Emitter` interface, and the recording emitter a generation writes to.

A generation never writes to a client. It writes to a `RecordingEmitter`,
which numbers its events and appends them to the generation's log (memory or
Redis) without ever waiting. Each client connection is an `Emitter` fed by a
relay that follows that log, so a slow or vanished client holds back nobody
but itself, and any client can resume from any event.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from ..protocol import Event
from ..streams import GenerationLog, Handle


class Emitter(abc.ABC):
    """One client's view of one or more generations.

    `open` is called once per subscription (a resume too), then `emit` with
    batches of events in order. Both may raise `OSError` (or the transport's
    own disconnect error) when the client has gone; the relay then stops and
    the generation goes on.
    """

    def __init__(self, fmt: str = "default") -> None:
        self.format = fmt

    @abc.abstractmethod
    async def open(self, handle: Handle) -> None: ...

    @abc.abstractmethod
    async def emit(self, events: Sequence[Event]) -> None: ...


class RecordingEmitter:
    """Numbers a generation's events and appends them to its log. Never blocks."""

    __slots__ = ("log", "chat_id", "message_id", "seq")

    def __init__(self, log: GenerationLog) -> None:
        self.log = log
        self.chat_id = log.handle.chat_id
        self.message_id = log.handle.answer_id
        self.seq = 0

    def emit(self, type: str, **data: Any) -> Event:
        event = self.next(type, **data)
        self.log.append(event)
        return event

    def next(self, type: str, **data: Any) -> Event:
        """The next numbered event, not yet appended (the terminal one goes through
        `StreamHub.finish`)."""
        self.seq += 1
        return Event(type, self.chat_id, self.message_id, data, self.seq)

    def keepalive(self) -> None:
        self.log.append(Event("keep-alive", self.chat_id, self.message_id))
