"""Readers pushed their events in the call that releases them: what they get is what a
woken reader gets (every event once, in order, then the end), whether the connection
takes the events at once, refuses some, stops reading for a while or resumes."""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
from httpx_ws import aconnect_ws

from app.events import Event, Handle
from app.main import create_app
from app.streams import GenerationLog, LogWriter
from tests.client import SseEvent, chat_body, iter_sse, read_events, rest
from tests.conftest import USER
from tests.servers import serve
from tests.test_slow_clients import masked_text_frame

pytestmark = pytest.mark.anyio


def handle() -> Handle:
    return Handle(chat_id="1", answer_id="100", question_id="99", user_id="7", question="q?")


def event(seq: int, type: str = "message") -> Event:
    return Event(type, "1", "100", {"data": f"d{seq}"}, seq)


async def pulled(batches: AsyncIterator[list[Event]], into: list[Event]) -> None:
    async for batch in batches:
        into.extend(batch)


async def settled() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_caught_up_reader_is_handed_each_event_in_the_call_that_appends_it():
    log = GenerationLog(handle())
    pushed: list[Event] = []
    woken: list[Event] = []
    reader = asyncio.create_task(pulled(log.follow(0, lambda b: pushed.extend(b) or True), woken))
    await settled()
    log.append(event(1))
    assert [e.seq for e in pushed] == [1]
    log.append(event(2))
    assert [e.seq for e in pushed] == [1, 2]
    log.end(event(3, "messageEnd"))
    async with asyncio.timeout(2):
        await reader  # it ends with the terminal event
    assert [e.seq for e in pushed] == [1, 2, 3]
    assert woken == []


async def test_a_reader_that_cannot_take_events_gets_them_from_where_it_was():
    log = GenerationLog(handle())
    got: list[Event] = []
    taking = True

    def push(batch: list[Event]) -> bool:
        if not taking:
            return False
        got.extend(batch)
        return True

    reader = asyncio.create_task(pulled(log.follow(0, push), got))
    await settled()
    log.append(event(1))
    taking = False
    log.append(event(2))  # refused: the reader is woken for it
    log.append(event(3))
    taking = True
    await settled()
    log.append(event(4))  # caught up again: pushed
    assert [e.seq for e in got] == [1, 2, 3, 4]
    log.end(event(5, "messageEnd"))
    async with asyncio.timeout(2):
        await reader
    assert [e.seq for e in got] == [1, 2, 3, 4, 5]


async def test_a_push_that_raises_hands_the_events_back_to_the_reader():
    log = GenerationLog(handle())
    got: list[Event] = []
    calls = 0

    def push(batch: list[Event]) -> bool:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("cannot now")
        got.extend(batch)
        return True

    reader = asyncio.create_task(pulled(log.follow(0, push), got))
    await settled()
    log.append(event(1))
    log.append(event(2))  # the generation goes on
    await settled()
    log.end(event(3, "messageEnd"))
    async with asyncio.timeout(2):
        await reader
    assert [e.seq for e in got] == [1, 2, 3]


async def test_held_events_are_pushed_only_once_released():
    log = GenerationLog(handle(), sink=lambda log, event: None)
    pushed: list[Event] = []
    reader = asyncio.create_task(pulled(log.follow(0, lambda b: pushed.extend(b) or True), []))
    await settled()
    log.append(event(1))
    log.append(event(2))
    assert pushed == []
    log.release(1)
    assert [e.seq for e in pushed] == [1]
    log.release(2)
    assert [e.seq for e in pushed] == [1, 2]
    log.end(event(3, "messageEnd"))
    async with asyncio.timeout(2):
        await reader
    assert [e.seq for e in pushed] == [1, 2, 3]


async def test_a_pushed_reader_gets_keep_alives_while_idle():
    log = GenerationLog(handle())
    pushed: list[Event] = []
    reader = asyncio.create_task(pulled(log.follow(0, lambda b: pushed.extend(b) or True), []))
    await settled()
    log.append(event(1))
    log.append(Event("keep-alive", "1", "100"))
    assert [(e.type, e.seq) for e in pushed] == [("message", 1), ("keep-alive", 0)]
    reader.cancel()


