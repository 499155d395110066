"""deepResearch: the research agent with the largest budget — rounds until done,
bounded by rounds and time, deduplicated, degrading, cancellable, its steps shown."""

from __future__ import annotations

import time

import httpx
import pytest

from app.main import create_app
from tests.client import chat_body, sse_chat
from tests.conftest import USER
from tests.fakes.search import RESULT_COUNT
from tests.servers import serve

pytestmark = pytest.mark.anyio

QUESTION = "compare rocket engines that burn methane"


def research_body(**fields):
    return chat_body(QUESTION, focusMode="deepResearch", **fields)


def progress(events):
    return [e.data["data"] for e in events if e.type == "progress"]


def rounds(events):
    return [
        e.data["step"]
        for e in events
        if e.type == "progress" and e.data.get("step", {}).get("kind") == "round"
    ]


async def run(server, body):
    async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
        return await sse_chat(client, body), client


async def test_research_runs_rounds_and_stops_when_the_model_says_so(
    settings, fake_model, fake_search
):
    fake_model.tool_rounds[:] = [
        [("web_search", {"query": "methane engines list"}), ("web_search", {"query": "raptor"})],
        [("done", {})],
    ]
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            events = await sse_chat(client, research_body(chatId="800", messageId="801"))
            saved = (await client.get("/sources/801")).json()["sources"]
    steps = rounds(events)
    assert [s["of"] for s in steps] == [25] * len(steps)  # the deep budget, not speed's
    assert "round 2: enough found" in progress(events)
    assert sorted(q for _, q in fake_search.queries) == ["methane engines list", "raptor"]
    types = [e.type for e in events]
    assert types.count("sources") == 1
    assert types.index("sources") < types.index("message")
    sources = next(e for e in events if e.type == "sources").data["data"]
    urls = [s["metadata"]["url"] for s in sources[:-1]]
    assert len(urls) == len(set(urls))  # both searches found the same pages: sent once
    assert len(saved) == len(urls)
    system = fake_model.last_system_prompt()
    assert "research analyst" in system and "FULLTEXT-" in system  # the report, pages read


async def test_research_stops_at_its_rounds(settings, fake_model, fake_search):
    fake_model.tool_rounds[:] = [[("web_search", {"query": f"angle {i}"})] for i in range(10)]
    with serve(create_app(settings.replace(research={"deep_rounds": 3}))) as server:
        events, _ = await run(server, research_body())
    assert len(fake_model.tool_requests()) == 3
    assert [q for _, q in fake_search.queries] == ["angle 0", "angle 1", "angle 2"]
    assert len(next(e for e in events if e.type == "sources").data["data"]) <= RESULT_COUNT + 1
    assert events[-1].data["status"] == "completed"


async def test_research_respects_its_time_budget(settings, fake_model, fake_search):
    fake_model.tool_rounds[:] = [[("web_search", {"query": "slow one"})]] * 5
    fake_search.search_delay = 5.0
    with serve(create_app(settings.replace(research={"deep_seconds": 1.0}))) as server:
        started = time.monotonic()
        events, _ = await run(server, research_body())
        elapsed = time.monotonic() - started
    assert elapsed < 3.5
    assert "answering without sources" in progress(events)
    assert events[-1].data["status"] == "completed"  # still a report, from the model alone


async def test_failing_searches_inside_a_round_degrade(settings, fake_model, fake_search):
    fake_model.tool_rounds[:] = [
        [("web_search", {"query": "one"}), ("web_search", {"query": "two"})]
    ]
    fake_search.fail = 500
    with serve(create_app(settings)) as server:
        events, _ = await run(server, research_body())
    assert any(s.startswith("web search failed") for s in progress(events))
    assert events[-1].data["status"] == "completed"


async def test_research_can_be_cancelled_mid_round(settings, fake_model, fake_search):
    fake_model.tool_rounds[:] = [[("web_search", {"query": "slow one"})]]
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
                    if "searching the web: slow one" in line:
                        cancel = await client.post(
                            "/api/chat/cancel", json={"chatId": "810", "userId": "1"}
                        )
                        assert cancel.status_code == 200
            assert time.monotonic() - started < 2.5
            assert '"status":"cancelled"' in lines[-2]
            answer = (await client.get("/api/chats/810")).json()["messages"][-1]
            assert answer["status"] == "cancelled"
    assert fake_model.streamed_requests() == []  # never reached the report


async def test_research_in_the_simple_format_shows_its_rounds(settings, fake_model, fake_search):
    fake_model.tool_rounds[:] = [[("web_search", {"query": q}) for q in "abc"], [("done", {})]]
    with serve(create_app(settings)) as server:
        events, _ = await run(server, research_body(format="simple"))
    messages = [e.data for e in events]
    assert messages[0]["type"] == "start"
    infos = [m for m in messages if m["type"] == "info" and m["metadata"]["kind"] == "progress"]
    assert "round 1 of 25" in [m["content"] for m in infos]
    kinds = [m["metadata"]["step"]["kind"] for m in infos if "step" in m["metadata"]]
    assert kinds.count("search") == 6  # three searches, each started and done
    assert any(m["metadata"].get("kind") == "sources" for m in messages)
    assert messages[-1]["type"] == "complete"
