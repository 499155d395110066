"""Auth by API key, rate limits, the concurrency cap, CORS, and what is logged."""

from __future__ import annotations

import asyncio
import logging

import httpx
import orjson
import pytest
from httpx_ws import WebSocketDisconnect, aconnect_ws

from app.main import create_app
from tests.client import chat_body, sse_chat
from tests.servers import serve

pytestmark = pytest.mark.anyio

KEYS = {"key-eleven": "11", "key-twenty-two": "22"}
ELEVEN = {"authorization": "Bearer key-eleven"}
TWENTY_TWO = {"authorization": "Bearer key-twenty-two"}


@pytest.fixture
def secured(settings):
    with serve(create_app(settings.replace(auth={"api_keys": KEYS}))) as server:
        yield server


@pytest.fixture
async def anon(secured):
    async with httpx.AsyncClient(base_url=secured.url, timeout=10) as http:
        yield http


async def test_every_api_route_needs_a_key(anon, fake_model):
    for method, path in [
        ("POST", "/api/chat/sse"),
        ("GET", "/api/chat/sse/resume?chatId=1"),
        ("POST", "/api/chat/cancel"),
        ("GET", "/api/chats"),
        ("GET", "/api/chats/1"),
        ("DELETE", "/api/chats/1"),
        ("GET", "/api/config"),
        ("POST", "/api/suggestions"),
        ("GET", "/sources/1"),
    ]:
        for headers in (
            {},
            {"authorization": "Bearer nope"},
            {"authorization": "Basic a2V5LWVsZXZlbg=="},
        ):
            response = await anon.request(method, path, headers=headers, json={})
            assert response.status_code == 401, (method, path, headers)
            assert response.json()["key"] == "UNAUTHORIZED"
    assert (await anon.get("/healthz")).status_code == 200
    assert (await anon.get("/readyz")).status_code == 200
    assert (await anon.get("/api/config", headers=ELEVEN)).json()["authRequired"] is True
    assert fake_model.requests == []


async def test_the_key_decides_the_user(anon, fake_model):
    events = await sse_chat(
        anon, {**chat_body("mine", chatId="900", messageId="901"), "userId": None}, headers=ELEVEN
    )
    assert events[-1].data["status"] == "completed"
    other = await anon.post(
        "/api/chat/sse", json={**chat_body("claim", chatId="902"), "userId": "22"}, headers=ELEVEN
    )
    assert other.status_code == 403 and other.json()["key"] == "FORBIDDEN"
    assert [c["id"] for c in (await anon.get("/api/chats", headers=ELEVEN)).json()["chats"]] == [
        "900"
    ]
    assert (await anon.get("/api/chats", headers=TWENTY_TWO)).json()["chats"] == []
    assert (
        await anon.get("/api/chats", params={"userId": "22"}, headers=ELEVEN)
    ).status_code == 403
    assert (await anon.get("/api/chats/900", headers=ELEVEN)).status_code == 200
    assert (await anon.get("/api/chats/900", headers=TWENTY_TWO)).status_code == 403
    assert (await anon.delete("/api/chats/900", headers=TWENTY_TWO)).status_code == 403
    assert (await anon.get("/sources/901", headers=TWENTY_TWO)).status_code == 403
    assert (await anon.get("/sources/901", params={"token": "key-eleven"})).status_code == 200
    assert (
        await anon.post("/api/suggestions", json={"chatId": "900"}, headers=TWENTY_TWO)
    ).status_code == 403
    # someone else's chat id cannot be written to either
    intrude = await anon.post(
        "/api/chat/sse", json={**chat_body("hi", chatId="900"), "userId": None}, headers=TWENTY_TWO
    )
    assert intrude.status_code == 403


async def test_cancel_and_resume_only_for_the_owner(anon, fake_model):
    async with anon.stream(
        "POST",
        "/api/chat/sse",
        json={**chat_body("long #tokens=300 #delay=0.02", chatId="910"), "userId": None},
        headers=ELEVEN,
    ) as response:
        lines = response.aiter_lines()
        await anext(lines)
        assert (
            await anon.post("/api/chat/cancel", json={"chatId": "910"}, headers=TWENTY_TWO)
        ).status_code == 403
        assert (
            await anon.get("/api/chat/sse/resume", params={"chatId": "910"}, headers=TWENTY_TWO)
        ).status_code == 403
        assert (
            await anon.post("/api/chat/cancel", json={"chatId": "910"}, headers=ELEVEN)
        ).status_code == 200
        rest = [line async for line in lines]
    assert any('"status":"cancelled"' in line for line in rest)


