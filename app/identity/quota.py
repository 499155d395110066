"""Daily token quotas (PROTOCOL §7, `limits.tokens_per_day`, per user overridable by an
admin): what a user's answers used today (UTC) is checked before a request starts any
model work. The count is the store's per-user, per-day tally (`Store.tokens_on`),
added to as each answer's usage is saved and never lowered: deleting a chat,
regenerating an answer or a `/v1/responses` answer that is not stored gives nothing
back."""

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


def today(now: float) -> int:
    """The UTC day of `now`, as days since 1970 (how the store counts them)."""
    return math.floor(now / DAY)


class Quota:
    def __init__(self, store: Store, tokens_per_day: int) -> None:
        self.store = store
        self.default = tokens_per_day

    def limit(self, user: User) -> int:
        return user.tokens_per_day if user.tokens_per_day is not None else self.default

    async def used_today(self, user_id: str, now: float | None = None) -> int:
        now = time.time() if now is None else now
        return await self.store.tokens_on(today(now), user_id)

    async def used_today_by_user(self, now: float | None = None) -> dict[str, int]:
        """`used_today` of every user who used any."""
        return await self.store.tokens_by_user(today(time.time() if now is None else now))

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
