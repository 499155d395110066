"""Registry of in-flight generations and their event logs; backend chosen by URL."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import GenerationLog, Handle, LocalRegistry, LogWriter, StreamHub

if TYPE_CHECKING:
    import redis.asyncio as aioredis


def open_redis(url: str) -> aioredis.Redis | None:
    """A Redis client for `redis://`, `rediss://` or `unix://` URLs; None for an empty
    URL or `memory://` (one process). Raises ValueError for another scheme. The
    caller closes it."""
    scheme = url.partition(":")[0].lower() if url else "memory"
    if scheme == "memory":
        return None
    if scheme in ("redis", "rediss", "unix"):
        import redis.asyncio as aioredis

        return aioredis.from_url(url, protocol=2)
    raise ValueError(f"unsupported redis URL {url!r}: use redis:// or leave it empty")


def open_hub(
    redis: aioredis.Redis | None,
    *,
    replay_ttl: float,
    handle_ttl: float,
    flush_interval: float,
    max_generation_seconds: float,
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
        flush_interval=flush_interval,
        max_generation_seconds=max_generation_seconds,
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
