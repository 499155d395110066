"""Ids: those a request names (`parse_id`), and the ones the server makes.

Snowflake ids: 41 bits of milliseconds, 10 bits of worker, 12 bits of sequence.

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
import math
import re
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any

from .errors import AppError, BadRequest, Unavailable

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("app.ids")

EPOCH_MS = 1_288_834_974_657  # the Twitter epoch, as the original used
WORKERS = 1024  # 10 bits
LEASE_MARGIN = 0.9  # a lease is trusted for this share of its time
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_DIGITS = re.compile(r"[0-9]+")


def parse_id(value: Any, name: str) -> str:
    """An opaque id (PROTOCOL §1): 1–64 characters of `[A-Za-z0-9_-]`; a JSON integer
    is taken as its decimal string. Anything else is `BadRequest`."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    if isinstance(value, str) and _ID.fullmatch(value):
        return value
    raise BadRequest(f"{name} must be an id of 1 to 64 letters, digits, '_' or '-'")


def is_number(text: str, max_digits: int = 18) -> bool:
    """Whether `text` is a whole number in ASCII digits (`str.isdigit` takes "²" and
    other digits `int()` refuses), of at most `max_digits` digits."""
    return len(text) <= max_digits and _DIGITS.fullmatch(text) is not None


class Snowflake:
    def __init__(self, worker: int = 0) -> None:
        self.worker = worker
        #: until when (monotonic) the worker number is known to be this process's alone
        self.valid_until = math.inf
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
        """The next id as a decimal string; `Unavailable` while this process cannot be
        sure its worker number is its own (its lease ran out while the store was
        away: it is being renewed)."""
        if time.monotonic() > self.valid_until:
            raise Unavailable("ids cannot be made until the worker lease is renewed", retry_after=1)
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
        leased_at = time.monotonic()
        self.ids.worker = await self.store.lease_worker(self.token, self.ttl, WORKERS)
        self.ids.valid_until = leased_at + self.ttl * LEASE_MARGIN
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
            # renew at a quarter of the lease; once it has run out, every second
            expired = time.monotonic() > self.ids.valid_until
            await asyncio.sleep(1.0 if expired else self.ttl / 4)
            try:
                renewed_at = time.monotonic()
                if not await self.store.renew_worker(self.ids.worker, self.token, self.ttl):
                    old = self.ids.worker
                    self.ids.worker = await self.store.lease_worker(self.token, self.ttl, WORKERS)
                    log.warning("worker number %d was lost; now %d", old, self.ids.worker)
                self.ids.valid_until = renewed_at + self.ttl * LEASE_MARGIN
            except Exception as exc:  # any failure: keep trying; ids stop while it runs out
                log.warning("worker lease not renewed: %r", exc)
