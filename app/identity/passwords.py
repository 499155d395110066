"""Passwords, hashed with Argon2id (argon2-cffi's defaults: RFC 9106's low-memory
profile), off the event loop. A password is never logged and never leaves here.

`CONCURRENT` hashes run at once; past `MAX_WAITING` waiting for a turn, a sign-up or
sign-in is refused at once (`Unavailable`, 503 with `Retry-After`) instead of
queueing behind a flood for ever longer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

from ..errors import Unavailable

#: the shortest password a sign-up may choose (PROTOCOL §7)
MIN_LENGTH = 10
MAX_LENGTH = 1024
#: hashes computed at once: each takes ~64 MiB and most of a core for a moment
CONCURRENT = 2
#: hashes that may wait for a turn (at ~50-100 ms each, about a second's worth)
MAX_WAITING = 16
RETRY_SECONDS = 2


class Passwords:
    def __init__(
        self, hasher: PasswordHasher | None = None, *, max_waiting: int = MAX_WAITING
    ) -> None:
        self._hasher = hasher or PasswordHasher()
        self._slots = asyncio.Semaphore(CONCURRENT)
        self._dummy: str | None = None
        self.max_waiting = max_waiting
        self._waiting = 0
        self.hashed = 0  # hashes computed or checked (for tests and metrics)

    @asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        if self._slots.locked() and self._waiting >= self.max_waiting:
            raise Unavailable(
                "the server is busy checking passwords; try again in a moment",
                retry_after=RETRY_SECONDS,
            )
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            self.hashed += 1
            yield
        finally:
            self._slots.release()

    async def hash(self, password: str) -> str:
        async with self._turn():
            return await asyncio.to_thread(self._hasher.hash, password)

    async def verify(self, stored: str | None, password: str) -> bool:
        """Whether `password` is the one `stored` was made from. With no `stored` hash
        (an unknown email) a hash is still checked, so the answer takes as long and
        says nothing about which emails have accounts."""
        if self._dummy is None:
            self._dummy = await self.hash("not a password of anyone")
        async with self._turn():
            try:
                return (
                    await asyncio.to_thread(self._hasher.verify, stored or self._dummy, password)
                    and stored is not None
                )
            except (VerifyMismatchError, VerificationError, InvalidHashError):
                return False
