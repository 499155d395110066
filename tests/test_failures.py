"""Failures are events, never hangs or crashes; the server keeps serving after each."""

from __future__ import annotations

import socket

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
