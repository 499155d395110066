"""Daily token quotas (PROTOCOL §7, `limits.tokens_per_day`, per user overridable by an
admin): what a user's answers used today (UTC), as the store's usage records it, is
checked before a request starts any model work."""

from __future__ import annotations

import math
import time

from ..errors import RateLimited
from ..store import Store
from .user import User

DAY = 86400


def next_midnight(now: float) -> float:
    """The next 00:00 UTC after `now` (Unix seconds)."""
    return (math.floor(now / DAY) + 1) * DAY


class Quota:
    def __init__(self, store: Store, tokens_per_day: int) -> None:
        self.store = store
        self.default = tokens_per_day

    def limit(self, user: User) -> int:
        return user.tokens_per_day if user.tokens_per_day is not None else self.default

    async def used_today(self, user_id: str, now: float | None = None) -> int:
        now = time.time() if now is None else now
        rows = await self.store.usage(user_id, next_midnight(now) - DAY)
        return sum(row.total_tokens for row in rows)

    async def check(self, user: User) -> None:
        """`RateLimited` (with `retry_after` until midnight UTC) once the user's answers
        today used their quota; nothing when they have none (0)."""
        limit = self.limit(user)
        if limit <= 0:
            return
        now = time.time()
        used = await self.used_today(user.id, now)
        if used >= limit:
            retry = max(1, math.ceil(next_midnight(now) - now))
            raise RateLimited(
                f"daily token quota reached ({used} of {limit} tokens today);"
                " it resets at midnight UTC",
                retry_after=retry,
            )
