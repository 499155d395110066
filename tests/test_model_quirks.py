"""What differs between model servers, handled inside the model client: where the
instructions go (`llm.system_prompt`) and a template that drops them, parameters a
server refuses, streamed tool calls a server cannot make."""

from __future__ import annotations

import logging

import httpx
import pytest

from app.config import LLMSettings
from app.errors import ConfigError
from app.main import create_app
from app.model import LLMClient
from app.model.quirks import (
    listed_traits,
    refused_parameter,
    with_instructions_in_user,
    without_refused,
)
from tests.client import answer_of, chat_body, reasoning_of, sse_chat
from tests.conftest import USER
from tests.servers import serve
from tests.test_agent import PLAN_JSON, ask, decided, steps, web

pytestmark = pytest.mark.anyio

INSTRUCTIONS = "Answer from the context below and cite each source by its number. " * 4


def client(model_url: str, key: str, **settings: str) -> LLMClient:
    return LLMClient(LLMSettings(base_url=model_url, api_key=key, model="m", **settings))


async def answered(llm: LLMClient, messages: list[dict[str, str]]) -> str:
    got: list[str] = []
    await llm.answer(messages, lambda d: got.append(d.text) if d.kind == "content" else None)
    return "".join(got)


# -- where the instructions go ----------------------------------------------------------------


def test_instructions_go_to_the_start_of_the_first_user_message():
    messages = [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "reply"},
        {"role": "system", "content": "More rules."},
        {"role": "user", "content": "second"},
    ]
    assert with_instructions_in_user(messages) == [
        {"role": "user", "content": "Rules.\n\nMore rules.\n\nfirst"},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": "second"},
    ]
    assert with_instructions_in_user([{"role": "system", "content": "Only rules."}]) == [
        {"role": "user", "content": "Only rules."}
    ]
    parts = [{"role": "system", "content": "R."}, {"role": "user", "content": [{"type": "x"}]}]
    assert with_instructions_in_user(parts)[0]["content"] == [
        {"type": "text", "text": "R."},
        {"type": "x"},
    ]


async def test_with_system_prompt_user_the_model_gets_the_instructions_in_the_user_message(
    model_url, fake_model
):
    llm = client(model_url, fake_model.api_key, system_prompt="user")
    try:
        await answered(
            llm, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        )
    finally:
        await llm.aclose()
    (asked,) = fake_model.streamed_requests()
    assert asked["messages"] == [{"role": "user", "content": "Be brief.\n\nhi"}]


async def test_the_answer_prompt_reaches_a_template_that_drops_system_messages(
    settings, fake_model, fake_search
):
    events = await ask(settings, web(mode="speed"), llm={"system_prompt": "user"})
    assert events[-1].data["status"] == "completed"
    messages = fake_model.streamed_requests()[-1]["messages"]
    assert [m["role"] for m in messages if m["role"] == "system"] == []
    first_user = next(m["content"] for m in messages if m["role"] == "user")
    assert "SNIPPET-" in first_user  # the search context, in the message the model keeps


async def test_an_unknown_system_prompt_place_is_refused(model_url):
    with pytest.raises(ConfigError, match="llm.system_prompt"):
        client(model_url, "k", system_prompt="assistant")


@pytest.mark.parametrize("drops", [True, False])
async def test_a_template_that_drops_the_system_prompt_is_warned_of_once(
    model_url, fake_model, caplog, drops
):
    fake_model.drops_system = drops
    llm = client(model_url, fake_model.api_key)
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "hi #reasoning=0"},
    ]
    try:
        with caplog.at_level(logging.WARNING, logger="app.llm"):
            for _ in range(3):
                await answered(llm, messages)
    finally:
        await llm.aclose()
    warned = [r.getMessage() for r in caplog.records if "system prompt" in r.getMessage()]
    assert len(warned) == (1 if drops else 0)  # a template that keeps it is not warned of
    assert all('llm.system_prompt = "user"' in line for line in warned)
    assert "cite each source" not in caplog.text  # no content in the log


