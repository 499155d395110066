"""Where `/mcp` keeps its sessions and its running tool calls: in Redis when the
deployment has one (any worker serves any session), else in this process.

A session is its owner's id under a random token, forgotten after
`idle_seconds` without a request. A call is what a tool call that follows an
answer needs to be cancelled or resumed from another request — the JSON-RPC
id, the progress token, the chat and the answer — kept under (session, stream)
for as long as the answer's events are (`keep_seconds`). Both backends bound
what they hold: Redis by the keys' TTLs, memory by the TTLs and `max_sessions`
(the oldest session goes first).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson

if TYPE_CHECKING:
    import redis.asyncio as aioredis

#: an MCP session without a request for this long is gone (its id answers 404)
IDLE_SECONDS = 30 * 60.0
#: sessions one process keeps without Redis; past it the least recently used goes
MAX_SESSIONS = 10_000


@dataclass(frozen=True, slots=True)
class Call:
    """A tool call that follows an answer: enough to resume its stream or cancel it."""

    id: int | str  # the JSON-RPC id, as the client sent it
    token: int | str | None  # its progress token
    tool: str
    chat_id: str
    answer_id: str


class Sessions(Protocol):
    async def open(self, user_id: str) -> str:
        """A new session of `user_id`: its id."""

    async def owner(self, session_id: str) -> str | None:
        """The session's user, and its idle time restarted; None when unknown or expired."""

    async def close(self, session_id: str) -> None: ...

    async def remember(self, session_id: str, stream: str, call: Call) -> None: ...

    async def call(self, session_id: str, stream: str) -> Call | None: ...


def new_session_id() -> str:
    return secrets.token_urlsafe(24)


class MemorySessions:
    """One process's sessions (no Redis: there is one worker)."""

    def __init__(
        self,
        *,
        idle_seconds: float = IDLE_SECONDS,
        keep_seconds: float = 300.0,
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        self.idle_seconds = idle_seconds
        self.keep_seconds = keep_seconds
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._calls: OrderedDict[tuple[str, str], tuple[Call, float]] = OrderedDict()

    def _expire(self, now: float) -> None:
        for table in (self._sessions, self._calls):
            while table:
                key, (_, until) = next(iter(table.items()))
                if until > now and len(table) <= self.max_sessions:
                    break
                del table[key]  # type: ignore[arg-type]

    async def open(self, user_id: str) -> str:
        now = time.monotonic()
        session_id = new_session_id()
        self._sessions[session_id] = (user_id, now + self.idle_seconds)
        self._expire(now)
        return session_id

    async def owner(self, session_id: str) -> str | None:
        now = time.monotonic()
        found = self._sessions.get(session_id)
        if found is None or found[1] <= now:
            return None
        self._sessions[session_id] = (found[0], now + self.idle_seconds)
        self._sessions.move_to_end(session_id)
        return found[0]

    async def close(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    async def remember(self, session_id: str, stream: str, call: Call) -> None:
        now = time.monotonic()
        self._calls[(session_id, stream)] = (call, now + self.keep_seconds)
        self._calls.move_to_end((session_id, stream))
        self._expire(now)

    async def call(self, session_id: str, stream: str) -> Call | None:
        found = self._calls.get((session_id, stream))
        return found[0] if found is not None and found[1] > time.monotonic() else None


class RedisSessions:
    """Sessions every worker sees: one key per session and per call, each with its TTL."""

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        idle_seconds: float = IDLE_SECONDS,
        keep_seconds: float = 300.0,
    ) -> None:
        self.redis = redis
        self.idle = max(1, round(idle_seconds))
        self.keep = max(1, round(keep_seconds))

    @staticmethod
    def _session(session_id: str) -> str:
        return f"mcp:session:{session_id}"

    @staticmethod
    def _call(session_id: str, stream: str) -> str:
        return f"mcp:call:{session_id}:{stream}"

    async def open(self, user_id: str) -> str:
        session_id = new_session_id()
        await self.redis.set(self._session(session_id), user_id, ex=self.idle)
        return session_id

    async def owner(self, session_id: str) -> str | None:
        user: Any = await self.redis.getex(self._session(session_id), ex=self.idle)
        if user is None:
            return None
        return user.decode() if isinstance(user, bytes) else str(user)

    async def close(self, session_id: str) -> None:
        await self.redis.delete(self._session(session_id))

    async def remember(self, session_id: str, stream: str, call: Call) -> None:
        await self.redis.set(
            self._call(session_id, stream), orjson.dumps(asdict(call)), ex=self.keep
        )

    async def call(self, session_id: str, stream: str) -> Call | None:
        raw: Any = await self.redis.get(self._call(session_id, stream))
        return None if raw is None else Call(**orjson.loads(raw))


def open_sessions(redis: aioredis.Redis | None, *, keep_seconds: float) -> Sessions:
    """Redis's sessions when there is one, else this process's."""
    if redis is not None:
        return RedisSessions(redis, keep_seconds=keep_seconds)
    return MemorySessions(keep_seconds=keep_seconds)