async def test_a_cancelled_reader_is_no_longer_pushed():
    log = GenerationLog(handle())
    pushed: list[Event] = []
    reader = asyncio.create_task(pulled(log.follow(0, lambda b: pushed.extend(b) or True), []))
    await settled()
    reader.cancel()
    await settled()
    log.append(event(1))
    assert pushed == []


def seqs(events: list[SseEvent]) -> list[int]:
    return [int(e.id.split(":")[1]) for e in events if e.id]


async def test_an_sse_client_that_stops_reading_gets_every_event_in_order_once_it_reads(
    settings, fake_model
):
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
            body = chat_body("#tokens=300 #size=20000 #reasoning=0", chatId="9101")
            async with http.stream("POST", "/api/chat/sse", json=body) as response:
                stream = iter_sse(response)
                first = await read_events(stream, 3)
                await asyncio.sleep(1.0)  # the server's buffers fill: it cannot write now
                events = first + await rest(stream)
    numbered = seqs(events)
    assert numbered == list(range(1, len(numbered) + 1))
    assert events[-1].type == "messageEnd"
    text = "".join(e.data["data"] for e in events if e.type == "message")
    assert len(text) == 300 * 20000


async def test_a_resume_while_the_answer_is_pushed_gets_the_rest_in_order(settings, fake_model):
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
            body = chat_body("#tokens=40 #delay=0.02 #reasoning=0", chatId="9102")
            async with http.stream("POST", "/api/chat/sse", json=body) as response:
                stream = iter_sse(response)
                first = await read_events(stream, 8)
                resumed_after = first[5].id
                async with http.stream(
                    "GET",
                    "/api/chat/sse/resume",
                    params={"chatId": "9102", "userId": "1"},
                    headers={"last-event-id": resumed_after},
                ) as again:
                    assert again.status_code == 200
                    resumed = await rest(iter_sse(again))
                whole = first + await rest(stream)
    numbered = seqs(whole)
    assert numbered == list(range(1, len(numbered) + 1))
    after = int(resumed_after.split(":")[1])
    assert seqs(resumed) == list(range(after + 1, numbered[-1] + 1))
    assert resumed[-1].type == whole[-1].type == "messageEnd"


