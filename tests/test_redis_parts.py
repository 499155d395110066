"""The Redis hub's parts on their own: the journal's and the heartbeat's bookkeeping
(no I/O), and the claims against a real Redis and a real three-master Redis Cluster."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from redis.asyncio import SSLConnection
from redis.exceptions import RedisError

from app.events import Event, Handle
from app.streams import close_redis, open_redis
from app.streams import rediskeys as keys
from app.streams.base import GenerationLog, Running
from app.streams.beat import Beat, Heartbeat
from app.streams.claims import CLAIMED, RECOVERING, TAKEN, Claims
from app.streams.connect import BLOCKING_CONNECTIONS, blocking_client, cluster_client, shed_idle
from app.streams.follower import follow
from app.streams.journal import Journal, LogWrite
from app.streams.recovery import Recovery
from app.streams.redis import RedisHub
from tests.client import wait_for

pytestmark = pytest.mark.anyio


def event(answer: str, seq: int, kind: str = "message") -> Event:
    return Event(kind, "c" + answer, answer, {"data": str(seq)}, seq)


def logged(write: LogWrite) -> list[int]:
    """The seqs of what a commit writes to an answer's log."""
    return [seq for seq, *_ in orjson.loads(write.dump())]


def test_the_journal_writes_every_generation_in_one_entry_and_logs_when_due():
    journal = Journal(checkpoint=2.0)
    for seq in (1, 2):
        journal.queue("a", event("a", seq))
        journal.queue("b", event("b", seq))
    plan = journal.plan(now=0.0)
    assert plan is not None and not plan.logs
    assert {a: [e.seq for e in b] for a, b in plan.journal.items()} == {"a": [1, 2], "b": [1, 2]}
    assert plan.trim is None and plan.expire_journal
    journal.written(plan, (10, 0), now=0.0)
    assert journal.plan(now=1.0) is None  # nothing new, no log due yet
    journal.queue("a", event("a", 3))
    plan = journal.plan(now=2.5)  # both logs due: what the journal held, and what is new
    assert plan is not None and not plan.journal
    assert {w.answer_id: logged(w) for w in plan.logs} == {
        "a": [1, 2, 3],
        "b": [1, 2],
    }
    assert {w.expire for w in plan.logs} == {"running"}
    journal.written(plan, None, now=2.5)
    journal.queue("b", event("b", 3))
    plan = journal.plan(now=2.6)
    assert plan is not None and plan.trim == (10, 0)  # nothing unlogged: up to the last


def test_the_journal_trims_only_what_earlier_commits_put_in_the_logs():
    journal = Journal(checkpoint=1.0)
    journal.queue("a", event("a", 1))
    first = journal.plan(now=0.0)
    assert first is not None
    journal.written(first, (1, 0), now=0.0)
    journal.queue("a", event("a", 2))
    journal.queue("b", event("b", 1))
    second = journal.plan(now=1.5)  # a's log is due now: the trim keeps its entry
    assert second is not None
    assert [w.answer_id for w in second.logs] == ["a"] and list(second.journal) == ["b"]
    assert second.trim == (1, 0)
    journal.written(second, (2, 0), now=1.5)
    journal.queue("b", event("b", 2))
    third = journal.plan(now=1.6)
    assert third is not None and third.trim == (2, 0)  # a's entry may go now


def test_a_followed_generation_goes_to_its_log_at_every_commit():
    journal = Journal(checkpoint=10.0)
    journal.queue("a", event("a", 1))
    plan = journal.plan(now=0.0)
    assert plan is not None
    journal.written(plan, (1, 0), now=0.0)
    assert journal.watch("a", until=6.0)  # its journal part must reach its log now
    plan = journal.plan(now=0.1)
    assert plan is not None and [w.answer_id for w in plan.logs] == ["a"]
    assert logged(plan.logs[0]) == [1]
    journal.written(plan, None, now=0.1)
    journal.queue("a", event("a", 2))
    plan = journal.plan(now=0.2)
    assert plan is not None and not plan.journal and plan.logs[0].expire == ""
    journal.written(plan, None, now=0.2)
    journal.queue("a", event("a", 3))
    plan = journal.plan(now=7.0)  # no longer followed: the journal again
    assert plan is not None and not plan.logs and list(plan.journal) == ["a"]


