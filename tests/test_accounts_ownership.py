"""With accounts, what one user makes beyond chats — knowledge collections, stored
`/v1/responses` — is out of another's reach, whatever ids the request names; and the
daily quota holds on `/v1/responses`, however its answers are kept or deleted."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from app.main import create_app
from tests.identity import PASSWORD, browser, question, sign_up
from tests.servers import serve

pytestmark = pytest.mark.anyio


@pytest.fixture
def server(settings):
    with serve(create_app(settings.replace(auth={"mode": "accounts"}))) as running:
        yield running


async def api_key(http: httpx.AsyncClient) -> dict[str, str]:
    made = await http.post("/api/keys", json={"name": "app"})
    assert made.status_code == 201, made.text
    return {"authorization": f"Bearer {made.json()['key']}"}


async def imported(http: httpx.AsyncClient, collection_id: str, import_id: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        progress = (await http.get(f"/api/collections/{collection_id}/imports/{import_id}")).json()
        if progress["done"] >= progress["total"]:
            assert progress["failed"] == []
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the import did not end")


async def test_another_users_collections_are_out_of_reach(server, fake_model):
    async with browser(server.url) as alice, browser(server.url) as bob:
        a = await sign_up(alice, "alice@example.test")
        b = await sign_up(bob, "bob@example.test")
        made = await alice.post("/api/collections", json={"name": "vault"})
        assert made.status_code == 201 and made.json()["collection"]["owner"] == a["id"]
        cid = made.json()["collection"]["id"]
        added = await alice.post(
            f"/api/collections/{cid}/documents",
            files=[("files", ("notes.txt", b"The vault code is MARMALADE."))],
        )
        assert added.status_code == 202, added.text
        import_id = added.json()["import"]["id"]
        await imported(alice, cid, import_id)
        doc_id = (await alice.get(f"/api/collections/{cid}/documents")).json()["documents"][0]["id"]

        # bob, by cookie, and naming alice as the user, gets nothing of it
        assert (await bob.get("/api/collections")).json()["collections"] == []
        as_alice = {"userId": a["id"]}
        assert (await bob.get("/api/collections", params=as_alice)).status_code == 403
        for method, path, body in (
            ("GET", f"/api/collections/{cid}", None),
            ("GET", f"/api/collections/{cid}/documents", None),
            ("GET", f"/api/collections/{cid}/imports/{import_id}", None),
            ("POST", f"/api/collections/{cid}/search", {"query": "vault code"}),
            ("PATCH", f"/api/collections/{cid}", {"name": "mine", "shared": [b["id"]]}),
            ("DELETE", f"/api/collections/{cid}/documents/{doc_id}", None),
            ("DELETE", f"/api/collections/{cid}", None),
            ("POST", f"/api/collections/{cid}/documents", {"urls": ["https://a.example"]}),
        ):
            answer = await bob.request(method, path, json=body)
            assert answer.status_code == 404, (method, path, answer.text)
        claimed = await bob.post("/api/collections", json={"name": "hers", "userId": a["id"]})
        assert claimed.status_code == 403
        asked = await bob.post(
            "/api/chat/sse", json=question("vault code?", collections=[cid], copilotEnabled=False)
        )
        assert asked.status_code == 400 and cid in asked.json()["data"]
        # nor with bob's API key on /v1
        key = await api_key(bob)
        completion = await bob.post(
            "/v1/chat/completions",
            headers=key,
            json={"model": f"collection:{cid}", "messages": [{"role": "user", "content": "code?"}]},
        )
        assert completion.status_code in (400, 404), completion.text

        # all of it still there, unchanged, for alice
        mine = (await alice.get(f"/api/collections/{cid}")).json()["collection"]
        assert mine["name"] == "vault" and mine["shared"] == [] and mine["documents"] == 1
        found = await alice.post(f"/api/collections/{cid}/search", json={"query": "vault code"})
        assert found.json()["results"][0]["pageContent"].endswith("MARMALADE.")

        # shared with bob: read-only for him
        shared = await alice.patch(f"/api/collections/{cid}", json={"shared": [b["id"]]})
        assert shared.status_code == 200
        assert [c["id"] for c in (await bob.get("/api/collections")).json()["collections"]] == [cid]
        assert (await bob.patch(f"/api/collections/{cid}", json={"name": "x"})).status_code == 403
        assert (await bob.delete(f"/api/collections/{cid}")).status_code == 403


async def test_another_users_responses_are_out_of_reach(server, fake_model):
    async with browser(server.url) as alice, browser(server.url) as bob:
        a = await sign_up(alice, "alice@example.test")
        await sign_up(bob, "bob@example.test")
        hers, his = await api_key(alice), await api_key(bob)
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=15, headers=hers) as alice,
        httpx.AsyncClient(base_url=server.url, timeout=15, headers=his) as bob,
    ):
        made = await alice.post("/v1/responses", json={"model": "deepSeek", "input": "q #tokens=3"})
        assert made.status_code == 200, made.text
        rid = made.json()["id"]
        for user in (None, a["id"]):  # OpenAI's `user` label is no claim with auth on
            extra = {"user": user} if user else {}
            assert (await bob.get(f"/v1/responses/{rid}", params=extra)).status_code == 404
            follow = await bob.post(
                "/v1/responses",
                json={"model": "deepSeek", "input": "and?", "previous_response_id": rid, **extra},
            )
            assert follow.status_code == 404
            assert follow.json()["error"]["type"] == "invalid_request_error"
        assert (await bob.post(f"/v1/responses/{rid}/cancel")).status_code == 404
        assert (await bob.delete(f"/v1/responses/{rid}")).status_code == 404
        assert (await bob.get("/api/chats")).json()["chats"] == []
        # hers to read and to go on with
        got = await alice.get(f"/v1/responses/{rid}")
        assert got.status_code == 200 and got.json()["status"] == "completed"
        follow = await alice.post(
            "/v1/responses",
            json={"model": "deepSeek", "input": "and?", "previous_response_id": rid},
        )
        assert follow.status_code == 200 and follow.json()["previous_response_id"] == rid
        assert len((await alice.get("/api/chats")).json()["chats"]) == 1


async def test_the_daily_quota_holds_on_responses_kept_or_not(settings, fake_model):
    limited = settings.replace(auth={"mode": "accounts"}, limits={"tokens_per_day": 1})
    with serve(create_app(limited)) as server:
        async with browser(server.url) as http:
            await sign_up(http, "admin@example.test")
            await sign_up(http, "user@example.test")
            key = await api_key(http)
        async with httpx.AsyncClient(base_url=server.url, timeout=15, headers=key) as app:
            # an answer that is not stored: its chat is deleted once it has ended
            made = await app.post(
                "/v1/responses",
                json={"model": "deepSeek", "input": "q #tokens=20", "store": False},
            )
            assert made.status_code == 200 and made.json()["status"] == "completed"
            deadline = time.monotonic() + 10
            while (await app.get("/api/chats")).json()["chats"]:
                assert time.monotonic() < deadline, "the unstored response's chat stayed"
                await asyncio.sleep(0.05)
            for body in (
                {"input": "again"},
                {"input": "again", "stream": True},
                {"input": "again", "background": True},
            ):
                refused = await app.post("/v1/responses", json={"model": "deepSeek", **body})
                assert refused.status_code == 429, (body, refused.text)
                assert refused.json()["error"]["type"] == "rate_limit_error"
                assert "daily token quota" in refused.json()["error"]["message"]
                assert int(refused.headers["retry-after"]) >= 1
        # nor does a password sign-in or a new session change that
        async with browser(server.url) as again:
            signed = await again.post(
                "/api/auth/login", json={"email": "user@example.test", "password": PASSWORD}
            )
            assert signed.status_code == 200
            assert (await again.post("/api/chat/sse", json=question("q"))).status_code == 429
