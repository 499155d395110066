"""The simplified message format (`format: "simple"`), on both transports."""

from __future__ import annotations

import httpx
import orjson
import pytest
from httpx_ws import aconnect_ws

from app.message_stream import MessageStream
from tests.client import SseEvent, chat_body, iter_sse
from tests.fakes.search import RELEVANT_QUESTION

pytestmark = pytest.mark.anyio


async def read_sse(client, url, **kwargs):
    async with client.stream(kwargs.pop("method", "POST"), url, **kwargs) as response:
        assert response.status_code == 200, await response.aread()
        return [e async for e in iter_sse(response) if isinstance(e, SseEvent)]


async def read_ws(server, body, path="/api/chat/ws"):
    async with aconnect_ws(server.ws_url + path, httpx.AsyncClient(timeout=10)) as ws:
        await ws.receive_text()
        await ws.send_text(orjson.dumps(body).decode())
        frames = []
        while not frames or frames[-1]["type"] not in ("complete", "error"):
            frames.append(orjson.loads(await ws.receive_text()))
        return frames


def check_simple(messages, question):
    """Every message has the four fields; start first and complete (or error) last."""
    assert messages[0]["type"] == "start"
    assert messages[0]["content"] == f"processing query: {question}"
    for m in messages:
        assert set(m) == {"type", "content", "timestamp", "metadata"}
        assert m["type"] in ("start", "info", "answer", "complete", "error")
        assert isinstance(m["timestamp"], float)
        assert m["metadata"]["chatId"] and m["metadata"]["messageId"]
    assert messages[-1]["type"] in ("complete", "error")
    return "".join(m["content"] for m in messages if m["type"] == "answer")


async def test_simple_format_over_sse_and_websocket_carry_the_same(client, server, fake_model):
    body = chat_body("hello there", format="simple")
    sse = await read_sse(client, "/api/chat/sse", json=body)
    assert sse[0].id is None  # start has no id
    answer_id = sse[1].data["metadata"]["messageId"]
    assert [e.id for e in sse[1:]] == [f"{answer_id}:{i}" for i in range(1, len(sse))]
    messages = [e.data for e in sse]
    assert check_simple(messages, "hello there") == "tok0 tok1 tok2 tok3 tok4 "
    assert [m["metadata"].get("kind") for m in messages if m["type"] == "info"] == [
        "reasoning",
        "reasoning",
    ]
    assert messages[-1]["metadata"]["status"] == "completed"

    frames = await read_ws(server, body)
    assert "eventId" not in frames[0]
    assert check_simple(
        [{k: v for k, v in f.items() if k != "eventId"} for f in frames], "hello there"
    ) == ("tok0 tok1 tok2 tok3 tok4 ")
    strip = lambda ms: [(m["type"], m["content"], m["metadata"].get("kind")) for m in ms]  # noqa: E731
    assert strip(frames) == strip(messages)


async def test_format_query_parameter_on_both_transports(client, server, fake_model):
    sse = await read_sse(client, "/api/chat/sse?format=simple", json=chat_body("hi"))
    assert sse[0].data["type"] == "start"
    frames = await read_ws(server, chat_body("hi"), path="/api/chat/ws?format=simple")
    assert frames[0]["type"] == "start" and frames[-1]["type"] == "complete"


