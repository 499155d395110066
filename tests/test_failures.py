"""Failures are events, never hangs or crashes; the server keeps serving after each:
upstream faults, a model that never answers or cannot be reached, clients that vanish
— and nothing is leaked."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import orjson
import pytest
from httpx_ws import aconnect_ws

from app.main import create_app
from tests.client import chat_body, sse_chat
from tests.conftest import USER
from tests.servers import serve

pytestmark = pytest.mark.anyio


async def saved_answer(client, chat_id):
    return (await client.get(f"/api/chats/{chat_id}")).json()["messages"][-1]


async def still_serving(client):
    events = await sse_chat(client, chat_body("still there?"))
    assert events[-1].data["status"] == "completed"


@pytest.mark.parametrize(
    ("directive", "key", "fragment"),
    [
        ("#fail=500", "STREAM_ERROR", "failed (500)"),
        ("#fail=429", "STREAM_ERROR", "429"),
        ("#break=2", "STREAM_ERROR", "broke"),
        ("#malformed=2", "STREAM_ERROR", "malformed"),
    ],
)
async def test_model_failures_end_the_stream_with_an_error_and_save_what_arrived(
    client, fake_model, directive, key, fragment
):
    events = await sse_chat(client, chat_body(f"q {directive}", chatId="500"))
    last = events[-1]
    assert last.type == "error"
    assert last.data["key"] == key
    assert fragment in last.data["data"]
    assert "fake failure" not in last.data["data"]  # the model's own words stay in the log
    assert last.data["messageId"] == events[0].data["messageId"]
    assert [e.type for e in events].count("error") == 1
    answer = await saved_answer(client, "500")
    assert answer["status"] == "failed"
    assert answer["error"] == {"key": key, "data": last.data["data"]}  # for a reopened chat
    if directive in ("#break=2", "#malformed=2"):
        assert answer["content"] == "tok0 tok1 "
    await still_serving(client)


async def test_empty_body_from_the_model_is_a_stream_error_naming_the_window(client, fake_model):
    # an empty 200 is how llama.cpp's server answers a prompt over its window
    events = await sse_chat(client, chat_body("q #empty", chatId="510"))
    assert events[-1].type == "error"
    assert events[-1].data["key"] == "STREAM_ERROR"
    assert "context window" in events[-1].data["data"]
    assert "empty" not in events[-1].data["data"]
    assert (await saved_answer(client, "510"))["status"] == "failed"


async def test_an_answer_cut_at_max_output_tokens_ends_completed_and_is_saved_whole(
    settings, fake_model
):
    with serve(create_app(settings.replace(llm={"max_output_tokens": 5}))) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10, event_hooks=USER) as client:
            events = await sse_chat(client, chat_body("never stops #endless", chatId="511"))
            answer = await saved_answer(client, "511")
    end = events[-1]
    assert end.type == "messageEnd" and end.data["status"] == "completed"
    assert end.data["truncated"] is True
    assert answer["status"] == "completed"
    assert answer["content"] == "tok0 tok1 tok2 tok3 tok4 "
    assert orjson.loads(answer["metadata"])["truncated"] is True
    assert fake_model.streamed_requests()[-1]["max_tokens"] == 5


async def test_unreachable_model_is_a_chat_error(settings, fake_model):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    unreachable = settings.replace(llm={"base_url": f"http://127.0.0.1:{port}/v1"})
    with serve(create_app(unreachable)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10, event_hooks=USER) as client:
            events = await sse_chat(client, chat_body("q", chatId="520"))
            assert events[-1].type == "error"
            assert events[-1].data["key"] == "CHAT_ERROR"
            assert (await saved_answer(client, "520"))["status"] == "failed"
            assert (await client.get("/healthz")).status_code == 200


async def test_model_deadline_ends_the_generation(settings, fake_model):
    with serve(create_app(settings.replace(llm={"timeout_seconds": 0.5}))) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10, event_hooks=USER) as client:
            events = await sse_chat(
                client, chat_body("q #keepalive=3 #tokens=50 #delay=0.05", chatId="525")
            )
            assert events[-1].data["key"] == "STREAM_ERROR"
            assert "timeout_seconds" in events[-1].data["data"]
    record = await fake_model.wait_stream_end()
    assert record.outcome == "client_closed"


async def test_no_model_key_is_a_config_error(settings, fake_model):
    with serve(create_app(settings.replace(llm={"api_key": ""}))) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10, event_hooks=USER) as client:
            response = await client.post("/api/chat/sse", json=chat_body("q"))
            assert response.status_code == 503
            assert response.json()["key"] == "CONFIG_ERROR"
            async with aconnect_ws(server.ws_url + "/api/chat/ws", client) as ws:
                await ws.receive_text()
                await ws.send_text(orjson.dumps(chat_body("q", chatId="5")).decode())
                frame = orjson.loads(await ws.receive_text())
                assert (frame["type"], frame["key"], frame["chatId"]) == (
                    "error",
                    "CONFIG_ERROR",
                    "5",
                )


@pytest.mark.parametrize(
    ("content", "headers", "status", "fragment"),
    [
        (b"{not json", {"content-type": "application/json"}, 400, "not valid JSON"),
        (b"", {}, 400, "empty"),
        (b'{"message": {"content": "x"}, "focusMode": "nope"}', {}, 400, "focusMode"),
        (b'{"message": {"content": ""}}', {}, 400, "content"),
        (b'{"message": {"content": "x"}, "optimizationMode": 3}', {}, 400, "optimizationMode"),
        (b'"just a string"', {}, 400, "JSON object"),
        (b"\xff\xfe\x00garbage", {}, 400, "not valid JSON"),
    ],
)
async def test_malformed_requests_are_refused_with_what_is_wrong(
    client, fake_model, content, headers, status, fragment
):
    response = await client.post("/api/chat/sse", content=content, headers=headers)
    assert response.status_code == status
    body = response.json()
    assert body["type"] == "error" and body["key"] == "BAD_REQUEST"
    assert fragment in body["data"]
    assert fake_model.streamed_requests() == []
    await still_serving(client)


async def test_over_large_body_is_413(client, fake_model):
    big = orjson.dumps(chat_body("x" * 2_000_000))
    response = await client.post("/api/chat/sse", content=big)
    assert response.status_code == 413
    assert response.json()["key"] == "BAD_REQUEST"

    async def chunks():
        for _ in range(40):
            yield b" " * 65536

    response = await client.post(
        "/api/chat/sse", content=chunks()
    )  # no content-length: counted while read
    assert response.status_code == 413
    await still_serving(client)


async def test_bad_websocket_frames_get_error_frames_and_the_socket_stays_open(server, fake_model):
    async with aconnect_ws(server.ws_url + "/api/chat/ws", httpx.AsyncClient(timeout=10)) as ws:
        await ws.receive_text()
        cases = [
            ("{nope", "not valid JSON"),
            ('{"type": "dance"}', "type must be"),
            (orjson.dumps(chat_body("q", focusMode="weird", chatId="77")).decode(), "focusMode"),
            ('{"type": "cancel"}', "chatId"),
            ("[1, 2]", "type must be"),
        ]
        for text, fragment in cases:
            await ws.send_text(text)
            frame = orjson.loads(await ws.receive_text())
            assert frame["type"] == "error" and frame["key"] == "BAD_REQUEST", frame
            assert fragment in frame["data"]
            if '"77"' in text:
                assert frame["chatId"] == "77"
        await ws.send_bytes(b"\x00\x01binary")
        frame = orjson.loads(await ws.receive_text())
        assert frame["key"] == "BAD_REQUEST" and "binary" in frame["data"]
        await ws.send_text('{"type": "cancel", "chatId": "123"}')
        frame = orjson.loads(await ws.receive_text())
        assert frame["key"] == "NOT_FOUND" and frame["chatId"] == "123"
        await ws.send_text('{"type": "ping"}')
        assert orjson.loads(await ws.receive_text()) == {"type": "pong"}


async def test_model_error_over_websocket_keeps_the_socket(server, fake_model):
    async with aconnect_ws(server.ws_url + "/api/chat/ws", httpx.AsyncClient(timeout=10)) as ws:
        await ws.receive_text()
        await ws.send_text(orjson.dumps(chat_body("q #fail=500")).decode())
        frames = []
        while not frames or frames[-1]["type"] not in ("error", "messageEnd"):
            frames.append(orjson.loads(await ws.receive_text()))
        assert frames[-1]["key"] == "STREAM_ERROR" and "eventId" in frames[-1]
        await ws.send_text(orjson.dumps(chat_body("again")).decode())
        frames = []
        while not frames or frames[-1]["type"] != "messageEnd":
            frames.append(orjson.loads(await ws.receive_text()))
        assert frames[-1]["status"] == "completed"


async def _state(app):
    service = app.state.service
    return {
        "generations": service.running(),
        "claims": len(service.hub.local.running()),
        "tasks": len(asyncio.all_tasks()),
    }


async def settled(server, baseline_tasks, timeout=10.0):
    """Wait until nothing runs on the server beyond what it ran when idle."""
    deadline = time.monotonic() + timeout
    while True:
        state = server.call(_state(server.app))
        if (state["generations"], state["claims"]) == (0, 0) and state["tasks"] <= baseline_tasks:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"leaked: {state} (idle tasks: {baseline_tasks})")
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("directive", "key"),
    [
        ("#fail=500", "STREAM_ERROR"),
        ("#fail=503", "STREAM_ERROR"),
        ("#fail=429", "STREAM_ERROR"),
        ("#break=3", "STREAM_ERROR"),
        ("#malformed=3", "STREAM_ERROR"),
        ("#empty", "STREAM_ERROR"),
        ("#tokens=3 #delay=1.5", "STREAM_ERROR"),  # read timeout between tokens
    ],
)
async def test_upstream_faults_end_cleanly_with_nothing_leaked(
    settings, fake_model, directive, key
):
    with serve(create_app(settings.replace(llm={"read_timeout_seconds": 0.5}))) as server:
        idle = server.call(_state(server.app))["tasks"]
        async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
            events = await sse_chat(http, chat_body(f"q {directive}", chatId="960"))
            assert events[-1].type == "error" and events[-1].data["key"] == key
            answer = (await http.get("/api/chats/960")).json()["messages"][-1]
            assert answer["status"] == "failed"
            await settled(server, idle + 2)  # the title chore may still be finishing
    for record in fake_model.streams:
        assert record.outcome != "open"


async def test_a_429_before_the_first_token_is_retried_once(client, fake_model):
    events = await sse_chat(client, chat_body("q #flaky=429"))
    assert events[-1].data["status"] == "completed"
    assert len(fake_model.streamed_requests()) == 2


async def test_a_model_that_never_answers_times_out(settings, fake_model):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never says a word
    port = silent.getsockname()[1]
    try:
        mute = settings.replace(
            llm={"base_url": f"http://127.0.0.1:{port}/v1", "read_timeout_seconds": 0.5}
        )
        with serve(create_app(mute)) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
                started = time.monotonic()
                events = await sse_chat(http, chat_body("q"))
                assert time.monotonic() - started < 5
        assert events[-1].data["key"] == "CHAT_ERROR" and "in time" in events[-1].data["data"]
    finally:
        silent.close()


async def test_two_hundred_abrupt_disconnects_leak_nothing(settings, fake_model):
    uncapped = settings.replace(limits={"max_concurrent_generations": 0})
    with serve(create_app(uncapped)) as server:
        await _two_hundred_abrupt_disconnects(server)


async def _two_hundred_abrupt_disconnects(server):
    idle = server.call(_state(server.app))["tasks"]
    async with httpx.AsyncClient(
        base_url=server.url,
        timeout=30,
        limits=httpx.Limits(max_connections=60),
        event_hooks=USER,
    ) as http:

        async def hang_up(i):
            body = chat_body(f"q{i} #tokens=30 #delay=0.01 #reasoning=0", chatId=str(10_000 + i))
            async with http.stream("POST", "/api/chat/sse", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if '"data":"tok1 "' in line:
                        return  # drop the connection mid-answer
            raise AssertionError("the answer ended before the client hung up")

        for start in range(0, 200, 50):
            await asyncio.gather(*(hang_up(i) for i in range(start, start + 50)))
        state = await settled(server, idle + 2, timeout=30)
        assert state["generations"] == 0
        metrics = (await http.get("/metrics")).text
        assert 'searchchat_connections_active{transport="sse"} 0.0' in metrics
        saved = (await http.get("/api/chats/10199")).json()["messages"][-1]
        assert saved["status"] == "completed"  # each kept going after its client left
        assert saved["content"].endswith("tok29 ")


async def test_a_model_that_cannot_be_connected_to_times_out(settings, fake_model):
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)  # a backlog that is full at once: further SYNs go unanswered
    port = full.getsockname()[1]
    fillers = []
    for _ in range(4):  # fill the accept queue; connections that never get accepted
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    try:
        hanging = settings.replace(
            llm={"base_url": f"http://127.0.0.1:{port}/v1", "connect_timeout_seconds": 0.5}
        )
        with serve(create_app(hanging)) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
                started = time.monotonic()
                events = await sse_chat(http, chat_body("q"))
                elapsed = time.monotonic() - started
        assert events[-1].data["key"] == "CHAT_ERROR" and "in time" in events[-1].data["data"]
        assert elapsed < 5
    finally:
        for filler in fillers:
            filler.close()
        full.close()
