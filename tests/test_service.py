"""The chat service on its own, without HTTP: a recording encoder shows the exact events
a generation writes, error and cancel paths included. The model is the fake one (a real
HTTP server), the store a real SQLite file, the hub the in-process one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from app.chat.service import ChatService
from app.errors import Conflict, Forbidden, NotFound
from app.main import open_service
from app.metrics import Metrics
from app.protocol import ChatRequest, Encoder, Event
from app.store import Chat, StoredMessage
from app.streams import Handle
from tests.fakes.search import RELEVANT_QUESTION

pytestmark = pytest.mark.anyio


Recorded = list[tuple[int, str, dict[str, Any]]]


class Recorder(Encoder[Recorded]):
    """An encoder that keeps the events as (seq, type, fields)."""

    name = "recorder"

    def encode(self, events: Sequence[Event]) -> Recorded:
        return [(e.seq, e.type, e.data) for e in events]


@pytest.fixture
async def service(settings) -> AsyncIterator[ChatService]:
    async with open_service(settings, metrics=Metrics()) as opened:
        yield opened


async def record(service: ChatService, handle: Handle, after: int = 0) -> list[Any]:
    out: list[Any] = []
    async with asyncio.timeout(10):
        async for chunk in service.relay(handle, Recorder(), after):
            out.extend(chunk)
    return out


def ask(content: str, **fields: Any) -> ChatRequest:
    return ChatRequest(content=content, **{"user_id": "1", "focus_mode": "deepSeek", **fields})


async def test_a_plain_answer_is_numbered_events_from_empty_message_to_end(service, fake_model):
    handle = await service.start(ask("hello", chat_id="100", message_id="101"))
    assert (handle.chat_id, handle.question_id) == ("100", "101")
    events = await record(service, handle)
    # where the time went: the model's first byte, then the first token out
    timings = events[-1][2].pop("timings")
    assert [t["stage"] for t in timings] == ["modelFirstByte", "firstToken"]
    assert timings[0]["endMs"] == timings[1]["startMs"] >= timings[0]["startMs"]
    assert events == [
        (1, "message", {"data": ""}),
        (2, "reasoning", {"data": "why0 "}),
        (3, "reasoning", {"data": "why1 "}),
        (4, "message", {"data": "tok0 "}),
        (5, "message", {"data": "tok1 "}),
        (6, "message", {"data": "tok2 "}),
        (7, "message", {"data": "tok3 "}),
        (8, "message", {"data": "tok4 "}),
        (
            9,
            "messageEnd",
            {
                "status": "completed",
                "questionMessageId": "101",
                # as the model counted: the prompt's words, 5 + 2 reasoning chunks
                "usage": {
                    "prompt_tokens": 37,
                    "completion_tokens": 7,
                    "reasoning_tokens": 2,
                    "total_tokens": 44,
                },
                "chatModel": {"provider": "default", "model": "fake-chat"},
            },
        ),
    ]
    _chat, messages, _files = await service.open_chat("100", "1")
    assert [(m.role, m.content, m.status) for m in messages] == [
        ("user", "hello", "completed"),
        ("assistant", "tok0 tok1 tok2 tok3 tok4 ", "completed"),
    ]


async def test_web_search_sends_progress_and_sources_before_the_answer(
    service, fake_model, fake_search
):
    handle = await service.start(
        ask(RELEVANT_QUESTION, focus_mode="webSearch", message_id="201", host="example.test")
    )
    events = await record(service, handle)
    assert [(seq, kind) for seq, kind, _ in events[:5]] == [
        (1, "progress"),
        (2, "progress"),
        (3, "sources"),
        (4, "message"),
        (5, "reasoning"),
    ]
    searching, found = events[0][2], events[1][2]
    assert searching["data"] == f"searching the web: {RELEVANT_QUESTION}"
    assert searching["step"]["kind"] == "search" and searching["step"]["status"] == "running"
    assert found["step"] == {**searching["step"], "status": "done", "results": 8}
    sources = events[2][2]["data"]
    assert len(sources) == 9
    link = sources[-1]["metadata"]
    assert link["title"] == "All Sources"
    assert link["url"] == f"//example.test/sources/201?sig={service.sign('201')}"
    assert "SNIPPET-0" in fake_model.last_system_prompt()


async def test_copilot_off_answers_from_the_model_alone(service, fake_model, fake_search):
    handle = await service.start(
        ask(RELEVANT_QUESTION, focus_mode="webSearch", copilot_enabled=False)
    )
    kinds = [kind for _, kind, _ in await record(service, handle)]
    assert "sources" not in kinds and "progress" not in kinds
    assert fake_search.queries == []
    assert "<context>" not in fake_model.last_system_prompt()


async def test_a_model_error_ends_with_an_error_event_and_a_failed_answer(service, fake_model):
    handle = await service.start(ask("hi #fail=503", chat_id="300"))
    assert await record(service, handle) == [
        (1, "message", {"data": ""}),
        (2, "error", {"key": "STREAM_ERROR", "data": "the model failed (503); try again shortly"}),
    ]
    _chat, messages, _files = await service.open_chat("300", "1")
    assert messages[-1].status == "failed"


async def test_cancel_mid_answer_ends_cancelled_and_keeps_the_partial_answer(service, fake_model):
    handle = await service.start(ask("long #tokens=400 #delay=0.01", chat_id="400"))
    events: list[Any] = []
    async for chunk in service.relay(handle, Recorder()):
        events.extend(chunk)
        tokens = sum(1 for _, kind, data in events if kind == "message" and data["data"])
        if tokens >= 3 and events[-1][1] != "messageEnd":
            await service.cancel("400", "1")
            break
    events.extend(await record(service, handle, after=events[-1][0]))
    kind, end = events[-1][1:]
    usage = end.pop("usage")  # the model never said: estimated from what it sent
    stages = [t["stage"] for t in end.pop("timings")]
    assert stages == ["modelFirstByte", "firstToken"]
    assert (kind, end) == (
        "messageEnd",
        {
            "status": "cancelled",
            "questionMessageId": handle.question_id,
            "chatModel": {"provider": "default", "model": "fake-chat"},
        },
    )
    assert usage["completion_tokens"] > 0 and usage["prompt_tokens"] > 0
    assert (await fake_model.wait_stream_end()).outcome == "client_closed"
    _chat, messages, _files = await service.open_chat("400", "1")
    answer = messages[-1]
    assert answer.status == "cancelled"
    assert answer.content.startswith("tok0 tok1 tok2 ") and "tok399" not in answer.content


async def test_a_cancel_before_the_body_starts_ends_at_once(service, fake_model):
    handle = await service.start(ask("never asked", chat_id="500", message_id="501"))
    await service.cancel("500", "1")
    assert await record(service, handle) == [
        (
            1,
            "messageEnd",
            {
                "status": "cancelled",
                "questionMessageId": "501",
                "chatModel": {"provider": "default", "model": "fake-chat"},
            },
        )
    ]
    assert fake_model.streamed_requests() == []
    _chat, messages, _files = await service.open_chat("500", "1")
    assert [(m.role, m.status) for m in messages] == [
        ("user", "completed"),
        ("assistant", "cancelled"),
    ]


async def test_the_generation_deadline_ends_it_with_an_error(settings, fake_model):
    short = settings.replace(llm={"timeout_seconds": 0.5})
    async with open_service(short, metrics=Metrics()) as service:
        handle = await service.start(ask("slow #tokens=100 #delay=0.05"))
        events = await record(service, handle)
    assert events[-1][1:] == (
        "error",
        {"key": "STREAM_ERROR", "data": "the answer did not finish within llm.timeout_seconds"},
    )
    assert (await fake_model.wait_stream_end()).outcome == "client_closed"


async def test_relay_after_a_seq_replays_only_the_rest(service, fake_model):
    handle = await service.start(ask("hello", chat_id="600"))
    everything = await record(service, handle)
    assert await record(service, handle, after=6) == everything[6:]
    again, seq = await service.find_resumable("600", "1", f"{handle.answer_id}:6")
    assert (again, seq) == (handle, 6)


async def test_one_generation_per_chat_and_only_its_owner_acts_on_it(service, fake_model):
    handle = await service.start(ask("long #tokens=200 #delay=0.01", chat_id="700"))
    with pytest.raises(Conflict, match="already running"):
        await service.start(ask("again", chat_id="700"))
    with pytest.raises(Forbidden):
        await service.cancel("700", "2")
    with pytest.raises(Conflict, match="cancel it first"):
        await service.delete_chat("700", "1")
    await service.cancel("700", "1")
    await record(service, handle)
    with pytest.raises(Forbidden):
        await service.start(ask("into another's chat", chat_id="700", user_id="2"))
    with pytest.raises(Forbidden):
        await service.open_chat("700", "2")
    with pytest.raises(Forbidden):
        await service.find_resumable("700", "2", None)
    await service.delete_chat("700", "1")
    with pytest.raises(NotFound):
        await service.open_chat("700", "1")


async def test_drain_cancels_what_runs_and_each_ends_with_message_end(service, fake_model):
    handles = [
        await service.start(ask(f"long {i} #tokens=500 #delay=0.01", chat_id=f"90{i}"))
        for i in range(3)
    ]
    readers = [asyncio.create_task(record(service, h)) for h in handles]
    await asyncio.sleep(0.2)
    await service.drain(grace=0)
    for reader in readers:
        assert (await reader)[-1][2]["status"] == "cancelled"
    assert service.running() == 0


async def test_the_sweeper_closes_every_orphan_however_many(service):
    """Rows left `streaming` by a process that is gone, more than one page of them."""
    old = time.time() - 3600
    for i in range(450):
        await service.store.begin_answer(
            Chat(f"o{i}", "1", "t", "deepSeek", old),
            StoredMessage(f"oq{i}", f"o{i}", "user", "q", old + i),
            StoredMessage(
                f"oa{i}",
                f"o{i}",
                "assistant",
                "",
                old + i + 0.5,
                status="streaming",
                reply_to=f"oq{i}",
            ),
        )
    assert await service.sweep() == 450
    assert await service.store.streaming_answers(time.time()) == []
