"""deepResearch: plan, iterate, reflect, stop; bounded; deduplicated; cancellable."""

from __future__ import annotations

import itertools
import time

import httpx
import pytest

from app.main import create_app
from tests.client import chat_body, sse_chat
from tests.conftest import USER
from tests.fakes.search import RESULT_COUNT
from tests.servers import serve

pytestmark = pytest.mark.anyio

PLAN = "plan web research"
REFLECT = "review web research"
QUESTION = "compare rocket engines that burn methane"


def research_body(**fields):
    return chat_body(QUESTION, focusMode="deepResearch", **fields)


def progress(events):
    return [e.data["data"] for e in events if e.type == "progress"]


async def run(server, body):
    async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
        return await sse_chat(client, body), client


async def test_research_plans_iterates_and_stops_when_the_model_says_so(
    settings, fake_model, fake_search
):
    fake_model.replies[:0] = [(PLAN, "methane engines list\nraptor vs be-4"), (REFLECT, "stop")]
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            events = await sse_chat(client, research_body(chatId="800", messageId="801"))
            saved = (await client.get("/sources/801")).json()["sources"]
    steps = progress(events)
    assert "iteration 1: searching 2 sub-questions" in steps
    assert "iteration 1: enough found; writing the report" in steps
    assert not any(s.startswith("iteration 2") for s in steps)
    assert sorted(q for _, q in fake_search.queries) == ["methane engines list", "raptor vs be-4"]
    types = [e.type for e in events]
    assert types.count("sources") == 1
    assert types.index("sources") < types.index("message")
    sources = next(e for e in events if e.type == "sources").data["data"]
    urls = [s["metadata"]["url"] for s in sources[:-1]]
    assert len(urls) == len(set(urls))  # both sub-questions found the same pages: sent once
    assert len(saved) == len(urls)
    system = fake_model.last_system_prompt()
    assert "research analyst" in system and "FULLTEXT-" in system
    reflect = next(r for r in fake_model.requests if REFLECT in r["messages"][0]["content"])
    assert "raptor vs be-4" in reflect["messages"][0]["content"]
    assert events[-1].data["status"] == "completed"


async def test_research_stops_at_max_iterations(settings, fake_model, fake_search):
    counter = itertools.count(1)
    fake_model.replies[:0] = [
        (PLAN, "first angle"),
        (REFLECT, lambda _prompt: f"new angle {next(counter)}"),
    ]
    with serve(create_app(settings.replace(research={"max_iterations": 3}))) as server:
        events, _ = await run(server, research_body())
    steps = progress(events)
    assert [s for s in steps if "sub-question" in s] == [
        "iteration 1: searching 1 sub-question",
        "iteration 2: searching 1 sub-question",
        "iteration 3: searching 1 sub-question",
    ]
    assert len(fake_search.queries) == 3
    assert (
        sum(REFLECT in r["messages"][0]["content"] for r in fake_model.requests if "messages" in r)
        == 2
    )
    assert len(next(e for e in events if e.type == "sources").data["data"]) <= RESULT_COUNT + 1
    assert events[-1].data["status"] == "completed"


async def test_research_respects_its_time_budget(settings, fake_model, fake_search):
    fake_model.replies[:0] = [(PLAN, "slow one\nslow two"), (REFLECT, "more")]
    fake_search.search_delay = 5.0
    with serve(create_app(settings.replace(research={"time_budget_seconds": 1.0}))) as server:
        started = time.monotonic()
        events, _ = await run(server, research_body())
        elapsed = time.monotonic() - started
    assert elapsed < 3.5
    assert any("time budget reached" in s for s in progress(events))
    assert "answering without sources" in progress(events)
    assert events[-1].data["status"] == "completed"  # still a report, from the model alone


async def test_failing_searches_inside_an_iteration_degrade(settings, fake_model, fake_search):
    fake_model.replies[:0] = [(PLAN, "one\ntwo"), (REFLECT, "stop")]
    fake_search.fail = 500
    with serve(create_app(settings)) as server:
        events, _ = await run(server, research_body())
    steps = progress(events)
    assert any(s.startswith("iteration 1: web search failed") for s in steps)
    assert events[-1].data["status"] == "completed"


async def test_research_can_be_cancelled_mid_iteration(settings, fake_model, fake_search):
    fake_model.replies[:0] = [(PLAN, "slow one\nslow two")]
    fake_search.search_delay = 5.0
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            async with client.stream(
                "POST", "/api/chat/sse", json=research_body(chatId="810")
            ) as response:
                started = time.monotonic()
                lines = []
                async for line in response.aiter_lines():
                    lines.append(line)
                    if "iteration 1: searching 2 sub-questions" in line:
                        cancel = await client.post(
                            "/api/chat/cancel", json={"chatId": "810", "userId": "1"}
                        )
                        assert cancel.status_code == 200
            assert time.monotonic() - started < 2.5
            assert '"status":"cancelled"' in lines[-2]
            answer = (await client.get("/api/chats/810")).json()["messages"][-1]
            assert answer["status"] == "cancelled"
    assert fake_model.streamed_requests() == []  # never reached the report


async def test_research_in_the_simple_format_shows_its_iterations(
    settings, fake_model, fake_search
):
    fake_model.replies[:0] = [(PLAN, "a\nb\nc"), (REFLECT, "stop")]
    with serve(create_app(settings)) as server:
        events, _ = await run(server, research_body(format="simple"))
    messages = [e.data for e in events]
    assert messages[0]["type"] == "start"
    infos = [
        m["content"]
        for m in messages
        if m["type"] == "info" and m["metadata"]["kind"] == "progress"
    ]
    assert "iteration 1: searching 3 sub-questions" in infos
    assert any(m["metadata"].get("kind") == "sources" for m in messages)
    assert messages[-1]["type"] == "complete"
