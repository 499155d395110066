from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from redis.crc import key_slot

from app.config import Settings
from app.main import create_app
from tests.fakes.model import FakeModel
from tests.fakes.search import FakeSearch
from tests.servers import ServerThread, free_port, serve, wait_for_port


async def _as_user(request: httpx.Request) -> None:
    if "userId" not in request.url.params:
        request.url = request.url.copy_add_param("userId", "1")


#: event hooks of an httpx client that acts as user "1", the user `chat_body` names:
#: auth is off, so a request names its user in the query (PROTOCOL §7)
USER: dict[str, Any] = {"request": [_as_user]}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def fake_model_server() -> Iterator[tuple[FakeModel, ServerThread]]:
    model = FakeModel()
    with serve(model.app()) as server:
        yield model, server


@pytest.fixture
def fake_model(fake_model_server: tuple[FakeModel, ServerThread]) -> FakeModel:
    model, _ = fake_model_server
    model.reset()
    return model


@pytest.fixture
def model_url(fake_model_server: tuple[FakeModel, ServerThread], fake_model: FakeModel) -> str:
    return fake_model_server[1].url + "/v1"


@pytest.fixture(scope="session")
def fake_search_server() -> Iterator[tuple[FakeSearch, ServerThread]]:
    search = FakeSearch()
    with serve(search.app()) as server:
        search.base_url = server.url
        yield search, server


@pytest.fixture
def fake_search(fake_search_server: tuple[FakeSearch, ServerThread]) -> FakeSearch:
    search, _ = fake_search_server
    search.reset()
    return search


@pytest.fixture
def settings(tmp_path: Path, model_url: str, fake_search: FakeSearch) -> Settings:
    base = fake_search.base_url
    return Settings().replace(
        llm={
            "base_url": model_url,
            "api_key": "test-key",
            "model": "fake-chat",
            "small_model": "fake-small",
        },
        embeddings={"base_url": model_url, "api_key": "test-key", "model": "fake-embed"},
        store={"url": f"sqlite:///{tmp_path}/chat.db"},
        collections={"url": f"tantivy:///{tmp_path}/collections"},
        server={"keepalive_seconds": 15.0, "shutdown_grace_seconds": 2.0},
        search={"provider": "tavily", "max_results": 8, "timeout_seconds": 10.0},
        tavily={"api_key": fake_search.api_key, "base_url": base + "/tavily"},
        searxng={"url": base + "/searxng"},
        google={"api_key": fake_search.api_key, "cse_id": "cx1", "base_url": base + "/google"},
        reader={"provider": "jina", "base_url": base + "/jina", "timeout_seconds": 5.0},
    )


@pytest.fixture
def server(settings: Settings) -> Iterator[ServerThread]:
    with serve(create_app(settings)) as running:
        yield running


@pytest.fixture
async def client(server: ServerThread) -> AsyncIterator[httpx.AsyncClient]:
    """A client acting as user "1" (the user `chat_body` names): auth is off, so a
    GET names its user in the query (PROTOCOL §7)."""
    async with httpx.AsyncClient(base_url=server.url, timeout=10, event_hooks=USER) as http:
        yield http


