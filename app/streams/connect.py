"""Redis clients for the hub and its neighbours: one Redis, or a Redis Cluster."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit


def open_redis(
    url: str, *, timeout: float = 2.0, max_connections: int = 64, cluster: bool = False
) -> Any:
    """A Redis client for `redis://`, `rediss://` or `unix://` URLs — a `RedisCluster`
    when `cluster` (the URL names any node of it) —; None for an empty URL or
    `memory://` (one process). Raises ValueError for another scheme. The caller
    closes it.

    Connecting takes at most `timeout` seconds, and a call waits at most as long for
    one of the pool's `max_connections` (per node, for a cluster); each call's
    answer is bounded by its caller (`asyncio.timeout`), so a Redis that stops
    answering (a failover to a new address, a partition) fails like one that refuses
    instead of holding its callers until the kernel gives up. Not by a socket
    timeout: redis-py enforces that with `asyncio.wait_for`, and a call cancelled
    while such a wait starts can then hang for good on Python 3.11 (measured: 1
    cancel in ~50–120)."""
    scheme = url.partition(":")[0].lower() if url else "memory"
    if scheme == "memory":
        return None
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"unsupported redis URL {url!r}: use redis:// or leave it empty")
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    # one attempt per call on one Redis: a retry here would multiply every deadline,
    # and the callers retry (or answer 503) themselves
    options: dict[str, Any] = {
        "protocol": 2,
        "socket_timeout": None,
        "socket_connect_timeout": timeout,
        "socket_keepalive": True,
        "max_connections": max_connections,
        "retry": Retry(NoBackoff(), 0),
    }
    if cluster:
        if scheme == "unix":
            raise ValueError("a Redis Cluster is reached over TCP: use redis:// or rediss://")
        parts = urlsplit(url)
        if parts.path.strip("/") not in ("", "0"):
            raise ValueError("a Redis Cluster has database 0 only: leave the URL's path empty")
        # one retry: a call that meets a failed master reads the slot map again and
        # goes to the replica that took over (the caller's deadline still bounds both)
        options["retry"] = Retry(NoBackoff(), 1)
        return aioredis.RedisCluster.from_url(
            parts._replace(path="").geturl(), reinitialize_steps=1, **options
        )
    pool = aioredis.BlockingConnectionPool.from_url(
        url, health_check_interval=15, timeout=timeout, **options
    )
    return aioredis.Redis.from_pool(pool)


def cluster_client(redis: Any) -> Any:
    """Another client on the cluster `redis` is on, with connections of its own."""
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import ClusterNode

    kwargs = dict(redis.connection_kwargs)
    known = redis.get_nodes() or list(redis.nodes_manager.startup_nodes.values())
    nodes = [ClusterNode(node.host, node.port) for node in known]
    keep = ("username", "password", "socket_connect_timeout", "socket_keepalive", "protocol")
    return aioredis.RedisCluster(
        startup_nodes=nodes,
        reinitialize_steps=1,
        retry=redis.retry,
        max_connections=kwargs.get("max_connections", 64),
        socket_timeout=None,
        ssl=kwargs.get("connection_class") is aioredis.SSLConnection,
        **{name: kwargs[name] for name in keep if name in kwargs},
    )


def is_cluster(redis: Any) -> bool:
    import redis.asyncio as aioredis

    return isinstance(redis, aioredis.RedisCluster)
