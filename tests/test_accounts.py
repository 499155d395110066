"""Accounts (PROTOCOL §7) on a real server: sign-up rules, the first user the admin,
sessions, throttled sign-in, cookie writes from other sites, per-user API keys, what
one user cannot reach of another's, disabling, the admin's routes and daily quotas."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time

import httpx
import orjson
import pytest
import redis.asyncio as aioredis
from httpx_ws import WebSocketDisconnect, aconnect_ws

from app.errors import RateLimited
from app.identity.throttle import PER_ACCOUNT, PER_ADDRESS, SignInThrottle
from app.main import create_app
from app.store import open_store
from tests.client import iter_sse, sse_chat
from tests.identity import PASSWORD, browser, question, sign_in, sign_up
from tests.servers import ROOT, serve

pytestmark = pytest.mark.anyio


@pytest.fixture
def accounts(settings):
    return settings.replace(auth={"mode": "accounts"})


@pytest.fixture
def server(accounts):
    with serve(create_app(accounts)) as running:
        yield running


async def test_signed_out_me_says_how_to_sign_in_and_every_route_needs_a_user(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as anon:
        me = await anon.get("/api/auth/me")
        assert me.status_code == 401
        assert me.json()["authMethods"] == ["password"] and me.json()["signup"] == "open"
        for method, path in [
            ("POST", "/api/chat/sse"),
            ("GET", "/api/chats"),
            ("GET", "/api/config"),
            ("GET", "/api/models"),
            ("GET", "/api/keys"),
            ("GET", "/api/admin/users"),
            ("GET", "/v1/models"),
        ]:
            response = await anon.request(method, path, json={})
            assert response.status_code == 401, (method, path)
        assert (await anon.get("/")).status_code == 200  # the sign-in page itself
        assert (await anon.get("/signin")).status_code == 200


async def test_the_first_account_is_the_admin_and_sign_up_checks_what_it_takes(server):
    async with browser(server.url) as first, browser(server.url) as second:
        admin = await sign_up(first, "Ada@Example.test", name="Ada")
        assert (admin["email"], admin["role"], admin["name"]) == (
            "ada@example.test",
            "admin",
            "Ada",
        )
        me = (await first.get("/api/auth/me")).json()
        assert me["user"]["id"] == admin["id"] and me["via"] == "session"
        user = await sign_up(second, "bob@example.test")
        assert user["role"] == "user" and user["name"] == "bob"
        weak = await second.post(
            "/api/auth/signup", json={"email": "c@example.test", "password": "short"}
        )
        assert weak.status_code == 400 and "10" in weak.json()["data"]
        taken = await second.post(
            "/api/auth/signup", json={"email": "ADA@example.test", "password": PASSWORD}
        )
        assert taken.status_code == 409
        bad = await second.post("/api/auth/signup", json={"email": "nope", "password": PASSWORD})
        assert bad.status_code == 400


async def test_session_cookie_is_httponly_lax_and_secure_behind_https(server):
    async with browser(server.url) as http:
        response = await http.post(
            "/api/auth/signup", json={"email": "a@example.test", "password": PASSWORD}
        )
        cookie = response.headers["set-cookie"].lower()
        assert cookie.startswith("sc_session=") and "httponly" in cookie
        assert "samesite=lax" in cookie and "secure" not in cookie and "path=/" in cookie
        over_https = await http.post(
            "/api/auth/login",
            json={"email": "a@example.test", "password": PASSWORD},
            headers={"x-forwarded-proto": "https", "origin": "https://" + server.url[7:]},
        )
        assert over_https.status_code == 200
        assert "secure" in over_https.headers["set-cookie"].lower()


@pytest.mark.parametrize("rule", ["invite", "closed"])
async def test_sign_up_by_invitation_or_not_at_all(settings, rule):
    with serve(create_app(settings.replace(auth={"mode": "accounts", "signup": rule}))) as server:
        async with browser(server.url) as admin, browser(server.url) as other:
            # nobody could invite the first one: it is let in, and is the admin
            assert (await sign_up(admin, "admin@example.test"))["role"] == "admin"
            refused = await other.post(
                "/api/auth/signup", json={"email": "b@example.test", "password": PASSWORD}
            )
            assert refused.status_code == 403 and refused.json()["key"] == "FORBIDDEN"
            invite = await admin.post("/api/admin/invites", json={"days": 1})
            assert invite.status_code == 201
            code = invite.json()["invite"]
            body = {"email": "b@example.test", "password": PASSWORD, "invite": code}
            joined = await other.post("/api/auth/signup", json=body)
            if rule == "closed":
                assert joined.status_code == 403  # closed means closed, invite or not
                return
            assert joined.status_code == 201 and joined.json()["user"]["role"] == "user"
            again = await other.post("/api/auth/signup", json={**body, "email": "c@example.test"})
            assert again.status_code == 403  # an invite is spent once
            assert (await other.post("/api/admin/invites", json={})).status_code == 403


async def test_wrong_passwords_are_throttled_per_account_and_per_address(server):
    async with browser(server.url) as http:
        await sign_up(http, "a@example.test")
        await sign_up(http, "b@example.test")
        unknown = await http.post(
            "/api/auth/login", json={"email": "who@example.test", "password": PASSWORD}
        )
        wrong = await http.post(
            "/api/auth/login", json={"email": "a@example.test", "password": "wrong password"}
        )
        assert unknown.status_code == wrong.status_code == 401
        assert unknown.json() == wrong.json()  # nothing says which emails exist
        for _ in range(4):
            response = await http.post(
                "/api/auth/login", json={"email": "a@example.test", "password": "wrong again"}
            )
            assert response.status_code == 401
        throttled = await http.post(
            "/api/auth/login", json={"email": "a@example.test", "password": PASSWORD}
        )
        assert throttled.status_code == 429 and throttled.json()["key"] == "RATE_LIMITED"
        assert 1 <= int(throttled.headers["retry-after"]) <= 15 * 60
        # the account is throttled, not its neighbours
        await sign_in(http, "b@example.test")
    # and one address cannot try many accounts without end
    elsewhere = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    async with browser(server.url, transport=elsewhere) as spray:
        statuses = []
        for n in range(32):
            response = await spray.post(
                "/api/auth/login", json={"email": f"u{n}@example.test", "password": "guess"}
            )
            statuses.append(response.status_code)
        assert statuses[:30] == [401] * 30 and statuses[30:] == [429, 429]
        refused = await spray.post(
            "/api/auth/login", json={"email": "b@example.test", "password": PASSWORD}
        )
        assert refused.status_code == 429


async def test_wrong_passwords_sent_at_once_are_each_counted_before_any_is_checked(server):
    """Twenty guesses in parallel: each is counted before its password is checked, so
    no more than the account's limit get an answer from the password check."""
    async with httpx.AsyncClient(
        base_url=server.url, timeout=120, headers={"origin": server.url}
    ) as http:
        await sign_up(http, "a@example.test")
        guesses = await asyncio.gather(
            *(
                http.post(
                    "/api/auth/login", json={"email": "a@example.test", "password": f"guess {n}"}
                )
                for n in range(20)
            )
        )
        statuses = sorted(r.status_code for r in guesses)
        assert statuses.count(401) <= 5 and statuses.count(401) + statuses.count(429) == 20
        assert (
            await http.post(
                "/api/auth/login", json={"email": "a@example.test", "password": PASSWORD}
            )
        ).status_code == 429


