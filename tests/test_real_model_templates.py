"""Real chat templates: a research round in balanced mode against a real model on
loopback (tests/real_model.py), once with real (clumsy) tool calls that its server
cannot stream (llama.cpp's chatml-function-calling), once with a template that drops
system messages and makes no tool calls at all (its gemma format), where the answer
comes through the fallbacks: whole tool rounds, the JSON planner, one plain search."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from app.config import Settings
from app.main import create_app
from tests.client import SseEvent, sse_chat
from tests.conftest import USER
from tests.fakes.search import RELEVANT_QUESTION, FakeSearch
from tests.real_model import ALIAS, LlamaServer
from tests.real_model import llama as llama  # a fixture
from tests.real_model import llama_tools as llama_tools  # a fixture
from tests.servers import serve
from tests.test_agent import steps, web

pytestmark = [pytest.mark.anyio, pytest.mark.real_model]

#: a guard, never reached when the server keeps its deadlines: the test fails, not hangs
GUARD_SECONDS = 2400


def real(settings: Settings, server: LlamaServer, **llm: str) -> Settings:
    """The tests' settings with the real model answering (the fake search kept)."""
    return settings.replace(
        llm={
            "base_url": server.url,
            "api_key": "local",
            "model": ALIAS,
            "small_model": ALIAS,
            "max_output_tokens": 48,
            "context_tokens": 2048,
            "timeout_seconds": 900.0,
            "read_timeout_seconds": 600.0,
            **llm,
        },
        # a small model on a busy machine: minutes, not seconds, for a round
        research={"balanced_rounds": 2, "round_seconds": 600.0, "balanced_seconds": 1200.0},
    )


async def ask(settings: Settings) -> list[SseEvent]:
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(
            base_url=server.url, timeout=GUARD_SECONDS, event_hooks=USER
        ) as http:
            async with asyncio.timeout(GUARD_SECONDS):
                return await sse_chat(http, web(RELEVANT_QUESTION, mode="balanced"))


def ended(events: list[SseEvent]) -> None:
    """The answer ended: completed, or with an error a person can read."""
    last = events[-1]
    assert last.type in ("messageEnd", "error"), last
    if last.type == "error":
        assert last.data["key"] in ("CHAT_ERROR", "STREAM_ERROR") and last.data["data"], last


async def test_real_tool_calls_drive_a_research_round(
    settings: Settings, fake_search: FakeSearch, llama_tools: LlamaServer
) -> None:
    events = await ask(real(settings, llama_tools))
    ended(events)
    rounds = [s for s in steps(events, "round") if s["status"] == "done" and s.get("calls")]
    assert rounds, steps(events, "round")  # the model's own calls were run
    assert fake_search.queries
    assert "sources" in [e.type for e in events]
    assert events[-1].data.get("status") == "completed"


async def test_a_template_that_drops_system_messages_still_answers_with_sources(
    settings: Settings,
    fake_search: FakeSearch,
    llama: LlamaServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="app.research"):
        events = await ask(real(settings, llama, system_prompt="user"))
    ended(events)
    assert fake_search.queries
    assert "sources" in [e.type for e in events]
    assert events[-1].data.get("status") == "completed"
    assert "did not answer in time" not in caplog.text
