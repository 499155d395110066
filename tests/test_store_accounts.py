"""The store's contract for accounts, sessions, API keys, invites and usage per user,
run on SQLite and on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.errors import Conflict, Forbidden
from app.store import Account, AccountChange, ApiKey, Chat, Saved, StoredMessage, Usage, open_store

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


def account(id, email=None, **kw):
    return Account(id, kw.pop("name", f"user {id}"), email=email, created_at=time.time(), **kw)


async def test_the_first_account_is_the_admin_even_when_many_sign_up_at_once(store):
    made = await asyncio.gather(
        *(store.add_account(account(f"u{n}", f"u{n}@x.test"), admin_if_none=True) for n in range(6))
    )
    assert sorted(a.role for a in made) == ["admin"] + ["user"] * 5
    assert await store.has_admin()
    later = await store.add_account(account("u9", "u9@x.test"), admin_if_none=True)
    assert later.role == "user"
    listed = await store.list_accounts()
    assert [a.id for a in listed] == sorted((a.id for a in listed), key=lambda i: int(i[1:]))
    assert len(listed) == 7


async def test_emails_and_identities_are_unique(store):
    await store.add_account(account("u1", "a@x.test", password_hash="h1"))
    with pytest.raises(Conflict):
        await store.add_account(account("u2", "a@x.test"))
    await store.add_account(account("u3", issuer="https://idp", subject="s1"))
    with pytest.raises(Conflict):
        await store.add_account(account("u4", issuer="https://idp", subject="s1"))
    await store.add_account(account("u5", issuer="https://other", subject="s1"))
    assert (await store.account_by_email("a@x.test")).password_hash == "h1"
    assert (await store.account_by_subject("https://idp", "s1")).id == "u3"
    assert await store.account_by_subject("https://idp", "s2") is None
    assert await store.get_account("u2") is None
    assert "h1" not in repr(await store.get_account("u1"))


async def test_an_invite_is_spent_once_and_only_before_it_expires(store):
    await store.add_account(account("admin", "admin@x.test"), admin_if_none=True)
    await store.add_invite("code-1", "admin", time.time() + 60)
    await store.add_invite("old", "admin", time.time() - 1)
    with pytest.raises(Forbidden):
        await store.add_account(account("u1", "u1@x.test"), invite="unknown")
    with pytest.raises(Forbidden):
        await store.add_account(account("u1", "u1@x.test"), invite="old")
    assert await store.get_account("u1") is None  # nothing written
    await store.add_account(account("u1", "u1@x.test"), invite="code-1")
    with pytest.raises(Forbidden):
        await store.add_account(account("u2", "u2@x.test"), invite="code-1")


async def test_without_an_admin_no_invite_is_needed(store):
    made = await store.add_account(account("u1", "u1@x.test"), admin_if_none=True, invite="none")
    assert made.role == "admin"


async def test_admin_changes_and_the_last_admin(store):
    await store.add_account(account("a", "a@x.test"), admin_if_none=True)
    await store.add_account(account("b", "b@x.test"))
    await store.add_session("sess-b", "b", time.time() + 60)
    changed = await store.update_account("b", AccountChange(tokens_per_day=500, role="admin"))
    assert (changed.tokens_per_day, changed.role) == (500, "admin")
    changed = await store.update_account("b", AccountChange(default_quota=True, disabled=True))
    assert (changed.tokens_per_day, changed.disabled) == (None, True)
    assert await store.session_account("sess-b") is None  # disabling ends its sessions
    with pytest.raises(Conflict):  # b is disabled: a is the last enabled admin
        await store.update_account("a", AccountChange(role="user"))
    with pytest.raises(Conflict):
        await store.update_account("a", AccountChange(disabled=True))
    assert (await store.get_account("a")).role == "admin"
    assert await store.update_account("nobody", AccountChange(disabled=True)) is None


async def test_sessions_expire_and_are_deleted(store):
    await store.add_account(account("u1", "u1@x.test"))
    await store.add_session("live", "u1", time.time() + 60)
    await store.add_session("gone", "u1", time.time() - 1)
    assert (await store.session_account("live")).id == "u1"
    assert await store.session_account("gone") is None
    assert await store.session_account("nope") is None
    assert await store.delete_session("live")
    assert not await store.delete_session("live")
    assert await store.session_account("live") is None


async def test_api_keys_are_listed_without_their_hash_and_revoked_by_their_owner(store):
    await store.add_account(account("u1", "u1@x.test"))
    await store.add_account(account("u2", "u2@x.test"))
    await store.add_api_key(ApiKey("k1", "u1", "laptop", "sck_abcd", 100.0), "hash-1")
    await store.add_api_key(ApiKey("k2", "u1", "phone", "sck_efgh", 101.0), "hash-2")
    assert [k.name for k in await store.list_api_keys("u1")] == ["laptop", "phone"]
    assert await store.list_api_keys("u2") == []
    assert (await store.api_key_account("hash-2")).id == "u1"
    assert not await store.revoke_api_key("u2", "k2")  # not theirs
    assert await store.api_key_account("hash-2") is not None
    assert await store.revoke_api_key("u1", "k2")
    assert await store.api_key_account("hash-2") is None
    assert [k.id for k in await store.list_api_keys("u1")] == ["k1"]


async def _answered(store, user, chat_id, at, tokens, *, question="q"):
    await store.begin_answer(
        Chat(chat_id, user, "t", "deepSeek", at),
        StoredMessage(f"{question}{chat_id}", chat_id, "user", "q", at),
        StoredMessage(f"a{chat_id}", chat_id, "assistant", "", at + 0.001, status="streaming"),
    )
    await store.finish_answer(
        f"a{chat_id}", Saved("x", "", "completed", usage=Usage("m", tokens, tokens))
    )


async def test_tokens_are_counted_per_user_and_day_of_the_answer(store):
    day = 20_000
    for user, chat_id, at, tokens in (
        ("u1", "c1", day * 86400.0 - 10, 10),  # the day before
        ("u1", "c2", day * 86400.0 + 5, 5),
        ("u2", "c3", day * 86400.0 + 7, 7),
    ):
        await _answered(store, user, chat_id, at, tokens)
    assert await store.tokens_by_user(day) == {"u1": 10, "u2": 14}
    assert await store.tokens_by_user(day - 1) == {"u1": 20}
    assert await store.tokens_on(day, "u1") == 10
    assert await store.tokens_on(day, "nobody") == 0
    # the tally does not go down with what it counted: deleting the chat leaves it
    assert await store.delete_chat("c2")
    assert await store.tokens_on(day, "u1") == 10
    assert await store.tokens_by_user(day) == {"u1": 10, "u2": 14}


async def test_an_answer_saved_twice_is_counted_once_and_a_regenerated_one_stays_counted(store):
    at = time.time()
    day = int(at // 86400)
    await _answered(store, "u1", "c1", at, 50)
    again = Saved("x", "", "completed", usage=Usage("m", 50, 50))
    assert await store.finish_answer("ac1", again)  # the keeper's retry after a lost reply
    assert await store.tokens_on(day, "u1") == 100
    grown = Saved("x", "", "completed", usage=Usage("m", 60, 50))
    await store.finish_answer("ac1", grown)  # only what it grew by
    assert await store.tokens_on(day, "u1") == 110
    # regenerating deletes the answer: its tokens stay spent, the new answer adds its own
    question = await store.get_message("qc1")
    chat = await store.get_chat("c1")
    await store.begin_answer(
        chat,
        question,
        StoredMessage("ac1b", "c1", "assistant", "", at + 1, status="streaming"),
        regenerate=True,
    )
    assert await store.get_message("ac1") is None
    assert await store.tokens_on(day, "u1") == 110
    await store.finish_answer("ac1b", Saved("y", "", "completed", usage=Usage("m", 5, 5)))
    assert await store.tokens_on(day, "u1") == 120