# -- parameters a server refuses ----------------------------------------------------------------


def test_what_a_refusal_names_is_read_from_its_words():
    body = {"max_tokens": 10, "response_format": {"type": "json_schema"}, "messages": []}
    openai_words = (
        "Unsupported parameter: 'max_tokens' is not supported with this model. "
        "Use 'max_completion_tokens' instead."
    )
    assert refused_parameter(400, openai_words, body) == "max_tokens"
    pydantic = (
        "1 validation error: {'type': 'literal_error', 'loc': ('body', 'response_format', "
        "'type'), 'msg': \"Input should be 'text' or 'json_object'\"}"
    )
    assert refused_parameter(500, pydantic, body) == "response_format"
    too_long = "This model's maximum context length is 4096 tokens; max_tokens is not valid"
    assert refused_parameter(400, too_long, body) is None
    assert refused_parameter(400, "max_tokens is too large", body) is None
    assert refused_parameter(429, openai_words, body) is None
    assert refused_parameter(400, openai_words, {"messages": []}) is None
    assert without_refused(body, {"max_tokens", "response_format"}) == {
        "messages": [],
        "max_completion_tokens": 10,
    }


async def test_a_refused_parameter_is_sent_once_more_without_it_and_never_again(
    model_url, fake_model
):
    fake_model.refused_parameters["stream_options"] = 400
    llm = client(model_url, fake_model.api_key)
    try:
        first = await answered(llm, [{"role": "user", "content": "a #tokens=2"}])
        second = await answered(llm, [{"role": "user", "content": "b #tokens=2"}])
    finally:
        await llm.aclose()
    # (without stream_options the fake takes a stream for a short call: its words differ)
    assert first and first == second
    assert ["stream_options" in r for r in fake_model.requests] == [True, False, False]


async def test_max_tokens_refused_is_sent_as_max_completion_tokens(model_url, fake_model):
    fake_model.refused_parameters["max_tokens"] = 400
    llm = client(model_url, fake_model.api_key)
    try:
        assert await llm.complete([{"role": "user", "content": "x"}], max_tokens=20) == "fake reply"
        assert await llm.complete([{"role": "user", "content": "y"}], max_tokens=30) == "fake reply"
    finally:
        await llm.aclose()
    asked = [(r.get("max_tokens"), r.get("max_completion_tokens")) for r in fake_model.requests]
    assert asked == [(20, None), (None, 20), (None, 30)]


async def test_a_500_for_response_format_is_retried_without_it(model_url, fake_model):
    fake_model.refused_parameters["response_format"] = 500
    llm = client(model_url, fake_model.api_key)
    post = llm._send  # the one path every request takes
    try:
        response = await post(
            "m",
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {}},
            lambda body: llm._require().post(
                "/chat/completions", cast_to=dict, body=body, stream=False
            ),
        )
    finally:
        await llm.aclose()
    assert response["choices"][0]["message"]["content"] == "fake reply"
    assert ["response_format" in r for r in fake_model.requests] == [True, False]
    assert llm.learned.refused == {"m": {"response_format"}}


# -- tool rounds a server cannot stream --------------------------------------------------------


async def test_an_empty_streamed_tool_answer_falls_back_to_whole_tool_rounds(
    settings, fake_model, fake_search
):
    decided(fake_model)
    fake_model.tool_stream_empty = True
    fake_model.tool_rounds[:] = [[("web_search", {"query": "whole round"})], [("done", {})]]
    events = await ask(settings, web())
    assert events[-1].data["status"] == "completed"
    assert ("tavily", "whole round") in fake_search.queries
    streamed = [r.get("stream", False) for r in fake_model.tool_requests()]
    assert streamed == [True, False, False]  # the verdict is kept for the second round
    assert not any(PLAN_JSON in str(r.get("messages")) for r in fake_model.requests)
    assert [s["status"] for s in steps(events, "round") if s["status"] != "running"] == [
        "done",
        "done",
    ]
    assert "sources" in [e.type for e in events]


