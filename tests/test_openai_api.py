"""The OpenAI-compatible API (PROTOCOL §10), driven with the official `openai` SDK (sync
and async, streaming and not) and LangChain's `ChatOpenAI`, through real uvicorn with
the fake model and the fake web."""

from __future__ import annotations

import contextlib
import time

import httpx
import openai
import pytest

from app.main import create_app
from tests.fakes.search import RELEVANT_QUESTION
from tests.servers import serve

pytestmark = pytest.mark.anyio


@contextlib.contextmanager
def api(settings, **sections):
    """The server, and the base URL an OpenAI client is pointed at."""
    with serve(create_app(settings.replace(**sections))) as server:
        yield server, server.url + "/v1"


def ask(content, *earlier, system=None):
    messages = [{"role": "system", "content": system}] if system else []
    for i, text in enumerate(earlier):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return [*messages, {"role": "user", "content": content}]


def test_models_are_the_focus_modes_and_their_search_variants(settings, fake_model):
    with api(settings) as (_, base):
        client = openai.OpenAI(base_url=base, api_key="anything")
        ids = [m.id for m in client.models.list()]
    assert {"webSearch", "webSearch:quality", "deepResearch", "deepSeek", "academicSearch"} <= set(
        ids
    )
    assert "academicSearch:balanced" in ids and "deepSeek:speed" not in ids


def test_a_whole_completion_with_citations_reasoning_and_usage(settings, fake_model, fake_search):
    fake_model.answer_text = "Raptor burns methane [4] with oxygen [1]."
    with api(settings) as (server, base):
        client = openai.OpenAI(base_url=base, api_key="anything")
        completion = client.chat.completions.create(
            model="webSearch",
            messages=ask(RELEVANT_QUESTION, system="Answer briefly."),
            user="7",
        )
        chats = httpx.get(server.url + "/api/chats", params={"userId": "7"}).json()["chats"]
        saved = httpx.get(
            server.url + f"/api/chats/{chats[0]['id']}", params={"userId": "7"}
        ).json()
    choice = completion.choices[0]
    assert completion.object == "chat.completion" and completion.model == "webSearch"
    assert choice.message.content == "Raptor burns methane [4] with oxygen [1]."
    assert choice.finish_reason == "stop"
    extra = completion.model_extra
    assert choice.message.model_extra["reasoning_content"] == "why0 why1 "
    sources = saved["messages"][-1]["sources"]
    assert extra["citations"] == [s["metadata"]["url"] for s in sources]
    assert extra["search_results"][3]["title"] == sources[3]["metadata"]["title"]
    assert extra["search_results"][3]["snippet"] == sources[3]["pageContent"]
    assert "Answer briefly." in fake_model.last_system_prompt()
    assert completion.usage.completion_tokens > 0 and completion.usage.prompt_tokens > 0


async def test_a_streamed_completion_as_openai_sends_it(settings, fake_model, fake_search):
    with api(settings) as (_, base):
        client = openai.AsyncOpenAI(base_url=base, api_key="anything")
        stream = await client.chat.completions.create(
            model="webSearch:balanced",
            messages=ask(RELEVANT_QUESTION),
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        await client.close()
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        for c in chunks
        if c.choices
    )
    # the research steps come first, a line each, shown as thinking; then the model's own
    steps, _, own = reasoning.rpartition("\n")
    assert content == "tok0 tok1 tok2 tok3 tok4 " and own == "why0 why1 "
    assert f"searching the web: {RELEVANT_QUESTION}" in steps.splitlines()
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finish] == ["stop"]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 7
    assert usage.usage.completion_tokens_details.reasoning_tokens == 2
    # citations ride on every chunk once they are known (before the answer's first token)
    with_text = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert all(len(c.model_extra["citations"]) == 8 for c in with_text)


async def test_earlier_messages_are_the_history(settings, fake_model):
    with api(settings) as (_, base):
        client = openai.AsyncOpenAI(base_url=base, api_key="anything")
        await client.chat.completions.create(
            model="deepSeek", messages=ask("and then?", "what is methane?", "a gas")
        )
        await client.close()
    sent = fake_model.streamed_requests()[-1]["messages"]
    assert [(m["role"], m["content"]) for m in sent[1:]] == [
        ("user", "what is methane?"),
        ("assistant", "a gas"),
        ("user", "and then?"),
    ]


