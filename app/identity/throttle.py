"""Sign-in and sign-up throttling: attempts counted per account and per client address
in fixed windows — in Redis when it is configured (every process shares the count),
in this process otherwise.

Each attempt is counted first, in one atomic step (Redis `INCR`, or an increment with
no `await` in between), and refused with `RateLimited` when that takes a count past
its limit — before any password is checked (and then taken back: a refused attempt
checked nothing). Checking the counts and adding to them afterwards would let many
attempts sent at once all pass the check before the first one is counted. A right
password takes its attempt back too: the account's count is cleared and the
address's lowered by one, so both count failed passwords only.
"""

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
#: sign-ups (each one tried, made or not) allowed per window from one address
SIGNUPS_PER_ADDRESS = 20
WINDOW_SECONDS = 15 * 60
#: the most counts this process keeps without Redis
MEMORY_KEYS = 10_000


class SignInThrottle:
    def __init__(
        self,
        redis: aioredis.Redis | None = None,
        *,
        per_account: int = PER_ACCOUNT,
        per_address: int = PER_ADDRESS,
        signups_per_address: int = SIGNUPS_PER_ADDRESS,
        window: float = WINDOW_SECONDS,
    ) -> None:
        self.redis = redis
        self.limits = {"account": per_account, "address": per_address}
        self.signups_per_address = signups_per_address
        self.window = window
        self._counts: dict[str, int] = {}

    def _window(self) -> int:
        return int(time.time() // self.window)

    def _keys(self, account: str, address: str) -> dict[str, str]:
        window = self._window()
        # the email itself is never a key: Redis keys show up in monitoring
        who = hashlib.sha256(account.strip().lower().encode()).hexdigest()[:32]
        return {
            "account": f"sc:signin:account:{who}:{window}",
            "address": f"sc:signin:address:{address}:{window}",
        }

    def _retry_after(self) -> int:
        now = time.time()
        return max(1, math.ceil((now // self.window + 1) * self.window - now))

    async def attempt(self, account: str, address: str) -> None:
        """Count one sign-in attempt for the account and the address; `RateLimited`
        (with when to try again) when either has now gone past its limit."""
        keys = self._keys(account, address)
        counts = await self._add(list(keys.values()))
        for (kind, limit), count in zip(self.limits.items(), counts, strict=True):
            if count > limit:
                # refused before any check: not an attempt at the password after all
                await self._add(list(keys.values()), -1)
                raise RateLimited(
                    f"too many failed sign-ins for this {kind}; try again later",
                    retry_after=self._retry_after(),
                )

    async def succeeded(self, account: str, address: str) -> None:
        """A right password: the account's count is cleared, and this attempt is taken
        back from the address's (which keeps counting the failures)."""
        keys = self._keys(account, address)
        if self.redis is not None:
            try:
                async with (
                    asyncio.timeout(REDIS_SECONDS),
                    self.redis.pipeline(transaction=False) as pipe,
                ):
                    pipe.delete(keys["account"])
                    pipe.decr(keys["address"])
                    pipe.expire(keys["address"], math.ceil(self.window * 2))
                    await pipe.execute()
                return
            except (RedisError, OSError, TimeoutError):
                pass
        self._counts.pop(keys["account"], None)
        if self._counts.get(keys["address"], 0) > 0:
            self._counts[keys["address"]] -= 1

    async def sign_up(self, address: str) -> None:
        """Count one sign-up attempt from the address; `RateLimited` past its limit."""
        (count,) = await self._add([f"sc:signup:address:{address}:{self._window()}"])
        if count > self.signups_per_address:  # refused sign-ups count too: a flood is refused
            raise RateLimited(
                "too many sign-ups from this address; try again later",
                retry_after=self._retry_after(),
            )

    async def _add(self, keys: list[str], amount: int = 1) -> list[int]:
        """Add `amount` to each count and return the new counts, each in one atomic step."""
        if self.redis is not None:
            try:
                # one INCRBY each, not a transaction: on a Redis Cluster the keys are in
                # other slots, and each count is atomic on its own
                async with (
                    asyncio.timeout(REDIS_SECONDS),
                    self.redis.pipeline(transaction=False) as pipe,
                ):
                    for key in keys:
                        pipe.incrby(key, amount)
                        pipe.expire(key, math.ceil(self.window * 2))
                    values = await pipe.execute()
                return [int(v) for v in values[0::2]]
            except (RedisError, OSError, TimeoutError):
                pass  # Redis is away: this process's own count still holds some back
        if len(self._counts) > MEMORY_KEYS:  # only this window's counts matter
            window = f":{self._window()}"
            self._counts = {k: v for k, v in self._counts.items() if k.endswith(window)}
        counts = []
        for key in keys:  # no await from here on: nothing runs between count and check
            self._counts[key] = self._counts.get(key, 0) + amount
            counts.append(self._counts[key])
        return counts
