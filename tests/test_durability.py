"""Nothing a client saw is ever lost, whatever dies or hangs: durable delivery, a Redis
that stops answering, a cancelled SQLite write, NUL bytes, and background loops that
meet an unexpected error.

Real things throughout: `python -m app` processes killed with SIGKILL, a redis-server
frozen with SIGSTOP (it accepts connections and answers nothing, as a partition or a
failover to a new address looks), SQLite files locked by another connection, a real
PostgreSQL, and the fake model and web.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sqlite3
import time
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
import redis.asyncio as aioredis

from app.chat.keeper import MAX_ATTEMPTS, AnswerKeeper
from app.chores import supervised
from app.errors import AppError, BadRequest, Unavailable
from app.events import Handle
from app.main import create_app
from app.search.web import until_deadline
from app.store import (
    Chat,
    Checkpoint,
    CollectionRecord,
    DocumentRecord,
    FileRecord,
    Saved,
    StoredMessage,
    open_store,
)
from app.store.base import mapping_errors
from app.store.sqlite import sqlite_path
from app.streams import rediskeys
from app.streams.memory import MemoryHub
from tests.client import answer_of, chat_body, iter_sse, read_events, rest, wait_for
from tests.conftest import USER, PostgresServer, RedisServer, new_database
from tests.servers import AppProcess, free_port, processes, serve
from tests.test_hub import redis_hub

pytestmark = pytest.mark.anyio


async def received_until_cut(response: httpx.Response, head: list) -> list:
    """Every event a client got before its server died: what it had read, then what
    was already on its way (read until the connection breaks)."""
    got = list(head)
    try:
        async for item in iter_sse(response):
            if hasattr(item, "data"):
                got.append(item)
    except (httpx.HTTPError, httpx.StreamError):
        pass
    return got


# -- 1. kill -9: what a client was shown is what is resumed and saved -------------------------


async def test_after_a_kill_what_every_client_saw_is_what_is_resumed_and_saved(
    hosts_env, fake_model
):
    """Three chats stream on A; A is killed outright. Each client resumes on B from the
    last event it received: nothing it was shown is missing from B's replay, and the
    saved answer is exactly what it was shown plus what the resume replayed."""
    with processes(2, hosts_env) as (a, b):
        async with httpx.AsyncClient(timeout=30, event_hooks=USER) as http:
            chats = ["d1", "d2", "d3"]
            bodies = [chat_body("long #tokens=3000 #delay=0.005", chatId=c) for c in chats]
            async with (
                http.stream("POST", a.url + "/api/chat/sse", json=bodies[0]) as r1,
                http.stream("POST", a.url + "/api/chat/sse", json=bodies[1]) as r2,
                http.stream("POST", a.url + "/api/chat/sse", json=bodies[2]) as r3,
            ):
                responses = [r1, r2, r3]
                heads = [await read_events(iter_sse(r), 40) for r in responses]
                a.kill()
                shown = [
                    await received_until_cut(r, h) for r, h in zip(responses, heads, strict=True)
                ]
            for chat, events in zip(chats, shown, strict=True):
                seqs = [int(e.id.rsplit(":", 1)[1]) for e in events]
                assert seqs == list(range(1, len(seqs) + 1)), chat  # in order, no gap
                async with http.stream(
                    "GET",
                    b.url + "/api/chat/sse/resume",
                    params={"chatId": chat, "lastEventId": events[-1].id},
                ) as response:
                    assert response.status_code == 200, chat
                    tail = await rest(iter_sse(response))
                # the resume goes on right after what the client had: nothing shown is
                # missing from what Redis kept
                assert int(tail[0].id.rsplit(":", 1)[1]) == seqs[-1] + 1, (chat, tail[0])
                assert tail[-1].type == "error" and tail[-1].data["key"] == "STREAM_ERROR"

                async def saved(chat: str = chat) -> dict | None:
                    row = (await http.get(b.url + f"/api/chats/{chat}")).json()["messages"][-1]
                    return row if row["status"] != "streaming" else None

                row = await wait_for(saved, timeout=15)
                assert row["status"] == "failed"
                assert row["content"] == answer_of(events + tail), chat
                assert len(answer_of(events)) > 100


async def v1_shown(lines: AsyncIterator[str], chunks: int | None = None) -> tuple[str, str]:
    """(answer id, text) a `/v1` stream's client was shown: the next `chunks` chunks
    of its lines, or all until the stream ends or breaks."""
    answer_id, text, seen = "", [], 0
    try:
        async for line in lines:
            if not line.startswith("data: {"):
                continue
            chunk = orjson.loads(line[6:])
            answer_id = chunk["id"].removeprefix("chatcmpl-")
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
            seen += 1
            if seen == chunks:
                break
    except (httpx.HTTPError, httpx.StreamError):
        pass
    return answer_id, "".join(text)


async def test_v1_streams_cut_by_a_kill_are_saved_with_what_their_clients_saw(
    hosts_env, fake_model
):
    """`/v1` streams cannot resume: when their process is killed, the sweeper on
    another one saves each answer with at least the text its client was shown."""
    body = {
        "model": "deepSeek",
        "stream": True,
        "user": "7",
        "messages": [{"role": "user", "content": "long #tokens=3000 #delay=0.01"}],
    }
    with processes(2, hosts_env) as (a, b):
        async with httpx.AsyncClient(timeout=30) as http, contextlib.AsyncExitStack() as stack:
            responses = [
                await stack.enter_async_context(
                    http.stream("POST", a.url + "/v1/chat/completions", json=body)
                )
                for _ in range(8)
            ]
            lines = [r.aiter_lines() for r in responses]
            heads = await asyncio.gather(*(v1_shown(each, 20) for each in lines))
            a.kill()
            tails = await asyncio.gather(*(v1_shown(each) for each in lines))
            shown = {h[0]: h[1] + t[1] for h, t in zip(heads, tails, strict=True)}
            await stack.aclose()

            async def saved() -> dict | None:
                chats = (await http.get(b.url + "/api/chats", params={"userId": "7"})).json()
                rows = {}
                for chat in chats["chats"]:
                    reply = await http.get(b.url + f"/api/chats/{chat['id']}?userId=7")
                    row = reply.json()["messages"][-1]
                    if row["status"] == "streaming":
                        return None
                    rows[row["messageId"]] = row
                return rows

            rows = await wait_for(saved, timeout=20)
            assert rows.keys() == shown.keys()
            for answer_id, text in shown.items():
                assert text.startswith("tok0 ") and len(text) > 60
                assert rows[answer_id]["status"] == "failed"
                assert rows[answer_id]["content"].startswith(text), answer_id


# -- 2. a Redis that stops answering ------------------------------------------------------------


def freeze(redis: RedisServer) -> None:
    assert redis.proc is not None
    os.kill(redis.proc.pid, signal.SIGSTOP)


def thaw(redis: RedisServer) -> None:
    assert redis.proc is not None
    os.kill(redis.proc.pid, signal.SIGCONT)


async def test_a_redis_that_stops_answering_fails_like_one_that_refuses(settings, fake_model):
    """Redis freezes (connections are accepted, nothing is answered) mid-answer: the
    running answer still ends with its `messageEnd` in bounded time, a new question is
    a 503 within seconds instead of hanging, `/readyz` says which part is away — and
    once Redis answers again, new questions work and the answer was saved."""
    redis = RedisServer()
    app = create_app(settings.replace(redis={"url": redis.url, "timeout_seconds": 1.0}))
    with redis, serve(app) as running:
        try:
            async with httpx.AsyncClient(
                base_url=running.url, timeout=30, event_hooks=USER
            ) as http:
                async with http.stream(
                    "POST",
                    "/api/chat/sse",
                    json=chat_body("long #tokens=100 #delay=0.02", chatId="h1"),
                ) as response:
                    stream = iter_sse(response)
                    await read_events(stream, 10)
                    freeze(redis)
                    started = time.monotonic()
                    tail = await rest(stream)
                    ended_after = time.monotonic() - started
                assert tail[-1].type == "messageEnd", tail[-1]
                assert ended_after < 8, ended_after  # ~2 s of tokens left, and the end
                started = time.monotonic()
                refused = await http.post("/api/chat/sse", json=chat_body("q", chatId="h2"))
                refused_after = time.monotonic() - started
                assert refused.status_code == 503, refused.text
                assert "registry is unavailable" in refused.json()["data"]
                started = time.monotonic()
                ready = await http.get("/readyz")
                ready_after = time.monotonic() - started
                assert ready.status_code == 503 and "redis" in ready.json()["failing"]
                # redis.timeout_seconds (1 s) each, not the kernel's minutes
                assert refused_after < 3 and ready_after < 3, (refused_after, ready_after)
                thaw(redis)

                async def accepted() -> bool:
                    probe = await http.post(
                        "/api/chat/sse", json=chat_body("probe #tokens=1", chatId="h3")
                    )
                    return probe.status_code == 200

                await wait_for(accepted, timeout=20)
                row = (await http.get("/api/chats/h1")).json()["messages"][-1]
                assert row["status"] == "completed"
                assert row["content"] == "".join(f"tok{i} " for i in range(100))
                # the end Redis missed is done again: the answer's keys are kept for
                # replay only, not for as long as a running answer may run
                replay_ms = settings.stream.replay_ttl_seconds * 1000
                direct = aioredis.Redis.from_url(redis.url)
                try:

                    async def ended_again() -> bool:
                        ttls = [
                            await direct.pttl(key(row["messageId"]))
                            for key in (rediskeys.gen, rediskeys.owner)
                        ]
                        return all(0 < ttl <= replay_ms for ttl in ttls)

                    await wait_for(ended_again, timeout=10)
                    assert 0 < await direct.pttl(rediskeys.latest("h1")) <= replay_ms
                finally:
                    await direct.aclose()
        finally:
            thaw(redis)


async def test_streams_go_on_at_checkpoint_pace_while_redis_is_frozen(settings, fake_model):
    """While Redis does not answer, the store is what makes events durable: a running
    answer keeps reaching its client (checkpoint by checkpoint), not frozen until Redis
    is back, and what it showed is saved."""
    redis = RedisServer()
    changed = settings.replace(
        redis={"url": redis.url, "timeout_seconds": 0.5}, stream={"flush_interval_ms": 100}
    )
    with redis, serve(create_app(changed)) as running:
        try:
            async with httpx.AsyncClient(
                base_url=running.url, timeout=30, event_hooks=USER
            ) as http:
                async with http.stream(
                    "POST",
                    "/api/chat/sse",
                    json=chat_body("long #tokens=400 #delay=0.02", chatId="f1"),
                ) as response:
                    stream = iter_sse(response)
                    head = await read_events(stream, 10)
                    freeze(redis)
                    await asyncio.sleep(2.0)  # the outage is noticed
                    during = await read_events(stream, 20)  # still coming, Redis frozen
                    assert len(during) == 20
                    row = (await http.get("/api/chats/f1")).json()["messages"][-1]
                    assert row["status"] == "streaming"
                    # what the client was shown is in the store already
                    assert row["content"].startswith(answer_of(head + during)), row["content"]
                    thaw(redis)
                    tail = await rest(stream)
                assert tail[-1].type == "messageEnd"
        finally:
            thaw(redis)


# -- 3. a cancelled SQLite write ------------------------------------------------------------------


async def test_a_write_cancelled_while_it_waits_for_the_lock_leaves_sqlite_usable(tmp_path):
    """Another connection holds the file's write lock; a write waits for it and is
    cancelled (a Stop at the wrong moment, a save timeout, a shutdown). Once the lock
    is free, every later write works and the store reports itself ready."""
    path = tmp_path / "chat.db"
    store = open_store(f"sqlite:///{path}")
    async with store:
        chat = Chat("c1", "1", "t", "webSearch", time.time())
        question = StoredMessage("q1", "c1", "user", "hello", time.time())
        answer = StoredMessage("a1", "c1", "assistant", "", time.time() + 1, status="streaming")
        await store.begin_answer(chat, question, answer)
        other = sqlite3.connect(path, timeout=0, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            for _ in range(3):
                write = asyncio.create_task(store.set_title("c1", "cancelled"))
                await asyncio.sleep(0.2)  # waiting inside BEGIN for the lock
                write.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await write
        finally:
            other.execute("ROLLBACK")
            other.close()
        await store.set_title("c1", "written")
        assert (await store.get_chat("c1")).title == "written"
        saved = Saved(content="done", reasoning="", status="completed")
        assert await store.finish_answer("a1", saved)
        await store.ping()


async def test_readyz_says_so_when_the_sqlite_store_cannot_write(settings, tmp_path, fake_model):
    with serve(create_app(settings)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20) as http:
            assert (await http.get("/readyz")).status_code == 200
            path = settings.store.url.removeprefix("sqlite:///")
            other = sqlite3.connect(path, timeout=0, isolation_level=None)
            try:
                other.execute("BEGIN IMMEDIATE")  # a writer that never lets go
                ready = await http.get("/readyz")
                assert ready.status_code == 503 and "store" in ready.json()["failing"]
            finally:
                other.execute("ROLLBACK")
                other.close()
            assert (await http.get("/readyz")).status_code == 200


# -- 4. NUL bytes, and one save that fails -----------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/nul.db"
    return new_database(request.getfixturevalue("postgres_server"))


async def test_nul_characters_are_cleaned_at_the_store_on_every_backend(store_url):
    store = open_store(store_url)
    async with store:
        now = time.time()
        chat = Chat("n1", "1", "ti\x00tle", "webSearch", now)
        question = StoredMessage("nq", "n1", "user", "what\x00 is it", now)
        answer = StoredMessage("na", "n1", "assistant", "", now + 1, status="streaming")
        await store.begin_answer(chat, question, answer)
        await store.set_sources("nq", [{"metadata": {"title": "a\x00b"}, "pageContent": "\x00"}])
        saved = Saved(
            content="tok0\x00 tok1",
            reasoning="why\x00",
            status="completed",
            steps=["searching\x00"],
            error=None,
        )
        assert await store.finish_answer("na", saved)
        messages = await store.list_messages("n1")
        assert [m.content for m in messages] == ["what is it", "tok0 tok1"]
        assert messages[0].sources == [{"metadata": {"title": "ab"}, "pageContent": ""}]
        assert messages[1].reasoning == "why" and messages[1].steps == ["searching"]
        assert (await store.get_chat("n1")).title == "title"


async def test_lone_surrogates_are_replaced_at_the_store_on_every_backend(store_url):
    """A web page's JSON may carry an escaped lone surrogate (`"\\ud800"`), which Python's
    decoder lets through and neither store can keep as UTF-8: it is saved as U+FFFD."""
    store = open_store(store_url)
    async with store:
        now = time.time()
        await store.begin_answer(
            Chat("u1", "1", "t", "webSearch", now),
            StoredMessage("uq", "u1", "user", "q", now),
            StoredMessage("ua", "u1", "assistant", "", now + 1, status="streaming"),
        )
        await store.set_sources("uq", [{"metadata": {"title": "a\ud800b"}, "pageContent": "x"}])
        saved = Saved(content="tok\udfff", reasoning="", status="completed")
        assert await store.finish_answer("ua", saved)
        messages = await store.list_messages("u1")
        assert messages[0].sources == [{"metadata": {"title": "a\ufffdb"}, "pageContent": "x"}]
        assert messages[1].content == "tok\ufffd"


async def test_model_output_and_questions_with_nul_are_saved_on_postgres(
    settings, postgres_server, fake_model, fake_search
):
    fake_search.extra.append(
        {"title": "T\x00", "url": "https://example.com/nul", "snippet": "snip\x00pet"}
    )
    changed = settings.replace(store={"url": new_database(postgres_server)})
    with serve(create_app(changed)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20, event_hooks=USER) as http:
            body = chat_body("with nul #nul #tokens=3", chatId="p1", focusMode="webSearch")
            async with http.stream("POST", "/api/chat/sse", json=body) as response:
                assert response.status_code == 200
                events = await rest(iter_sse(response))
            assert events[-1].type == "messageEnd"
            asked = await http.post("/api/chat/sse", json=chat_body("a\x00question", chatId="p2"))
            assert asked.status_code == 200
            for chat, content in (("p1", "tok0 tok1 tok2 "), ("p2", None)):
                row = (await http.get(f"/api/chats/{chat}")).json()["messages"][-1]
                assert row["status"] == "completed", row
                if content is not None:
                    assert row["content"] == content
            first = (await http.get("/api/chats/p1")).json()["messages"]
            assert first[1]["sources"][0]["metadata"]["title"] == "T"


class RefusesOne:
    """A real store that refuses (as a data error) every save of one answer id."""

    def __init__(self, store, refused: str) -> None:
        self.store = store
        self.refused = refused
        self.available = False  # the store is away at first, for every answer

    def __getattr__(self, name):
        return getattr(self.store, name)

    async def finish_answer(self, answer_id, saved, *, only_streaming=False):
        if not self.available:
            raise Unavailable("the chat store is unavailable; try again shortly")
        if answer_id == self.refused:
            raise BadRequest("the store cannot keep a value of this request")
        return await self.store.finish_answer(answer_id, saved, only_streaming=only_streaming)


async def test_one_answer_the_store_refuses_never_holds_back_the_others(tmp_path, caplog):
    """Answers end while the store is away; the oldest of them is one the store will
    never take. When it comes back, every other answer is saved, and the refused one
    is given up after a few tries with one ERROR line naming it (a dead letter)."""
    store = open_store(f"sqlite:///{tmp_path}/keep.db")
    async with store:
        now = time.time()
        ids = ["poison", *(f"ok{i}" for i in range(5))]
        for i, answer_id in enumerate(ids):
            await store.begin_answer(
                Chat(f"c{i}", "1", "t", "deepSeek", now),
                StoredMessage(f"q{i}", f"c{i}", "user", "q", now),
                StoredMessage(answer_id, f"c{i}", "assistant", "", now + 1, status="streaming"),
            )
        wrapped = RefusesOne(store, "poison")
        keeper = AnswerKeeper(
            wrapped, MemoryHub(replay_ttl=5), checkpoint_interval=10, sweep_interval=60
        )
        for answer_id in ids:  # the poisoned one first: the oldest in the queue
            saved = await keeper.save(answer_id, Saved(answer_id, "", "completed"))
            assert saved is False
        wrapped.available = True
        with caplog.at_level(logging.ERROR, logger="app.keeper"):
            for _ in range(12):
                for entry in keeper._unsaved.values():
                    entry.next_at = 0.0
                await keeper.retry_now()
        for i, answer_id in enumerate(ids[1:], start=1):
            row = (await store.list_messages(f"c{i}"))[-1]
            assert (row.status, row.content) == ("completed", answer_id)
        assert keeper.pending() == 0
        assert "answer poison is given up" in caplog.text
        assert (await store.list_messages("c0"))[-1].status == "streaming"  # left to the sweeper


async def refuse_content(url: str, word: str) -> None:
    """Make the database itself refuse every answer whose text holds `word`: a trigger
    in SQLite, a CHECK constraint in PostgreSQL (rows already there are left as they are)."""
    if url.startswith("sqlite"):
        with contextlib.closing(sqlite3.connect(sqlite_path(url))) as db:
            db.execute(
                "CREATE TRIGGER refuse BEFORE UPDATE ON messages"
                f" WHEN NEW.content LIKE '%{word}%' BEGIN SELECT RAISE(ABORT, 'refused'); END"
            )
            db.commit()
        return
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            f"ALTER TABLE messages ADD CONSTRAINT refuse CHECK (content NOT LIKE '%{word}%')"
            " NOT VALID"
        )
    finally:
        await conn.close()


async def add_answers(store, ids: list[str], at: float) -> None:
    """A chat of one question and one `streaming` answer for each id, made at `at`."""
    for i, answer_id in enumerate(ids):
        await store.begin_answer(
            Chat(f"c-{answer_id}", "1", "t", "deepSeek", at + i),
            StoredMessage(f"q-{answer_id}", f"c-{answer_id}", "user", "q", at + i),
            StoredMessage(answer_id, f"c-{answer_id}", "assistant", "", at + i + 0.5, "streaming"),
        )


async def last_message(store, answer_id: str) -> StoredMessage:
    return (await store.list_messages(f"c-{answer_id}"))[-1]


async def test_an_orphan_the_store_refuses_never_stops_the_sweep(store_url, caplog):
    """Three answers left `streaming` by a process that died; the database refuses the
    oldest (a constraint of its own). The others are closed by the first sweep all the
    same, and the refused one is given up after a few sweeps with one ERROR line."""
    store = open_store(store_url)
    async with store:
        ids = ["refused", "ok1", "ok2"]
        await add_answers(store, ids, time.time() - 60)
        await store.checkpoint_answers([Checkpoint(a, f"{a} so far", "", []) for a in ids])
        await refuse_content(store_url, "refused")
        keeper = AnswerKeeper(
            store, MemoryHub(replay_ttl=5), checkpoint_interval=10, sweep_interval=60
        )
        with caplog.at_level(logging.WARNING, logger="app.keeper"):
            assert await keeper.sweep() == 2
            for _ in range(MAX_ATTEMPTS + 2):
                assert await keeper.sweep() == 0
        for answer_id in ("ok1", "ok2"):
            row = await last_message(store, answer_id)
            assert (row.status, row.content) == ("failed", f"{answer_id} so far")
        assert (await last_message(store, "refused")).status == "streaming"
        assert caplog.text.count("orphaned answer refused is given up") == 1
        assert caplog.text.count("orphaned answer refused could not be saved") == MAX_ATTEMPTS - 1


async def test_answers_the_store_refuses_are_given_up_by_the_running_keeper(store_url, caplog):
    """The keeper's own loop: the database refuses one ended answer for good; every
    other is saved, and the refused one is given up after `MAX_ATTEMPTS` tries."""
    store = open_store(store_url)
    async with store:
        ids = ["refused", *(f"ok{i}" for i in range(4))]
        await add_answers(store, ids, time.time())
        await refuse_content(store_url, "refused")
        keeper = AnswerKeeper(
            store, MemoryHub(replay_ttl=5), checkpoint_interval=10, sweep_interval=60
        )
        await keeper.open()
        try:
            with caplog.at_level(logging.ERROR, logger="app.keeper"):
                saved = [await keeper.save(a, Saved(f"{a} text", "", "completed")) for a in ids]
                assert saved == [False, True, True, True, True]

                async def all_done() -> bool:
                    return keeper.pending() == 0

                await wait_for(all_done, timeout=20)
        finally:
            await keeper.aclose()
        for answer_id in ids[1:]:
            assert (await last_message(store, answer_id)).content == f"{answer_id} text"
        assert caplog.text.count("answer refused is given up") == 1


class Growing:
    """A running answer, as the keeper sees one."""

    def __init__(self, answer_id: str) -> None:
        self.answer_id = answer_id

    def progress(self) -> tuple[int, Checkpoint]:
        return 3, Checkpoint(self.answer_id, f"{self.answer_id} so far", "", [])


async def test_a_checkpoint_the_store_refuses_for_one_answer_saves_the_others(store_url):
    store = open_store(store_url)
    async with store:
        ids = ["refused", "ok1", "ok2"]
        await add_answers(store, ids, time.time())
        await refuse_content(store_url, "refused")
        keeper = AnswerKeeper(
            store, MemoryHub(replay_ttl=5), checkpoint_interval=10, sweep_interval=60
        )
        for answer_id in ids:
            keeper.track(Growing(answer_id))
        assert await keeper.checkpoint() == 2
        for answer_id in ("ok1", "ok2"):
            assert (await last_message(store, answer_id)).content == f"{answer_id} so far"
        assert (await last_message(store, "refused")).content == ""


async def test_errors_of_real_databases_read_as_what_they_are(tmp_path, postgres_url):
    """What each database really raises: a locked SQLite file or a PostgreSQL that is
    not there is "try again" (503); a statement that is wrong (a missing table, the
    wrong number of arguments) is a bug (500), never "try again"; a value the database
    refuses is a 400."""
    import asyncpg

    from app.store import postgres as pg
    from app.store import sqlite as sq

    path = tmp_path / "errors.db"

    @sq.mapped
    async def sqlite_run(sql: str, timeout: float = 5.0) -> None:
        with contextlib.closing(sqlite3.connect(path, timeout=timeout)) as db:
            db.execute(sql)

    await sqlite_run("CREATE TABLE t (x)")
    with pytest.raises(AppError) as bug:
        await sqlite_run("SELECT * FROM nowhere")
    assert type(bug.value) is AppError and bug.value.status == 500
    with contextlib.closing(sqlite3.connect(path)) as holder:
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(Unavailable):
            await sqlite_run("INSERT INTO t VALUES (1)", timeout=0.05)

    @pg.mapped
    async def pg_run(url: str, sql: str, *args: object) -> None:
        conn = await asyncpg.connect(url, timeout=5)
        try:
            await conn.execute(sql, *args)
        finally:
            await conn.close()

    with pytest.raises(AppError) as bug:
        await pg_run(postgres_url, "SELECT * FROM nowhere")
    assert type(bug.value) is AppError
    with pytest.raises(AppError) as bug:
        await pg_run(postgres_url, "SELECT $1::int")  # the server expects 1 argument
    assert type(bug.value) is AppError and bug.value.status == 500
    with pytest.raises(BadRequest) as data:
        await pg_run(postgres_url, "SELECT $1::int", "not a number")  # asyncpg refuses it
    assert data.value.status == 400
    with pytest.raises(BadRequest) as data:
        await pg_run(postgres_url, "SELECT 1 / 0")
    assert data.value.status == 400
    with pytest.raises(Unavailable):
        await pg_run(f"postgresql://postgres@127.0.0.1:{free_port()}/x", "SELECT 1")


async def test_an_answer_the_store_never_took_is_saved_from_redis_after_its_process_died(
    hosts_env, fake_model
):
    """An answer ends while PostgreSQL is away; its process waits longer than the
    replay TTL for the store, then dies (kill -9). When the store is back, another
    process saves the answer from its log, whole: the log was held meanwhile."""
    pg = PostgresServer()
    pg.start()
    try:
        env = {**hosts_env, "STORE_URL": new_database(pg.url), "STREAM_REPLAY_TTL_SECONDS": "1"}
        with processes(2, env) as (a, b):
            async with httpx.AsyncClient(timeout=30, event_hooks=USER) as http:
                body = chat_body("q #tokens=30 #delay=0.05", chatId="held")
                async with http.stream("POST", a.url + "/api/chat/sse", json=body) as response:
                    events = iter_sse(response)
                    head = await read_events(events, 3)
                    pg.stop()
                    events = head + await rest(events)
                assert events[-1].type == "messageEnd"  # the client saw nothing of it
                await asyncio.sleep(4)  # past the replay TTL, the store still away
                a.kill()
                pg.start()

                async def saved():
                    answer = await http.get(b.url + "/api/chats/held")
                    if answer.status_code != 200:
                        return None
                    row = answer.json()["messages"][-1]
                    return row if row["status"] != "streaming" else None

                row = await wait_for(saved, timeout=30)
                assert row["status"] == "completed"
                assert row["content"] == answer_of(events)
    finally:
        pg.remove()


async def test_driver_errors_read_as_what_they_are():
    """A value the database cannot keep is a 400, a broken constraint a 409, a database
    that cannot be reached a 503 — and a bug (an unknown column) a 500, not "try again"."""
    import asyncpg

    from app.store.postgres import ERRORS

    @mapping_errors(ERRORS)
    async def raising(exc: BaseException) -> None:
        raise exc

    with pytest.raises(BadRequest, match="cannot keep") as data:
        await raising(asyncpg.exceptions.CharacterNotInRepertoireError("0x00"))
    assert data.value.status == 400
    with pytest.raises(Unavailable):
        await raising(asyncpg.exceptions.CannotConnectNowError("starting"))
    with pytest.raises(Unavailable):
        await raising(ConnectionResetError())
    with pytest.raises(BadRequest) as conflict:
        await raising(asyncpg.exceptions.UniqueViolationError("dup"))
    assert conflict.value.status == 409
    with pytest.raises(AppError) as bug:
        await raising(asyncpg.exceptions.UndefinedColumnError("no column"))
    assert type(bug.value) is AppError and bug.value.status == 500


async def test_sessions_ended_under_statements_are_503_and_leave_no_broken_connection(
    postgres_server,
):
    """PostgreSQL ends sessions mid-transaction, again and again (a restart or a
    failover looks like this): every write meanwhile is a 503 — never a 500 — and
    once it stops, every call works: no connection left stuck in the pool."""
    import asyncpg

    url = new_database(postgres_server)
    outcomes: dict[str, int] = {}
    async with open_store(url) as store:
        killer = await asyncpg.connect(url)

        async def one_round(name: str) -> None:
            now = time.time()
            chat = Chat(name, "1", "t", "webSearch", now)
            question = StoredMessage("q" + name, name, "user", "what", now)
            answer = StoredMessage("a" + name, name, "assistant", "", now, status="streaming")
            await store.begin_answer(chat, question, answer)
            await store.get_chat(name)
            await store.set_title(name, "x")

        async def work(worker: int, until: float) -> None:
            n = 0
            while time.monotonic() < until:
                n += 1
                try:
                    await one_round(f"w{worker}-{n}")
                    outcomes["ok"] = outcomes.get("ok", 0) + 1
                except Unavailable:
                    outcomes["503"] = outcomes.get("503", 0) + 1
                except AppError as exc:
                    what = repr(exc.__cause__)[:80]
                    outcomes[what] = outcomes.get(what, 0) + 1

        async def end_sessions(until: float) -> None:
            while time.monotonic() < until:
                await asyncio.sleep(0.05)
                await killer.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )

        try:
            until = time.monotonic() + 5
            await asyncio.gather(end_sessions(until), *(work(i, until) for i in range(20)))
        finally:
            await killer.close()
        assert set(outcomes) <= {"ok", "503"}, outcomes
        assert outcomes.get("503", 0) > 20  # sessions were ended under statements
        for attempt in range(3):  # a connection closed while idle fails its next call once
            try:
                await asyncio.gather(*(one_round(f"after{attempt}-{i}") for i in range(40)))
                break
            except Unavailable:
                continue
        await asyncio.gather(*(one_round(f"then-{i}") for i in range(40)))  # all of them work


# -- 5. background loops, tasks, and uploads that a stop cuts off ----------------------------------


async def test_a_supervised_loop_that_fails_is_started_again():
    runs = []

    async def body() -> None:
        runs.append(time.monotonic())
        if len(runs) < 3:
            raise RuntimeError("unexpected")
        await asyncio.sleep(3600)

    task = asyncio.create_task(supervised("test loop", body, first_delay=0.01))
    await wait_for(lambda: asyncio.sleep(0, len(runs) >= 3), timeout=3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_heartbeat_that_meets_an_unexpected_error_goes_on(redis_url):
    """The heartbeat fails once with an error nobody expected: it is logged and the
    heartbeat goes on, so the process keeps its claims (a dead heartbeat would let
    them expire and the chats be claimed twice)."""
    async with (
        redis_hub(redis_url, handle_ttl=1.2) as owner,
        redis_hub(redis_url, handle_ttl=1.2) as other,
    ):
        h = Handle("7", "700", "699", "1", "q")
        await owner.register(h, lambda: None)
        beat, failed = owner.beat, []

        async def failing_once() -> None:
            if not failed:
                failed.append(True)
                raise RuntimeError("a bug in the heartbeat")
            await beat()

        owner.beat = failing_once  # type: ignore[method-assign]
        await asyncio.sleep(3.0)  # two and a half claim TTLs
        assert failed
        assert await other.lookup("7") == h


async def test_an_upload_left_indexing_by_a_dead_process_is_marked_failed(tmp_path):
    store = open_store(f"sqlite:///{tmp_path}/files.db")
    async with store:
        old = time.time() - 120
        live = await store.lease_worker("live-token", 60, 1024)
        assert live >= 0
        for file_id, indexer in (("dead", "dead-token"), ("alive", "live-token"), ("none", "")):
            record = FileRecord(file_id, "1", f"{file_id}.txt", "txt", 3, old)
            await store.add_file(record, indexer)
        keeper = AnswerKeeper(
            store, MemoryHub(replay_ttl=5), checkpoint_interval=10, sweep_interval=60
        )
        await keeper.sweep()
        status = {f.id: (f.status, f.error) for f in await store.list_files("1")}
        assert status["alive"] == ("indexing", "")
        assert status["dead"][0] == status["none"][0] == "failed"
        assert "upload it again" in status["dead"][1]


async def test_a_collection_document_left_indexing_by_a_dead_process_is_failed_and_unindexed(
    tmp_path,
):
    """A process killed between putting a batch's passages in the engine and marking
    them ready: the sweep fails its documents and takes their passages back."""
    from app.collections import open_engine
    from app.collections.base import Passage
    from app.collections.retrieval import Retriever
    from app.collections.service import CollectionService
    from app.config import CollectionSettings, EmbeddingsSettings, UploadSettings
    from app.ids import Snowflake
    from app.model import Embedder

    store = open_store(f"sqlite:///{tmp_path}/documents.db")
    engine = open_engine(f"tantivy:///{tmp_path}/engine")
    embedder = Embedder(EmbeddingsSettings(model=""))
    async with store, engine:
        old = time.time() - 120
        assert await store.lease_worker("live-token", 60, 1024) >= 0
        await store.add_collection(CollectionRecord("c1", "1", "docs", "", old))
        for doc_id, indexer in (("dead", "dead-token"), ("alive", "live-token"), ("none", "")):
            record = DocumentRecord(doc_id, "c1", "i1", f"{doc_id}.txt", "txt", 3, old)
            await store.add_documents([record], indexer)
            await engine.add("c1", [Passage(doc_id, 0, 0, record.title, "File", "kestrel")])
        settings = CollectionSettings()
        retriever = Retriever(settings, engine=engine, embedder=embedder)
        service = CollectionService(
            settings,
            UploadSettings(),
            store=store,
            retriever=retriever,
            reader=None,
            ids=Snowflake(),
        )
        assert await service.sweep() == 2
        assert await service.sweep() == 0  # each is swept once
        status = {d.id: (d.status, d.error) for d in await store.list_documents("c1")}
        assert status["alive"] == ("indexing", "")
        assert status["dead"][0] == status["none"][0] == "failed"
        assert "add it again" in status["dead"][1]
        assert [p.document_id for p in await engine.passages("c1")] == ["alive"]
        await embedder.aclose()


async def test_an_upload_cut_by_a_stop_is_failed_not_left_indexing(settings, tmp_path, fake_model):
    """A big upload is being read in the background when the server stops: it is marked
    failed (upload it again), not left `indexing` for ever."""
    from tests.test_files import make_pdf

    big = make_pdf(filler=600)
    env = {
        "LLM_BASE_URL": settings.llm.base_url,
        "LLM_API_KEY": "test-key",
        "STORE_URL": settings.store.url,
    }
    server = AppProcess(env).start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
            answer = await http.post(
                "/api/uploads?wait=false&userId=1",
                files={"files": ("big.pdf", big, "application/pdf")},
            )
            assert answer.status_code == 202
            file_id = answer.json()["files"][0]["fileId"]
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(30)
        restarted = AppProcess(env).start()
        try:
            async with httpx.AsyncClient(base_url=restarted.url, timeout=20) as http:
                record = (await http.get(f"/api/uploads/{file_id}?userId=1")).json()
            assert record["status"] in ("failed", "ready"), record
            if record["status"] == "failed":
                assert "upload it again" in record["error"]
        finally:
            restarted.stop()
    finally:
        server.stop()


async def test_until_deadline_waits_for_what_it_cancels():
    ended: list[str] = []

    async def slow(name: str) -> str:
        try:
            await asyncio.sleep(10)
        finally:
            await asyncio.sleep(0.05)  # cleaning up takes a moment
            ended.append(name)
        return name

    async def quick() -> str:
        return "quick"

    loop = asyncio.get_running_loop()
    got = await until_deadline([quick(), slow("a"), slow("b")], loop.time() + 0.1)
    assert got == ["quick", None, None]
    assert sorted(ended) == ["a", "b"]  # both had ended when it returned


# -- one process without Redis -----------------------------------------------------------------------


async def test_without_redis_a_crash_loses_at_most_a_flush_interval(
    tmp_path, model_url, fake_model
):
    """One process, SQLite, no Redis, killed outright mid-answer: when it starts again
    the answer is closed with what was checkpointed — all a client had seen but at most
    `stream.flush_interval_ms` of it."""
    env = {
        "LLM_BASE_URL": model_url,
        "LLM_API_KEY": "test-key",
        "STORE_URL": f"sqlite:///{tmp_path}/chat.db",
        "STREAM_FLUSH_INTERVAL_MS": "200",
    }
    crashed = AppProcess(env).start()
    async with httpx.AsyncClient(timeout=30, event_hooks=USER) as http:
        async with http.stream(
            "POST",
            crashed.url + "/api/chat/sse",
            json=chat_body("#tokens=2000 #delay=0.01", chatId="s1"),
        ) as response:
            head = await read_events(iter_sse(response), 100)
            crashed.kill()
            shown = answer_of(await received_until_cut(response, head))
        restarted = AppProcess(env).start()
        try:

            async def closed():
                row = (await http.get(restarted.url + "/api/chats/s1")).json()["messages"][-1]
                return row if row["status"] != "streaming" else None

            row = await wait_for(closed, timeout=10)
        finally:
            restarted.stop()
            crashed.stop()
    assert row["status"] == "failed"
    saved = row["content"]
    assert saved and shown.startswith(saved), (saved[-40:], shown[-40:])
    # 200 ms of tokens 10 ms apart, and a little for the kill to land
    assert shown.count("tok") - saved.count("tok") <= 30


def test_a_running_answers_progress_reads_only_what_was_added():
    """What a checkpoint saves grows with the answer, read incrementally: the same as
    joining everything written so far, at every step."""
    from app.chat.keeper import Progress, steps_of
    from app.events import Event

    progress, content, reasoning, events = Progress(), [], [], []
    for i in range(6):
        content.append(f"tok{i} ")
        if i % 2:
            reasoning.append(f"r{i}")
        events.append(
            Event("progress" if i % 3 == 0 else "message", "c", "a", {"data": f"s{i}"}, i + 1)
        )
        progress.update(content, reasoning, events)
        assert progress.content == "".join(content)
        assert progress.reasoning == "".join(reasoning)
        assert progress.steps == steps_of(events)
    progress.update(content, reasoning, events)  # nothing new: nothing changes
    assert progress.steps == ["s0", "s3"]
