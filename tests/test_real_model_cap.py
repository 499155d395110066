"""Answers from a real model end, capped, with the question intact: Gemma 3 270M (a base
model that never stops and echoes its prompts) served by llama.cpp on loopback, the web
faked. Every answer ends `completed` within `llm.max_output_tokens` on every transport;
no small step's output is taken for the question, a `rewrited` event or the title; an
abandoned step or answer stops the model server's work; a question longer than its
window ends with an answer or an error that names the window, never "empty answer"."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import orjson
import pytest
from httpx_ws import aconnect_ws

from app.config import Settings
from app.main import create_app
from app.prompts import Prompts
from tests.client import chat_body, iter_sse, sse_chat
from tests.conftest import USER
from tests.fakes.search import RELEVANT_QUESTION
from tests.real_model import ALIAS, LlamaServer
from tests.real_model import llama as llama  # the session's model server (a fixture)
from tests.servers import serve

pytestmark = [pytest.mark.real_model, pytest.mark.anyio]

#: the cap of every answer here, in tokens
CAP = 48
#: what a token of Gemma's answer is at most, in characters (a cautious bound)
TOKEN_CHARS = 24
#: the prompts whose words must never come back as a question or a title
ECHOED = ("rewrite_question", "classify", "title", "planner")
FOLLOW_UP = "and how hot does that engine run when it burns the methane?"


@pytest.fixture
def real(settings: Settings, llama: LlamaServer) -> Settings:
    return settings.replace(
        llm={
            "base_url": llama.url,
            "api_key": "local",
            "model": ALIAS,
            "small_model": ALIAS,
            "max_output_tokens": CAP,
        },
        # a base model calls tools at random: two rounds of research are rounds enough
        research={"balanced_rounds": 2},
    )


def within_cap(text: str, usage: dict[str, int] | None) -> None:
    if usage and usage.get("completion_tokens"):
        assert usage["completion_tokens"] <= CAP + 1
    assert len(text) <= CAP * TOKEN_CHARS


def answer(events) -> str:
    return "".join(e.data["data"] for e in events if e.type == "message")


def assert_no_echo(*texts: str) -> None:
    prompts = Prompts()
    for text in texts:
        for name in ECHOED:
            assert not prompts.echoes(name, text), (name, text)


async def test_every_transport_ends_completed_within_the_cap(real):
    with serve(create_app(real)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, event_hooks=USER) as http:
            events = await sse_chat(http, chat_body("tell me a story", chatId="r1"))
            end = events[-1]
            assert end.type == "messageEnd" and end.data["status"] == "completed", end.data
            within_cap(answer(events), end.data.get("usage"))
            saved = (await http.get("/api/chats/r1")).json()["messages"][-1]
            assert saved["status"] == "completed" and saved["content"] == answer(events)

            async with aconnect_ws(server.ws_url + "/api/chat/ws", http) as ws:
                await ws.receive_text()
                await ws.send_text(orjson.dumps(chat_body("tell me a poem", chatId="r2")).decode())
                frames = []
                while not frames or frames[-1]["type"] not in ("messageEnd", "error"):
                    frames.append(orjson.loads(await ws.receive_text()))
            assert frames[-1]["type"] == "messageEnd" and frames[-1]["status"] == "completed"
            within_cap("".join(f["data"] for f in frames if f["type"] == "message"), None)

        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        question = [{"role": "user", "content": "tell me about rivers"}]
        whole = await client.chat.completions.create(model="deepSeek", messages=question)
        assert whole.choices[0].finish_reason in ("stop", "length")
        within_cap(whole.choices[0].message.content or "", None)
        stream = await client.chat.completions.create(
            model="deepSeek", messages=question, stream=True
        )
        chunks = [c async for c in stream]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finish[-1] in ("stop", "length") and not any(
            "error" in (c.model_extra or {}) for c in chunks
        )
        within_cap("".join(c.choices[0].delta.content or "" for c in chunks if c.choices), None)
        response = await client.responses.create(model="deepSeek", input="tell me about lakes")
        assert response.status in ("completed", "incomplete"), response.error
        if response.status == "incomplete":
            assert response.incomplete_details.reason == "max_output_tokens"
        within_cap(response.output_text, None)
        await client.close()


async def test_no_step_takes_its_own_prompt_for_the_question_or_the_title(real, llama):
    with serve(create_app(real)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, event_hooks=USER) as http:
            seen: list[str] = []
            for chat_id, mode, focus in (("e1", "balanced", "webSearch"), ("e2", "", "deepSeek")):
                body = chat_body(
                    FOLLOW_UP,
                    chatId=chat_id,
                    focusMode=focus,
                    history=[["human", RELEVANT_QUESTION], ["assistant", "With oxygen."]],
                    **({"optimizationMode": mode} if mode else {}),
                )
                events = await sse_chat(http, body)
                assert events[-1].type == "messageEnd", events[-1].data
                seen += [e.data["content"] for e in events if e.type == "rewrited"]
                searched = [
                    e.data["step"].get("query")
                    for e in events
                    if e.type == "progress" and e.data.get("step", {}).get("kind") == "search"
                ]
                seen += [q for q in searched if q]
                # the title is asked for once the answer ended: the model server idle
                # again, it was written (or refused: the question stays the title)
                assert await wait_idle(llama, 60)
                deadline = time.monotonic() + 2
                while time.monotonic() < deadline:
                    chat = (await http.get(f"/api/chats/{chat_id}")).json()
                    if chat["chat"]["title"] != FOLLOW_UP:
                        break
                    await asyncio.sleep(0.1)
                question = chat["messages"][0]
                assert question["content"] == FOLLOW_UP
                seen += [chat["chat"]["title"], question.get("rewritten") or ""]
    assert_no_echo(*seen)
    assert all(len(text) <= 3 * len(FOLLOW_UP) + 80 for text in seen)


@pytest.mark.parametrize("mode", ["speed", "balanced"])
async def test_speed_and_balanced_modes_end_with_sources(real, mode):
    with serve(create_app(real)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=180, event_hooks=USER) as http:
            body = chat_body(RELEVANT_QUESTION, focusMode="webSearch", optimizationMode=mode)
            events = await sse_chat(http, body)
    assert "sources" in [e.type for e in events]
    assert events[-1].type == "messageEnd" and events[-1].data["status"] == "completed"


async def wait_idle(llama: LlamaServer, seconds: float = 8.0) -> bool:
    """Whether the model server goes idle within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await asyncio.to_thread(llama.idle_after, 0.5):
            return True
    return False


