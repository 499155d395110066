"""`memory://`: the registry and event logs of one process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from ..errors import BadRequest, RateLimited
from ..protocol import Event
from .base import GenerationLog, Handle, StreamHub


class MemoryHub(StreamHub):
    def __init__(self, *, replay_ttl: float, process: str = "local") -> None:
        super().__init__(replay_ttl=replay_ttl, process=process)
        self._running: dict[str, tuple[Handle, Callable[[], None]]] = {}
        self._logs: dict[str, GenerationLog] = {}
        self._latest: dict[str, str] = {}
        self._expiry: dict[str, asyncio.TimerHandle] = {}

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        for timer in self._expiry.values():
            timer.cancel()
        self._expiry.clear()

    async def register(
        self, handle: Handle, on_cancel: Callable[[], None], *, max_per_user: int = 0
    ) -> GenerationLog:
        if handle.chat_id in self._running:
            raise BadRequest("a generation is already running for this chat")
        if max_per_user and self._count_user(handle.user_id) >= max_per_user:
            raise too_many(max_per_user)
        return self._open(handle, on_cancel)

    def _count_user(self, user_id: str) -> int:
        return sum(1 for h, _ in self._running.values() if h.user_id == user_id)

    def _open(self, handle: Handle, on_cancel: Callable[[], None]) -> GenerationLog:
        self._running[handle.chat_id] = (handle, on_cancel)
        log = self._new_log(handle)
        self._logs[handle.answer_id] = log
        self._latest[handle.chat_id] = handle.answer_id
        return log

    def _new_log(self, handle: Handle) -> GenerationLog:
        return GenerationLog(handle)

    def _local(self, answer_id: str) -> GenerationLog | None:
        return self._logs.get(answer_id)

    def _local_cancel(self, answer_id: str) -> bool:
        """Cancel a generation of this process by answer id; False when it is not here."""
        log = self._logs.get(answer_id)
        entry = self._running.get(log.handle.chat_id) if log else None
        if entry is None or entry[0].answer_id != answer_id:
            return False
        entry[1]()
        return True

    async def finish(self, handle: Handle, terminal: Event) -> None:
        self._release(handle)
        log = self._logs.get(handle.answer_id)
        if log is not None:
            GenerationLog.append(log, terminal)
        self._keep_for_replay(handle)

    def _release(self, handle: Handle) -> None:
        entry = self._running.get(handle.chat_id)
        if entry is not None and entry[0].answer_id == handle.answer_id:
            del self._running[handle.chat_id]

    def _keep_for_replay(self, handle: Handle) -> None:
        if handle.answer_id in self._logs and handle.answer_id not in self._expiry:
            loop = asyncio.get_running_loop()
            self._expiry[handle.answer_id] = loop.call_later(self.replay_ttl, self._expire, handle)

    def _expire(self, handle: Handle) -> None:
        self._expiry.pop(handle.answer_id, None)
        self._logs.pop(handle.answer_id, None)
        if self._latest.get(handle.chat_id) == handle.answer_id:
            del self._latest[handle.chat_id]

    async def lookup(self, chat_id: str) -> Handle | None:
        entry = self._running.get(chat_id)
        return entry[0] if entry else None

    async def cancel(self, handle: Handle) -> None:
        self._local_cancel(handle.answer_id)

    async def latest(self, chat_id: str) -> Handle | None:
        answer_id = self._latest.get(chat_id)
        log = self._logs.get(answer_id) if answer_id else None
        return log.handle if log else None

    async def find(self, answer_id: str) -> Handle | None:
        log = self._logs.get(answer_id)
        return log.handle if log else None

    async def subscribe(self, handle: Handle, after_seq: int) -> AsyncIterator[list[Event]]:
        log = self._logs.get(handle.answer_id)
        if log is None:
            return
        async for batch in log.follow(after_seq):
            yield batch

    def local_count(self) -> int:
        """Generations running in this process (for tests and metrics)."""
        return len(self._running)


def too_many(cap: int) -> RateLimited:
    return RateLimited(
        f"you already have {cap} answers being generated; wait for one to end", retry_after=5
    )