@pytest.mark.parametrize("shared", [False, True], ids=["memory", "redis"])
async def test_the_throttle_counts_each_attempt_in_one_step(shared, request):
    redis = aioredis.Redis.from_url(request.getfixturevalue("redis_url")) if shared else None
    throttle = SignInThrottle(redis)
    try:
        results = await asyncio.gather(
            *(throttle.attempt("a@example.test", "10.0.0.1") for _ in range(20)),
            return_exceptions=True,
        )
        assert results.count(None) == PER_ACCOUNT
        assert all(isinstance(r, RateLimited) for r in results if r is not None)
        with pytest.raises(RateLimited, match="account"):
            await throttle.attempt("a@example.test", "10.0.0.1")
        # the address counts the 5 that were checked; b fails 4 times, then gets it right:
        # its count is cleared, the address's holds its failures
        for _ in range(PER_ACCOUNT - 1):
            await throttle.attempt("b@example.test", "10.0.0.1")
        await throttle.attempt("b@example.test", "10.0.0.1")
        await throttle.succeeded("b@example.test", "10.0.0.1")
        for _ in range(PER_ACCOUNT):
            await throttle.attempt("b@example.test", "10.0.0.1")
        for n in range(PER_ADDRESS - 3 * PER_ACCOUNT + 1):
            await throttle.attempt(f"u{n}@example.test", "10.0.0.1")
        with pytest.raises(RateLimited, match="address"):
            await throttle.attempt("new@example.test", "10.0.0.1")
    finally:
        if redis is not None:
            await redis.aclose()