async def test_a_cancel_stops_the_model_servers_work(real, llama):
    with serve(create_app(real)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, event_hooks=USER) as http:
            await sse_chat(http, chat_body("hi", chatId="c1"))  # the chat, and its title
    assert await wait_idle(llama, 60)
    endless = real.replace(llm={"max_output_tokens": 4000})  # the same store
    with serve(create_app(endless)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, event_hooks=USER) as http:
            # mid-answer, and in a small step (the classifier of a long follow-up)
            for body, first in (
                (chat_body("tell me a long story", chatId="c1"), "message"),
                (chat_body(FOLLOW_UP, chatId="c1", focusMode="webSearch"), None),
            ):
                async with http.stream("POST", "/api/chat/sse", json=body) as response:
                    if first is not None:  # the answer is asked for
                        async for event in iter_sse(response):
                            if getattr(event, "type", "") == first:
                                break
                    # being written (a first answer's text is held back: nothing shows yet)
                    await asyncio.sleep(1.5)
                    cancel = {"chatId": "c1", "userId": "1"}
                    assert (await http.post("/api/chat/cancel", json=cancel)).status_code in (
                        200,
                        404,
                    )
                # not cancelled, either would keep the model busy for a minute or more (an
                # answer of up to 4,000 tokens; the follow-up's classifier, rounds and
                # answer): idle within 15 s says the call was dropped, on a busy machine too
                assert await wait_idle(llama, 15.0)


@pytest.mark.parametrize("focus", ["deepSeek", "webSearch"])
async def test_a_question_over_the_window_never_ends_with_an_empty_answer(real, focus):
    question = "Please explain this list of words: " + "river lake ocean stream " * 700
    with serve(create_app(real)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=180, event_hooks=USER) as http:
            events = await sse_chat(http, chat_body(question, focusMode=focus))
    end = events[-1]
    if end.type == "error":
        assert end.data["key"] == "STREAM_ERROR"
        assert "context window" in end.data["data"]
        assert "empty" not in end.data["data"]
    else:
        assert end.data["status"] == "completed"