async def test_a_client_that_goes_away_stops_the_generation(settings, fake_model):
    with api(settings) as (_, base):
        async with httpx.AsyncClient(timeout=10) as http:
            body = {
                "model": "deepSeek",
                "messages": ask("long #tokens=2000 #delay=0.01"),
                "stream": True,
            }
            async with http.stream("POST", base + "/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if "tok3" in line:
                        break
            gone = time.monotonic()
        record = await fake_model.wait_stream_end()
    assert record.outcome == "client_closed"
    assert record.closed_at - gone < 1.0
    assert record.tokens_sent < 300


@pytest.mark.parametrize(
    ("sections", "call", "error", "status"),
    [
        ({}, {"model": "nope"}, openai.NotFoundError, 404),
        ({}, {"messages": []}, openai.BadRequestError, 400),
        ({}, {"messages": [{"role": "assistant", "content": "hi"}]}, openai.BadRequestError, 400),
        ({"llm": {"api_key": ""}}, {}, openai.InternalServerError, 503),
        ({"auth": {"api_keys": {"right": "1"}}}, {}, openai.AuthenticationError, 401),
    ],
)
def test_errors_come_in_openais_shape(settings, fake_model, sections, call, error, status):
    with api(settings, **sections) as (_, base):
        client = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
        with pytest.raises(error) as info:
            client.chat.completions.create(**{"model": "deepSeek", "messages": ask("q"), **call})
    assert info.value.status_code == status
    body = info.value.body
    assert set(body) >= {"message", "type", "code"} and body["message"]


def test_too_many_requests_is_429_with_retry_after(settings, fake_model, hour_windows):
    with api(settings, limits={"requests_per_minute": 1}) as (_, base):
        client = openai.OpenAI(base_url=base, api_key="k", max_retries=0)
        client.chat.completions.create(model="deepSeek", messages=ask("q"))
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model="deepSeek", messages=ask("q"))
    assert info.value.response.headers["retry-after"].isdigit()
    assert info.value.body["code"] == "rate_limit_exceeded"


async def test_a_failure_mid_stream_is_an_error_chunk(settings, fake_model):
    with api(settings) as (_, base):
        client = openai.AsyncOpenAI(base_url=base, api_key="k", max_retries=0)
        stream = await client.chat.completions.create(
            model="deepSeek", messages=ask("q #break=2"), stream=True
        )
        with pytest.raises(openai.APIError, match="broke off"):
            async for _ in stream:
                pass
        await client.close()


def test_with_auth_the_key_decides_the_user(settings, fake_model):
    keyed = {"auth": {"api_keys": {"key-one": "u1"}}}
    with api(settings, **keyed) as (server, base):
        client = openai.OpenAI(base_url=base, api_key="key-one")
        client.chat.completions.create(model="deepSeek", messages=ask("q #tokens=3"))
        usage = httpx.get(
            server.url + "/api/usage", headers={"authorization": "Bearer key-one"}
        ).json()
    assert usage["userId"] == "u1" and usage["total"]["answers"] == 1


async def test_usage_is_recorded_for_every_transport(client, server, fake_model):
    from tests.client import chat_body, sse_chat

    events = await sse_chat(client, chat_body("one #tokens=4"))
    assert events[-1].data["usage"]["completion_tokens"] == 6  # 4 + 2 reasoning
    await sse_chat(client, chat_body("two #tokens=3 #nousage"))  # estimated
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="k") as oa:
        await oa.chat.completions.create(model="deepSeek", messages=ask("three"), user="1")
    usage = (await client.get("/api/usage")).json()
    (row,) = usage["models"]
    assert row["model"] == "fake-chat" and row["answers"] == 3 and row["estimated"] is True
    assert row["completion_tokens"] >= 6 + 7
    metrics = (await client.get("/metrics")).text
    assert 'searchchat_tokens_total{kind="completion",model="fake-chat"}' in metrics


def test_langchain_chat_openai_uses_it(settings, fake_model, fake_search):
    from langchain_openai import ChatOpenAI

    with api(settings) as (_, base):
        llm = ChatOpenAI(base_url=base, api_key="anything", model="webSearch", max_retries=0)
        answer = llm.invoke(RELEVANT_QUESTION)
        streamed = "".join(chunk.content for chunk in llm.stream("and in short?"))
    assert answer.content == "tok0 tok1 tok2 tok3 tok4 "
    assert streamed == "tok0 tok1 tok2 tok3 tok4 "


async def test_an_answer_cut_at_max_output_tokens_finishes_with_length(settings, fake_model):
    with api(settings, llm={"max_output_tokens": 4}) as (_, base):
        client = openai.AsyncOpenAI(base_url=base, api_key="anything", max_retries=0)
        whole = await client.chat.completions.create(
            model="deepSeek", messages=ask("never stops #endless")
        )
        stream = await client.chat.completions.create(
            model="deepSeek", messages=ask("never stops #endless"), stream=True
        )
        chunks = [chunk async for chunk in stream]
        await client.close()
    assert whole.choices[0].message.content == "tok0 tok1 tok2 tok3 "  # its text, not a 502
    assert whole.choices[0].finish_reason == "length"
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "tok0 tok1 tok2 tok3 "
    )
