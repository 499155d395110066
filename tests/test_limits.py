"""What one client may ask for: rate limits that count resumes too, the process's
cap on the answers it runs (in each protocol's shape), the cap per forwarded address
and per key, and the largest body."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from httpx_ws import aconnect_ws

from app.main import create_app
from tests.client import chat_body, iter_sse, read_events, sse_chat
from tests.conftest import USER
from tests.servers import processes, serve

pytestmark = pytest.mark.anyio


async def test_resumes_count_against_the_rate_limit(settings, fake_model, hour_windows):
    limited = settings.replace(limits={"requests_per_minute": 3})
    with serve(create_app(limited)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20, event_hooks=USER) as http:
            events = await sse_chat(http, chat_body("q", chatId="rl1"))
            answers = [
                await http.get(
                    "/api/chat/sse/resume", params={"chatId": "rl1", "lastEventId": events[1].id}
                )
                for _ in range(3)
            ]
    assert [a.status_code for a in answers][:2] == [200, 200]
    assert answers[-1].status_code == 429 and answers[-1].headers["retry-after"]


async def test_a_process_caps_the_answers_it_runs(settings, fake_model):
    capped = settings.replace(
        limits={"max_generations_per_process": 2, "max_concurrent_generations": 0}
    )
    with serve(create_app(capped)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20, event_hooks=USER) as http:
            async with (
                http.stream("POST", "/api/chat/sse", json=chat_body("#hang", chatId="p1")) as a,
                http.stream("POST", "/api/chat/sse", json=chat_body("#hang", chatId="p2")) as b,
            ):
                await read_events(iter_sse(a), 2)
                await read_events(iter_sse(b), 2)
                third = await http.post("/api/chat/sse", json=chat_body("q", chatId="p3"))
                assert third.status_code == 503 and third.headers["retry-after"] == "2"
                assert "answering 2 questions already" in third.json()["data"]
                for chat in ("p1", "p2"):
                    await http.post("/api/chat/cancel", json={"chatId": chat, "userId": "1"})


async def test_a_burst_of_questions_at_once_never_passes_the_process_cap(settings, fake_model):
    """Ten questions sent at the same moment to a process capped at three: exactly three
    start (the check and the place it takes happen before the first await)."""
    capped = settings.replace(
        limits={"max_generations_per_process": 3, "max_concurrent_generations": 0}
    )
    with serve(create_app(capped)) as running:
        async with httpx.AsyncClient(
            base_url=running.url,
            timeout=20,
            event_hooks=USER,
            limits=httpx.Limits(max_connections=20),
        ) as http:
            go, answered, stop = asyncio.Event(), asyncio.Event(), asyncio.Event()
            statuses: list[int] = []

            async def ask(i: int) -> None:
                await go.wait()
                body = chat_body("#hang", chatId=f"burst{i}")
                async with http.stream("POST", "/api/chat/sse", json=body) as answer:
                    statuses.append(answer.status_code)
                    if len(statuses) == 10:
                        answered.set()
                    await stop.wait()  # an accepted answer runs on meanwhile

            asking = [asyncio.create_task(ask(i)) for i in range(10)]
            await asyncio.sleep(0.2)
            go.set()
            await asyncio.wait_for(answered.wait(), 10)
            assert running.app.state.service.running() == 3
            stop.set()
            await asyncio.gather(*asking)
            for i in range(10):
                await http.post("/api/chat/cancel", json={"chatId": f"burst{i}", "userId": "1"})
    assert sorted(statuses) == [200] * 3 + [503] * 7, statuses


async def test_the_process_cap_answers_websocket_and_v1_in_their_shapes(settings, fake_model):
    capped = settings.replace(
        limits={"max_generations_per_process": 1, "max_concurrent_generations": 0}
    )
    with serve(create_app(capped)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20, event_hooks=USER) as http:
            body = chat_body("#hang", chatId="only")
            async with http.stream("POST", "/api/chat/sse", json=body) as first:
                await read_events(iter_sse(first), 2)
                async with aconnect_ws(running.ws_url + "/api/chat/ws", http) as ws:
                    await ws.receive_text()  # signal
                    await ws.send_text(orjson.dumps(chat_body("q", chatId="ws1")).decode())
                    frame = orjson.loads(await ws.receive_text())
                v1 = await http.post(
                    "/v1/chat/completions",
                    json={"model": "deepSeek", "messages": [{"role": "user", "content": "q"}]},
                )
                await http.post("/api/chat/cancel", json={"chatId": "only", "userId": "1"})
    assert frame["type"] == "error" and "answering 1 questions already" in frame["data"], frame
    assert frame["chatId"] == "ws1"
    assert v1.status_code == 503 and v1.headers["retry-after"] == "2"
    assert v1.json()["error"]["type"] == "server_error"
    assert "answering 1 questions already" in v1.json()["error"]["message"]


async def test_websocket_resumes_count_against_the_rate_limit(settings, fake_model, hour_windows):
    limited = settings.replace(limits={"requests_per_minute": 3})
    with serve(create_app(limited)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20, event_hooks=USER) as http:
            events = await sse_chat(http, chat_body("q", chatId="wr1"))  # one request
            async with aconnect_ws(running.ws_url + "/api/chat/ws", http) as ws:
                await ws.receive_text()  # signal
                frames = []
                for _ in range(3):
                    resume = {"type": "resume", "chatId": "wr1", "userId": "1"}
                    resume["lastEventId"] = events[1].id
                    await ws.send_text(orjson.dumps(resume).decode())
                # the refusal and the replays come in whatever order their tasks run
                while not (
                    any(f.get("type") == "error" for f in frames)
                    and any(f.get("type") == "messageEnd" for f in frames)
                ):
                    frames.append(orjson.loads(await ws.receive_text(timeout=10)))
    refused = [f for f in frames if f.get("type") == "error"]
    assert refused[0]["key"] == "RATE_LIMITED", refused
    # the first two resumes were taken (each a replay up to the end)
    assert sum(f.get("type") == "messageEnd" for f in frames) >= 1


async def test_behind_a_trusted_proxy_the_cap_counts_the_forwarded_address(settings, fake_model):
    capped = settings.replace(limits={"max_concurrent_generations": 1})
    with serve(create_app(capped)) as server:  # from 127.0.0.1, a trusted proxy by default
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:

            def via(address, content, chat):
                return http.post(
                    "/api/chat/sse",
                    json=chat_body(content, chatId=chat),
                    headers={"x-forwarded-for": f"203.0.113.9, {address}"},
                )

            async with http.stream(
                "POST",
                "/api/chat/sse",
                json=chat_body("long #tokens=100 #delay=0.02", chatId="p1"),
                headers={"x-forwarded-for": "198.51.100.1"},
            ) as first:
                await anext(first.aiter_lines())
                assert (await via("198.51.100.1", "same client", "p2")).status_code == 429
                assert (await via("198.51.100.2", "another client", "p3")).status_code == 200


async def test_with_auth_the_cap_counts_per_key(settings, fake_model):
    keyed = settings.replace(
        limits={"max_concurrent_generations": 1}, auth={"api_keys": {"k1": "u1", "k2": "u2"}}
    )
    with serve(create_app(keyed)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
            one = {"authorization": "Bearer k1"}
            body = {**chat_body("long #tokens=100 #delay=0.02", chatId="q1"), "userId": None}
            async with http.stream("POST", "/api/chat/sse", json=body, headers=one) as first:
                await anext(first.aiter_lines())
                again = {**chat_body("again", chatId="q2"), "userId": None}
                assert (
                    await http.post("/api/chat/sse", json=again, headers=one)
                ).status_code == 429
                other = {**chat_body("other key", chatId="q3"), "userId": None}
                two = {"authorization": "Bearer k2"}
                assert (
                    await http.post("/api/chat/sse", json=other, headers=two)
                ).status_code == 200


async def test_an_over_large_body_is_answered_413_not_reset(env, fake_model):
    with processes(1, env) as (a,):
        async with httpx.AsyncClient(timeout=30) as http:
            big = orjson.dumps(chat_body("x" * 1_500_000))
            for _ in range(5):  # every time, not by luck
                response = await http.post(a.url + "/api/chat/sse", content=big)
                assert response.status_code == 413
                assert response.json()["key"] == "BAD_REQUEST"
            huge_headers = {f"x-filler-{i}": "y" * 1000 for i in range(40)}
            response = await http.get(a.url + "/healthz", headers=huge_headers)
            assert response.status_code == 431
            assert (await http.get(a.url + "/healthz")).status_code == 200
