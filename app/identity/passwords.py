"""Passwords, hashed with Argon2id (argon2-cffi's defaults: RFC 9106's low-memory
profile), off the event loop. A password is never logged and never leaves here."""

from __future__ import annotations

import asyncio

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

#: the shortest password a sign-up may choose (PROTOCOL §7)
MIN_LENGTH = 10
MAX_LENGTH = 1024
#: hashes computed at once: each takes ~64 MiB and most of a core for a moment
CONCURRENT = 2


class Passwords:
    def __init__(self, hasher: PasswordHasher | None = None) -> None:
        self._hasher = hasher or PasswordHasher()
        self._slots = asyncio.Semaphore(CONCURRENT)
        self._dummy: str | None = None

    async def hash(self, password: str) -> str:
        async with self._slots:
            return await asyncio.to_thread(self._hasher.hash, password)

    async def verify(self, stored: str | None, password: str) -> bool:
        """Whether `password` is the one `stored` was made from. With no `stored` hash
        (an unknown email) a hash is still checked, so the answer takes as long and
        says nothing about which emails have accounts."""
        if self._dummy is None:
            self._dummy = await self.hash("not a password of anyone")
        async with self._slots:
            try:
                return (
                    await asyncio.to_thread(self._hasher.verify, stored or self._dummy, password)
                    and stored is not None
                )
            except (VerifyMismatchError, VerificationError, InvalidHashError):
                return False
