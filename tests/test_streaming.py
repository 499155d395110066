"""End to end through real uvicorn: the event sequence over SSE and WebSocket."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from httpx_ws import aconnect_ws

from app.main import create_app
from tests.client import SseEvent, answer_of, chat_body, iter_sse, reasoning_of, sse_chat
from tests.fakes.model import THINK_ANSWER, THINK_REASONING
from tests.servers import serve

pytestmark = pytest.mark.anyio


async def ws_chat(ws, body, until=("messageEnd", "error")):
    await ws.send_text(orjson.dumps(body).decode())
    frames = []
    while True:
        frame = orjson.loads(await ws.receive_text())
        frames.append(frame)
        if frame["type"] in until:
            return frames


async def open_ws(server, path="/api/chat/ws"):
    return aconnect_ws(server.ws_url + path, httpx.AsyncClient(timeout=10))


def shape(events):
    """What must be equal across transports: types, payloads, seq numbers (and the
    stages timed, not their times)."""
    out = []
    for e in events:
        data = dict(e.data if isinstance(e, SseEvent) else e)
        event_id = e.id if isinstance(e, SseEvent) else data.pop("eventId", None)
        for key in ("messageId", "chatId", "questionMessageId"):
            data.pop(key, None)
        if "timings" in data:  # when each stage ran differs; which stages ran does not
            data["timings"] = sorted(span["stage"] for span in data["timings"])
        out.append((event_id.split(":")[1] if event_id else None, data))
    return out


async def test_sse_stream_has_the_documented_sequence_ids_and_headers(client, fake_model):
    async with client.stream(
        "POST",
        "/api/chat/sse",
        json=chat_body("hello", chatId="7138337258229764", messageId="71383373052067817"),
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        events = [e async for e in iter_sse(response) if isinstance(e, SseEvent)]
    types = [e.type for e in events]
    assert types == ["message", "reasoning", "reasoning"] + ["message"] * 5 + ["messageEnd"]
    assert events[0].data["data"] == ""
    assert reasoning_of(events) == "why0 why1 "
    assert answer_of(events) == "tok0 tok1 tok2 tok3 tok4 "
    answer_id = events[0].data["messageId"]
    assert answer_id.isdigit() and answer_id not in ("7138337258229764", "71383373052067817")
    assert [e.id for e in events] == [f"{answer_id}:{i}" for i in range(1, len(events) + 1)]
    for e in events:
        assert e.data["chatId"] == "7138337258229764"
        assert e.data["messageId"] == answer_id
    assert events[-1].data["status"] == "completed"
    assert events[-1].data["questionMessageId"] == "71383373052067817"


async def test_both_transports_produce_the_same_events(server, client, fake_model):
    body = chat_body("same please #tokens=7 #reasoning=3 #keepalive=0")
    sse_events = await sse_chat(client, body)
    async with await open_ws(server) as ws:
        assert orjson.loads(await ws.receive_text()) == {"type": "signal", "data": "open"}
        ws_frames = await ws_chat(ws, body)
    assert shape(sse_events) == shape(ws_frames)
    assert len(sse_events) == 1 + 3 + 7 + 1
    answer_id = ws_frames[0]["messageId"]
    assert [f["eventId"] for f in ws_frames] == [
        f"{answer_id}:{i}" for i in range(1, len(ws_frames) + 1)
    ]


async def test_websocket_at_root_path_and_ping(server, fake_model):
    async with await open_ws(server, "/") as ws:
        assert orjson.loads(await ws.receive_text())["type"] == "signal"
        await ws.send_text('{"type": "ping"}')
        assert orjson.loads(await ws.receive_text()) == {"type": "pong"}
        frames = await ws_chat(ws, chat_body("hi"))
        assert answer_of(frames) == "tok0 tok1 tok2 tok3 tok4 "


async def test_several_chats_run_at_once_on_one_socket(server, fake_model):
    async with await open_ws(server) as ws:
        await ws.receive_text()
        bodies = [
            chat_body(f"chat {i} #tokens={3 + i} #delay=0.01", chatId=str(1000 + i))
            for i in range(3)
        ]
        for body in bodies:
            await ws.send_text(orjson.dumps(body).decode())
        by_chat: dict[str, list] = {}
        ended = 0
        while ended < 3:
            frame = orjson.loads(await ws.receive_text())
            by_chat.setdefault(frame["chatId"], []).append(frame)
            ended += frame["type"] == "messageEnd"
    assert sorted(by_chat) == ["1000", "1001", "1002"]
    for i in range(3):
        frames = by_chat[str(1000 + i)]
        assert answer_of(frames) == "".join(f"tok{j} " for j in range(3 + i))
        seqs = [int(f["eventId"].split(":")[1]) for f in frames]
        assert seqs == list(range(1, len(frames) + 1))
    # interleaved, not one after the other
    assert len(fake_model.streams) == 3


async def test_upstream_keepalives_become_keepalive_frames_and_ping_comments(
    server, client, fake_model
):
    body = chat_body("slow start #keepalive=2")
    async with await open_ws(server) as ws:
        await ws.receive_text()
        frames = await ws_chat(ws, body)
    keepalives = [f for f in frames if f["type"] == "keep-alive"]
    assert len(keepalives) >= 1
    assert all("eventId" not in f and f["messageId"] and f["chatId"] for f in keepalives)
    numbered = [f for f in frames if "eventId" in f]
    assert [int(f["eventId"].split(":")[1]) for f in numbered] == list(range(1, len(numbered) + 1))

    async with client.stream("POST", "/api/chat/sse", json=body) as response:
        items = [e async for e in iter_sse(response)]
    assert ": ping" in [i for i in items if isinstance(i, str)]
    assert all(isinstance(i, str) or i.type != "keep-alive" for i in items)


async def test_idle_sse_stream_gets_ping_comments(settings, fake_model):
    with serve(create_app(settings.replace(server={"keepalive_seconds": 0.2}))) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            async with http.stream(
                "POST", "/api/chat/sse", json=chat_body("slow #tokens=3 #delay=0.35")
            ) as response:
                items = [e async for e in iter_sse(response)]
    pings = [i for i in items if i == ": ping"]
    assert len(pings) >= 2
    assert answer_of([i for i in items if isinstance(i, SseEvent)]) == "tok0 tok1 tok2 "


async def test_think_tags_in_content_become_reasoning(client, fake_model):
    events = await sse_chat(client, chat_body("#think"))
    assert reasoning_of(events) == "why0 why1 " + THINK_REASONING
    assert answer_of(events) == THINK_ANSWER
    assert "<" not in answer_of(events)


@pytest.mark.parametrize(
    ("focus", "marker"),
    [
        ("deepSeek", "helpful, knowledgeable assistant"),
        ("mathAssistant", "mathematics assistant"),
        ("writingAssistant", "writing assistant"),
        ("translator", "professional translator"),
    ],
)
async def test_each_focus_mode_sends_its_system_prompt(client, fake_model, focus, marker):
    events = await sse_chat(client, chat_body("question", focusMode=focus))
    assert events[-1].type == "messageEnd"
    system = fake_model.last_system_prompt()
    assert marker in system
    assert "{date}" not in system
    request = fake_model.streamed_requests()[-1]
    assert request["model"] == "fake-chat"
    assert request["messages"][-1] == {"role": "user", "content": "question"}


async def test_web_search_without_copilot_answers_from_the_model_alone(client, fake_model):
    events = await sse_chat(
        client, chat_body("question", focusMode="webSearch", copilotEnabled=False)
    )
    assert [e.type for e in events if e.type not in ("message", "reasoning")] == ["messageEnd"]
    assert "helpful, knowledgeable assistant" in fake_model.last_system_prompt()


async def test_client_disconnect_does_not_stop_the_generation(server, client, fake_model):
    body = chat_body("long #tokens=30 #delay=0.02")
    async with client.stream("POST", "/api/chat/sse", json=body) as response:
        seen = []
        async for item in iter_sse(response):
            if isinstance(item, SseEvent):
                seen.append(item)
            if len(seen) == 4:
                break
    chat_id = seen[0].data["chatId"]
    record = await fake_model.wait_stream_end(timeout=10)
    assert record.outcome == "completed"
    for _ in range(100):
        chat = (await client.get(f"/api/chats/{chat_id}")).json()
        answer = chat["messages"][-1]
        if answer["status"] == "completed":
            break
        await asyncio.sleep(0.05)
    assert answer["status"] == "completed"
    assert answer["content"] == "".join(f"tok{i} " for i in range(30))
