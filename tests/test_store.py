"""One contract for the store, run on SQLite and on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import pytest

from app.errors import Conflict, Forbidden, NotFound, Unavailable
from app.store import (
    Chat,
    Checkpoint,
    Saved,
    StoredMessage,
    StoredResponse,
    StreamingAnswer,
    open_store,
)
from app.store.postgres import MIGRATIONS as PG_MIGRATIONS
from app.store.sqlite import MIGRATIONS as SQLITE_MIGRATIONS
from tests.conftest import asyncio_run_in_thread

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/store.db"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
async def store(store_url):
    async with open_store(store_url) as opened:
        yield opened


def chat(id="c1", user="u7", at=None, title="t"):
    return Chat(id, user, title, "webSearch", at or time.time())


def message(id, chat_id="c1", role="user", at=None, **kw):
    return StoredMessage(
        id, chat_id, role, kw.pop("content", f"text {id}"), at or time.time(), **kw
    )


def answer(id, question, at, chat_id="c1"):
    return message(id, chat_id, "assistant", at, content="", status="streaming", reply_to=question)


async def ask(store, chat_id, question_id, answer_id, at, user="u7"):
    return await store.begin_answer(
        chat(chat_id, user, at),
        message(question_id, chat_id, at=at),
        answer(answer_id, question_id, at + 0.000001, chat_id),
    )


async def test_a_question_creates_its_chat_once_and_chats_list_newest_first(store):
    assert await ask(store, "c1", "q1", "a1", 100.0)
    assert not await ask(store, "c1", "q2", "a2", 101.0)  # the chat exists
    await ask(store, "c2", "q3", "a3", 200.0)
    await ask(store, "c3", "q4", "a4", 300.0, user="u8")
    assert [c.id for c in await store.list_chats("u7")] == ["c2", "c1"]
    assert [c.id for c in await store.list_chats("u7", limit=1)] == ["c2"]
    got = await store.get_chat("c1")
    assert (got.id, got.user_id, got.title, got.focus_mode, got.created_at) == (
        "c1",
        "u7",
        "t",
        "webSearch",
        100.0,
    )
    await store.set_title("c1", "New title")
    assert (await store.get_chat("c1")).title == "New title"
    assert await store.delete_chat("c1")
    assert not await store.delete_chat("c1")
    assert await store.get_chat("c1") is None
    assert await store.get_message("q1") is None
    assert await store.get_chat("999") is None


async def test_a_taken_message_id_is_a_conflict_and_writes_nothing(store):
    await ask(store, "c1", "q1", "a1", 100.0)
    with pytest.raises(Conflict, match="already used"):
        await ask(store, "c9", "q1", "a9", 101.0)  # the same question id, another chat
    assert await store.get_chat("c9") is None  # rolled back with it
    assert await store.get_message("a9") is None


async def test_posting_into_another_users_chat_is_forbidden(store):
    await ask(store, "c1", "q1", "a1", 100.0)
    with pytest.raises(Forbidden):
        await ask(store, "c1", "q2", "a2", 101.0, user="u8")
    assert await store.get_message("q2") is None


async def test_same_question_sent_twice_at_once_starts_one_answer(store):
    results = await asyncio.gather(
        ask(store, "c1", "q1", "a1", 100.0),
        ask(store, "c2", "q1", "a2", 100.0),
        return_exceptions=True,
    )
    assert sorted(type(r).__name__ for r in results) == ["Conflict", "bool"]


async def test_finishing_saves_text_status_rewrite_and_sources(store):
    await ask(store, "c1", "q1", "a1", 10.0)
    sources = [{"metadata": {"title": "T", "url": "https://x/ü"}, "pageContent": "snippet ☃"}]
    await store.set_sources("q1", sources[:0])
    saved = Saved("answer", "because", "cancelled", "q1", rewritten="standalone?", sources=sources)
    assert await store.finish_answer("a1", saved)
    question, ans = await store.list_messages("c1")
    assert (question.rewritten, question.sources, question.role) == ("standalone?", sources, "user")
    assert (ans.content, ans.reasoning, ans.status, ans.reply_to) == (
        "answer",
        "because",
        "cancelled",
        "q1",
    )
    assert (ans.steps, ans.error) == ([], None)
    # a sweeper never overwrites what its owner saved
    assert not await store.finish_answer("a1", Saved("", "", "failed"), only_streaming=True)
    assert (await store.get_message("a1")).status == "cancelled"


async def test_an_answer_keeps_its_steps_and_its_error(store):
    await ask(store, "c1", "q1", "a1", 10.0)
    steps = ["searching the web: ü?", "reading 2 pages"]
    error = {"key": "STREAM_ERROR", "data": "the model stream broke"}
    await store.finish_answer("a1", Saved("part", "", "failed", steps=steps, error=error))
    answer = await store.get_message("a1")
    assert (answer.status, answer.steps, answer.error) == ("failed", steps, error)
    assert (await store.list_messages("c1"))[1].steps == steps


async def test_streaming_answers_are_found_for_the_sweeper(store):
    await ask(store, "c1", "q1", "a1", 10.0)
    await ask(store, "c2", "q2", "a2", 20.0)
    await store.finish_answer("a2", Saved("done", "", "completed"))
    assert await store.streaming_answers(created_before=15.0) == [
        StreamingAnswer("a1", "c1", 10.000001)
    ]
    assert [m.id for m in await store.streaming_answers(created_before=5.0)] == []


async def test_checkpoints_add_parts_that_reads_fold_in_and_the_end_makes_whole(store):
    await ask(store, "c1", "q1", "a1", 10.0)
    await ask(store, "c2", "q2", "a2", 11.0)
    await store.checkpoint_answers(
        [Checkpoint("a1", "Hello ", "hm", ["searching"]), Checkpoint("a2", "Hi", "", [])]
    )
    more = Checkpoint("a1", "wörld", " ok", ["searching"], 6, 2, steps_changed=False)
    await store.checkpoint_answers([more])
    await store.checkpoint_answers([more])  # sent again: its part is there already
    a1 = await store.get_message("a1")
    assert (a1.content, a1.reasoning, a1.steps) == ("Hello wörld", "hm ok", ["searching"])
    # a part of reasoning only, then progress lines only
    await store.checkpoint_answers([Checkpoint("a1", "", "!", ["searching"], 12, 5, False)])
    await store.checkpoint_answers([Checkpoint("a1", "", "", ["searching", "reading"], 12, 6)])
    a1 = await store.get_message("a1")
    assert (a1.content, a1.reasoning, a1.steps) == (
        "Hello wörld",
        "hm ok!",
        ["searching", "reading"],
    )
    assert [m.content for m in await store.list_messages("c1")] == ["text q1", "Hello wörld"]
    running = await store.streaming_answers(created_before=20.0)
    assert [(await store.get_message(m.id)).content for m in running] == ["Hello wörld", "Hi"]
    # what the checkpoints added was not written into the answer's row
    db = store.db
    assert await db.fetchval("SELECT content FROM messages WHERE id = ?", "a1") == ""
    # an answer whose stored text is not known is sent whole, and its parts go
    await store.checkpoint_answers([Checkpoint("a2", "Hi there", "", ["x"], -1, -1)])
    a2 = await store.get_message("a2")
    assert (a2.content, a2.steps) == ("Hi there", ["x"])
    # the end saves the answer whole; a checkpoint that comes after it adds nothing
    await store.finish_answer("a1", Saved("Hello wörld!", "hm ok!", "completed"))
    await store.checkpoint_answers([Checkpoint("a1", " late", "", [], 12, 6)])
    assert (await store.get_message("a1")).content == "Hello wörld!"
    assert await db.fetchval("SELECT count(*) FROM answer_parts") == 0
    # a running answer's parts go with its chat
    await store.checkpoint_answers([Checkpoint("a2", "!", "", ["x"], 8, 0, steps_changed=False)])
    assert (await store.get_message("a2")).content == "Hi there!"
    assert await store.delete_chat("c2")
    assert await db.fetchval("SELECT count(*) FROM answer_parts") == 0


async def test_a_checkpoint_waits_for_an_end_being_saved_and_adds_nothing_after_it(
    postgres_url,
):
    """The end's save holds the answer's row; a checkpoint of it meanwhile waits, then
    finds it ended: no part is left behind the whole answer."""
    import asyncpg

    async with open_store(postgres_url) as store:
        await ask(store, "c1", "q1", "a1", 10.0)
        conn = await asyncpg.connect(postgres_url)
        try:
            ending = conn.transaction()
            await ending.start()
            await conn.execute(
                "UPDATE messages SET content = 'whole', status = 'completed' WHERE id = 'a1'"
            )
            await conn.execute("DELETE FROM answer_parts WHERE answer_id = 'a1'")
            checkpoint = asyncio.create_task(
                store.checkpoint_answers([Checkpoint("a1", "part", "", [], 0, 0, False)])
            )
            await asyncio.sleep(0.5)
            assert not checkpoint.done()  # it waits for the end's save
            await ending.commit()
            await checkpoint
        finally:
            await conn.close()
        assert await store.db.fetchval("SELECT count(*) FROM answer_parts") == 0
        assert (await store.get_message("a1")).content == "whole"


async def test_regenerate_deletes_the_answer_and_everything_after(store):
    await ask(store, "c1", "q1", "a1", 10.0)
    await ask(store, "c1", "q2", "a2", 20.0)
    await ask(store, "c1", "q3", "a3", 30.0)
    q2 = await store.get_message("q2")
    await store.begin_answer(
        await store.get_chat("c1"), q2, answer("a2b", "q2", 40.0), regenerate=True
    )
    assert [m.id for m in await store.list_messages("c1")] == ["q1", "a1", "q2", "a2b"]


async def test_a_response_keeps_its_request_and_outcome_and_goes_with_its_answer(store):
    await ask(store, "c1", "q1", "a1", 100.0)
    await ask(store, "c1", "q2", "a2", 101.0)
    asked = {"model": "webSearch:quality", "metadata": {"k": "v"}, "include": ["x"]}
    await store.add_response(StoredResponse("a2", asked, previous="a1"))
    got = await store.get_response("a2")
    assert (got.request, got.previous, got.outcome) == (asked, "a1", None)
    outcome = [{"type": "messageEnd", "data": {"status": "completed", "images": []}}]
    await store.end_response("a2", outcome)
    assert (await store.get_response("a2")).outcome == outcome
    assert await store.get_response("a1") is None
    await store.begin_answer(
        chat(), message("q2", at=101.0), answer("a3", "q2", 102.0), regenerate=True
    )
    assert await store.get_response("a2") is None  # its answer was regenerated away


async def test_deleting_a_turn_keeps_the_rest_of_its_chat(store):
    await ask(store, "c1", "q1", "a1", 100.0)
    await ask(store, "c1", "q2", "a2", 101.0)
    await store.add_response(StoredResponse("a2", {"model": "deepSeek"}, previous="a1"))
    assert not await store.delete_turn("q1")  # a question is not a turn's answer
    assert await store.delete_turn("a2")
    assert not await store.delete_turn("a2")
    assert [m.id for m in await store.list_messages("c1")] == ["q1", "a1"]
    assert await store.get_response("a2") is None
    assert await store.delete_turn("a1")  # the last turn: the chat goes too
    assert await store.get_chat("c1") is None and await store.list_messages("c1") == []


async def test_worker_numbers_are_leased_one_per_process(store):
    leased = [await store.lease_worker(f"p{i}", ttl=30, workers=8) for i in range(8)]
    assert sorted(leased) == list(range(8))
    with pytest.raises(Unavailable):
        await store.lease_worker("p9", ttl=30, workers=8)
    assert await store.renew_worker(leased[0], "p0", ttl=30)
    assert not await store.renew_worker(leased[0], "someone else", ttl=30)
    await store.release_worker(leased[3], "p3")
    assert await store.lease_worker("p9", ttl=30, workers=8) == leased[3]


async def test_an_expired_lease_is_taken_over(store):
    first = await store.lease_worker("old", ttl=0.01, workers=1)
    await asyncio.sleep(0.05)
    assert await store.lease_worker("new", ttl=30, workers=1) == first
    assert not await store.renew_worker(first, "old", ttl=30)


async def test_a_secret_is_made_once_and_shared(store_url):
    async with open_store(store_url) as one, open_store(store_url) as two:
        value = await one.secret("links")
        assert len(value) == 64 and await two.secret("links") == value
        assert await one.secret("other") != value


async def test_reopening_runs_no_migration_twice(store_url):
    async with open_store(store_url) as first:
        await ask(first, "c1", "q1", "a1", 1.0)
    async with open_store(store_url) as second:  # re-run on an up-to-date schema
        assert (await second.get_chat("c1")).id == "c1"
        await second.ping()


async def test_concurrent_starts_share_one_schema(store_url):
    stores = [open_store(store_url) for _ in range(4)]
    await asyncio.gather(*(s.open() for s in stores))
    try:
        await asyncio.gather(
            *(ask(s, f"c{i}", f"q{i}", f"a{i}", float(i)) for i, s in enumerate(stores))
        )
        assert len(await stores[0].list_chats("u7")) == 4
    finally:
        await asyncio.gather(*(s.close() for s in stores))


async def test_a_database_of_the_first_schema_is_upgraded_with_its_chats(store_url, tmp_path):
    """Integer ids of the first schema become their decimal text, and nothing is lost."""
    if store_url.startswith("sqlite"):
        path = store_url.removeprefix("sqlite:///")
        db = sqlite3.connect(path)
        db.executescript(SQLITE_MIGRATIONS[0])
        db.execute("PRAGMA user_version=1")
        _first_schema_rows(db.execute)
        db.commit()
        db.close()
    else:
        asyncio_run_in_thread(_first_schema_postgres(store_url))
    async with open_store(store_url) as upgraded:
        (got,) = await upgraded.list_chats("7")
        assert (got.id, got.user_id, got.title) == ("7138337258229764", "7", "old chat")
        messages = await upgraded.list_messages("7138337258229764")
        assert [(m.id, m.role, m.content, m.reply_to) for m in messages] == [
            ("71383373052067817", "user", "old question", None),
            ("493612582016638976", "assistant", "old answer", "71383373052067817"),
        ]
        # and new, opaque ids go in beside them
        await ask(upgraded, "7138337258229764", "deadbeef", "cafe", 3.0, user="7")
        assert len(await upgraded.list_messages("7138337258229764")) == 4


FIRST_SCHEMA_ROWS = [
    ("INSERT INTO chats VALUES (7138337258229764, 7, 'old chat', 'webSearch', 1.0)", ()),
    (
        "INSERT INTO messages (id, chat_id, role, content, status, created_at)"
        " VALUES (71383373052067817, 7138337258229764, 'user', 'old question', 'completed', 1.0)",
        (),
    ),
    (
        "INSERT INTO messages (id, chat_id, role, content, status, reply_to, created_at)"
        " VALUES (493612582016638976, 7138337258229764, 'assistant', 'old answer',"
        " 'completed', 71383373052067817, 2.0)",
        (),
    ),
]


def _first_schema_rows(execute):
    for sql, params in FIRST_SCHEMA_ROWS:
        execute(sql, params)


async def _first_schema_postgres(url):
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        await conn.execute(PG_MIGRATIONS[0])
        await conn.execute(
            "CREATE TABLE schema_migrations ("
            " version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        )
        await conn.execute("INSERT INTO schema_migrations (version) VALUES (1)")
        for sql, _ in FIRST_SCHEMA_ROWS:
            await conn.execute(sql)
    finally:
        await conn.close()


#: an answer of the schema before the daily token tally (migration 9): 40 tokens on day 20000
USED_BEFORE_THE_TALLY = [
    "INSERT INTO chats (id, user_id, title, focus_mode, created_at)"
    " VALUES ('c1', 'u7', 't', 'webSearch', 1728000100.0)",
    "INSERT INTO messages (id, chat_id, role, content, status, created_at, model,"
    " prompt_tokens, completion_tokens) VALUES ('a1', 'c1', 'assistant', 'x', 'completed',"
    " 1728000100.5, 'm', 30, 10)",
]


async def test_the_daily_token_tally_starts_from_the_answers_saved_before_it(store_url):
    """Upgrading does not hand back what was used today: the tally is filled from the
    answers already saved."""
    tally = next(i for i, script in enumerate(SQLITE_MIGRATIONS) if "tokens_by_day" in script)
    assert "tokens_by_day" in SQLITE_MIGRATIONS[tally] and "tokens_by_day" in PG_MIGRATIONS[tally]
    if store_url.startswith("sqlite"):
        db = sqlite3.connect(store_url.removeprefix("sqlite:///"))
        for script in SQLITE_MIGRATIONS[:tally]:
            db.executescript(script)
        db.execute(f"PRAGMA user_version={tally}")
        for sql in USED_BEFORE_THE_TALLY:
            db.execute(sql)
        db.commit()
        db.close()
    else:
        asyncio_run_in_thread(_postgres_before_the_tally(store_url, tally))
    async with open_store(store_url) as upgraded:
        assert await upgraded.tokens_on(20_000, "u7") == 40
        assert await upgraded.tokens_by_user(20_000) == {"u7": 40}


async def _postgres_before_the_tally(url, tally):
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        for script in PG_MIGRATIONS[:tally]:
            await conn.execute(script)
        await conn.execute(
            "CREATE TABLE schema_migrations ("
            " version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        )
        for version in range(1, tally + 1):
            await conn.execute("INSERT INTO schema_migrations (version) VALUES ($1)", version)
        for sql in USED_BEFORE_THE_TALLY:
            await conn.execute(sql)
    finally:
        await conn.close()


async def test_an_unreachable_store_is_unavailable_not_a_driver_error(tmp_path):
    store = open_store(f"sqlite:///{tmp_path}/x.db")
    with pytest.raises(Unavailable, match="store is unavailable"):
        await store.get_chat("c1")  # never opened


def test_unknown_store_scheme_is_refused():
    with pytest.raises(ValueError, match="unsupported store URL"):
        open_store("mysql://x")


async def test_postgres_without_a_statement_cache_as_behind_pgbouncer(postgres_url):
    """`store.statement_cache_size = 0` (PgBouncer in transaction mode): every
    operation still works, answers included, with no statement cached."""
    async with open_store(postgres_url, pool_size=2, statement_cache_size=0) as opened:
        assert await ask(opened, "c1", "q1", "a1", 100.0)
        await opened.finish_answer("a1", Saved("done", "", "completed"))
        assert [m.content for m in await opened.list_messages("c1")] == ["text q1", "done"]
        async with opened.pool.acquire() as connection:
            assert connection._stmt_cache.get_max_size() == 0  # asyncpg's own cache, off


async def test_collections_their_shares_and_documents(store):
    from dataclasses import replace

    from app.store import CollectionRecord, DocumentRecord

    mine = CollectionRecord("k1", "u1", "Handbooks", "all of them", 10.0, shared=("u2",))
    await store.add_collection(mine)
    await store.add_collection(CollectionRecord("k2", "u2", "Theirs", "", 11.0))
    docs = [
        DocumentRecord("d1", "k1", "i1", "a/b.md", "text", 10, 12.0),
        DocumentRecord(
            "d2", "k1", "i1", "c.pdf", "pdf", 20, 13.0, status="failed", error="no", code=422
        ),
    ]
    await store.add_documents(docs)
    await store.finish_document(replace(docs[0], status="ready", pages=1, chunks=4))
    got = await store.get_collection("k1")
    assert got == replace(mine, documents=2, chunks=4)
    assert [c.id for c in await store.list_collections("u2")] == ["k2", "k1"]
    assert [c.id for c in await store.list_collections("u1")] == ["k1"]
    assert await store.list_collections("u3") == []
    await store.update_collection(replace(mine, name="Manuals", shared=("u3", "u4")))
    assert [c.id for c in await store.list_collections("u2")] == ["k2"]
    assert (await store.get_collection("k1")).shared == ("u3", "u4")
    listed = await store.list_documents("k1")
    assert [(d.id, d.status, d.chunks, d.code) for d in listed] == [
        ("d1", "ready", 4, 0),
        ("d2", "failed", 0, 422),
    ]
    assert [d.id for d in await store.list_documents("k1", "i1")] == ["d1", "d2"]
    assert await store.list_documents("k1", "other") == []
    assert await store.delete_document("d2") and not await store.delete_document("d2")
    assert (await store.get_document("d1")).title == "a/b.md"
    assert await store.delete_collection("k1")
    assert await store.get_collection("k1") is None and await store.get_document("d1") is None
    assert [c.id for c in await store.list_collections("u3")] == []


async def test_groups_share_collections_with_their_members(store):
    from dataclasses import replace

    from app.store import CollectionRecord, GroupRecord

    ops = GroupRecord("g1", "ops", 1.0, members=("u2", "u3"))
    await store.add_group(ops)
    await store.add_group(GroupRecord("g2", "hr", 2.0))
    with pytest.raises(Conflict):
        await store.add_group(GroupRecord("g3", "ops", 3.0))
    assert [g.name for g in await store.list_groups()] == ["hr", "ops"]
    assert await store.list_groups("u2") == [ops]
    book = CollectionRecord("k1", "u1", "Runbooks", "", 10.0, groups=("g1",))
    await store.add_collection(book)
    assert (await store.get_collection("k1")).groups == ("g1",)
    assert [c.id for c in await store.list_collections("u3")] == ["k1"]
    assert await store.update_group(replace(ops, name="sre", members=("u3",)))
    assert await store.list_collections("u2") == []
    assert [c.id for c in await store.list_collections("u3")] == ["k1"]
    assert not await store.update_group(GroupRecord("nope", "x", 1.0))
    await store.update_collection(replace(book, groups=("g1", "g2"), shared=("u9",)))
    got = await store.get_collection("k1")
    assert got.groups == ("g1", "g2") and got.shared == ("u9",)
    assert await store.delete_group("g1") and not await store.delete_group("g1")
    assert await store.list_collections("u3") == []
    assert (await store.get_collection("k1")).groups == ("g2",)
    assert await store.get_group("g1") is None and (await store.get_group("g2")).name == "hr"


async def test_documents_past_the_limit_are_refused_in_the_transaction_that_adds_them(store):
    from dataclasses import replace

    from app.store import CollectionRecord, DocumentRecord

    await store.add_collection(CollectionRecord("k1", "u1", "Docs", "", 10.0))

    def doc(n, status="indexing"):
        return DocumentRecord(
            f"d{n}", "k1", f"i{n % 2}", f"{n}.md", "text", 1, 10.0 + n, status=status
        )

    await store.add_documents([doc(0, "failed"), doc(1, "failed")])  # failed ones do not count
    stored = await asyncio.gather(
        store.add_documents([doc(2), doc(3)], max_documents=3),
        store.add_documents([doc(4), doc(5)], max_documents=3),
    )
    statuses = [d.status for batch in stored for d in batch]
    assert statuses.count("indexing") == 3 and statuses.count("failed") == 1
    refused = next(d for batch in stored for d in batch if d.status == "failed")
    assert refused.code == 413 and "3 documents" in refused.error
    assert (await store.get_document(refused.id)).status == "failed"
    total, done, failed = await store.import_progress("k1", "i0")
    assert (total, done) == (3, 1 + (refused.import_id == "i0"))
    assert [d.id for d in failed] == ["d0"] + ([refused.id] if refused.import_id == "i0" else [])
    assert await store.import_progress("k1", "nope") == (0, 0, [])
    assert await store.ready_documents(["d2", "d3", "nope"]) == set()
    ready = next(d for batch in stored for d in batch if d.status == "indexing")
    await store.finish_document(replace(ready, status="ready"))
    assert await store.ready_documents([ready.id, "d0"]) == {ready.id}
    with pytest.raises(NotFound):
        await store.add_documents([DocumentRecord("x", "gone", "i", "x.md", "text", 1, 1.0)])
    swept = await store.fail_orphaned_documents("lost", time.time() + 60)
    assert sorted(swept) == sorted(
        ("k1", d.id) for batch in stored for d in batch if d.status == "indexing" and d != ready
    )
    assert await store.fail_orphaned_documents("lost", time.time() + 60) == []


async def test_what_belongs_to_a_deleted_row_goes_with_it(store):
    """Chunks and attachments go with their file, attachments with their chat, a
    collection's shares with the group shared with (ON DELETE CASCADE on both backends)."""
    from app.store import CollectionRecord, FileRecord, GroupRecord, StoredChunk

    await ask(store, "c1", "q1", "a1", 100.0)
    await ask(store, "c2", "q2", "a2", 101.0)
    for file_id in ("f1", "f2"):
        record = FileRecord(file_id, "u7", "a.txt", "txt", 3, 100.0, "ready", 1, 1, "")
        await store.add_file(record)
        await store.finish_file(record, [StoredChunk(0, 1, "abc", None)])
    await store.attach_files("c1", ["f1", "f2"])
    await store.attach_files("c2", ["f1"])
    assert await store.delete_file("f1")
    assert await store.file_chunks("f1") == []
    assert [f.id for f in (await store.chat_files(["c1", "c2"]))["c1"]] == ["f2"]
    assert await store.delete_chat("c1")
    assert await store.chat_files(["c1", "c2"]) == {}
    assert [c.text for c in await store.file_chunks("f2")] == ["abc"]  # the file stays

    await store.add_group(GroupRecord("g1", "team", 1.0, ("u2",)))
    await store.add_collection(CollectionRecord("k1", "u1", "Docs", "", 2.0, groups=("g1",)))
    assert [c.id for c in await store.list_collections("u2")] == ["k1"]
    assert await store.delete_group("g1")
    assert (await store.get_collection("k1")).groups == ()
    assert await store.list_collections("u2") == []