class RedisServer:
    """A real redis-server on a loopback port (a free one by default); it can be
    stopped and started again on the same port, empty (no persistence)."""

    def __init__(self, port: int | None = None, args: tuple[str, ...] = ()) -> None:
        self.args = args
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.fail("redis-server is not installed: run `bash scripts/test.sh`")
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="redistest-")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
            + ["--save", "", "--appendonly", "no", "--dir", self.dir, *self.args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def start_redis(port: int | None = None) -> Iterator[str]:
    """A real redis-server on a loopback port (a free one by default), stopped on exit."""
    with RedisServer(port) as server:
        yield server.url


@pytest.fixture
def hour_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rate limiter's windows an hour long for this test. They are fixed minutes:
    calls either side of a minute's end fall in two windows, each under the limit."""
    monkeypatch.setattr("app.auth.WINDOW_SECONDS", 3600)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    with start_redis() as url:
        yield url


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The shared Redis, emptied for this test."""
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    return redis_server


class RedisCluster:
    """A real Redis Cluster on loopback: `masters` nodes, each with `replicas`
    replicas, on free ports, no persistence. `url` names its first node (any node
    would do); `nodes` can be stopped (`kill`) and started again to test failovers."""

    def __init__(self, masters: int = 3, replicas: int = 0) -> None:
        self.nodes = [
            RedisServer(
                port=_cluster_port(),
                args=("--cluster-enabled", "yes", "--cluster-node-timeout", "1000")
                + ("--cluster-config-file", "nodes.conf")
                + ("--cluster-replica-validity-factor", "0")
                # a replica's first sync starts at once, not 5 s later
                + ("--repl-diskless-sync-delay", "0"),
            )
            for _ in range(masters * (replicas + 1))
        ]
        self.replicas = replicas
        self.url = self.nodes[0].url

    def start(self) -> RedisCluster:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses]
            + ["--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.wait_ok()
        return self

    def wait_ok(self, timeout: float = 30) -> None:
        """Until every live node says the cluster is ok and knows every slot's master."""
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for node in self.nodes:
                if node.proc is None:
                    continue
                with contextlib.suppress(redis.RedisError, OSError):
                    client = redis.Redis(port=node.port, socket_timeout=1)
                    try:
                        states.append(client.cluster("info")["cluster_state"])
                    finally:
                        client.close()
            if states and all(state == "ok" for state in states):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster is not ok: {states}")
            time.sleep(0.1)

    def masters(self) -> list[RedisServer]:
        """The live nodes that serve slots now."""
        out = []
        for node in self.nodes:
            if node.proc is None:
                continue
            client = redis.Redis(port=node.port, socket_timeout=1)
            try:
                if client.info("replication")["role"] == "master":
                    out.append(node)
            finally:
                client.close()
        return out

    def node_of(self, key: str) -> RedisServer:
        """The master that serves `key` now."""
        for node in self.masters():
            client = redis.Redis(port=node.port, socket_timeout=1)
            try:
                slot = client.cluster("keyslot", key)
                if any(first <= slot <= last for first, last in _own_slots(client)):
                    return node
            finally:
                client.close()
        raise LookupError(key)

    def ids_on(self, node: RedisServer, key: Callable[[str], str], count: int = 1) -> list[str]:
        """`count` ids whose `key(id)` the master `node` serves now."""
        client = redis.Redis(port=node.port, socket_timeout=1)
        try:
            ranges = _own_slots(client)
        finally:
            client.close()
        found = []
        for n in itertools.count(1):
            slot = key_slot(key(str(n)).encode())
            if any(first <= slot <= last for first, last in ranges):
                found.append(str(n))
                if len(found) == count:
                    return found
        raise AssertionError("unreachable")

    def replica_of(self, master: RedisServer) -> RedisServer:
        client = redis.Redis(port=master.port, socket_timeout=1)
        try:
            replicas = client.info("replication")
        finally:
            client.close()
        port = int(replicas["slave0"]["port"])
        return next(node for node in self.nodes if node.port == port)

    def kill(self, master: RedisServer) -> RedisServer:
        """Kill `master` outright and wait until its replica serves its slots (the
        cluster ok again); the replica."""
        replica = self.replica_of(master)
        assert master.proc is not None
        master.proc.kill()
        master.proc.wait()
        master.proc = None
        deadline = time.monotonic() + 30
        while replica not in self.masters():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no replica of {master.port} took over")
            time.sleep(0.1)
        self.wait_ok()
        return replica

    def revive(self, node: RedisServer) -> None:
        """Start a killed node again: it rejoins as a replica of the one that took over
        its slots, once it has its data."""
        node.start()
        deadline = time.monotonic() + 30
        while True:
            client = redis.Redis(port=node.port, socket_timeout=1)
            try:
                info = client.info("replication")
            except (redis.RedisError, OSError):
                info = {}
            finally:
                client.close()
            if info.get("role") == "slave" and info.get("master_link_status") == "up":
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{node.port} did not come back as a replica: {info}")
            time.sleep(0.1)
        self.wait_ok()

    def flush(self) -> None:
        for node in self.masters():
            client = redis.Redis(port=node.port, socket_timeout=2)
            try:
                client.flushall()
            finally:
                client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
            shutil.rmtree(node.dir, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _cluster_port() -> int:
    """A free port whose cluster bus port (10000 above it) is free too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _own_slots(client: redis.Redis) -> list[tuple[int, int]]:
    """The slot ranges served by the node `client` talks to."""
    for node in client.cluster("nodes").values():
        if "myself" in node["flags"]:
            return [(int(first), int(last)) for first, last in node["slots"]]
    return []


@pytest.fixture(scope="session")
def redis_cluster_server() -> Iterator[RedisCluster]:
    with RedisCluster() as cluster:
        yield cluster


@pytest.fixture
def redis_cluster(redis_cluster_server: RedisCluster) -> RedisCluster:
    """The shared three-master Redis Cluster, emptied for this test."""
    redis_cluster_server.flush()
    return redis_cluster_server


@pytest.fixture(scope="session")
def replicated_cluster_server() -> Iterator[RedisCluster]:
    with RedisCluster(replicas=1) as cluster:
        yield cluster


@pytest.fixture
def replicated_cluster(replicated_cluster_server: RedisCluster) -> Iterator[RedisCluster]:
    """A shared three-master Redis Cluster with a replica each, emptied for this test,
    for failovers: a master the test `kill`s is revived as a replica afterwards."""
    cluster = replicated_cluster_server
    cluster.flush()
    yield cluster
    for node in cluster.nodes:
        if node.proc is None:
            cluster.revive(node)


class RedisSentinelGroup:
    """A real Redis master with a replica, watched by a real Redis Sentinel (quorum
    1), on loopback; `url` names the sentinel and the service, as the server is
    configured. The master can be killed (`kill`): the sentinel promotes the replica."""

    SERVICE = "main"

    def __init__(self) -> None:
        self.master = RedisServer()
        self.replica = RedisServer(args=("--replicaof", "127.0.0.1", str(self.master.port)))
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="sentineltest-")
        self.url = f"redis+sentinel://127.0.0.1:{self.port}/{self.SERVICE}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisSentinelGroup:
        self.master.start()
        self.replica.start()
        config = Path(self.dir) / "sentinel.conf"  # the sentinel rewrites it
        config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {self.SERVICE} 1000\n"
            f"sentinel failover-timeout {self.SERVICE} 10000\n"
        )
        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", str(config), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port)
        self.wait_for(lambda s: s.sentinel_slaves(self.SERVICE))  # it knows the replica
        return self

    def wait_for(self, found: Callable[[redis.Redis], Any], timeout: float = 30) -> Any:
        """Until `found(sentinel client)` says something true."""
        deadline = time.monotonic() + timeout
        while True:
            client = redis.Redis(port=self.port, socket_timeout=1, decode_responses=True)
            try:
                value = found(client)
            except (redis.RedisError, OSError):
                value = None
            finally:
                client.close()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError("the sentinel did not see it happen")
            time.sleep(0.1)

    def master_port(self) -> int:
        return int(self.wait_for(lambda s: s.sentinel_get_master_addr_by_name(self.SERVICE))[1])

    def kill(self) -> None:
        """Kill the master outright and wait until the sentinel names the replica."""
        assert self.master.proc is not None
        self.master.proc.kill()
        self.master.proc.wait()
        self.master.proc = None
        self.wait_for(
            lambda s: int(s.sentinel_get_master_addr_by_name(self.SERVICE)[1]) == self.replica.port
        )
        client = redis.Redis(port=self.replica.port, socket_timeout=1)
        try:  # and the replica knows it is the master now
            deadline = time.monotonic() + 30
            while client.info("replication")["role"] != "master":
                if time.monotonic() > deadline:
                    raise TimeoutError("the replica was not promoted")
                time.sleep(0.1)
        finally:
            client.close()

    def flush(self) -> None:
        client = redis.Redis(port=self.master_port(), socket_timeout=2)
        try:
            client.flushall()
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None
        for server in (self.master, self.replica):
            server.stop()
            shutil.rmtree(server.dir, ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisSentinelGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def redis_sentinel_server() -> Iterator[RedisSentinelGroup]:
    with RedisSentinelGroup() as group:
        yield group


@pytest.fixture
def redis_sentinel(redis_sentinel_server: RedisSentinelGroup) -> RedisSentinelGroup:
    """The shared Redis master and replica under a Redis Sentinel, emptied for this test."""
    redis_sentinel_server.flush()
    return redis_sentinel_server


def _pg_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    return str(candidates[-1]) if candidates else None


class PostgresServer:
    """A real PostgreSQL (initdb in a temp dir) on a free loopback port; it can be
    stopped and started again on the same port and data."""

    def __init__(self) -> None:
        initdb, self.binary = _pg_binary("initdb"), _pg_binary("postgres")
        if not (initdb and self.binary):
            pytest.fail("PostgreSQL is not installed: run `bash scripts/test.sh`")
        self.dir = Path(tempfile.mkdtemp(prefix="pgtest-"))
        self.as_user: list[str] = []
        if os.geteuid() == 0:  # postgres refuses to run as root
            shutil.chown(self.dir, "postgres", "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        subprocess.run(
            [
                *self.as_user,
                initdb,
                "-D",
                str(self.dir / "data"),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        options = [
            "listen_addresses=127.0.0.1",
            "fsync=off",
            "synchronous_commit=off",
            "full_page_writes=off",
            "max_connections=200",
        ]
        self.proc = subprocess.Popen(
            [
                *self.as_user,
                self.binary,
                "-D",
                str(self.dir / "data"),
                "-p",
                str(self.port),
                "-k",
                str(self.dir),
                *(arg for option in options for arg in ("-c", option)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port, timeout=30)
        # listening is not accepting ("the database system is starting up")
        ready = _pg_binary("pg_isready")
        deadline = time.monotonic() + 30
        while ready and time.monotonic() < deadline:
            probe = [ready, "-q", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres"]
            if subprocess.run(probe, check=False).returncode == 0:
                break
            time.sleep(0.05)

    def stop(self) -> None:
        """Fast shutdown: open sessions are cut, as in a crash-free restart."""
        if self.proc is None:
            return
        pg_ctl = _pg_binary("pg_ctl")
        if pg_ctl:
            subprocess.run(
                [*self.as_user, pg_ctl, "-D", str(self.dir / "data"), "stop", "-m", "fast", "-w"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=30,
            )
        else:
            self.proc.send_signal(signal.SIGINT)
        self.proc.wait(20)
        self.proc = None

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def start_postgres() -> Iterator[str]:
    """A real PostgreSQL on a free loopback port, stopped and removed on exit."""
    server = PostgresServer()
    server.start()
    try:
        yield server.url
    finally:
        server.remove()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    with start_postgres() as url:
        yield url


@pytest.fixture
def postgres_url(postgres_server: str) -> str:
    """A fresh, empty database of the shared server for this test."""
    return new_database(postgres_server)


def new_database(server: str) -> str:
    name = f"t{uuid.uuid4().hex[:12]}"
    asyncio_run_in_thread(_create_database(server, name))
    return f"{server}/{name}"


async def _create_database(server: str, name: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(server + "/postgres")
    try:
        await conn.execute(f"CREATE DATABASE {name}")
    finally:
        await conn.close()


def asyncio_run_in_thread(coro: Any) -> Any:
    """Run a coroutine to completion on a loop of its own (callable from inside a running loop)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


#: the Redis topologies the cross-process tests run on: one Redis, and a three-master
#: Redis Cluster (`@BOTH_TOPOLOGIES` on a test that asks for `topology`)
TOPOLOGIES = ("redis", "cluster")
BOTH_TOPOLOGIES = pytest.mark.parametrize("topology", TOPOLOGIES, indirect=True)


@pytest.fixture
def topology(request: pytest.FixtureRequest) -> dict[str, str]:
    """What points the server at Redis — `REDIS_URL` and `REDIS_CLUSTER` — for one
    Redis (emptied for this test), or (parametrised with "cluster") for a node of
    the shared three-master Redis Cluster (emptied too)."""
    if getattr(request, "param", "redis") == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        return {"REDIS_URL": cluster.url, "REDIS_CLUSTER": "true"}
    return {"REDIS_URL": request.getfixturevalue("redis_url"), "REDIS_CLUSTER": "false"}


@pytest.fixture
def hosts_env(model_url, fake_search, postgres_server, topology):
    """Two "hosts" share one Postgres database and one Redis (or Redis Cluster: see
    `topology`)."""
    return {
        **topology,
        "LLM_BASE_URL": model_url,
        "LLM_API_KEY": "test-key",
        "LLM_MODEL": "fake-chat",
        "STORE_URL": new_database(postgres_server),
        "STREAM_HANDLE_TTL_SECONDS": "3",
        "LIMITS_MAX_CONCURRENT_GENERATIONS": "0",
        "SEARCH_PROVIDER": "tavily",
        "TAVILY_API_KEY": fake_search.api_key,
        "TAVILY_BASE_URL": fake_search.base_url + "/tavily",
    }


@pytest.fixture
def env(hosts_env):
    """Two "hosts" share one Postgres database and one Redis."""
    return hosts_env