async def test_one_generation_in_both_formats_carries_the_same_information(
    client, fake_model, fake_search
):
    """Render one generation both ways (the live stream, then a replay in the other
    format) and map every default event onto its simple counterpart."""
    decision = {"skipSearch": False, "sources": ["web"], "question": "falcon methane engines"}
    fake_model.replies.insert(0, ("decision (JSON)", orjson.dumps(decision).decode()))
    body = chat_body(RELEVANT_QUESTION + " and more words", focusMode="webSearch", chatId="700")
    default = await read_sse(client, "/api/chat/sse", json=body)
    simple = await read_sse(client, "/api/chat/sse/resume?chatId=700&format=simple", method="GET")
    assert simple[0].data["type"] == "start"
    assert [e.id for e in simple[1:]] == [e.id for e in default]
    kinds = set()
    for d, s in zip(default, simple[1:], strict=True):
        d, s = d.data, s.data
        kinds.add(d["type"])
        if "messageId" in d:  # all but rewrited
            assert s["metadata"]["messageId"] == d["messageId"]
        assert s["metadata"]["chatId"] == d["chatId"]
        if d["type"] == "message":
            assert (s["type"], s["content"]) == ("answer", d["data"])
        elif d["type"] in ("progress", "reasoning"):
            assert (s["type"], s["content"], s["metadata"]["kind"]) == (
                "info",
                d["data"],
                d["type"],
            )
        elif d["type"] == "rewrited":
            assert (s["type"], s["content"], s["metadata"]["kind"]) == (
                "info",
                d["content"],
                "rewrited",
            )
        elif d["type"] == "sources":
            assert (s["type"], s["metadata"]["kind"], s["metadata"]["sources"]) == (
                "info",
                "sources",
                d["data"],
            )
        elif d["type"] == "messageEnd":
            assert (s["type"], s["metadata"]["status"]) == ("complete", d["status"])
            assert s["metadata"]["questionMessageId"] == d["questionMessageId"]
        else:
            raise AssertionError(d)
    assert kinds == {"rewrited", "progress", "sources", "message", "reasoning", "messageEnd"}


async def test_errors_in_the_simple_format(client, fake_model):
    events = await read_sse(client, "/api/chat/sse", json=chat_body("q #fail=500", format="simple"))
    last = events[-1].data
    assert last["type"] == "error"
    assert last["metadata"]["key"] == "STREAM_ERROR" and "500" in last["content"]


def test_message_stream_helper_speaks_the_simple_format():
    stream = MessageStream(chat_id="5", message_id="6", question="write a report on Milvus")
    stream.send_start()
    stream.send_info("iteration 1: searching related documents...")
    stream.send_info("thinking", kind="reasoning")
    stream.send_answer("Milvus is ")
    stream.send_answer("a vector database.")
    stream.send_complete()
    messages = stream.get_messages_as_dicts()
    for m in messages:
        assert isinstance(m.pop("timestamp"), float)
    meta = {"chatId": "5", "messageId": "6"}
    assert messages == [
        {
            "type": "start",
            "content": "processing query: write a report on Milvus",
            "metadata": meta,
        },
        {
            "type": "info",
            "content": "iteration 1: searching related documents...",
            "metadata": {**meta, "kind": "progress"},
        },
        {"type": "info", "content": "thinking", "metadata": {**meta, "kind": "reasoning"}},
        {"type": "answer", "content": "Milvus is ", "metadata": meta},
        {"type": "answer", "content": "a vector database.", "metadata": meta},
        {
            "type": "complete",
            "content": "query completed",
            "metadata": {**meta, "status": "completed"},
        },
    ]
    # the same events, as the default format carries them
    assert stream.get_events_as_dicts() == [
        {"type": "progress", "data": "iteration 1: searching related documents...", **meta},
        {"type": "reasoning", "data": "thinking", **meta},
        {"type": "message", "data": "Milvus is ", **meta},
        {"type": "message", "data": "a vector database.", **meta},
        {"type": "messageEnd", "status": "completed", **meta},
    ]
    assert [e.seq for e in stream.events] == [1, 2, 3, 4, 5]

    failed = MessageStream()
    failed.send_error("query failed: cannot reach the database", key="SEARCH_ERROR")
    (error,) = failed.get_messages_as_dicts()
    assert (error["type"], error["metadata"]["key"]) == ("error", "SEARCH_ERROR")
    with pytest.raises(ValueError):
        failed.send_info("x", kind="answer")


async def test_simple_format_for_web_search(client, fake_model, fake_search):
    events = await read_sse(
        client,
        "/api/chat/sse",
        json=chat_body(RELEVANT_QUESTION, focusMode="webSearch", format="simple"),
    )
    messages = [e.data for e in events]
    check_simple(messages, RELEVANT_QUESTION)
    sources = next(m for m in messages if m["metadata"].get("kind") == "sources")
    assert len(sources["metadata"]["sources"]) == 9 and sources["content"] == "8 sources"
    assert any(
        m["metadata"].get("kind") == "progress" and "searching" in m["content"] for m in messages
    )