async def test_sign_up_is_throttled_per_address_and_refused_before_any_hashing(settings):
    invite_only = settings.replace(auth={"mode": "accounts", "signup": "invite"})
    with serve(create_app(invite_only)) as server:
        passwords = server.app.state.identity.accounts.passwords
        async with browser(server.url) as http:
            await sign_up(http, "admin@example.test")
            hashed = passwords.hashed
            for body in (
                {"invite": "inv_made-up"},
                {},
                {"invite": "inv_made-up", "email": "admin@example.test"},
            ):
                refused = await http.post(
                    "/api/auth/signup",
                    json={"email": "b@example.test", "password": PASSWORD, **body},
                )
                assert refused.status_code in (403, 409), refused.text
            assert passwords.hashed == hashed  # no password was hashed for any of them
            statuses = []
            for n in range(20):
                response = await http.post(
                    "/api/auth/signup", json={"email": f"u{n}@example.test", "password": PASSWORD}
                )
                statuses.append(response.status_code)
            # 20 sign-ups from one address in a window, the admin's first among them
            assert statuses[:16] == [403] * 16 and statuses[16:] == [429] * 4
            assert 1 <= int(response.headers["retry-after"]) <= 15 * 60
            assert passwords.hashed == hashed
        elsewhere = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        async with browser(server.url, transport=elsewhere) as neighbour:
            other = await neighbour.post(
                "/api/auth/signup", json={"email": "c@example.test", "password": PASSWORD}
            )
            assert other.status_code == 403  # its own count: refused by the rule, not throttled


async def test_a_sign_up_flood_is_refused_at_once_while_passwords_queue(settings):
    with serve(create_app(settings.replace(auth={"mode": "accounts"}))) as server:
        server.app.state.identity.accounts.passwords.max_waiting = 1
        async with browser(server.url) as http:
            answers = await asyncio.gather(
                *(
                    http.post(
                        "/api/auth/signup",
                        json={"email": f"u{n}@example.test", "password": PASSWORD},
                    )
                    for n in range(8)
                )
            )
        statuses = sorted(r.status_code for r in answers)
        assert statuses.count(201) >= 3 and 503 in statuses
        busy = next(r for r in answers if r.status_code == 503)
        assert busy.headers["retry-after"] and "busy" in busy.json()["data"]


async def test_sign_out_ends_the_session_and_a_cookie_of_nobody_is_refused(server, fake_model):
    async with browser(server.url) as http:
        await sign_up(http, "a@example.test")
        stolen = http.cookies["sc_session"]
        events = await sse_chat(http, question("hello"))
        assert events[-1].data["status"] == "completed"
        assert (await http.post("/api/auth/logout")).status_code == 204
        assert "sc_session" not in http.cookies
        assert (await http.get("/api/chats")).status_code == 401
    async with browser(server.url, cookies={"sc_session": stolen}) as replay:
        response = await replay.get("/api/chats")
        assert response.status_code == 401 and "sign in" in response.json()["data"]
    async with browser(server.url, cookies={"sc_session": "made-up"}) as forged:
        assert (await forged.get("/api/chats")).status_code == 401


