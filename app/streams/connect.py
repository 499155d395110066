"""Redis clients for the hub and its neighbours: one Redis, a Redis Cluster, or the
master of a group that Redis Sentinel watches over."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from redis.exceptions import RedisError

#: connections per node of a cluster client that waits on Redis (XREAD BLOCK, pub/sub):
#: one per remote follower, so as many as Redis takes by default (`maxclients`)
BLOCKING_CONNECTIONS = 10_000
#: how often a waiting client's unused connections are closed (`shed_idle_every`)
SHED_SECONDS = 60.0


def open_redis(
    url: str, *, timeout: float = 2.0, max_connections: int = 64, cluster: bool = False
) -> Any:
    """A Redis client for `redis://`, `rediss://` or `unix://` URLs — a `RedisCluster`
    when `cluster` (the URL names any node of it) —, or for the master that Redis
    Sentinel names (`redis+sentinel://[user:password@]host:port[,host:port…]/service[/db]`,
    optionally `?sentinel_password=…`); None for an empty URL or `memory://` (one
    process). Raises ValueError for another scheme. The caller closes it with
    `close_redis`.

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
    if scheme not in ("redis", "rediss", "unix", "redis+sentinel"):
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
    if scheme == "redis+sentinel":
        if cluster:
            raise ValueError("redis.cluster and a redis+sentinel:// URL: choose one")
        return _sentinel_master(url, timeout, options)
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


def _sentinel_master(url: str, timeout: float, options: dict[str, Any]) -> Any:
    """A client of the master the sentinels of `url` name: each new connection asks
    them where it is (after a failover, the promoted replica). Its pool waits for a
    free connection as one Redis's does."""
    import redis.asyncio as aioredis
    from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

    class WaitingPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
        """A sentinel's pool that waits (`timeout`) for a connection at its limit."""

    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    sentinels = []
    for address in hosts.split(","):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"a sentinel address is host:port, not {address!r}")
        sentinels.append((host.strip("[]"), int(port)))
    service, _, db = parts.path.strip("/").partition("/")
    if not service:
        raise ValueError("a redis+sentinel:// URL names the service: …/mymaster")
    query = {name: values[-1] for name, values in parse_qs(parts.query).items()}
    unknown = set(query) - {"sentinel_password"}
    if unknown:
        raise ValueError(f"unknown redis+sentinel:// options: {', '.join(sorted(unknown))}")
    sentinel_options: dict[str, Any] = {
        "protocol": 2,
        "socket_timeout": None,
        "socket_connect_timeout": timeout,
    }
    if "sentinel_password" in query:
        sentinel_options["password"] = query["sentinel_password"]
    master: dict[str, Any] = {**options, "db": int(db or 0)}
    if username:
        master["username"] = unquote(username)
    if password:
        master["password"] = unquote(password)
    watchers = Sentinel(sentinels, sentinel_kwargs=sentinel_options, **master)  # type: ignore[no-untyped-call, unused-ignore]
    return watchers.master_for(
        service, connection_pool_class=WaitingPool, timeout=timeout, health_check_interval=15
    )


def is_sentinel(redis: Any) -> bool:
    from redis.asyncio.sentinel import SentinelConnectionPool

    return isinstance(getattr(redis, "connection_pool", None), SentinelConnectionPool)


def blocking_client(redis: Any) -> Any:
    """A client on connections of its own, with the same address(es) and options as
    `redis`, for reads that wait on Redis (XREAD BLOCK, pub/sub) — one connection per
    waiting reader, as many as they need; each wait is bounded by the caller (see
    `open_redis` on why not by a socket timeout). The caller closes it with
    `close_redis`."""
    import redis.asyncio as aioredis

    if is_cluster(redis):
        return cluster_client(redis)
    pool = redis.connection_pool
    options = dict(pool.connection_kwargs)
    options["socket_timeout"] = None
    if is_sentinel(redis):
        from redis.asyncio.sentinel import Sentinel

        del options["connection_pool"]  # the pool itself, set by the pool
        watchers = pool.sentinel_manager
        addresses = [
            (
                s.connection_pool.connection_kwargs["host"],
                s.connection_pool.connection_kwargs["port"],
            )
            for s in watchers.sentinels
        ]
        own = Sentinel(addresses, sentinel_kwargs=watchers.sentinel_kwargs, **options)  # type: ignore[no-untyped-call, unused-ignore]
        return own.master_for(pool.service_name)
    waiting = aioredis.ConnectionPool(connection_class=pool.connection_class, **options)
    return aioredis.Redis.from_pool(waiting)


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


async def shed_idle(redis: Any) -> None:
    """Close the connections of a client that wait unused in its pool (of every node,
    for a cluster): redis-py's pools never close one, so a client for reads that wait
    (one connection per waiting reader) would keep as many sockets as it ever had
    readers at once. They stay in the pool and connect again when next taken."""
    if is_cluster(redis):
        nodes = list(redis.nodes_manager.nodes_cache.values())
        await asyncio.gather(
            *(node.disconnect_free_connections() for node in nodes), return_exceptions=True
        )
        return
    await redis.connection_pool.disconnect(inuse_connections=False)


async def shed_idle_every(redis: Any, timeout: float, seconds: float = SHED_SECONDS) -> None:
    """Every `seconds`, `shed_idle` (a client for reads that wait held a connection per
    waiting reader: a worker that once followed hundreds of answers does not keep
    their sockets); a failure is let go, the next comes."""
    while True:
        await asyncio.sleep(seconds)
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(timeout):
                await shed_idle(redis)


async def close_redis(redis: Any) -> None:
    """Close a client from `open_redis` or `blocking_client`, every connection of it.
    redis-py's `RedisCluster.aclose` does nothing while a failed call has left the
    client to be initialised again, and never closes nodes it no longer lists; so
    every node known here (the slot map's and the startup nodes) is disconnected
    too, and what the client still had running to disconnect is waited for."""
    if redis is None:
        return
    if is_sentinel(redis):  # and the clients that ask the sentinels
        await redis.aclose()
        await redis.connection_pool.sentinel_manager.aclose()
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
