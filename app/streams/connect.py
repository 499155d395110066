"""Redis clients for the hub and its neighbours: one Redis, or a Redis Cluster."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any
from urllib.parse import urlsplit

from redis.exceptions import RedisError

#: connections per node of a cluster client that waits on Redis (XREAD BLOCK, pub/sub):
#: one per remote follower, so as many as Redis takes by default (`maxclients`)
BLOCKING_CONNECTIONS = 10_000


def open_redis(
    url: str, *, timeout: float = 2.0, max_connections: int = 64, cluster: bool = False
) -> Any:
    """A Redis client for `redis://`, `rediss://` or `unix://` URLs — a `RedisCluster`
    when `cluster` (the URL names any node of it) —; None for an empty URL or
    `memory://` (one process). Raises ValueError for another scheme. The caller
    closes it with `close_redis`.

    Connecting takes at most `timeout` seconds, and a call waits at most as long for
    one of the pool's `max_connections` (per node, for a cluster, whose nodes refuse
    at once instead: redis-py's `MaxConnectionsError`); each call's answer is bounded
    by its caller (`asyncio.timeout`), so a Redis that stops answering (a failover
    to a new address, a partition) fails like one that refuses instead of holding
    its callers until the kernel gives up. Not by a socket timeout: redis-py
    enforces that with `asyncio.wait_for`, and a call cancelled while such a wait
    starts can then hang for good on Python 3.11 (measured: 1 cancel in ~50–120)."""
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
            parts._replace(path="").geturl(), reinitialize_steps=0, **options
        )
    pool = aioredis.BlockingConnectionPool.from_url(
        url, health_check_interval=15, timeout=timeout, **options
    )
    return aioredis.Redis.from_pool(pool)


#: what a cluster client's connections are made with, given again to another client
_KEPT = (
    "username",
    "password",
    "credential_provider",
    "client_name",
    "socket_connect_timeout",
    "socket_keepalive",
    "socket_keepalive_options",
    "protocol",
)


def cluster_client(redis: Any, max_connections: int = BLOCKING_CONNECTIONS) -> Any:
    """Another client on the cluster `redis` is on, with connections of its own (and
    the same credentials and TLS options), at most `max_connections` per node."""
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import ClusterNode

    kwargs = redis.connection_kwargs
    known = redis.get_nodes() or list(redis.nodes_manager.startup_nodes.values())
    nodes = [ClusterNode(node.host, node.port) for node in known]
    kept = {name: kwargs[name] for name in _KEPT if name in kwargs}
    kept.update({name: value for name, value in kwargs.items() if name.startswith("ssl_")})
    return aioredis.RedisCluster(
        startup_nodes=nodes,
        reinitialize_steps=0,
        retry=redis.retry,
        max_connections=max_connections,
        socket_timeout=None,
        ssl=kwargs.get("connection_class") is aioredis.SSLConnection,
        **kept,
    )


def is_cluster(redis: Any) -> bool:
    import redis.asyncio as aioredis

    return isinstance(redis, aioredis.RedisCluster)


async def refresh_cluster(redis: Any) -> None:
    """Read where a cluster's slots are now (a replica may have taken over a failed
    master). Through the client when a failed call left it to be initialised again
    (redis-py then reads the map at the next call anyway, and its flag and its
    connections must agree for `aclose` to close them); else the map alone."""
    if redis._initialize:
        await redis.initialize()
    else:
        await redis.nodes_manager.initialize()


async def close_redis(redis: Any) -> None:
    """Close a client from `open_redis` or `cluster_client`, every connection of it.
    redis-py's `RedisCluster.aclose` does nothing while a failed call has left the
    client to be initialised again, and never closes nodes it no longer lists; so
    every node known here (the slot map's and the startup nodes) is disconnected
    too, and what the client still had running to disconnect is waited for."""
    if redis is None:
        return
    if not is_cluster(redis):
        await redis.aclose()
        return
    with contextlib.suppress(RedisError, OSError):
        await redis.aclose()
    manager = redis.nodes_manager
    nodes = {id(node): node for node in manager.nodes_cache.values()}
    nodes.update((id(node), node) for node in manager.startup_nodes.values())
    pending = [*getattr(manager, "_background_tasks", ())]
    for node in nodes.values():
        pending += getattr(node, "_background_tasks", ())
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    await asyncio.gather(*(node.disconnect() for node in nodes.values()), return_exceptions=True)
