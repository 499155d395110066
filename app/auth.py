"""Who is asking, and how often: API-key auth and per-user rate limits.

Auth is off until `auth.api_keys` maps keys to user ids. Then every `/api/*`
route, both WebSocket paths and `/sources/*` need `Authorization: Bearer <key>`
(WebSocket and `/sources` also accept `?token=`), the key decides the user,
and a request naming another `userId` is refused. Keys are compared in
constant time and never logged.

Rate limits count the requests that start model work (chat requests and
suggestions) per user — per client address when auth is off — in fixed
one-minute windows, in Redis when it is configured (shared by all workers)
and in memory otherwise.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from .errors import Forbidden, RateLimited, Unauthorized

if TYPE_CHECKING:
    import redis.asyncio as aioredis

WINDOW_SECONDS = 60
REDIS_SECONDS = 2.0  # a Redis that does not answer in this long counts as away


class Auth:
    def __init__(self, api_keys: Mapping[str, str]) -> None:
        self._keys = [(key.encode(), user) for key, user in api_keys.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def user_for(self, token: str | None) -> str | None:
        """The user of a key, or None. Every key is compared, in constant time."""
        if not token:
            return None
        given = token.encode()
        found = None
        for key, user in self._keys:
            if hmac.compare_digest(key, given):
                found = user
        return found

    def authenticate(self, authorization: str | None, token: str | None = None) -> str | None:
        """The caller's user id when auth is on (Unauthorized without a valid key);
        None when auth is off."""
        if not self.enabled:
            return None
        bearer = None
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer":
                bearer = value.strip()
        user = self.user_for(bearer or token)
        if user is None:
            raise Unauthorized("a valid API key is needed: Authorization: Bearer <key>")
        return user

    @staticmethod
    def resolve(authenticated: str | None, claimed: str | None) -> str | None:
        """The user a request acts as: the key's user (a different claim is
        Forbidden), else the claimed one."""
        if authenticated is None:
            return claimed
        if claimed is not None and claimed != authenticated:
            raise Forbidden("userId does not match the API key")
        return authenticated


class RateLimiter:
    """Fixed one-minute windows per key; `limit` 0 turns it off."""

    def __init__(self, limit: int, redis: aioredis.Redis | None = None) -> None:
        self.limit = limit
        self.redis = redis  # None: count in this process
        self._counts: dict[tuple[str, int], int] = {}

    async def hit(self, who: str) -> None:
        """Count one request; RateLimited (with retry_after) past the limit."""
        if self.limit <= 0:
            return
        now = time.time()
        window = int(now // WINDOW_SECONDS)
        retry_after = max(1, math.ceil((window + 1) * WINDOW_SECONDS - now))
        count = await self._count(who, window)
        if count > self.limit:
            raise RateLimited(
                f"more than {self.limit} requests a minute; try again in {retry_after} s",
                retry_after=retry_after,
            )

    async def _count(self, who: str, window: int) -> int:
        if self.redis is not None:
            key = f"sc:rate:{who}:{window}"
            try:
                async with asyncio.timeout(REDIS_SECONDS):
                    async with self.redis.pipeline(transaction=False) as pipe:
                        pipe.incr(key)
                        pipe.expire(key, WINDOW_SECONDS * 2)
                        count, _ = await pipe.execute()
                return int(count)
            except (RedisError, OSError, TimeoutError):
                pass  # Redis is away: count in this process rather than refuse everyone
        if len(self._counts) > 10_000:
            self._counts = {k: v for k, v in self._counts.items() if k[1] >= window}
        self._counts[(who, window)] = self._counts.get((who, window), 0) + 1
        return self._counts[(who, window)]