def test_a_failed_commit_puts_its_events_back_in_front():
    journal = Journal(checkpoint=2.0)
    journal.queue("a", event("a", 1))
    plan = journal.plan(now=0.0)
    assert plan is not None
    journal.queue("a", event("a", 2))
    journal.failed(plan)
    assert [e.seq for e in journal.pending["a"]] == [1, 2]


def test_an_end_is_written_to_its_log_with_the_replay_expiry():
    journal = Journal(checkpoint=2.0)
    journal.queue("a", event("a", 1))
    plan = journal.plan(now=0.0)
    assert plan is not None
    journal.written(plan, (1, 0), now=0.0)
    journal.queue("a", event("a", 2, "messageEnd"))
    plan = journal.plan(now=0.1, only="a")
    assert plan is not None and plan.logs[0].expire == "replay"
    assert logged(plan.logs[0]) == [1, 2] and not plan.journal


def test_what_waits_for_its_log_is_kept_as_the_journal_wrote_it():
    journal = Journal(checkpoint=2.0)
    first = [Event("message", "ca", "a", {"data": f"é{seq}\u2028"}, seq) for seq in (1, 2)]
    for e in first:
        journal.queue("a", e)
    plan = journal.plan(now=0.0)
    assert plan is not None
    fields = plan.encode()
    assert fields == {"a": keys.dump_events(first)}
    journal.written(plan, (1, 0), now=0.0)
    # kept as the entry's bytes, encoded once: no event objects wait for the log
    assert journal.unlogged == {"a": [fields["a"]]}
    second = [event("a", 3)]
    journal.queue("a", second[0])
    plan = journal.plan(now=0.5)
    assert plan is not None and not plan.logs
    journal.written(plan, (2, 0), now=0.5)
    assert all(isinstance(part, bytes) for part in journal.unlogged["a"])
    journal.queue("a", event("a", 4, "messageEnd"))
    plan = journal.plan(now=0.6, only="a")
    assert plan is not None and [w.answer_id for w in plan.logs] == ["a"]
    every = [*first, *second, *plan.pending["a"]]
    assert plan.logs[0].dump() == keys.dump_events(every)  # as if encoded in one go
    assert plan.logs[0].ended and plan.logs[0].expire == "replay"


HEART = Heartbeat("p1", False, handle_ttl_ms=4000, proc_ttl_ms=8000, keep_ms=60_000, refresh=1.0)


def running(*answers: str) -> list[Running]:
    return [Running(Handle("c" + a, a, "q", "u", "q?"), lambda: None, "u") for a in answers]


def beat_at_10(
    running: list[Running], extended: dict[str, float], heart: Heartbeat = HEART, **hub: Any
) -> Beat:
    """The beat at monotonic time 10, of a hub that (unless `hub` says otherwise) does
    not doubt Redis and read every flag before."""
    knows = {"doubtful": False, "flags_unread": False, "fresh": (), **hub}
    return heart.plan(running, extended, now=10.0, wall_ms=0, **knows)


def test_a_beat_reads_the_claims_a_quarter_of_their_ttl_old_and_the_new_answers_flags():
    a, b = running("a", "b")
    beat = beat_at_10([a, b], {"a": 9.5, "b": 8.0}, fresh={"a"})
    assert beat.due == [b] and beat.flags == [a]
    assert [name for name, _, _ in beat.commands()] == [
        "set",
        "pexpire",
        "getex",
        "get",
        "zadd",
        "pexpire",
    ]
    claim = keys.dump_handle(b.handle)
    heard = beat.read([b"1", 1, claim, b"1", 1, 1])
    assert not heard.lost_data and heard.missing == [] and heard.kept == [1]
    assert heard.cancelled == [a]
    heard = beat.read([b"1", 1, None, None, 1, 1])
    assert heard.missing == [b] and heard.cancelled == []
    assert beat.read([b"1", 1, b"another", None, 1, 1]).kept == [0]