async def test_websocket_needs_a_key(secured, fake_model):
    async with httpx.AsyncClient(timeout=10) as http:
        async with aconnect_ws(secured.ws_url + "/api/chat/ws", http) as ws:
            frame = orjson.loads(await ws.receive_text())
            assert (frame["type"], frame["key"]) == ("error", "UNAUTHORIZED")
            with pytest.raises(WebSocketDisconnect) as closed:
                await ws.receive_text()
            assert closed.value.code == 4401
        for url, headers in (
            (secured.ws_url + "/api/chat/ws?token=key-eleven", {}),
            (secured.ws_url + "/", ELEVEN),
        ):
            async with aconnect_ws(url, http, headers=headers) as ws:
                assert orjson.loads(await ws.receive_text())["type"] == "signal"
                await ws.send_text(orjson.dumps({**chat_body("hi"), "userId": "22"}).decode())
                assert orjson.loads(await ws.receive_text())["key"] == "FORBIDDEN"
                await ws.send_text(
                    orjson.dumps({**chat_body("hi", chatId="920"), "userId": None}).decode()
                )
                frames = [orjson.loads(await ws.receive_text())]
                while frames[-1]["type"] not in ("messageEnd", "error"):
                    frames.append(orjson.loads(await ws.receive_text()))
                assert frames[-1]["status"] == "completed"
            async with httpx.AsyncClient(base_url=secured.url, timeout=10) as client:
                assert (await client.get("/api/chats/920", headers=ELEVEN)).status_code == 200
            break


async def test_cors_is_open_without_auth_and_closed_with_it(client, anon):
    origin = {"origin": "https://elsewhere.example"}
    open_ = await client.get("/api/config", headers=origin)
    assert open_.headers.get("access-control-allow-origin") == "*"
    closed = await anon.get("/api/config", headers={**origin, **ELEVEN})
    assert "access-control-allow-origin" not in closed.headers


async def test_keys_and_tokens_are_not_logged(secured, caplog):
    caplog.set_level(logging.DEBUG)
    async with httpx.AsyncClient(base_url=secured.url, timeout=10) as http:
        await http.get("/api/config", headers=ELEVEN)
        await http.get("/sources/1", params={"token": "key-eleven"})
        await http.get("/api/config", headers={"authorization": "Bearer wrong-key-123"})
        async with aconnect_ws(secured.ws_url + "/api/chat/ws?token=key-eleven", http) as ws:
            await ws.receive_text()
    await asyncio.sleep(0.1)
    server_side = [
        r for r in caplog.records if r.name.startswith(("app", "uvicorn"))
    ]  # not the test's client
    text = "\n".join(r.getMessage() + str(getattr(r, "fields", "")) for r in server_side)
    assert "/api/config" in text  # the access log did run
    assert "key-eleven" not in text and "wrong-key-123" not in text and "token=" not in text


async def test_requests_per_minute_per_client(settings, fake_model):
    with serve(create_app(settings.replace(limits={"requests_per_minute": 2}))) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            await sse_chat(http, chat_body("one"))
            await sse_chat(http, chat_body("two"))
            third = await http.post("/api/chat/sse", json=chat_body("three"))
            assert third.status_code == 429
            assert third.json()["key"] == "RATE_LIMITED"
            assert 1 <= int(third.headers["retry-after"]) <= 60
            async with aconnect_ws(server.ws_url + "/api/chat/ws", http) as ws:
                await ws.receive_text()
                await ws.send_text(orjson.dumps(chat_body("four", chatId="930")).decode())
                frame = orjson.loads(await ws.receive_text())
                assert (frame["key"], frame["chatId"]) == ("RATE_LIMITED", "930")
            assert (await http.get("/api/chats")).status_code == 200  # reading is not limited


async def test_rate_limit_is_shared_across_processes_through_redis(settings, redis_url, fake_model):
    shared = settings.replace(
        limits={"requests_per_minute": 3}, redis={"url": redis_url}, auth={"api_keys": KEYS}
    )
    with serve(create_app(shared)) as a, serve(create_app(shared)) as b:
        async with httpx.AsyncClient(timeout=10) as http:
            for url in (a.url, b.url, a.url):
                async with http.stream(
                    "POST",
                    url + "/api/chat/sse",
                    json={**chat_body("q"), "userId": None},
                    headers=ELEVEN,
                ) as r:
                    assert r.status_code == 200
                    await r.aread()
            refused = await http.post(
                b.url + "/api/chat/sse", json={**chat_body("q"), "userId": None}, headers=ELEVEN
            )
            assert refused.status_code == 429
            other_user = await http.post(
                b.url + "/api/chat/sse", json={**chat_body("q"), "userId": None}, headers=TWENTY_TWO
            )
            assert other_user.status_code == 200
            await other_user.aread()