async def test_keep_alives_reach_an_sse_client_while_the_answer_is_idle(settings, fake_model):
    quick = settings.replace(server={"keepalive_seconds": 0.1})
    with serve(create_app(quick)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
            body = chat_body("#tokens=3 #reasoning=0 #delay=0.6", chatId="9103")
            async with http.stream("POST", "/api/chat/sse", json=body) as response:
                items = [item async for item in iter_sse(response)]
    events = [i for i in items if isinstance(i, SseEvent)]
    between = items[items.index(events[0]) : items.index(events[-1])]
    assert any(isinstance(i, str) and i.startswith(": ping") for i in between)
    assert events[-1].type == "messageEnd"


async def test_one_socket_follows_two_pushed_answers_each_in_order(settings, fake_model):
    with serve(create_app(settings)) as server:
        client = httpx.AsyncClient(timeout=10)
        async with aconnect_ws(server.ws_url + "/api/chat/ws", client) as ws:
            assert orjson.loads(await ws.receive_text())["type"] == "signal"
            for chat_id in ("9104", "9105"):
                body = chat_body("#tokens=30 #delay=0.01 #reasoning=0", chatId=chat_id)
                await ws.send_text(orjson.dumps(body).decode())
            frames: dict[str, list[dict]] = {"9104": [], "9105": []}
            ended = 0
            async with asyncio.timeout(10):
                while ended < 2:
                    frame = orjson.loads(await ws.receive_text())
                    frames[frame["chatId"]].append(frame)
                    ended += frame["type"] == "messageEnd"
        await client.aclose()
    for got in frames.values():
        numbered = [int(f["eventId"].split(":")[1]) for f in got if "eventId" in f]
        assert numbered == list(range(1, len(numbered) + 1))
        assert "".join(f["data"] for f in got if f["type"] == "message") == "".join(
            f"tok{i} " for i in range(30)
        )
        assert got[-1]["type"] == "messageEnd"


def read_frames_until_end(sock: socket.socket) -> list[dict]:
    """A server's unmasked text frames (others skipped), until a `messageEnd` or `error`."""
    stream = sock.makefile("rb")
    frames: list[dict] = []
    while True:
        head = stream.read(2)
        length = head[1] & 0x7F
        if length == 126:
            length = int.from_bytes(stream.read(2), "big")
        elif length == 127:
            length = int.from_bytes(stream.read(8), "big")
        payload = stream.read(length)
        if head[0] & 0x0F != 1:  # a ping
            continue
        frame = orjson.loads(payload)
        frames.append(frame)
        if frame.get("type") in ("messageEnd", "error"):
            return frames


async def test_a_websocket_client_that_stops_reading_gets_every_frame_in_order(
    settings, fake_model
):
    with serve(create_app(settings)) as server:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        try:
            sock.sendall(
                b"GET /api/chat/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                b"Sec-WebSocket-Version: 13\r\n\r\n"
            )
            response = b""
            while b"\r\n\r\n" not in response:
                response += sock.recv(1)
            assert b" 101 " in response.split(b"\r\n", 1)[0]
            body = chat_body("#tokens=300 #size=20000 #reasoning=0", chatId="9106")
            sock.sendall(masked_text_frame(orjson.dumps(body)))
            await asyncio.sleep(1.0)  # not read: the server's buffers fill
            sock.settimeout(20)
            frames = await asyncio.to_thread(read_frames_until_end, sock)
        finally:
            sock.close()
    numbered = [int(f["eventId"].split(":")[1]) for f in frames if "eventId" in f]
    assert numbered == list(range(1, len(numbered) + 1))
    assert len("".join(f["data"] for f in frames if f["type"] == "message")) == 300 * 20000
    assert frames[-1]["type"] == "messageEnd"


def test_a_logs_events_read_back_as_they_were_written():
    log = GenerationLog(handle(), sink=lambda log, event: None)  # released by hand
    writer = LogWriter(log)
    writer.emit("message", data="a")
    writer.emit("sources", data=[{"title": "t"}])
    writer.emit("message", data="b")
    events = log.events
    assert [(e.type, e.seq, e.data) for e in events] == [
        ("message", 1, {"data": "a"}),
        ("sources", 2, {"data": [{"title": "t"}]}),
        ("message", 3, {"data": "b"}),
    ]
    assert (events[-1].seq, events[0].chat_id, events[0].message_id) == (3, "1", "100")
    assert [e.seq for e in events[1:]] == [2, 3] and events[2:1] == [] and events[::2][1].seq == 3
    with pytest.raises(IndexError):
        events[3]
    writer.emit("message", data="\ud800")  # JSON cannot hold a lone surrogate
    writer.emit("custom", data=("a", 1))  # a type the protocol does not know
    writer.emit("progress", data="step")
    assert [(e.type, e.data) for e in log.events[3:]] == [
        ("message", {"data": "\ud800"}),
        ("custom", {"data": ("a", 1)}),
        ("progress", {"data": "step"}),
    ]
    assert [e.seq for e in log.events.of_type("message")] == [1, 3, 4]
    assert [e.seq for e in log.events.of_type("custom", 2)] == [5]
    log.release(4)
    log.fail(Event("error", "1", "100", {"key": "INTERNAL", "data": "x"}, 5))
    assert [e.type for e in log.events] == ["message", "sources", "message", "message", "error"]
    assert [e.seq for e in log.events] == [1, 2, 3, 4, 5] and log.events.terminal(4)


def test_a_logs_tokens_leave_the_collector_nothing_to_scan():
    """Kept one per token for replay, tracked objects made every collection scan every
    token of every running answer."""
    log = GenerationLog(handle())
    writer = LogWriter(log)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(10_000):
        writer.emit("message", data=str(i))
    assert len(gc.get_objects()) - before < 100
    # nor does what the log holds refer to an object per token that a collection visits
    assert len(gc.get_referents(*gc.get_referents(log.events))) < 100
    assert [e.data["data"] for e in log.events[-2:]] == ["9998", "9999"]
