"""The Redis hub's parts on their own: the journal's bookkeeping (no I/O), and the
claims against a real Redis and a real three-master Redis Cluster."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from app.events import Event, Handle
from app.streams import open_redis
from app.streams import rediskeys as keys
from app.streams.claims import CLAIMED, RECOVERING, TAKEN, Claims
from app.streams.journal import Journal

pytestmark = pytest.mark.anyio


def event(answer: str, seq: int, kind: str = "message") -> Event:
    return Event(kind, "c" + answer, answer, {"data": str(seq)}, seq)


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
    assert {w.answer_id: [e.seq for e in w.events] for w in plan.logs} == {
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
    assert [e.seq for e in plan.logs[0].events] == [1]
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
    assert [e.seq for e in plan.logs[0].events] == [1, 2] and not plan.journal


@pytest.fixture(params=["redis", "cluster"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[object]:
    if request.param == "cluster":
        redis = open_redis(request.getfixturevalue("redis_cluster").url, cluster=True)
    else:
        redis = open_redis(request.getfixturevalue("redis_url"))
    try:
        yield redis
    finally:
        await redis.aclose()


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