@pytest.mark.parametrize("backend", ["memory", "redis", "cluster"])
async def test_concurrent_generations_are_capped_per_address_with_auth_off(
    settings, fake_model, backend, request
):
    """A claimed userId proves nothing: changing it does not get past the cap, while
    another client address has a cap of its own."""
    changes = {"limits": {"max_concurrent_generations": 1}}
    if backend == "redis":
        changes["redis"] = {"url": request.getfixturevalue("redis_url")}
    elif backend == "cluster":
        changes["redis"] = {"url": request.getfixturevalue("redis_cluster").url, "cluster": True}
    with serve(create_app(settings.replace(**changes))) as server:
        elsewhere = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=10) as http,
            httpx.AsyncClient(base_url=server.url, timeout=10, transport=elsewhere) as other,
        ):
            async with http.stream(
                "POST",
                "/api/chat/sse",
                json=chat_body("long #tokens=100 #delay=0.02", chatId="940"),
            ) as first:
                lines = first.aiter_lines()
                await anext(lines)
                second = await http.post("/api/chat/sse", json=chat_body("another", chatId="941"))
                assert second.status_code == 429 and second.json()["key"] == "RATE_LIMITED"
                renamed = await http.post(
                    "/api/chat/sse", json={**chat_body("as another", chatId="944"), "userId": "2"}
                )
                assert renamed.status_code == 429
                other_address = await other.post(
                    "/api/chat/sse", json={**chat_body("theirs", chatId="942"), "userId": "2"}
                )
                assert other_address.status_code == 200
                rest = [line async for line in lines]
                assert any('"status":"completed"' in line for line in rest)
            events = await sse_chat(
                http, chat_body("after", chatId="943")
            )  # the slot is free again
            assert events[-1].data["status"] == "completed"


async def test_websocket_messages_per_second(settings, fake_model):
    with serve(create_app(settings.replace(limits={"ws_messages_per_second": 5}))) as server:
        async with aconnect_ws(server.ws_url + "/api/chat/ws", httpx.AsyncClient(timeout=10)) as ws:
            await ws.receive_text()
            for _ in range(20):
                await ws.send_text('{"type": "ping"}')
            frames = [orjson.loads(await ws.receive_text()) for _ in range(20)]
            assert 3 <= sum(f["type"] == "pong" for f in frames) <= 7
            assert all(f["type"] == "pong" or f["key"] == "RATE_LIMITED" for f in frames)
            await asyncio.sleep(0.5)
            await ws.send_text('{"type": "ping"}')
            assert orjson.loads(await ws.receive_text()) == {
                "type": "pong"
            }  # still open, and allowed again


async def test_input_limits_say_which_limit(settings, fake_model):
    limited = settings.replace(
        limits={"max_content_chars": 50, "max_history_messages": 3, "max_body_bytes": 4096}
    )
    with serve(create_app(limited)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            cases = [
                (chat_body("x" * 51), "longer than 50"),
                (chat_body("q", history=[["human", "a"]] * 4), "more than 3"),
                (chat_body("q", history=[["human", "x" * 51]]), "history[0] is longer"),
                ({**chat_body("q"), "userId": "1" * 65}, "userId"),
                (chat_body("q", chatId="a/b"), "chatId"),
            ]
            for body, fragment in cases:
                response = await http.post("/api/chat/sse", json=body)
                assert response.status_code == 400 and fragment in response.json()["data"], (
                    body,
                    response.text,
                )
            deep = b'{"message": {"content": "q"}, "files": ' + b"[" * 40 + b"]" * 40 + b"}"
            assert "nested" in (await http.post("/api/chat/sse", content=deep)).json()["data"]
            async with aconnect_ws(server.ws_url + "/api/chat/ws", http) as ws:
                await ws.receive_text()
                await ws.send_text(orjson.dumps(chat_body("y" * 5000)).decode())
                frame = orjson.loads(await ws.receive_text())
                assert frame["key"] == "BAD_REQUEST" and "larger than 4096" in frame["data"]
                await ws.send_text('{"type": "ping"}')
                assert orjson.loads(await ws.receive_text()) == {"type": "pong"}
