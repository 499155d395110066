"""One contract for the stream hub (registry, cancel, event log), run on memory and
on Redis: one Redis, a three-master Redis Cluster, and a master under Redis Sentinel.

For Redis, `other` is a second hub on the same server, as another process
would have; for memory it is the same hub (one process is all it serves).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import redis
import redis.asyncio as aioredis

from app.errors import Conflict
from app.protocol import Event
from app.streams import Handle, StreamHub, close_redis, follower, open_redis
from app.streams import rediskeys as keys
from app.streams.connect import cluster_client
from app.streams.memory import MemoryHub
from app.streams.redis import RedisHub
from tests.conftest import RedisSentinelGroup, RedisServer

pytestmark = pytest.mark.anyio


def handle(chat="1", answer="100", user="7") -> Handle:
    return Handle(
        chat_id=chat,
        answer_id=answer,
        question_id="99",
        user_id=user,
        question="q?",
    )


def events(h: Handle, types: list[str]) -> list[Event]:
    return [Event(t, h.chat_id, h.answer_id, {"data": f"d{i}"}, i + 1) for i, t in enumerate(types)]


@pytest.fixture(params=["redis", "cluster"])
def target(request: pytest.FixtureRequest) -> tuple[str, bool]:
    """One Redis, or a three-master Redis Cluster: its URL and whether it is a cluster."""
    if request.param == "cluster":
        return request.getfixturevalue("redis_cluster").url, True
    return request.getfixturevalue("redis_url"), False


@pytest.fixture(params=["memory", "redis", "cluster", "sentinel"])
async def hubs(request: pytest.FixtureRequest) -> AsyncIterator[tuple[StreamHub, StreamHub]]:
    if request.param == "memory":
        hub = MemoryHub(replay_ttl=5)
        async with hub:
            yield hub, hub
        return
    if request.param == "cluster":
        url, cluster = request.getfixturevalue("redis_cluster").url, True
    elif request.param == "sentinel":
        url, cluster = request.getfixturevalue("redis_sentinel").url, False
    else:
        url, cluster = request.getfixturevalue("redis_url"), False
    async with (
        redis_hub(url, cluster, handle_ttl=1.5) as a,
        redis_hub(url, cluster, handle_ttl=1.5) as b,
    ):
        yield a, b


@contextlib.asynccontextmanager
async def redis_hub(url: str, cluster: bool = False, **options: float) -> AsyncIterator[RedisHub]:
    """A Redis hub on a client of its own, as another process would have."""
    options = {"replay_ttl": 5, "flush_interval": 0.01, "max_generation_seconds": 60, **options}
    client = open_redis(url, cluster=cluster)
    try:
        async with RedisHub(client, **options) as hub:
            yield hub
    finally:
        await close_redis(client)


async def calls(client: Any, command: str) -> int:
    """How many times the Redis (every master of a cluster) ran `command`."""
    if isinstance(client, aioredis.RedisCluster):
        found = await client.info("commandstats", target_nodes=aioredis.RedisCluster.PRIMARIES)
        stats = list(found.values())
    else:
        stats = [await client.info("commandstats")]
    return sum(s.get(f"cmdstat_{command}", {}).get("calls", 0) for s in stats)


async def collect(hub: StreamHub, h: Handle, after: int = 0, timeout: float = 5) -> list[Event]:
    out: list[Event] = []
    async with asyncio.timeout(timeout):
        async for batch in hub.subscribe(h, after):
            out.extend(batch)
    return out


async def test_register_claims_the_chat_until_finished(hubs):
    owner, other = hubs
    h = handle()
    await owner.register(h, lambda: None)
    assert await other.lookup("1") == h
    with pytest.raises(Conflict, match="already running"):
        await other.register(handle(answer="101"), lambda: None)
    await owner.finish(h, Event("messageEnd", "1", "100", {"status": "completed"}, 1))
    assert await other.lookup("1") is None
    await other.register(handle(answer="102"), lambda: None)  # free again


async def test_cancel_reaches_the_owner_from_anywhere(hubs):
    owner, other = hubs
    h = handle()
    cancelled = asyncio.Event()
    await owner.register(h, cancelled.set)
    await other.cancel(await other.lookup("1"))
    async with asyncio.timeout(3):
        await cancelled.wait()


async def test_events_replay_from_any_seq_then_follow_live(hubs):
    owner, other = hubs
    h = handle()
    log = await owner.register(h, lambda: None)
    first = events(h, ["message", "reasoning", "message", "message"])
    for e in first:
        log.append(e)
    log.append(Event("keep-alive", "1", "100"))  # unnumbered: never replayed

    async def finish_later():
        await asyncio.sleep(0.2)
        log.append(Event("message", "1", "100", {"data": "late"}, 5))
        await owner.finish(h, Event("messageEnd", "1", "100", {"status": "completed"}, 6))

    finisher = asyncio.create_task(finish_later())
    found = await other.find("100")
    assert found == h
    got = await collect(other, found, after=2)
    await finisher
    assert [e.seq for e in got] == [3, 4, 5, 6]
    assert got[2].data == {"data": "late"} and got[-1].type == "messageEnd"
    assert [e.seq for e in await collect(other, found)] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]  # finished: replays to its end
    assert (await other.latest("1")).answer_id == "100"
    assert await other.find("nope") is None


async def test_live_readers_get_every_event_once_in_order(hubs):
    owner, other = hubs
    h = handle()
    log = await owner.register(h, lambda: None)
    readers = [asyncio.create_task(collect(hub, h)) for hub in (owner, other, other)]
    await asyncio.sleep(0.05)
    for i in range(1, 300):
        log.append(Event("message", "1", "100", {"data": str(i)}, i))
        if i % 50 == 0:
            await asyncio.sleep(0.01)
    await owner.finish(h, Event("messageEnd", "1", "100", {"status": "completed"}, 300))
    for reader in readers:
        assert [e.seq for e in await reader] == list(range(1, 301))


async def test_redis_generation_lost_with_its_process_ends_with_an_error(target):
    h = handle()
    async with redis_hub(*target, handle_ttl=0.5) as dead:
        log = await dead.register(h, lambda: None)
        for e in events(h, ["message", "message"]):
            log.append(e)
    # the process is gone: its events were written, nobody refreshes its claim
    async with redis_hub(*target, handle_ttl=0.5) as other:
        got = await collect(other, await other.find("100"), timeout=10)
        assert [e.seq for e in got] == [1, 2, 3]
        assert got[-1].type == "error"
        assert got[-1].data["key"] == "STREAM_ERROR" and "lost" in got[-1].data["data"]
        assert await other.lookup("1") is None


async def test_redis_the_orphans_of_a_dead_process_are_read_with_one_journal_read(target):
    """The sweeper reads what Redis kept of a dead process's answers at once: each
    whole (its log and the journal's part), the journal they share read once, not
    once per answer (which, hundreds of orphans on a busy process, was megabytes
    read again and again)."""
    answers = [handle(chat=str(i), answer=str(500 + i)) for i in range(20)]
    async with redis_hub(*target, handle_ttl=0.5) as dead:
        for h in answers:
            log = await dead.register(h, lambda: None)
            for e in events(h, ["message"] * 5):
                log.append(e)
        await dead.flush()
    async with redis_hub(*target, handle_ttl=0.5) as other:
        before = await calls(other.redis, "xrange")
        logged = await other.logged_many([h.answer_id for h in answers] + ["missing"])
        read = await calls(other.redis, "xrange") - before
        assert {a: [e.seq for e in got] for a, got in logged.items()} == {
            **{h.answer_id: [1, 2, 3, 4, 5] for h in answers},
            "missing": [],
        }
        assert logged["510"][0].data == {"data": "d0"}
        assert read <= 1 + len(answers), read  # the journal once, and each log


async def test_redis_cancel_flag_is_honoured_when_pubsub_misses_it(redis_url):
    async with (
        redis_hub(redis_url, handle_ttl=0.6) as owner,
        redis_hub(redis_url, handle_ttl=0.6) as other,
    ):
        await asyncio.sleep(0.1)  # the owner listens
        await other.redis.client_kill_filter(_type="pubsub")  # and loses its subscription
        h = handle()
        cancelled = asyncio.Event()
        await owner.register(h, cancelled.set)
        await other.cancel(h)
        async with asyncio.timeout(3):
            await cancelled.wait()  # picked up by the heartbeat


async def test_redis_a_cancel_that_comes_before_its_answer_is_local_is_honoured(redis_url):
    """Stop pressed on another process in the instant between the claim and the
    owner holding the answer: the published cancel finds nothing to stop, and the
    owner's next heartbeat picks its flag up."""
    async with (
        redis_hub(redis_url, handle_ttl=3) as owner,
        redis_hub(redis_url, handle_ttl=3) as other,
    ):
        await asyncio.sleep(0.2)  # both listen, and the first beats are done
        h = handle()
        await other.cancel(h)  # published: nobody runs it yet
        cancelled = asyncio.Event()
        await owner.register(h, cancelled.set)
        async with asyncio.timeout(3):
            await cancelled.wait()


async def test_redis_batches_many_events_into_few_commands(target):
    async with redis_hub(*target, flush_interval=0.05, handle_ttl=15) as owner:
        h = handle()
        log = await owner.register(h, lambda: None)
        for i in range(1, 1001):
            log.append(Event("message", "1", "100", {"data": "x"}, i))
        await asyncio.sleep(0.2)
        assert 1 <= await owner.redis.xlen(keys.journal(owner.token)) <= 5
        assert await owner.redis.xlen(keys.log("100")) <= 1  # written every 2 s and at the end


async def entries_added(client: Any, key: str) -> int:
    """How many entries a stream has had (trimmed ones too)."""
    return int((await client.xinfo_stream(key))["entries-added"])


async def test_redis_paced_generations_share_one_journal_entry_per_flush(target):
    """Twenty generations at a model's pace: one journal entry per commit for all of
    them (not one each), their logs written at their ends and — for the five followed
    from another process — at every commit; each follower gets every event of its
    answer, in order."""
    async with (
        redis_hub(*target, flush_interval=0.05, handle_ttl=15) as owner,
        redis_hub(*target, handle_ttl=15) as other,
    ):
        hs = [handle(chat=str(c), answer=str(500 + c)) for c in range(20)]
        logs = [await owner.register(h, lambda: None) for h in hs]
        readers = [asyncio.create_task(collect(other, h)) for h in hs[:5]]
        await asyncio.sleep(0.2)  # they follow
        before = await calls(owner.redis, "xadd")
        for i in range(1, 41):  # 40 events each, 25 ms apart: about a second
            for h, log in zip(hs, logs, strict=True):
                log.append(Event("message", h.chat_id, h.answer_id, {"data": str(i)}, i))
            await asyncio.sleep(0.025)
        for h in hs:
            await owner.finish(h, Event("messageEnd", h.chat_id, h.answer_id, {}, 41))
        written = await calls(owner.redis, "xadd") - before
        commits = await entries_added(owner.redis, keys.journal(owner.token))
        # ~40 commits: each one journal entry, plus a log entry for each followed
        # answer; per generation per commit would be 20 × 40
        assert commits <= 60, commits
        assert written <= commits * 6 + 20 * 3, (written, commits)
        for h in hs[5:]:  # not followed: written every 2 s and at the end
            assert await entries_added(owner.redis, keys.log(h.answer_id)) <= 2
        for reader in readers:
            got = await reader
            assert [e.seq for e in got] == list(range(1, 42))
            assert got[-1].type == "messageEnd"
        for h in hs:  # every log whole, without the journal
            entries = await owner.redis.xrange(keys.log(h.answer_id))
            seqs = sorted({seq for _, f in entries for seq, *_ in orjson.loads(f[b"e"])})
            assert seqs == list(range(1, 42))


async def test_redis_a_follower_reads_its_answer_not_the_owners_journal(target, monkeypatch):
    """A follower's traffic grows with its own answer's events: with 50 busy
    generations on the owner, following one of them reads about what that one wrote
    (its log), never the owner's journal."""
    async with (
        redis_hub(*target, flush_interval=0.01, handle_ttl=15) as owner,
        redis_hub(*target, handle_ttl=15) as other,
    ):
        hs = [handle(chat=str(c), answer=str(700 + c)) for c in range(50)]
        logs = [await owner.register(h, lambda: None) for h in hs]
        followed = hs[0]
        read = 0
        xread = follower._xread

        async def counted(client, key, last_id):
            nonlocal read
            assert client is other.blocking and key == keys.log(followed.answer_id)
            found = await xread(client, key, last_id)
            read += sum(
                len(entry_id) + sum(len(f) + len(v) for f, v in fields.items())
                for entry_id, fields in keys.entries(found)
            )
            return found

        monkeypatch.setattr(follower, "_xread", counted)
        reader = asyncio.create_task(collect(other, followed, timeout=20))
        text = "x" * 20
        for i in range(1, 81):
            for h, log in zip(hs, logs, strict=True):
                log.append(Event("message", h.chat_id, h.answer_id, {"data": text}, i))
            await asyncio.sleep(0.01)
        for h in hs:
            await owner.finish(h, Event("messageEnd", h.chat_id, h.answer_id, {}, 81))
        got = await reader
        assert [e.seq for e in got] == list(range(1, 82))
        own = len(orjson.dumps([[e.seq, e.type, e.data, e.ts] for e in got]))
        # the owner wrote 50 times as much; the follower read its own answer (all of
        # it), with the framing of each entry
        assert own * 0.9 < read < own * 4, (read, own)


async def test_redis_a_follower_that_starts_late_catches_up_from_the_log(target, monkeypatch):
    """What the owner's journal holds of an answer reaches its log once someone
    follows it, at once (not at the next checkpoint)."""
    monkeypatch.setattr("app.streams.redis.CHECKPOINT_SECONDS", 30)
    async with (
        redis_hub(*target, flush_interval=0.01, handle_ttl=15) as owner,
        redis_hub(*target, handle_ttl=15) as other,
    ):
        h = handle(chat="9", answer="900")
        log = await owner.register(h, lambda: None)
        for i in range(1, 11):
            log.append(Event("message", "9", "900", {"data": str(i)}, i))
        await asyncio.sleep(0.1)
        assert await owner.redis.xlen(keys.log("900")) == 0  # in the journal only
        reader = other.subscribe(await other.find("900"), 3)
        async with asyncio.timeout(1.5):
            got = list(await anext(reader))
        assert [e.seq for e in got] == list(range(4, 11))
        log.append(Event("message", "9", "900", {"data": "11"}, 11))
        await owner.finish(h, Event("messageEnd", "9", "900", {}, 12))
        async with asyncio.timeout(5):
            async for batch in reader:
                got.extend(batch)
        assert [e.seq for e in got] == list(range(4, 13))


async def test_redis_a_reader_gets_what_was_written_again_after_redis_lost_it():
    """Redis restarts empty while an answer ends (its last events are written again
    to its log only, not to the journal) and another generation keeps the owner's
    journal busy: a reader elsewhere still gets every event and the end."""
    with RedisServer() as server:
        async with (
            redis_hub(server.url, flush_interval=0.05, handle_ttl=15) as owner,
            redis_hub(server.url, handle_ttl=15) as other,
        ):
            a, b = handle(chat="1", answer="100"), handle(chat="2", answer="200")
            log_a = await owner.register(a, lambda: None)
            log_b = await owner.register(b, lambda: None)

            async def keep_busy() -> None:
                for i in range(1, 1000):
                    log_b.append(Event("message", "2", "200", {"data": str(i)}, i))
                    await asyncio.sleep(0.1)

            busy = asyncio.create_task(keep_busy())
            for e in events(a, ["message"] * 5):
                log_a.append(e)
            reader = asyncio.create_task(collect(other, await other.find("100"), timeout=15))
            await asyncio.sleep(0.5)
            server.stop()
            for i in range(6, 9):
                log_a.append(Event("message", "1", "100", {"data": str(i)}, i))
            await owner.finish(a, Event("messageEnd", "1", "100", {"status": "completed"}, 9))
            await asyncio.sleep(1.0)
            server.start()
            try:
                got = await reader
            finally:
                busy.cancel()
            assert [e.seq for e in got] == list(range(1, 10))
            assert got[-1].type == "messageEnd"


async def test_redis_a_claim_taken_by_another_generation_is_reported(target, caplog):
    async with redis_hub(*target, handle_ttl=1.2) as owner:
        h = handle(chat="5", answer="500")
        await owner.register(h, lambda: None)
        other = orjson.dumps(
            {**orjson.loads(await owner.redis.get(keys.run("5"))), "answer_id": "501"}
        )
        await owner.redis.set(keys.run("5"), other, px=1200)  # as if it had expired and been taken
        await owner.beat()
        await asyncio.sleep(owner.claim_refresh)
        await owner.beat()
        assert "claimed by another generation while 500 runs here" in caplog.text
        assert await owner.redis.get(keys.run("5")) == other  # left as it is


async def test_redis_after_a_lost_connection_the_next_beat_reads_every_claim(target):
    """A claim its node lost (it came back empty) is found at the first beat after
    the connection was lost, not a quarter of its TTL later: until then another
    process could take the chat. Without a lost connection, a claim not yet due is
    not read."""
    async with redis_hub(*target, handle_ttl=60) as owner:
        h = handle(chat="6", answer="600")
        await owner.register(h, lambda: None)
        await owner.beat()  # the claim is fresh: not due for 15 s
        await owner.redis.delete(keys.run("6"))
        await owner.beat()
        assert await owner.redis.get(keys.run("6")) is None  # not read: not due
        owner.connection_lost()
        await owner.beat()
        assert await owner.redis.get(keys.run("6")) is not None  # found gone, set again
        await owner.finish(h, Event("messageEnd", "6", "600", {"status": "completed"}, 1))


async def test_redis_an_end_that_meets_a_stalled_redis_still_arrives():
    """Redis stalls (not restarted: it keeps its data) while a generation ends and the
    write times out: the terminal event is written when Redis answers again (a
    write sent twice leaves one event per seq for readers)."""
    with RedisServer(args=("--enable-debug-command", "yes")) as server:
        admin = aioredis.from_url(server.url)  # no deadline: it waits out the stall
        client = aioredis.from_url(server.url, socket_timeout=0.3)
        try:
            hub = RedisHub(
                client, replay_ttl=5, handle_ttl=5, flush_interval=0.01, max_generation_seconds=60
            )
            async with hub:
                h = handle()
                log = await hub.register(h, lambda: None)
                for e in events(h, ["message", "message"]):
                    log.append(e)
                await hub.flush()
                stall = asyncio.create_task(admin.execute_command("DEBUG", "SLEEP", "3"))
                await asyncio.sleep(0.05)
                await hub.finish(h, Event("messageEnd", "1", "100", {"status": "completed"}, 3))
                await stall

                async def written():  # what Redis has, not this process's copy
                    entries = await admin.xrange(keys.log("100"))
                    kinds = {
                        seq: kind for _, f in entries for seq, kind, *_ in orjson.loads(f[b"e"])
                    }
                    return [kinds[seq] for seq in sorted(kinds)]

                for _ in range(100):
                    if (await written())[-1:] == ["messageEnd"]:
                        break
                    await asyncio.sleep(0.05)
                assert await written() == ["message", "message", "messageEnd"]
        finally:
            await client.aclose()
            await admin.aclose()


@pytest.mark.parametrize("victim", ["answer", "journal"])
async def test_cluster_a_master_killed_mid_stream_loses_nothing(replicated_cluster, victim):
    """A three-master cluster with a replica each: mid-stream, the master that holds a
    running answer's claim, handle and log ("answer") — or the one that holds its
    owner's liveness key and journal ("journal"), which the events of another,
    unfollowed answer go through — is killed, and its replica promoted. The owner
    writes on; the follower on another process gets every event once and the end;
    the chat stays claimed by its generation; and every event of both answers is
    in Redis at the end."""
    cluster = replicated_cluster
    async with (
        redis_hub(cluster.url, True, flush_interval=0.01, handle_ttl=3) as owner,
        redis_hub(cluster.url, True, handle_ttl=3) as other,
    ):
        journal_master = cluster.node_of(keys.journal(owner.token))
        if victim == "journal":
            master = journal_master
            home = next(m for m in cluster.masters() if m is not master)
        else:
            master = home = next(m for m in cluster.masters() if m is not journal_master)
        chat, quiet_chat = cluster.ids_on(home, keys.run, 2)
        answer, quiet_answer = cluster.ids_on(home, keys.log, 2)
        h, quiet = handle(chat=chat, answer=answer), handle(chat=quiet_chat, answer=quiet_answer)
        assert cluster.node_of(keys.gen(answer)) is cluster.node_of(keys.run(chat)) is home
        logs = [await owner.register(h, lambda: None), await owner.register(quiet, lambda: None)]
        reader = asyncio.create_task(collect(other, h, timeout=40))

        async def write() -> None:
            for i in range(1, 301):
                for log, each in zip(logs, (h, quiet), strict=True):
                    log.append(Event("message", each.chat_id, each.answer_id, {"data": str(i)}, i))
                await asyncio.sleep(0.02)

        writer = asyncio.create_task(write())
        await asyncio.sleep(1.0)
        await asyncio.to_thread(cluster.kill, master)  # and its replica takes over
        await writer
        assert (await other.lookup(chat)) == h
        assert (await other.find(answer)) == h
        for each in (h, quiet):
            end = Event("messageEnd", each.chat_id, each.answer_id, {"status": "completed"}, 301)
            await owner.finish(each, end)
        got = await reader
        assert [e.seq for e in got] == list(range(1, 302))
        assert got[-1].type == "messageEnd"
        for each in (h, quiet):
            assert [e.seq for e in await other.logged(each.answer_id)] == list(range(1, 302))


async def test_cluster_a_master_that_restarts_empty_gets_back_what_it_lost(redis_cluster):
    """A master without a replica restarts empty mid-stream. Of two running answers,
    one had its chat's claim there (its handle and log elsewhere), the other its
    handle and log (its claim elsewhere): the owner finds the claim gone, and the
    handle gone while its claim lives on, and writes both answers again; a follower
    of each gets every event once and the end."""
    cluster = redis_cluster
    async with (
        redis_hub(cluster.url, True, flush_interval=0.01, handle_ttl=1.5) as owner,
        redis_hub(cluster.url, True, handle_ttl=1.5) as other,
    ):
        home = cluster.node_of(keys.proc(owner.token))  # the owner's own keys stay
        victim = next(m for m in cluster.masters() if m is not home)
        claim_lost = handle(
            chat=cluster.ids_on(victim, keys.run)[0], answer=cluster.ids_on(home, keys.log)[0]
        )
        handle_lost = handle(
            chat=cluster.ids_on(home, keys.run)[0], answer=cluster.ids_on(victim, keys.log)[0]
        )
        claimed_again: list[str] = []
        reasserted: list[str] = []
        claim_again, reassert = owner._claim_again, owner.recovery.reassert

        async def spy_claim_again(missing):
            claimed_again.extend(r.handle.answer_id for r in missing)
            await claim_again(missing)

        async def spy_reassert(redis, token, logs, *args, **kwargs):
            reasserted.extend(log.handle.answer_id for log in logs)
            await reassert(redis, token, logs, *args, **kwargs)

        owner._claim_again = spy_claim_again  # type: ignore[method-assign]
        owner.recovery.reassert = spy_reassert  # type: ignore[method-assign]
        hs = [claim_lost, handle_lost]
        logs = [await owner.register(h, lambda: None) for h in hs]
        readers = [asyncio.create_task(collect(other, h, timeout=30)) for h in hs]

        async def write() -> None:
            for i in range(1, 151):
                for log, h in zip(logs, hs, strict=True):
                    log.append(Event("message", h.chat_id, h.answer_id, {"data": str(i)}, i))
                await asyncio.sleep(0.02)

        writer = asyncio.create_task(write())
        await asyncio.sleep(0.8)
        victim.stop()
        await asyncio.to_thread(victim.start)  # back at once, empty, with its slots
        await asyncio.to_thread(cluster.wait_ok)
        await writer
        await asyncio.sleep(owner.beat_interval * 2)  # a beat or two after it
        assert claimed_again == [claim_lost.answer_id]
        assert set(reasserted) == {claim_lost.answer_id, handle_lost.answer_id}
        assert await other.lookup(claim_lost.chat_id) == claim_lost
        assert await other.find(handle_lost.answer_id) == handle_lost
        for h in hs:
            await owner.finish(h, Event("messageEnd", h.chat_id, h.answer_id, {}, 151))
        for reader in readers:
            got = await reader
            assert [e.seq for e in got] == list(range(1, 152))
            assert got[-1].type == "messageEnd"


async def test_cluster_more_followers_than_a_pool_holds_are_not_an_outage(redis_cluster):
    """Seventy clients of one process follow an answer of another: each waits in an
    XREAD BLOCK on the node of its log, holding a connection meanwhile — more than a
    pool of 64 per node — and none of it counts as Redis failing; every follower
    gets every event once."""
    url = redis_cluster.url
    async with (
        redis_hub(url, True, flush_interval=0.01, handle_ttl=15) as owner,
        redis_hub(url, True, handle_ttl=15) as other,
    ):
        h = handle()
        log = await owner.register(h, lambda: None)
        readers = [asyncio.create_task(collect(other, h, timeout=20)) for _ in range(70)]
        node = redis_cluster.node_of(keys.log(h.answer_id))

        def blocked() -> int:
            admin = redis.Redis(port=node.port, socket_timeout=1)
            try:
                return int(admin.info("clients")["blocked_clients"])
            finally:
                admin.close()

        for _ in range(100):  # they all wait at once, each on a connection of its own
            if await asyncio.to_thread(blocked) >= 70:
                break
            await asyncio.sleep(0.05)
        assert await asyncio.to_thread(blocked) >= 70
        for i in range(1, 51):
            log.append(Event("message", "1", "100", {"data": str(i)}, i))
            await asyncio.sleep(0.01)
        await owner.finish(h, Event("messageEnd", "1", "100", {}, 51))
        for reader in readers:
            assert [e.seq for e in await reader] == list(range(1, 52))
        assert not other.recovery.doubtful()  # no connection counted as lost


async def test_cluster_followers_beyond_the_connection_limit_wait_their_turn(redis_cluster):
    """With more followers than connections its client may open to a node (a cluster
    node refuses at once where one Redis's pool waits), the followers take turns:
    back-pressure, not an outage — every one gets every event once."""
    url = redis_cluster.url
    client = open_redis(url, cluster=True)
    blocking = cluster_client(client, max_connections=3)
    try:
        async with (
            redis_hub(url, True, flush_interval=0.01, handle_ttl=15) as owner,
            RedisHub(
                client,
                replay_ttl=5,
                handle_ttl=15,
                max_generation_seconds=60,
                blocking=blocking,
            ) as other,
        ):
            h = handle()
            log = await owner.register(h, lambda: None)
            readers = [asyncio.create_task(collect(other, h, timeout=20)) for _ in range(10)]
            for i in range(1, 31):
                log.append(Event("message", "1", "100", {"data": str(i)}, i))
                await asyncio.sleep(0.02)
            await owner.finish(h, Event("messageEnd", "1", "100", {}, 31))
            for reader in readers:
                assert [e.seq for e in await reader] == list(range(1, 32))
            assert not other.recovery.doubtful()
    finally:
        await close_redis(blocking)
        await close_redis(client)


async def test_redis_an_answer_whose_events_cannot_be_written_ends_alone_with_an_error(target):
    """An event that cannot be encoded (a lone surrogate: JSON from a search API may
    hold one) ends its answer with an INTERNAL error, right after what its readers
    were shown, and cancels its generation; every other answer of the process goes
    on (a commit retried for ever held them all back)."""
    async with (
        redis_hub(*target, flush_interval=0.01, handle_ttl=15) as owner,
        redis_hub(*target, handle_ttl=15) as other,
    ):
        bad, good = handle(chat="1", answer="100"), handle(chat="2", answer="200")
        cancelled = asyncio.Event()
        bad_log = await owner.register(bad, cancelled.set)
        good_log = await owner.register(good, lambda: None)
        readers = [
            asyncio.create_task(collect(hub, h, timeout=10))
            for hub, h in ((owner, bad), (other, bad), (other, good))
        ]
        bad_log.append(Event("message", "1", "100", {"data": "fine"}, 1))
        good_log.append(Event("message", "2", "200", {"data": "1"}, 1))
        await owner.flush()
        title = "broken \ud800 title"
        bad_log.append(Event("sources", "1", "100", {"data": [{"title": title}]}, 2))
        good_log.append(Event("message", "2", "200", {"data": "2"}, 2))
        async with asyncio.timeout(3):
            await cancelled.wait()
        bad_log.append(Event("message", "1", "100", {"data": "late"}, 3))  # dropped
        for i in range(3, 11):
            good_log.append(Event("message", "2", "200", {"data": str(i)}, i))
            await asyncio.sleep(0.01)
        await owner.finish(good, Event("messageEnd", "2", "200", {}, 11))
        await owner.finish(bad, Event("messageEnd", "1", "100", {"status": "cancelled"}, 4))
        *bad_reads, good_read = [await reader for reader in readers]
        for got in bad_reads:  # on the owner, and on another process
            assert [(e.seq, e.type) for e in got] == [(1, "message"), (2, "error")]
            assert got[-1].data["key"] == "INTERNAL"
        assert [e.seq for e in good_read] == list(range(1, 12))
        assert [e.type for e in await other.logged("100")] == ["message", "error"]
        assert await other.lookup("1") is None  # its claim ended


async def test_sentinel_a_master_killed_mid_stream_loses_nothing():
    """A master with a replica under Redis Sentinel is killed mid-stream, and the
    sentinel promotes the replica: the owner writes on (its connections ask the
    sentinel where the master is now), a follower on another process gets every
    event once and the end, and the chat stays claimed by its generation."""
    with RedisSentinelGroup() as group:
        async with (
            redis_hub(group.url, flush_interval=0.01, handle_ttl=3) as owner,
            redis_hub(group.url, handle_ttl=3) as other,
        ):
            h = handle(chat="41", answer="4100")
            log = await owner.register(h, lambda: None)
            reader = asyncio.create_task(collect(other, h, timeout=40))

            async def write() -> None:
                for i in range(1, 251):
                    log.append(Event("message", "41", "4100", {"data": str(i)}, i))
                    await asyncio.sleep(0.02)

            writer = asyncio.create_task(write())
            await asyncio.sleep(1.0)
            await asyncio.to_thread(group.kill)
            await writer
            assert (await other.lookup("41")) == h
            await owner.finish(h, Event("messageEnd", "41", "4100", {"status": "completed"}, 251))
            got = await reader
            assert [e.seq for e in got] == list(range(1, 252))
            assert got[-1].type == "messageEnd"
            assert [e.seq for e in await other.logged("4100")] == list(range(1, 252))
