"""`memory://`: the registry and event logs of one process."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ..events import Event, Handle
from .base import GenerationLog, LocalRegistry, Push, StreamHub


class MemoryHub(StreamHub):
    name = "memory"

    def __init__(self, *, replay_ttl: float) -> None:
        self.local = LocalRegistry(replay_ttl)

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        self.local.close()

    async def claim(
        self, handle: Handle, cap_key: str, max_running: int
    ) -> tuple[GenerationLog, str]:
        self.local.check_free(handle, cap_key, max_running)
        return GenerationLog(handle), cap_key

    async def abandon(self, handle: Handle) -> None:
        self.local.release(handle, keep_log=False)

    async def finish(self, handle: Handle, terminal: Event) -> None:
        log = self.local.log(handle.answer_id)
        self.local.release(handle)
        if log is not None:
            log.end(terminal)

    async def lookup(self, chat_id: str) -> Handle | None:
        return self.local.lookup(chat_id)

    async def cancel(self, handle: Handle) -> None:
        self.local.cancel(handle.answer_id)

    async def latest(self, chat_id: str) -> Handle | None:
        return self.local.latest(chat_id)

    async def find(self, answer_id: str) -> Handle | None:
        log = self.local.log(answer_id)
        return log.handle if log else None

    async def states(self, answers: list[tuple[str, str]]) -> list[str]:
        return ["running" if self.local.runs(answer_id) else "gone" for _, answer_id in answers]

    async def logged(self, answer_id: str) -> list[Event]:
        log = self.local.log(answer_id)
        return list(log.events) if log else []

    async def lead(self, chore: str, ttl: float) -> bool:
        return True  # the only process

    def subscribe(
        self, handle: Handle, after_seq: int, push: Push | None = None
    ) -> AsyncIterator[list[Event]]:
        log = self.local.log(handle.answer_id)
        return log.follow(after_seq, push) if log is not None else _nothing()


async def _nothing() -> AsyncIterator[list[Event]]:
    return
    yield