async def test_a_cross_site_write_with_the_cookie_is_refused(server, fake_model):
    async with browser(server.url) as http:
        await sign_up(http, "a@example.test")
        cookie = {"sc_session": http.cookies["sc_session"]}
    evil = {"origin": "https://evil.example"}
    async with httpx.AsyncClient(base_url=server.url, timeout=10, cookies=cookie) as raw:
        for headers in (evil, {}, {"origin": "null"}, {"referer": "https://evil.example/x"}):
            response = await raw.post("/api/chat/sse", json=question("q"), headers=headers)
            assert response.status_code == 403, headers
            assert response.json()["key"] == "FORBIDDEN"
        assert (await raw.delete("/api/chats/1", headers=evil)).status_code == 403
        assert (await raw.post("/api/keys", json={}, headers=evil)).status_code == 403
        assert (await raw.post("/api/auth/logout", headers=evil)).status_code == 403
        assert fake_model.requests == []
        # reading is not a write: the browser keeps the answer from the other site (CORS)
        assert (await raw.get("/api/chats", headers=evil)).status_code == 200
        # the server's own pages may write (by Origin, or by Referer without one)
        own = await raw.post(
            "/api/chat/sse", json=question("q"), headers={"referer": server.url + "/"}
        )
        assert own.status_code == 200
        await own.aread()
        # a login form posted from another site cannot sign the victim in as someone else
        login = await raw.post(
            "/api/auth/login", json={"email": "a@example.test", "password": PASSWORD}, headers=evil
        )
        assert login.status_code == 403
    # and sign-in without an Origin (no cookie at all) is told what to send
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as script:
        bare = await script.post(
            "/api/auth/login", json={"email": "a@example.test", "password": PASSWORD}
        )
        assert bare.status_code == 403 and "Origin header" in bare.json()["data"]
    async with httpx.AsyncClient(base_url=server.url, timeout=10, cookies=cookie) as raw:
        # a WebSocket opened by another site's page with the cookie
        async with aconnect_ws(server.ws_url + "/api/chat/ws", raw, headers=evil) as ws:
            frame = orjson.loads(await ws.receive_text())
            assert frame["key"] == "FORBIDDEN"
            with pytest.raises(WebSocketDisconnect) as closed:
                await ws.receive_text()
            assert closed.value.code == 4403


