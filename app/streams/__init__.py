"""Registry of in-flight generations and their event logs; backend chosen by URL."""

from __future__ import annotations

from typing import Any

from ..events import Handle
from .base import GenerationLog, LocalRegistry, LoggedEvents, LogWriter, Push, StreamHub
from .connect import close_redis, open_redis


def open_hub(
    redis: Any,
    *,
    replay_ttl: float,
    handle_ttl: float,
    max_generation_seconds: float,
    commit_linger: float = 0.005,
    timeout: float = 2.0,
) -> StreamHub:
    """The Redis hub on `redis` (from `open_redis`: one Redis or a Cluster, which the
    caller closes with `close_redis`), else the one-process memory hub."""
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
    "LoggedEvents",
    "LogWriter",
    "Push",
    "StreamHub",
    "close_redis",
    "open_hub",
    "open_redis",
]
