"""Accounts across two real server processes sharing one Redis and one PostgreSQL: what
one process does to a session, a key or an account holds on the other at once."""

from __future__ import annotations

import httpx
import pytest

from tests.client import sse_chat
from tests.identity import PASSWORD, browser, question, sign_in, sign_up
from tests.servers import processes

pytestmark = pytest.mark.anyio


@pytest.fixture
def pair(postgres_url, redis_url, model_url):
    env = {
        "LLM_BASE_URL": model_url,
        "LLM_API_KEY": "test-key",
        "LLM_MODEL": "fake-chat",
        "STORE_URL": postgres_url,
        "REDIS_URL": redis_url,
        "AUTH_MODE": "accounts",
        "STREAM_FLUSH_INTERVAL_MS": "10",
    }
    with processes(2, env) as (a, b):
        yield a, b


async def test_sign_out_on_one_process_ends_the_session_on_the_other(pair, fake_model):
    a, b = pair
    async with browser(a.url) as at_a:
        await sign_up(at_a, "ada@example.test")
        cookie = {"sc_session": at_a.cookies["sc_session"]}
        async with browser(b.url, cookies=cookie) as at_b:
            events = await sse_chat(at_b, question("asked on b", chatId="p1"))
            assert events[-1].data["status"] == "completed"
            assert (await at_a.get("/api/chats/p1")).status_code == 200
            assert (await at_a.post("/api/auth/logout")).status_code == 204
            refused = await at_b.get("/api/chats")
            assert refused.status_code == 401 and refused.json()["key"] == "UNAUTHORIZED"
            assert (await at_b.post("/api/chat/sse", json=question("more"))).status_code == 401


async def test_a_key_revoked_or_an_account_disabled_on_one_process_stops_on_the_other(
    pair, fake_model
):
    a, b = pair
    async with browser(a.url) as admin_a, browser(b.url) as user_b:
        await sign_up(admin_a, "admin@example.test")
        user = await sign_up(user_b, "user@example.test")
        keys = []
        for name in ("one", "two"):
            made = await user_b.post("/api/keys", json={"name": name})
            keys.append((made.json()["id"], made.json()["key"]))
        async with httpx.AsyncClient(base_url=a.url, timeout=10) as app_a:

            async def status(key: str) -> int:
                response = await app_a.get("/api/chats", headers={"authorization": f"Bearer {key}"})
                return response.status_code

            assert await status(keys[0][1]) == 200 and await status(keys[1][1]) == 200
            assert (await user_b.delete(f"/api/keys/{keys[0][0]}")).status_code == 200
            assert await status(keys[0][1]) == 401
            assert await status(keys[1][1]) == 200
            disabled = await admin_a.patch(
                f"/api/admin/users/{user['id']}", json={"disabled": True}
            )
            assert disabled.status_code == 200
            assert await status(keys[1][1]) == 401
            assert (await user_b.get("/api/chats")).status_code == 401  # the session on b


async def test_failed_sign_ins_are_counted_across_processes_in_redis(pair):
    a, b = pair
    async with browser(a.url) as at_a, browser(b.url) as at_b:
        await sign_up(at_a, "ada@example.test")
        wrong = {"email": "ada@example.test", "password": "not the password"}
        for http in (at_a, at_b, at_a, at_b, at_a):
            assert (await http.post("/api/auth/login", json=wrong)).status_code == 401
        for http in (at_b, at_a):
            right = await http.post(
                "/api/auth/login", json={"email": "ada@example.test", "password": PASSWORD}
            )
            assert right.status_code == 429
    async with browser(b.url) as fresh:
        await sign_up(fresh, "bob@example.test")
        await sign_in(fresh, "bob@example.test")  # another account is not held back
