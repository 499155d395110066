"""The store away, refusing or cut off, on SQLite and a real PostgreSQL: answers
still end and are saved when it returns, one refused save never holds back the
others, NUL bytes and lone surrogates are cleaned, and driver errors read as what
they are."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sqlite3
import time

import httpx
import orjson
import pytest
from httpx_ws import aconnect_ws

from app.chat.keeper import MAX_ATTEMPTS, AnswerKeeper
from app.errors import AppError, BadRequest, Unavailable
from app.main import create_app
from app.store import Chat, Checkpoint, Saved, StoredMessage, open_store
from app.store.base import mapping_errors
from app.store.sqlite import sqlite_path
from app.streams.memory import MemoryHub
from tests.client import (
    SseEvent,
    answer_of,
    chat_body,
    iter_sse,
    read_events,
    read_sse_events,
    rest,
    wait_for,
)
from tests.conftest import USER, PostgresServer, new_database
from tests.servers import free_port, serve

pytestmark = pytest.mark.anyio


async def test_a_postgres_restart_mid_generation_loses_nothing(settings, fake_model):
    from tests.conftest import PostgresServer, new_database

    postgres = PostgresServer()
    postgres.start()
    try:
        store_url = new_database(postgres.url)
        with serve(create_app(settings.replace(store={"url": store_url}))) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
                async with http.stream(
                    "POST",
                    "/api/chat/sse",
                    json=chat_body("long #tokens=60 #delay=0.02", chatId="995"),
                ) as response:
                    events = []
                    async for item in iter_sse(response):
                        if isinstance(item, SseEvent):
                            events.append(item)
                            if len(events) == 5:
                                postgres.stop()  # the database restarts mid-answer ...
                                postgres.start()
                assert events[-1].data["status"] == "completed"  # ... and the answer is saved
                answer = (await http.get("/api/chats/995")).json()["messages"][-1]
                assert answer["status"] == "completed"
                assert answer["content"] == "".join(f"tok{i} " for i in range(60))
    finally:
        postgres.remove()


async def test_answers_that_end_while_postgres_is_down_are_saved_when_it_returns(
    settings, fake_model
):
    pg = PostgresServer()
    pg.start()
    try:
        app = create_app(settings.replace(store={"url": new_database(pg.url)}))
        with serve(app) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as http:

                async def answer(i):
                    body = chat_body(f"q{i} #tokens=40 #delay=0.05", chatId=f"pg{i}")
                    async with http.stream("POST", "/api/chat/sse", json=body) as response:
                        return await rest(iter_sse(response))

                streams = [asyncio.create_task(answer(i)) for i in range(10)]
                await asyncio.sleep(0.6)
                pg.stop()  # down for ~6 s while every answer finishes
                down = await http.post("/api/chat/sse", json=chat_body("new chat meanwhile"))
                assert down.status_code == 503
                assert down.json() == {
                    "type": "error",
                    "key": "INTERNAL",
                    "data": "the chat store is unavailable; try again shortly",
                }
                results = await asyncio.gather(*streams)
                for events in results:  # the clients saw nothing of it
                    assert events[-1].type == "messageEnd", events[-1]
                    assert events[-1].data["status"] == "completed"
                await asyncio.sleep(6 - 2.5)
                pg.start()

                async def saved():
                    rows = [
                        (await http.get(f"/api/chats/pg{i}")).json()["messages"][-1]
                        for i in range(10)
                    ]
                    return rows if all(r["status"] != "streaming" for r in rows) else None

                rows = await wait_for(saved, timeout=20)
                for i, row in enumerate(rows):
                    assert row["status"] == "completed"
                    assert row["content"] == answer_of(results[i])  # lost: 0 of 10
    finally:
        pg.remove()


async def test_a_store_that_is_down_at_the_start_is_a_503_or_an_error_frame(settings, fake_model):
    pg = PostgresServer()
    pg.start()
    try:
        app = create_app(settings.replace(store={"url": new_database(pg.url)}))
        with serve(app) as server:
            pg.stop()
            async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
                for body in (chat_body("new chat"), chat_body("in a chat", chatId="e1")):
                    refused = await http.post("/api/chat/sse", json=body)
                    assert refused.status_code == 503, refused.text
                    assert refused.headers["content-type"] == "application/json"
                    assert refused.json()["key"] == "INTERNAL"
                    assert not re.search(r"Error|127\.0\.0\.1|:\d{4,5}", refused.text)
                assert (await http.get("/api/chats")).status_code == 503
            async with aconnect_ws(server.ws_url + "/api/chat/ws", httpx.AsyncClient()) as ws:
                await ws.receive_text()
                await ws.send_text(orjson.dumps(chat_body("q", chatId="e2")).decode())
                frame = orjson.loads(await ws.receive_text())
                assert (frame["type"], frame["key"], frame["chatId"]) == ("error", "INTERNAL", "e2")
                await ws.send_text('{"type": "ping"}')
                assert orjson.loads(await ws.receive_text()) == {"type": "pong"}  # still open
    finally:
        pg.remove()


async def test_an_answer_still_ends_when_the_store_refuses_to_save_it(settings, fake_model):
    """Postgres turned read-only mid-answer (as after a failover): the client gets its
    end, the chat is free again, and the answer is saved once writes come back."""
    pg = PostgresServer()
    pg.start()
    try:
        url = new_database(pg.url)
        name = url.rsplit("/", 1)[1]

        async def read_only(on: bool) -> None:
            import asyncpg

            conn = await asyncpg.connect(pg.url + "/postgres")
            try:
                value = "on" if on else "off"
                await conn.execute(
                    f"ALTER DATABASE {name} SET default_transaction_read_only = {value}"
                )
                await conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = $1 AND pid <> pg_backend_pid()",
                    name,
                )
            finally:
                await conn.close()

        with serve(create_app(settings.replace(store={"url": url}))) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as http:
                body = chat_body("#tokens=60 #delay=0.02", chatId="ro1")
                async with http.stream("POST", "/api/chat/sse", json=body) as response:
                    stream = iter_sse(response)
                    head = await read_events(stream, 5)
                    await read_only(True)
                    tail = await rest(stream)
                assert tail[-1].type == "messageEnd" and tail[-1].data["status"] == "completed"
                await read_only(False)

                async def saved():
                    response = await http.get("/api/chats/ro1")
                    if response.status_code != 200:
                        return None
                    answer = response.json()["messages"][-1]
                    return answer if answer["status"] == "completed" else None

                answer = await wait_for(saved, timeout=20)
                assert answer["content"] == answer_of(head + tail)
                again = await read_sse_events(http, chat_body("again #tokens=2", chatId="ro1"))
                assert again[-1].data["status"] == "completed"  # not "already running"
    finally:
        pg.remove()


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
    """Make the database itself refuse every answer whose text holds `word`, saved
    whole or in a checkpoint's part: triggers in SQLite, CHECK constraints in PostgreSQL
    (rows already there are left as they are)."""
    if url.startswith("sqlite"):
        with contextlib.closing(sqlite3.connect(sqlite_path(url))) as db:
            for table, when in (("messages", "UPDATE"), ("answer_parts", "INSERT")):
                db.execute(
                    f"CREATE TRIGGER refuse_{table} BEFORE {when} ON {table}"
                    f" WHEN NEW.content LIKE '%{word}%' BEGIN SELECT RAISE(ABORT, 'refused'); END"
                )
            db.commit()
        return
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        for table in ("messages", "answer_parts"):
            await conn.execute(
                f"ALTER TABLE {table} ADD CONSTRAINT refuse_{table}"
                f" CHECK (content NOT LIKE '%{word}%') NOT VALID"
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


class Written:
    """A running answer that grows by what a test appends to it."""

    def __init__(self, answer_id: str) -> None:
        self.answer_id = answer_id
        self.content = self.reasoning = ""
        self.steps: list[str] = []
        self.seq = 0

    def add(self, content: str = "", reasoning: str = "") -> None:
        self.content += content
        self.reasoning += reasoning
        self.seq += 1

    def progress(self) -> tuple[int, Checkpoint]:
        return self.seq, Checkpoint(self.answer_id, self.content, self.reasoning, self.steps)


def idle_keeper(store) -> AnswerKeeper:
    """A keeper whose own checkpoints and sweeps do not come in a test's time: the test
    calls `checkpoint()` itself."""
    return AnswerKeeper(store, MemoryHub(replay_ttl=5), checkpoint_interval=10, sweep_interval=60)


def recording(store) -> list[Checkpoint]:
    """What `store` is sent to checkpoint from now on, in order, as it is sent."""
    sent: list[Checkpoint] = []
    checkpoint_answers = store.checkpoint_answers

    async def recorded(progress):
        sent.extend(progress)
        await checkpoint_answers(progress)

    store.checkpoint_answers = recorded
    return sent


async def test_checkpoints_send_what_was_added_and_keep_the_whole_answer(store_url):
    """A checkpoint sends each running answer only what was added since the last one,
    and the row holds the whole answer after each (a NUL, which the store drops, and
    text beyond the first characters included); the same checkpoint sent twice (its
    commit's answer lost) leaves the row as once."""
    store = open_store(store_url)
    async with store:
        await add_answers(store, ["grows"], time.time())
        keeper = idle_keeper(store)
        sent = recording(store)
        answer = Written("grows")
        keeper.track(answer)
        answer.add("Héllo", "think")
        assert await keeper.checkpoint() == 1
        answer.add(" w\x00orld", "ing")
        assert await keeper.checkpoint() == 1
        assert await keeper.checkpoint() == 0  # nothing new
        answer.add("! 🙂", "")
        assert await keeper.checkpoint() == 1
        assert [(c.content, c.content_from) for c in sent] == [  # after so many bytes
            ("Héllo", 0),
            (" w\x00orld", 6),
            ("! 🙂", 12),
        ]
        assert [(c.reasoning, c.reasoning_from) for c in sent] == [
            ("think", 0),
            ("ing", 5),
            ("", 8),
        ]
        row = await last_message(store, "grows")
        assert (row.content, row.reasoning) == ("Héllo world! 🙂", "thinking")
        await store.checkpoint_answers([sent[-1]])  # sent again
        row = await last_message(store, "grows")
        assert (row.content, row.reasoning) == ("Héllo world! 🙂", "thinking")


async def test_checkpoints_send_progress_lines_only_when_they_change(store_url):
    store = open_store(store_url)
    async with store:
        await add_answers(store, ["steps"], time.time())
        keeper = idle_keeper(store)
        sent = recording(store)
        answer = Written("steps")
        keeper.track(answer)
        for text, steps in (
            ("a", ["searching"]),
            ("b", ["searching"]),
            ("c", ["searching", "reading"]),
        ):
            answer.add(text)
            answer.steps = steps
            assert await keeper.checkpoint() == 1
        assert [c.steps_changed for c in sent] == [True, False, True]
        row = await last_message(store, "steps")
        assert (row.content, row.steps) == ("abc", ["searching", "reading"])


async def test_a_checkpoint_whose_outcome_was_lost_is_followed_by_the_whole_answer(store_url):
    """A checkpoint written by the store whose answer never came back (the store went
    away, or did not answer in time) leaves the keeper not knowing what the row holds:
    the next checkpoint sends that answer whole, and the row holds it all again."""
    store = open_store(store_url)
    async with store:
        await add_answers(store, ["lost"], time.time())
        keeper = idle_keeper(store)
        sent: list[Checkpoint] = []
        checkpoint_answers = store.checkpoint_answers
        lose = [False]

        async def written_then_lost(progress):
            sent.extend(progress)
            await checkpoint_answers(progress)
            if lose[0]:
                lose[0] = False
                raise Unavailable("the store went away")

        store.checkpoint_answers = written_then_lost
        answer = Written("lost")
        keeper.track(answer)
        answer.add("one", "a")
        assert await keeper.checkpoint() == 1
        answer.add(" two", "b")
        lose[0] = True
        with pytest.raises(Unavailable):
            await keeper.checkpoint()
        answer.add(" three", "c")
        assert await keeper.checkpoint() == 1
        answer.add(" four", "")
        assert await keeper.checkpoint() == 1
        assert [(c.content, c.content_from) for c in sent] == [
            ("one", 0),
            (" two", 3),
            ("one two three", -1),  # whole: what the row held was not known
            (" four", 13),
        ]
        row = await last_message(store, "lost")
        assert (row.content, row.reasoning) == ("one two three four", "abc")


async def test_a_checkpoint_of_many_answers_goes_in_slices(store_url):
    """A checkpoint of more running answers than a slice sends them in several store
    calls, a slice each; one that ends meanwhile is not sent; a slice whose outcome
    was lost leaves those before it saved and its own answers sent whole next time,
    and those after it are sent then."""
    store = open_store(store_url)
    async with store:
        ids = [f"many{n}" for n in range(7)]
        await add_answers(store, ids, time.time())
        keeper = idle_keeper(store)
        keeper.checkpoint_slice = 2
        calls: list[list[tuple[str, int]]] = []
        checkpoint_answers = store.checkpoint_answers
        lose_call = [-1]

        async def sliced(progress):
            calls.append([(c.answer_id, c.content_from) for c in progress])
            if len(calls) == 1:
                keeper.untrack("many3")  # ends while the first slice is written
            await checkpoint_answers(progress)
            if len(calls) == lose_call[0]:
                raise Unavailable("the store went away")

        store.checkpoint_answers = sliced
        answers = [Written(answer_id) for answer_id in ids]
        for answer in answers:
            keeper.track(answer)
            answer.add("one ")
        assert await keeper.checkpoint() == 6
        assert calls == [
            [("many0", 0), ("many1", 0)],
            [("many2", 0)],
            [("many4", 0), ("many5", 0)],
            [("many6", 0)],
        ]
        calls.clear()
        for answer in answers:
            answer.add("two")
        lose_call[0] = 2
        with pytest.raises(Unavailable):
            await keeper.checkpoint()
        assert calls == [[("many0", 4), ("many1", 4)], [("many2", 4), ("many4", 4)]]
        calls.clear()
        lose_call[0] = -1
        assert await keeper.checkpoint() == 4
        assert calls == [[("many2", -1), ("many4", -1)], [("many5", 4), ("many6", 4)]]
        for answer_id in ids:
            if answer_id != "many3":
                assert (await last_message(store, answer_id)).content == "one two"


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


def test_a_running_answers_progress_reads_only_what_was_added():
    """What a checkpoint saves grows with the answer, read incrementally: the same as
    joining everything written so far, at every step."""
    from app.chat.keeper import Progress, steps_of
    from app.events import Event
    from app.streams import LoggedEvents

    progress, content, reasoning, events = Progress(), [], [], LoggedEvents("c", "a")
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
