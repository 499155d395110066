"""Sign-in throttling: failed attempts counted per account and per client address in
fixed windows — in Redis when it is configured (every process shares the count), in
this process otherwise. Past either limit a sign-in is refused with `RateLimited`
before its password is even checked."""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from ..auth import REDIS_SECONDS
from ..errors import RateLimited

if TYPE_CHECKING:
    import redis.asyncio as aioredis

#: failed sign-ins allowed per window, per account and per address
PER_ACCOUNT = 5
PER_ADDRESS = 30
WINDOW_SECONDS = 15 * 60


class SignInThrottle:
    def __init__(
        self,
        redis: aioredis.Redis | None = None,
        *,
        per_account: int = PER_ACCOUNT,
        per_address: int = PER_ADDRESS,
        window: float = WINDOW_SECONDS,
    ) -> None:
        self.redis = redis
        self.limits = {"account": per_account, "address": per_address}
        self.window = window
        self._counts: dict[str, int] = {}

    def _keys(self, account: str, address: str) -> dict[str, str]:
        window = int(time.time() // self.window)
        # the email itself is never a key: Redis keys show up in monitoring
        who = hashlib.sha256(account.strip().lower().encode()).hexdigest()[:32]
        return {
            "account": f"sc:signin:account:{who}:{window}",
            "address": f"sc:signin:address:{address}:{window}",
        }

    def _retry_after(self) -> int:
        now = time.time()
        return max(1, math.ceil((now // self.window + 1) * self.window - now))

    async def check(self, account: str, address: str) -> None:
        """RateLimited (with when to try again) when the account or the address has
        failed too often in this window."""
        keys = self._keys(account, address)
        counts = await self._read(list(keys.values()))
        for (kind, limit), count in zip(self.limits.items(), counts, strict=True):
            if count >= limit:
                raise RateLimited(
                    f"too many failed sign-ins for this {kind}; try again later",
                    retry_after=self._retry_after(),
                )

    async def failed(self, account: str, address: str) -> None:
        await self._add(list(self._keys(account, address).values()))

    async def succeeded(self, account: str, address: str) -> None:
        """A right password clears the account's count (not the address's)."""
        key = self._keys(account, address)["account"]
        if self.redis is not None:
            try:
                async with asyncio.timeout(REDIS_SECONDS):
                    await self.redis.delete(key)
                return
            except (RedisError, OSError, TimeoutError):
                pass
        self._counts.pop(key, None)

    async def _read(self, keys: list[str]) -> list[int]:
        if self.redis is not None:
            try:
                # one GET each, not MGET: on a Redis Cluster the keys are in other slots
                async with (
                    asyncio.timeout(REDIS_SECONDS),
                    self.redis.pipeline(transaction=False) as pipe,
                ):
                    for key in keys:
                        pipe.get(key)
                    values = await pipe.execute()
                return [int(v or 0) for v in values]
            except (RedisError, OSError, TimeoutError):
                pass  # Redis is away: this process's own count still holds some back
        return [self._counts.get(key, 0) for key in keys]

    async def _add(self, keys: list[str]) -> None:
        if self.redis is not None:
            try:
                async with (
                    asyncio.timeout(REDIS_SECONDS),
                    self.redis.pipeline(transaction=False) as pipe,
                ):
                    for key in keys:
                        pipe.incr(key)
                        pipe.expire(key, math.ceil(self.window * 2))
                    await pipe.execute()
                return
            except (RedisError, OSError, TimeoutError):
                pass
        if len(self._counts) > 10_000:  # only this window's counts matter
            window = f":{int(time.time() // self.window)}"
            self._counts = {k: v for k, v in self._counts.items() if k.endswith(window)}
        for key in keys:
            self._counts[key] = self._counts.get(key, 0) + 1