async def test_api_keys_are_shown_once_work_everywhere_and_stop_when_revoked(server, fake_model):
    async with browser(server.url) as http:
        await sign_up(http, "a@example.test")
        made = await http.post("/api/keys", json={"name": "laptop"})
        assert made.status_code == 201
        key = made.json()["key"]
        assert key.startswith("sck_") and made.json()["name"] == "laptop"
        listed = (await http.get("/api/keys")).json()["keys"]
        assert [k["name"] for k in listed] == ["laptop"] and key not in orjson.dumps(
            listed
        ).decode()
        assert listed[0]["prefix"] == key[:12]
        key_id = made.json()["id"]
    bearer = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=server.url, timeout=10, headers=bearer) as app:
        events = await sse_chat(app, question("over sse", chatId="k1"))
        assert events[-1].data["status"] == "completed"
        completion = await app.post(
            "/v1/chat/completions",
            json={"model": "deepSeek", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert completion.status_code == 200
        async with aconnect_ws(server.ws_url + f"/api/chat/ws?token={key}", app) as ws:
            assert orjson.loads(await ws.receive_text())["type"] == "signal"
            await ws.send_text(orjson.dumps(question("over ws", chatId="k2")).decode())
            frame = orjson.loads(await ws.receive_text())
            while frame["type"] not in ("messageEnd", "error"):
                frame = orjson.loads(await ws.receive_text())
            assert frame["status"] == "completed"
        # a key cannot make keys: revoking a leaked one must cut off whoever holds it
        assert (await app.post("/api/keys", json={"name": "more"})).status_code == 403
        assert (await app.get("/api/keys")).status_code == 200
        assert (await app.delete(f"/api/keys/{key_id}")).status_code == 200
        refused = await app.get("/api/chats")
        assert refused.status_code == 401 and "revoked" in refused.json()["data"]
        v1 = await app.get("/v1/models")
        assert v1.status_code == 401 and v1.json()["error"]["code"] == "invalid_api_key"


async def test_another_users_chats_files_keys_and_usage_are_out_of_reach(server, fake_model):
    async with browser(server.url) as alice, browser(server.url) as bob:
        a = await sign_up(alice, "alice@example.test")
        await sign_up(bob, "bob@example.test")
        events = await sse_chat(alice, question("mine", chatId="c-alice", messageId="q-alice"))
        assert events[-1].data["status"] == "completed"
        upload = await alice.post(
            "/api/uploads", files={"files": ("notes.txt", b"alice's notes " * 20, "text/plain")}
        )
        assert upload.status_code == 200, upload.text
        file_id = upload.json()["files"][0]["fileId"]
        key_id = (await alice.post("/api/keys", json={"name": "k"})).json()["id"]

        assert (await bob.get("/api/chats")).json()["chats"] == []
        assert (await bob.get("/api/chats/c-alice")).status_code == 403
        assert (await bob.delete("/api/chats/c-alice")).status_code == 403
        assert (await bob.get("/sources/q-alice")).status_code == 403
        assert (await bob.get("/api/chats", params={"userId": a["id"]})).status_code == 403
        claim = await bob.post("/api/chat/sse", json={**question("as her"), "userId": a["id"]})
        assert claim.status_code == 403
        intrude = await bob.post("/api/chat/sse", json=question("into hers", chatId="c-alice"))
        assert intrude.status_code == 403
        assert (await bob.get(f"/api/uploads/{file_id}")).status_code == 403
        assert (await bob.delete(f"/api/uploads/{file_id}")).status_code == 403
        assert (await bob.get("/api/uploads")).json()["files"] == []
        foreign_file = await bob.post("/api/chat/sse", json=question("q", files=[file_id]))
        assert foreign_file.status_code == 400
        assert (await bob.get("/api/keys")).json()["keys"] == []
        assert (await bob.delete(f"/api/keys/{key_id}")).status_code == 404
        assert (await bob.get("/api/usage", params={"userId": a["id"]})).status_code == 403
        assert (await bob.get("/api/usage")).json()["total"]["answers"] == 0
        assert (await bob.get(f"/api/admin/users/{a['id']}/usage")).status_code == 403
        assert (await bob.get("/api/admin/users")).status_code == 403
        # all of it still there for its owner
        assert (await alice.get("/api/chats/c-alice")).status_code == 200
        assert (await alice.get(f"/api/uploads/{file_id}")).status_code == 200
        assert (await alice.get("/api/usage")).json()["total"]["answers"] == 1
        assert len((await alice.get("/api/keys")).json()["keys"]) == 1


async def test_a_disabled_user_is_cut_off_on_the_next_request_everywhere(server, fake_model):
    async with browser(server.url) as admin, browser(server.url) as user:
        await sign_up(admin, "admin@example.test")
        target = await sign_up(user, "user@example.test")
        key = (await user.post("/api/keys", json={"name": "k"})).json()["key"]
        bearer = {"authorization": f"Bearer {key}"}
        cookie = {"sc_session": user.cookies["sc_session"]}
        async with (
            httpx.AsyncClient(
                timeout=10, cookies=cookie, headers={"origin": server.url}
            ) as ws_http,
            aconnect_ws(server.ws_url + "/api/chat/ws", ws_http) as ws,
        ):
            assert orjson.loads(await ws.receive_text())["type"] == "signal"
            await ws.send_text(
                orjson.dumps(question("long #tokens=400 #delay=0.02", chatId="w1")).decode()
            )
            first = orjson.loads(await ws.receive_text())
            assert first["chatId"] == "w1"
            async with user.stream(
                "POST", "/api/chat/sse", json=question("long #tokens=400 #delay=0.02", chatId="s1")
            ) as streaming:
                assert streaming.status_code == 200
                disable = await admin.patch(
                    f"/api/admin/users/{target['id']}", json={"disabled": True}
                )
                assert disable.status_code == 200 and disable.json()["user"]["disabled"] is True
                # the next request, by cookie or by key, is refused
                next_request = await user.get("/api/chats")
                assert next_request.status_code == 401
                by_key = await user.get("/api/chats", headers=bearer)
                assert by_key.status_code == 401 and "disabled" in by_key.json()["data"]
                # the open socket's next frame ends it, with what it was streaming
                await ws.send_text('{"type": "cancel", "chatId": "w1"}')
                frames = []
                with pytest.raises(WebSocketDisconnect) as closed:
                    while True:
                        frames.append(orjson.loads(await ws.receive_text()))
                assert closed.value.code == 4401
                assert frames[-1]["key"] == "UNAUTHORIZED"
                assert not any(f.get("type") == "messageEnd" for f in frames)
        assert (
            await user.post(
                "/api/auth/login", json={"email": "user@example.test", "password": PASSWORD}
            )
        ).status_code == 401
        enable = await admin.patch(f"/api/admin/users/{target['id']}", json={"disabled": False})
        assert enable.status_code == 200
        assert (await user.get("/api/chats", headers=bearer)).status_code == 200  # the key again
        assert (await user.get("/api/chats")).status_code == 401  # its sessions ended for good


async def test_the_admin_lists_users_sets_roles_and_quotas_and_guards_the_config(
    server, fake_model
):
    async with browser(server.url) as admin, browser(server.url) as user:
        me = await sign_up(admin, "admin@example.test")
        other = await sign_up(user, "user@example.test")
        await sse_chat(user, question("spend some tokens"))
        listed = (await admin.get("/api/admin/users")).json()
        assert [u["email"] for u in listed["users"]] == ["admin@example.test", "user@example.test"]
        spent = {u["id"]: u["tokensToday"] for u in listed["users"]}
        assert spent[other["id"]] > 0 and spent[me["id"]] == 0
        assert listed["users"][1]["quota"] == 0  # the default: none
        patched = await admin.patch(f"/api/admin/users/{other['id']}", json={"tokensPerDay": 5000})
        assert patched.json()["user"]["tokensPerDay"] == 5000
        usage = (await admin.get(f"/api/admin/users/{other['id']}/usage")).json()
        assert usage["userId"] == other["id"] and usage["total"]["answers"] == 1
        for bad in ({"role": "king"}, {"tokensPerDay": -1}, {"disabled": "yes"}, {"x": 1}):
            assert (
                await admin.patch(f"/api/admin/users/{other['id']}", json=bad)
            ).status_code == 400
        assert (
            await admin.patch("/api/admin/users/nobody", json={"disabled": True})
        ).status_code == 404
        # the last admin cannot step down or be disabled
        last = await admin.patch(f"/api/admin/users/{me['id']}", json={"role": "user"})
        assert last.status_code == 409
        promoted = await admin.patch(f"/api/admin/users/{other['id']}", json={"role": "admin"})
        assert promoted.json()["user"]["role"] == "admin"
        assert (await user.get("/api/admin/users")).status_code == 200  # an admin now
        demoted = await user.patch(f"/api/admin/users/{other['id']}", json={"role": "user"})
        assert demoted.status_code == 200
        assert (await user.get("/api/admin/users")).status_code == 403
        # configuration writes: admin only (and read-only for the admin as before)
        refused = await user.post("/api/config", json={"automaticImageSearch": True})
        assert refused.status_code == 403 and "admin" in refused.json()["data"]
        allowed = await admin.post("/api/config", json={"automaticImageSearch": True})
        assert allowed.status_code == 200
        assert (await admin.get("/api/config")).json()["authMode"] == "accounts"


async def test_a_daily_quota_stops_questions_before_the_model_on_every_transport(
    settings, fake_model
):
    limited = settings.replace(auth={"mode": "accounts"}, limits={"tokens_per_day": 1})
    with serve(create_app(limited)) as server:
        async with browser(server.url) as admin, browser(server.url) as user:
            await sign_up(admin, "admin@example.test")
            target = await sign_up(user, "user@example.test")
            key = (await user.post("/api/keys", json={"name": "k"})).json()["key"]
            events = await sse_chat(user, question("the first answer"))
            assert events[-1].data["status"] == "completed"
            # the chat's title is written in the background once the answer is out
            for _ in range(100):
                if any("Title:" in str(r["messages"]) for r in fake_model.requests):
                    break
                await asyncio.sleep(0.05)
            asked = len(fake_model.requests)

            refused = await user.post("/api/chat/sse", json=question("one more"))
            assert refused.status_code == 429 and refused.json()["key"] == "RATE_LIMITED"
            assert "daily token quota" in refused.json()["data"]
            until_midnight = 86400 - time.time() % 86400
            assert abs(int(refused.headers["retry-after"]) - until_midnight) <= 5
            async with httpx.AsyncClient(timeout=10) as http:
                completion = await http.post(
                    server.url + "/v1/chat/completions",
                    json={"model": "deepSeek", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"authorization": f"Bearer {key}"},
                )
                assert completion.status_code == 429
                assert completion.json()["error"]["type"] == "rate_limit_error"
                assert completion.headers["retry-after"]
                async with aconnect_ws(server.ws_url + f"/api/chat/ws?token={key}", http) as ws:
                    await ws.receive_text()
                    await ws.send_text(orjson.dumps(question("over ws", chatId="qw")).decode())
                    frame = orjson.loads(await ws.receive_text())
                    assert (frame["key"], frame["chatId"]) == ("RATE_LIMITED", "qw")
                    assert abs(frame["retryAfter"] - until_midnight) <= 5
            assert (
                await user.post("/api/suggestions", json={"history": [["human", "q"]]})
            ).status_code == 429
            assert len(fake_model.requests) == asked  # no model call for any of them
            assert (await user.get("/api/chats")).status_code == 200  # reading goes on
            # the admin lifts this user's quota (0: none): questions go through again
            await admin.patch(f"/api/admin/users/{target['id']}", json={"tokensPerDay": 0})
            again = await sse_chat(user, question("thanks"))
            assert again[-1].data["status"] == "completed"
            # and back to the default
            await admin.patch(f"/api/admin/users/{target['id']}", json={"tokensPerDay": None})
            assert (await user.post("/api/chat/sse", json=question("no"))).status_code == 429
            # another user has a quota of their own
            await sse_chat(admin, question("the admin's first"))


async def test_deleting_a_chat_or_regenerating_gives_no_quota_back(settings, fake_model):
    limited = settings.replace(auth={"mode": "accounts"}, limits={"tokens_per_day": 1})
    with serve(create_app(limited)) as server:
        async with browser(server.url) as admin, browser(server.url) as user:
            await sign_up(admin, "admin@example.test")
            target = await sign_up(user, "user@example.test")

            async def used() -> int:
                listed = (await admin.get("/api/admin/users")).json()["users"]
                return {u["id"]: u["tokensToday"] for u in listed}[target["id"]]

            async def quota(tokens: int | None) -> None:
                changed = await admin.patch(
                    f"/api/admin/users/{target['id']}", json={"tokensPerDay": tokens}
                )
                assert changed.status_code == 200

            events = await sse_chat(user, question("first #tokens=40", chatId="c1"))
            assert events[-1].data["status"] == "completed"
            spent = await used()
            assert spent > 0
            assert (await user.post("/api/chat/sse", json=question("more"))).status_code == 429
            # the chat with the answer is deleted: what it used stays used
            assert (await user.delete("/api/chats/c1")).status_code == 200
            assert (await user.get("/api/usage")).json()["total"]["answers"] == 0
            assert await used() == spent
            again = await user.post("/api/chat/sse", json=question("and now?"))
            assert again.status_code == 429 and "daily token quota" in again.json()["data"]

            # room for one more question: regenerating a long answer as a short one
            await quota(spent + 1)
            events = await sse_chat(user, question("long #tokens=40", chatId="c2", messageId="q2"))
            assert events[-1].data["status"] == "completed"
            await quota(await used() + 1)
            events = await sse_chat(user, question("short #tokens=1", chatId="c2", messageId="q2"))
            assert events[-1].data["status"] == "completed"  # the regenerated answer
            history = (await user.get("/api/chats/c2")).json()["messages"]
            assert len(history) == 2  # the long answer is gone ...
            refused = await user.post("/api/chat/sse", json=question("more"))
            assert refused.status_code == 429  # ... and still counted


def create_admin(settings, tmp_path, email, password="an admin's long passphrase"):
    config = tmp_path / "empty.toml"
    config.write_text("")
    env = {**os.environ, "APP_CONFIG": str(config), "STORE_URL": settings.store.url}
    return subprocess.run(
        [sys.executable, "-m", "app.identity", "create-admin", email],
        input=password + "\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


async def test_the_first_admin_is_made_from_the_command_line(settings, tmp_path):
    """Made before the server is reachable, nobody else can be the first sign-up."""
    short = await asyncio.to_thread(create_admin, settings, tmp_path, "ops@example.test", "short")
    assert short.returncode != 0 and "10" in short.stderr
    made = await asyncio.to_thread(create_admin, settings, tmp_path, "Ops@Example.test")
    assert made.returncode == 0, made.stderr
    assert "ops@example.test" in made.stdout
    invite_only = settings.replace(auth={"mode": "accounts", "signup": "invite"})
    with serve(create_app(invite_only)) as server:
        async with browser(server.url) as stranger, browser(server.url) as ops:
            # an admin exists: the first to come along is not let in without an invite
            refused = await stranger.post(
                "/api/auth/signup", json={"email": "eve@example.test", "password": PASSWORD}
            )
            assert refused.status_code == 403
            admin = await sign_in(ops, "ops@example.test", "an admin's long passphrase")
            assert admin["role"] == "admin"
            code = (await ops.post("/api/admin/invites", json={})).json()["invite"]
            bob = await sign_up(stranger, "bob@example.test", invite=code)
            assert bob["role"] == "user"
    # an account that exists is made an admin (its password left alone)
    promoted = await asyncio.to_thread(create_admin, settings, tmp_path, "bob@example.test", "")
    assert promoted.returncode == 0, promoted.stderr
    async with open_store(settings.store.url) as store:
        account = await store.account_by_email("bob@example.test")
        assert account is not None and account.role == "admin" and account.password_hash


async def test_static_keys_work_beside_accounts(settings, fake_model):
    both = settings.replace(auth={"mode": "accounts", "api_keys": {"ops-key": "ops"}})
    with serve(create_app(both)) as server:
        async with httpx.AsyncClient(
            base_url=server.url, timeout=10, headers={"authorization": "Bearer ops-key"}
        ) as http:
            events = await sse_chat(http, question("hello", chatId="ops1"))
            assert events[-1].data["status"] == "completed"
            assert (await http.get("/api/chats")).json()["chats"][0]["userId"] == "ops"
            me = (await http.get("/api/auth/me")).json()
            assert me["user"]["id"] == "ops" and me["via"] == "key"
            assert (await http.post("/api/keys", json={})).status_code == 403
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            wrong = await http.get("/api/chats", headers={"authorization": "Bearer opskey"})
            assert wrong.status_code == 401


async def test_disabling_mid_answer_leaves_the_answer_saved(server, fake_model):
    """The running answer was allowed when it started: it finishes and is saved; only
    what the user asks next is refused."""
    async with browser(server.url) as admin, browser(server.url) as user:
        await sign_up(admin, "admin@example.test")
        target = await sign_up(user, "user@example.test")
        async with user.stream(
            "POST", "/api/chat/sse", json=question("long #tokens=60 #delay=0.01", chatId="m1")
        ) as response:
            stream = iter_sse(response)
            await anext(stream)
            await admin.patch(f"/api/admin/users/{target['id']}", json={"disabled": True})
            rest = [e async for e in stream]
        assert rest[-1].data["status"] == "completed"
        await asyncio.sleep(0.2)
        await admin.patch(f"/api/admin/users/{target['id']}", json={"disabled": False})
        await sign_in(user, "user@example.test")
        saved = (await user.get("/api/chats/m1")).json()["messages"][-1]
        assert saved["status"] == "completed"


async def test_passwords_sessions_keys_and_tokens_are_not_logged(server, fake_model, caplog):
    caplog.set_level(logging.DEBUG)
    secret_password = "a-password-nobody-logs-42"
    async with browser(server.url) as http:
        await sign_up(http, "log@example.test", password=secret_password)
        await http.post(
            "/api/auth/login", json={"email": "log@example.test", "password": "wrong-pw-777"}
        )
        await sign_in(http, "log@example.test", password=secret_password)
        session = http.cookies["sc_session"]
        key = (await http.post("/api/keys", json={"name": "k"})).json()["key"]
        await sse_chat(http, question("hello"))
        async with aconnect_ws(server.ws_url + f"/api/chat/ws?token={key}", http) as ws:
            await ws.receive_text()
        await http.get("/api/chats", headers={"authorization": f"Bearer {key}"})
        await http.get("/api/chats", headers={"authorization": "Bearer sck_not-a-real-key"})
    await asyncio.sleep(0.1)
    server_side = [r for r in caplog.records if r.name.startswith(("app", "uvicorn"))]
    text = "\n".join(r.getMessage() + str(getattr(r, "fields", "")) for r in server_side)
    assert "/api/auth/login" in text  # the access log did run
    for secret in (secret_password, "wrong-pw-777", session, key, "sck_not-a-real-key"):
        assert secret not in text
    assert "token=" not in text


def test_http_clients_log_no_request_urls_once_logging_is_configured():
    probe = (
        "import logging; from app import logs; logs.configure();"
        "print([logging.getLogger(n).isEnabledFor(logging.INFO) for n in"
        " ('httpx', 'httpx2', 'httpcore', 'app')])"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert done.stdout.strip() == "[False, False, False, True]"
