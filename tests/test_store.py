"""One contract for the store, run on SQLite and on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.store import Chat, StoredMessage, open_store

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


def chat(id="1", user="7", at=None, title="t"):
    return Chat(id, user, title, "webSearch", at or time.time())


def message(id, chat_id="1", role="user", at=None, **kw):
    return StoredMessage(
        id, chat_id, role, kw.pop("content", f"text {id}"), at or time.time(), **kw
    )


async def test_chats_are_created_once_listed_newest_first_and_deleted(store):
    assert await store.create_chat(chat("1", at=100.0))
    assert not await store.create_chat(chat("1", at=101.0, title="again"))
    await store.create_chat(chat("2", at=200.0))
    await store.create_chat(chat("3", user="8", at=300.0))
    assert [c.id for c in await store.list_chats("7")] == ["2", "1"]
    assert [c.id for c in await store.list_chats("7", limit=1)] == ["2"]
    got = await store.get_chat("1")
    assert (got.id, got.user_id, got.title, got.focus_mode, got.created_at) == (
        "1",
        "7",
        "t",
        "webSearch",
        100.0,
    )
    await store.set_title("1", "New title")
    assert (await store.get_chat("1")).title == "New title"
    await store.add_messages([message("10", "1")])
    assert await store.delete_chat("1")
    assert not await store.delete_chat("1")
    assert await store.get_chat("1") is None
    assert await store.get_message("10") is None
    assert await store.get_chat("999") is None


async def test_messages_keep_order_status_reasoning_rewrite_and_sources(store):
    await store.create_chat(chat("1"))
    big = 2**63 - 1
    q = message(str(big), role="user", at=10.0, rewritten="standalone?")
    a = message("12", role="assistant", at=10.0, status="streaming", reply_to=str(big))
    await store.add_messages([a, q, message("5", at=5.0)])
    sources = [{"metadata": {"title": "T", "url": "https://x/ü"}, "pageContent": "snippet \u2603"}]
    await store.set_sources(str(big), sources)
    await store.finish_message("12", content="answer", reasoning="because", status="cancelled")
    listed = await store.list_messages("1")
    assert [m.id for m in listed] == ["5", "12", str(big)]  # by time, then id
    question = await store.get_message(str(big))
    assert (question.rewritten, question.sources, question.role) == ("standalone?", sources, "user")
    answer = listed[1]
    assert (answer.content, answer.reasoning, answer.status, answer.reply_to) == (
        "answer",
        "because",
        "cancelled",
        str(big),
    )
    assert (await store.get_message("5")).sources == []


async def test_several_messages_in_one_call(store):
    await store.create_chat(chat("1"))
    await store.add_messages([message("21", at=1.0, content="already there")])
    await store.add_messages(
        [message("21", at=2.0, content="ignored"), message("22", at=3.0, role="assistant")]
    )
    listed = await store.list_messages("1")
    assert [(m.id, m.content) for m in listed] == [("21", "already there"), ("22", "text 22")]


async def test_reopening_runs_no_migration_twice(store_url):
    async with open_store(store_url) as first:
        await first.create_chat(chat("1"))
    async with open_store(store_url) as second:  # re-run on an up-to-date schema
        assert (await second.get_chat("1")).id == "1"
        await second.ping()


async def test_concurrent_starts_share_one_schema(store_url):
    stores = [open_store(store_url) for _ in range(4)]
    await asyncio.gather(*(s.open() for s in stores))
    try:
        await asyncio.gather(*(s.create_chat(chat(str(i + 1))) for i, s in enumerate(stores)))
        assert len(await stores[0].list_chats("7")) == 4
    finally:
        await asyncio.gather(*(s.close() for s in stores))


def test_unknown_store_scheme_is_refused():
    with pytest.raises(ValueError, match="unsupported store URL"):
        open_store("mysql://x")
