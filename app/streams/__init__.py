"""Registry of in-flight generations and their event logs; backend chosen by URL."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..events import Handle
from .base import GenerationLog, LocalRegistry, LogWriter, StreamHub

if TYPE_CHECKING:
    import redis.asyncio as aioredis


def open_redis(
    url: str, *, timeout: float = 2.0, max_connections: int = 64
) -> aioredis.Redis | None:
    """A Redis client for `redis://`, `rediss://` or `unix://` URLs; None for an empty
    URL or `memory://` (one process). Raises ValueError for another scheme. The
    caller closes it.

    Connecting takes at most `timeout` seconds, and a call waits at most as long for
    one of the pool's `max_connections`; each call's answer is bounded by its
    caller (`asyncio.timeout`), so a Redis that stops answering (a failover to a
    new address, a partition) fails like one that refuses instead of holding its
    callers until the kernel gives up. Not by a socket timeout: redis-py enforces
    that with `asyncio.wait_for`, and a call cancelled while such a wait starts can
    then hang for good on Python 3.11 (measured: 1 cancel in ~50–120)."""
    scheme = url.partition(":")[0].lower() if url else "memory"
    if scheme == "memory":
        return None
    if scheme in ("redis", "rediss", "unix"):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            protocol=2,
            socket_timeout=None,
            socket_connect_timeout=timeout,
            socket_keepalive=True,
            health_check_interval=15,
            max_connections=max_connections,
            timeout=timeout,
            # one attempt per call: a retry here would multiply every deadline, and the
            # callers retry (or answer 503) themselves
            retry=Retry(NoBackoff(), 0),
        )
        return aioredis.Redis.from_pool(pool)
    raise ValueError(f"unsupported redis URL {url!r}: use redis:// or leave it empty")


def open_hub(
    redis: aioredis.Redis | None,
    *,
    replay_ttl: float,
    handle_ttl: float,
    max_generation_seconds: float,
    commit_linger: float = 0.005,
    timeout: float = 2.0,
) -> StreamHub:
    """The Redis hub on `redis` (from `open_redis`), else the one-process memory hub."""
    if redis is None:
        from .memory import MemoryHub

        return MemoryHub(replay_ttl=replay_ttl)
    from .redis import RedisHub

    return RedisHub(
        redis,
        replay_ttl=replay_ttl,
        handle_ttl=handle_ttl,
        max_generation_seconds=max_generation_seconds,
        commit_linger=commit_linger,
        timeout=timeout,
    )


__all__ = [
    "GenerationLog",
    "Handle",
    "LocalRegistry",
    "LogWriter",
    "StreamHub",
    "open_hub",
    "open_redis",
]
