"""Snowflake ids: 41 bits of milliseconds, 10 bits of worker, 12 bits of sequence.

Ids are 64-bit integers, ordered by time, written as decimal strings (JavaScript
cannot hold them as numbers). They are unique across every process and host of
a deployment because each process holds a worker number of its own, leased from
the store (`WorkerLease`) and renewed while it runs: a process id is no such
number (two containers both run their server as PID 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time

from .errors import AppError
from .store import Store

log = logging.getLogger("app.ids")

EPOCH_MS = 1_288_834_974_657  # the Twitter epoch, as the original used
WORKERS = 1024  # 10 bits


class Snowflake:
    def __init__(self, worker: int = 0) -> None:
        self.worker = worker
        self._lock = threading.Lock()
        self._last_ms = -1
        self._sequence = 0

    def next(self) -> int:
        with self._lock:
            now = int(time.time() * 1000)
            if now < self._last_ms:  # the clock stepped back: keep counting from the last
                now = self._last_ms
            if now == self._last_ms:
                self._sequence = (self._sequence + 1) & 0xFFF
                if self._sequence == 0:
                    now = self._last_ms + 1
            else:
                self._sequence = 0
            self._last_ms = now
            return ((now - EPOCH_MS) << 22) | ((self.worker & 0x3FF) << 12) | self._sequence

    def next_str(self) -> str:
        return str(self.next())


class WorkerLease:
    """Leases `ids` a worker number from the store on enter, renews it every `ttl`/4
    seconds, and gives it back on exit. A lease that was lost (the store was away
    longer than `ttl` and another process took the number) is replaced by a new one."""

    def __init__(self, store: Store, ids: Snowflake, *, ttl: float = 60.0) -> None:
        self.store = store
        self.ids = ids
        self.ttl = ttl
        self.token = secrets.token_hex(8)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> WorkerLease:
        self.ids.worker = await self.store.lease_worker(self.token, self.ttl, WORKERS)
        self._task = asyncio.create_task(self._renew(), name="worker-lease")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(AppError):
            await self.store.release_worker(self.ids.worker, self.token)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 4)
            try:
                if await self.store.renew_worker(self.ids.worker, self.token, self.ttl):
                    continue
                old = self.ids.worker
                self.ids.worker = await self.store.lease_worker(self.token, self.ttl, WORKERS)
                log.warning("worker number %d was lost; now %d", old, self.ids.worker)
            except AppError as exc:
                log.warning("worker lease not renewed: %s", exc.message)