async def test_a_500_to_streamed_tools_falls_back_to_whole_tool_rounds(
    settings, fake_model, fake_search
):
    decided(fake_model)
    fake_model.tool_stream_error = 500
    fake_model.tool_rounds[:] = [[("web_search", {"query": "after a 500"})], [("done", {})]]
    events = await ask(settings, web())
    assert events[-1].data["status"] == "completed"
    assert ("tavily", "after a 500") in fake_search.queries
    assert [r.get("stream", False) for r in fake_model.tool_requests()] == [True, False, False]


async def test_a_server_that_cannot_do_tools_either_way_gets_the_json_planner(
    settings, fake_model, fake_search
):
    decided(fake_model)
    fake_model.tool_stream_empty = True
    fake_model.tool_whole_error = 500
    plans = iter(['{"calls": [{"tool": "web_search", "args": {"query": "planned"}}]}'])
    fake_model.replies.insert(0, (PLAN_JSON, lambda _p: next(plans, '{"done": true}')))
    events = await ask(settings, web())
    assert events[-1].data["status"] == "completed"
    assert ("tavily", "planned") in fake_search.queries
    assert [r.get("stream", False) for r in fake_model.tool_requests()] == [True, False]
    assert "sources" in [e.type for e in events]


async def test_the_next_answer_does_not_stream_tools_again(settings, fake_model, fake_search):
    decided(fake_model)
    fake_model.tool_stream_empty = True
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as http:
            for _ in range(2):
                events = await sse_chat(http, web())
                assert events[-1].data["status"] == "completed"
    assert [r.get("stream", False) for r in fake_model.tool_requests()] == [True, False, False]


# -- a template that leaves the opening <think> out, on the first answer -----------------------

R1_ALIAS = {
    "id": "local-model",
    "object": "model",
    "root": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
}


async def test_a_model_listed_as_leaving_the_tag_out_is_split_from_its_first_answer(
    model_url, fake_model
):
    fake_model.listed[:] = [R1_ALIAS, {"id": "plain-model", "object": "model"}]
    llm = LLMClient(
        LLMSettings(base_url=model_url, api_key=fake_model.api_key, model="local-model")
    )
    got: list[tuple[str, str]] = []
    try:
        assert await llm.probe() is None
        await llm.answer(
            [{"role": "user", "content": "explain #lonethink #reasoning=0"}],
            lambda d: got.append((d.kind, d.text)),
        )
    finally:
        await llm.aclose()
    assert "".join(t for kind, t in got if kind == "reasoning") == "Let me think."
    assert "".join(t for kind, t in got if kind == "content") == "The answer."
    assert llm.learned.open_left_out == {"local-model"}


async def test_the_first_answer_of_a_fresh_server_shows_no_reasoning_as_answer(
    settings, fake_model
):
    fake_model.listed[:] = [R1_ALIAS]
    app = create_app(settings.replace(llm={"model": "local-model"}))
    with serve(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as http:
            events = await sse_chat(http, chat_body("explain #lonethink #reasoning=0"))
    assert events[-1].data["status"] == "completed"
    assert answer_of(events) == "The answer."
    assert reasoning_of(events) == "Let me think."


def test_a_model_list_says_whether_a_model_takes_tools_and_reasons():
    # OpenRouter names every parameter a model takes: what is not there it does not take
    openrouter = {"id": "a/b", "supported_parameters": ["tools", "tool_choice", "reasoning"]}
    assert listed_traits(openrouter) == (True, True)
    assert listed_traits({"id": "a/c", "supported_parameters": ["max_tokens"]}) == (False, False)
    # a `capabilities` list (Ollama's, LM Studio's) counts for what it names
    assert listed_traits({"id": "q", "capabilities": ["completion", "tools", "thinking"]}) == (
        True,
        True,
    )
    assert listed_traits({"id": "g", "capabilities": ["completion"]}) == (None, None)
    assert listed_traits({"id": "plain", "object": "model"}) == (None, None)
