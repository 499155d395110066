"""Registry of in-flight generations and their event logs; backend chosen by URL."""

from __future__ import annotations

from .base import GenerationLog, Handle, StreamHub


def open_hub(url: str, *, replay_ttl: float, process: str, **redis_options: float) -> StreamHub:
    """`memory://` (or empty) for one process, `redis://…` / `rediss://…` for many.

    `redis_options` (handle_ttl, flush_interval, max_generation_seconds) tune
    the Redis hub. Raises ValueError for another scheme.
    """
    scheme = url.partition(":")[0].lower() if url else "memory"
    if scheme == "memory":
        from .memory import MemoryHub

        return MemoryHub(replay_ttl=replay_ttl, process=process)
    if scheme in ("redis", "rediss", "unix"):
        from .redis import RedisHub

        return RedisHub(url, replay_ttl=replay_ttl, process=process, **redis_options)
    raise ValueError(f"unsupported redis URL {url!r}: use redis:// or leave it empty")


__all__ = ["GenerationLog", "Handle", "StreamHub", "open_hub"]