def test_a_beat_that_doubts_redis_reads_every_claim_and_a_lost_key_means_all_are_gone():
    a, b = running("a", "b")
    beat = beat_at_10([a, b], {"a": 9.5, "b": 9.5}, doubtful=True, flags_unread=True)
    assert beat.due == [a, b] and beat.flags == [a, b]
    heard = beat.read([None, 0, None, None, None, b"1", 2, 1])
    assert heard.lost_data and heard.missing == [a, b] and heard.cancelled == [b]


def test_a_beat_on_a_cluster_finds_a_claim_whose_handle_its_node_lost():
    (a,) = running("a")
    heart = Heartbeat("p1", True, handle_ttl_ms=4000, proc_ttl_ms=8000, keep_ms=1, refresh=0.0)
    beat = beat_at_10([a], {}, heart)
    assert [name for name, _, _ in beat.commands()][2:4] == ["getex", "exists"]
    heard = beat.read([b"1", 1, keys.dump_handle(a.handle), 0, 1, 1])
    assert heard.lost == [a] and heard.missing == []


@pytest.fixture(params=["redis", "cluster"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[object]:
    if request.param == "cluster":
        redis = open_redis(request.getfixturevalue("redis_cluster").url, cluster=True)
    else:
        redis = open_redis(request.getfixturevalue("redis_url"))
    try:
        yield redis
    finally:
        await close_redis(redis)


def handle(chat: str, answer: str) -> Handle:
    return Handle(chat, answer, "q", "u", "q?")


async def test_claims_take_a_free_chat_once_and_release_only_their_own(client):
    mine = Claims(client, "p1", handle_ttl_ms=2000, keep_ms=60_000)
    other = Claims(client, "p2", handle_ttl_ms=2000, keep_ms=60_000)
    for token in ("p1", "p2"):
        await client.set(keys.proc(token), b"1", px=5000)
    h, h2 = handle("1", "10"), handle("1", "11")
    assert await mine.claim(h, keys.dump_handle(h), "u") == (CLAIMED, 1)
    assert (await other.claim(h2, keys.dump_handle(h2), "u"))[0] == TAKEN
    await other.release([(h2, keys.dump_handle(h2))])  # not its claim: left alone
    assert await client.get(keys.run("1")) == keys.dump_handle(h)
    assert await client.get(keys.owner("10")) == b"p1"
    await client.delete(keys.run("1"))  # as if Redis had lost it
    assert await mine.keep([(h, keys.dump_handle(h), "u")]) == [2]
    assert await mine.keep([(h, keys.dump_handle(h), "u")]) == [1]
    assert await other.keep([(h2, keys.dump_handle(h2), "u")]) == [0]
    await mine.ended(h, keys.dump_handle(h), "u", 5000)
    assert await client.get(keys.run("1")) is None
    assert await client.zscore(keys.active("u"), "10") is None


async def test_a_claim_is_refused_while_redis_recovers(client):
    claims = Claims(client, "p1", handle_ttl_ms=2000, keep_ms=60_000)
    h = handle("2", "20")
    # this process's liveness key is gone: Redis lost its data
    assert (await claims.claim(h, keys.dump_handle(h), "u"))[0] == RECOVERING
    assert await client.get(keys.run("2")) is None  # taken back
    await client.set(keys.proc("p1"), b"1", px=5000)
    await client.set(keys.RECOVERING, b"p9", px=5000)  # another process said so
    assert (await claims.claim(h, keys.dump_handle(h), "u"))[0] == RECOVERING
    await client.delete(keys.RECOVERING)
    assert (await claims.claim(h, keys.dump_handle(h), "u"))[0] == CLAIMED


async def test_one_process_leads_a_chore_until_its_lock_expires(client):
    a = Claims(client, "p1", handle_ttl_ms=2000, keep_ms=60_000)
    b = Claims(client, "p2", handle_ttl_ms=2000, keep_ms=60_000)
    assert await a.lead("sweeper", ttl=1.5)
    assert not await b.lead("sweeper", ttl=1.5)
    assert await a.lead("sweeper", ttl=1.5)  # extended
    await asyncio.sleep(1.7)
    assert await b.lead("sweeper", ttl=1.5)  # a stopped extending it
    assert not await a.lead("sweeper", ttl=1.5)


async def test_a_claim_that_fails_half_way_is_taken_back(client):
    """The claim is set, then counting the cap fails: the claim is released before the
    error goes up, so the chat does not answer "already running" until it expires."""
    claims = Claims(client, "p1", handle_ttl_ms=2000, keep_ms=60_000)
    await client.set(keys.proc("p1"), b"1", px=5000)
    await client.set(keys.active("u"), b"not a sorted set")
    h = handle("3", "30")
    with pytest.raises(RedisError, match="WRONGTYPE"):
        await claims.claim(h, keys.dump_handle(h), "u")
    await claims.aclose()  # taken back in the background
    assert await client.get(keys.run("3")) is None
    assert await client.get(keys.gen("30")) is None


def test_a_clusters_waiting_client_keeps_the_tls_options_and_credentials():
    url = (
        "rediss://user:secret@127.0.0.1:7000"
        "?ssl_cert_reqs=none&ssl_check_hostname=false&ssl_ca_certs=/etc/ssl/ca.pem"
    )
    client = open_redis(url, cluster=True)
    waiting = cluster_client(client).connection_kwargs
    assert waiting["connection_class"] is SSLConnection
    for name in ("ssl_cert_reqs", "ssl_check_hostname", "ssl_ca_certs", "username", "password"):
        assert waiting[name] == client.connection_kwargs[name], name
    assert waiting["ssl_cert_reqs"] == "none" and waiting["password"] == "secret"
    # one connection per follower waiting on a node: far more than the 64 of calls
    assert waiting["max_connections"] == BLOCKING_CONNECTIONS > 64


async def test_a_cluster_client_that_a_failed_call_left_is_closed_whole(redis_cluster):
    """A call that fails on a connection leaves redis-py's cluster client to be
    initialised again, and its `aclose` then closes nothing (the connections were left
    for the garbage collector: "Unclosed ClusterNode"); `close_redis` closes every
    connection it made all the same."""
    client = open_redis(redis_cluster.url, cluster=True)
    for master in redis_cluster.masters():  # a connection to each
        await client.set(keys.gen(redis_cluster.ids_on(master, keys.gen)[0]), b"1")
    client._initialize = True  # as `RedisCluster._execute_command` leaves it then
    manager = client.nodes_manager
    nodes = [*manager.nodes_cache.values(), *manager.startup_nodes.values()]
    assert [c for node in nodes for c in node._connections if c.is_connected]
    await close_redis(client)
    assert [c for node in nodes for c in node._connections if c.is_connected] == []


def numbered(h: Handle, first: int, last: int, end: bool = False) -> list[Event]:
    return [
        Event("messageEnd" if end and seq == last else "message", h.chat_id, h.answer_id, {}, seq)
        for seq in range(first, last + 1)
    ]


async def test_reassert_writes_again_the_keys_and_whole_logs_of_this_processs_answers(client):
    running, ended = handle("4", "40"), handle("5", "50")
    journal = Journal(checkpoint=2.0)
    running_log = GenerationLog(running, lambda log, e: journal.queue(log.handle.answer_id, e))
    for e in numbered(running, 1, 600):  # more than one entry's worth
        running_log.append(e)
    ended_log = GenerationLog(ended)
    for e in numbered(ended, 1, 2):
        ended_log.append(e)
    ended_log.end(numbered(ended, 3, 3, end=True)[0])
    assert running_log.durable == 0  # none of it acknowledged by Redis
    await Recovery(settle=1.0).reassert(
        client, "p1", [running_log, ended_log], journal, replay_ms=5000, running_ms=60_000
    )
    assert running_log.durable == 600 and "40" not in journal.pending  # in Redis now
    for h, last, most in ((running, 600, 65_000), (ended, 3, 5000)):
        assert keys.load_handle(await client.get(keys.gen(h.answer_id))) == h
        assert await client.get(keys.latest(h.chat_id)) == h.answer_id.encode()
        assert await client.get(keys.owner(h.answer_id)) == b"p1"
        entries = await client.xrange(keys.log(h.answer_id))
        seqs = [e.seq for _, fields in entries for e in keys.load_events(fields[b"e"], h)]
        assert seqs == list(range(1, last + 1))
        for key in (keys.gen(h.answer_id), keys.log(h.answer_id), keys.latest(h.chat_id)):
            assert most - 5000 < await client.pttl(key) <= most, key
    assert len(await client.xrange(keys.log("40"))) == 2  # 500 events an entry


async def write_log(client, h: Handle, events: list[Event]) -> None:
    """What an owner's commit writes to an answer's log."""
    await client.xadd(keys.log(h.answer_id), {"e": keys.dump_events(events)})


@contextlib.asynccontextmanager
async def following(client, h: Handle, after: int) -> AsyncIterator[asyncio.Task[list[Event]]]:
    """A hub on `client` following `h` from `after`, until its end (in a task)."""
    async with RedisHub(client, replay_ttl=5, handle_ttl=1.5, max_generation_seconds=60) as hub:

        async def read() -> list[Event]:
            got: list[Event] = []
            async with asyncio.timeout(10):
                async for batch in follow(hub, h, after):
                    got.extend(batch)
            return got

        task = asyncio.create_task(read())
        try:
            yield task
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def running_on(client, h: Handle, owner: str = "p9") -> None:
    """As the process `owner` keeps `h` running: alive, the chat claimed, the answer its."""
    await client.set(keys.proc(owner), b"1", px=20_000)
    await client.set(keys.run(h.chat_id), keys.dump_handle(h), px=20_000)
    await client.set(keys.owner(h.answer_id), owner.encode(), px=20_000)


async def test_a_follower_reads_its_answers_log_from_a_seq_to_the_end_and_says_so(client):
    h = handle("6", "60")
    await running_on(client, h)
    await write_log(client, h, numbered(h, 1, 2))
    await write_log(client, h, numbered(h, 3, 3))
    owner_hears = client.pubsub(ignore_subscribe_messages=True)
    await owner_hears.subscribe(keys.follow_channel("p9"))
    try:
        async with following(client, h, 1) as reader:
            async with asyncio.timeout(5):  # it tells the owner it follows that answer
                while (message := await owner_hears.get_message(timeout=1)) is None:
                    pass
            assert message["data"] == b"60"
            await write_log(client, h, numbered(h, 4, 5))
            await write_log(client, h, numbered(h, 6, 6, end=True))
            got = await reader
    finally:
        await owner_hears.aclose()
    assert [e.seq for e in got] == [2, 3, 4, 5, 6] and got[-1].type == "messageEnd"


async def test_a_follower_that_finds_events_missing_waits_for_the_log_written_again(client):
    """Redis lost entries of the log (3 and 4 are gone): the follower reads it once
    more from the start, then waits — without giving up — until the owner writes the
    whole log again, and goes on from where it was, each event once."""
    h = handle("7", "70")
    await running_on(client, h)
    await write_log(client, h, numbered(h, 1, 2))
    await write_log(client, h, numbered(h, 5, 6))
    async with following(client, h, 0) as reader:
        await asyncio.sleep(0.5)  # it found the gap, read it all again, and waits
        await client.delete(keys.log(h.answer_id))  # what `Recovery.reassert` does
        await write_log(client, h, numbered(h, 1, 6))
        await write_log(client, h, numbered(h, 7, 7, end=True))
        got = await reader
    assert [e.seq for e in got] == list(range(1, 8))


async def test_a_follower_of_an_answer_whose_process_died_ends_with_an_error(client):
    h = handle("8", "80")
    await client.set(keys.owner(h.answer_id), b"p9", px=20_000)  # no claim, no process
    await write_log(client, h, numbered(h, 1, 2))
    async with following(client, h, 1) as reader:
        got = await reader
    assert [(e.seq, e.type) for e in got] == [(2, "message"), (3, "error")]
    assert got[-1].data == {
        "key": "STREAM_ERROR",
        "data": "generation lost: its server process stopped",
    }


async def test_a_sentinel_url_names_the_sentinels_the_service_and_the_masters_credentials():
    client = open_redis(
        "redis+sentinel://app:p%40ss@10.0.0.5:26379,10.0.0.6:26380/main/2?sentinel_password=s3"
    )
    await close_redis(client)  # it has not connected anywhere
    pool = client.connection_pool
    watchers = pool.sentinel_manager
    assert pool.service_name == "main"
    assert [
        (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
        for s in watchers.sentinels
    ] == [("10.0.0.5", 26379), ("10.0.0.6", 26380)]
    assert watchers.sentinel_kwargs["password"] == "s3"
    kwargs = pool.connection_kwargs
    assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("app", "p@ss", 2)
    for url, message in (
        ("redis+sentinel://10.0.0.5:26379", "names the service"),
        ("redis+sentinel://10.0.0.5/main", "host:port"),
        ("redis+sentinel://10.0.0.5:26379/main?ssl=true", "unknown"),
    ):
        with pytest.raises(ValueError, match=message):
            open_redis(url)
    with pytest.raises(ValueError, match="choose one"):
        open_redis("redis+sentinel://10.0.0.5:26379/main", cluster=True)


async def test_on_a_sentinels_master_claims_and_a_waiting_client_work(redis_sentinel):
    """Through the sentinel: the master it names takes claims, and the hub's client for
    reads that wait (its own sentinel clients) reaches the same master."""
    client = open_redis(redis_sentinel.url)
    waiting = blocking_client(client)
    try:
        claims = Claims(client, "p1", handle_ttl_ms=2000, keep_ms=60_000)
        await client.set(keys.proc("p1"), b"1", px=5000)
        h = handle("9", "90")
        assert await claims.claim(h, keys.dump_handle(h), "u") == (CLAIMED, 1)
        assert await waiting.get(keys.run("9")) == keys.dump_handle(h)
        assert (
            waiting.connection_pool.sentinel_manager is not client.connection_pool.sentinel_manager
        )
    finally:
        await close_redis(waiting)
        await close_redis(client)


async def connected(redis: object) -> int:
    """Clients Redis has connected (every master's, on a cluster)."""
    if hasattr(redis, "nodes_manager"):
        found = await redis.info("clients", target_nodes=redis.PRIMARIES)  # type: ignore[attr-defined]
        return sum(int(info["connected_clients"]) for info in found.values())
    return int((await redis.info("clients"))["connected_clients"])  # type: ignore[attr-defined]


async def test_the_waiting_clients_unused_connections_are_closed(client):
    """A connection per reader that waits: once they are done, `shed_idle` closes the
    ones left in the pool (and the client connects again when asked)."""
    waiting = blocking_client(client)
    try:
        before = await connected(client)
        await asyncio.gather(
            *(waiting.xread({keys.log(f"idle{i}"): "0-0"}, block=200) for i in range(8))
        )
        assert await connected(client) >= before + 8
        await shed_idle(waiting)

        async def shed():  # Redis may answer INFO before it has read the closes
            return await connected(client) <= before + 1

        assert await wait_for(shed, timeout=2)
        assert await waiting.xread({keys.log("idle0"): "0-0"}, block=10) in ([], {}, None)
    finally:
        await close_redis(waiting)
