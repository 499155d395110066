"""The Responses API (PROTOCOL §11), driven with the official `openai` SDK
(`client.responses`), through real uvicorn with the fake model and the fake web."""

from __future__ import annotations

import contextlib
import re
import time

import httpx
import openai
import pytest

from app.main import create_app
from tests.fakes.search import RELEVANT_QUESTION
from tests.servers import serve

pytestmark = pytest.mark.anyio

ANSWER = "Raptor burns methane [4] with oxygen [1]."


@contextlib.contextmanager
def api(settings, **sections):
    """The server, and an `openai` client pointed at it."""
    with serve(create_app(settings.replace(**sections))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="anything", max_retries=0)
        yield server, client


def test_a_whole_response_with_searches_reasoning_citations_and_usage(
    settings, fake_model, fake_search
):
    fake_model.answer_text = ANSWER
    with api(settings) as (_, client):
        response = client.responses.create(
            model="webSearch",
            input=RELEVANT_QUESTION,
            instructions="Answer briefly.",
            metadata={"ticket": "42"},
            include=["web_search_call.action.sources"],
        )
    assert response.object == "response" and response.status == "completed"
    assert response.id.startswith("resp_") and response.model == "webSearch"
    assert response.metadata == {"ticket": "42"}
    assert [item.type for item in response.output] == ["web_search_call", "reasoning", "message"]
    search, reasoning, message = response.output
    assert search.status == "completed" and search.action.query == RELEVANT_QUESTION
    assert len(search.action.sources) == 8
    assert reasoning.summary[0].text == "why0 why1 "
    assert response.output_text == ANSWER
    text = message.content[0]
    urls = [f"{fake_search.base_url}/pages/{n}" for n in (3, 0)]
    assert [(a.type, a.url) for a in text.annotations] == [("url_citation", u) for u in urls]
    assert [ANSWER[a.start_index : a.end_index] for a in text.annotations] == ["[4]", "[1]"]
    assert text.annotations[0].title.startswith("Result 3")
    assert response.usage.output_tokens > 0 and response.usage.input_tokens > 0
    assert response.usage.output_tokens_details.reasoning_tokens == 2
    assert response.usage.total_tokens == (
        response.usage.input_tokens + response.usage.output_tokens
    )
    assert "Answer briefly." in fake_model.last_system_prompt()


def test_input_as_messages_with_parts_and_developer_instructions(settings, fake_model):
    with api(settings) as (_, client):
        client.responses.create(
            model="deepSeek",
            input=[
                {"role": "developer", "content": "Be terse."},
                {"role": "user", "content": "what is methane?"},
                {"role": "assistant", "content": "a gas"},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "and then?"},
                        {"type": "input_image", "image_url": "https://example.test/a.png"},
                    ],
                },
            ],
        )
    sent = fake_model.streamed_requests()[-1]["messages"]
    assert "Be terse." in sent[0]["content"]
    assert [(m["role"], m["content"]) for m in sent[1:]] == [
        ("user", "what is methane?"),
        ("assistant", "a gas"),
        ("user", "and then?"),
    ]


def test_the_stream_is_the_responses_event_sequence(settings, fake_model, fake_search):
    fake_model.answer_text = ANSWER
    with api(settings) as (_, client):
        events = list(
            client.responses.create(model="webSearch", input=RELEVANT_QUESTION, stream=True)
        )
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:7] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.web_search_call.in_progress",
        "response.web_search_call.searching",
        "response.web_search_call.completed",
        "response.output_item.done",
    ]
    reasoning = kinds.index("response.reasoning_summary_part.added")
    assert kinds[reasoning - 1] == "response.output_item.added"
    message = kinds.index("response.content_part.added")
    assert reasoning < message and kinds[message - 1] == "response.output_item.added"
    assert kinds[-7:] == [
        "response.output_text.delta",
        "response.output_text.annotation.added",
        "response.output_text.annotation.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert deltas == ANSWER and thought == "why0 why1 "
    done = events[-1].response
    assert done.status == "completed" and done.output_text == ANSWER
    notes = [e.annotation for e in events if e.type == "response.output_text.annotation.added"]
    assert [ANSWER[n.start_index : n.end_index] for n in notes] == ["[4]", "[1]"]


def test_the_sdks_stream_helper_gets_the_final_response(settings, fake_model, fake_search):
    with api(settings) as (_, client):
        with client.responses.stream(model="webSearch", input=RELEVANT_QUESTION) as stream:
            texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
    assert "".join(texts) == "tok0 tok1 tok2 tok3 tok4 " == final.output_text


def test_previous_response_id_continues_the_same_chat(settings, fake_model):
    with api(settings) as (server, client):
        first = client.responses.create(model="deepSeek", input="what is methane?", user="7")
        second = client.responses.create(
            model="deepSeek", input="and then?", previous_response_id=first.id, user="7"
        )
        assert second.previous_response_id == first.id
        chats = httpx.get(server.url + "/api/chats", params={"userId": "7"}).json()["chats"]
        with pytest.raises(openai.NotFoundError):
            client.responses.create(
                model="deepSeek", input="mine?", previous_response_id=first.id, user="8"
            )
    assert len(chats) == 1
    sent = fake_model.streamed_requests()[-1]["messages"]
    assert [(m["role"], m["content"]) for m in sent[1:]] == [
        ("user", "what is methane?"),
        ("assistant", "tok0 tok1 tok2 tok3 tok4 "),
        ("user", "and then?"),
    ]


def test_retrieve_and_delete_a_stored_response(settings, fake_model):
    with api(settings) as (_, client):
        made = client.responses.create(model="deepSeek", input="q #tokens=3", user="7")
        got = client.responses.retrieve(made.id, extra_query={"user": "7"})
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made.id, extra_query={"user": "8"})
        client.responses.delete(made.id, extra_query={"user": "7"})
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made.id, extra_query={"user": "7"})
    assert got.status == "completed" and got.output_text == "tok0 tok1 tok2 "


def test_store_false_keeps_nothing(settings, fake_model):
    with api(settings) as (server, client):
        made = client.responses.create(model="deepSeek", input="q #tokens=3", store=False)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if not httpx.get(server.url + "/api/chats", params={"userId": "0"}).json()["chats"]:
                break
            time.sleep(0.05)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made.id)
    assert made.output_text == "tok0 tok1 tok2 " and made.store is False


def test_background_runs_on_and_is_resumed_exactly(settings, fake_model):
    with api(settings) as (server, client):
        made = client.responses.create(
            model="deepSeek", input="long #tokens=40 #delay=0.01", background=True
        )
        assert made.status in ("queued", "in_progress") and made.background is True
        url = f"{server.url}/v1/responses/{made.id}"
        whole = _sse(url, {"stream": "true"})
        part = _sse(url, {"stream": "true", "starting_after": "5"})
        done = client.responses.retrieve(made.id)
    assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
    assert part == whole[6:]
    assert whole[-1]["type"] == "response.completed"
    assert done.status == "completed" and done.output_text == "".join(f"tok{i} " for i in range(40))


def _sse(url: str, params: dict[str, str]) -> list[dict]:
    import json

    events = []
    with httpx.stream("GET", url, params=params, timeout=10) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


async def test_a_streaming_client_that_goes_away_stops_the_response(settings, fake_model):
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(timeout=10) as http:
            body = {"model": "deepSeek", "input": "long #tokens=2000 #delay=0.01", "stream": True}
            async with http.stream("POST", server.url + "/v1/responses", json=body) as response:
                async for line in response.aiter_lines():
                    if "tok3" in line:
                        break
            gone = time.monotonic()
        record = await fake_model.wait_stream_end()
    assert record.outcome == "client_closed"
    assert record.closed_at - gone < 1.0


def test_cancel_stops_a_background_response(settings, fake_model):
    with api(settings) as (_, client):
        made = client.responses.create(
            model="deepSeek", input="long #tokens=2000 #delay=0.01", background=True
        )
        time.sleep(0.3)
        cancelled = client.responses.cancel(made.id)
    assert cancelled.status == "cancelled"
    assert 0 < len(cancelled.output_text) < len("tok0 ") * 2000


@pytest.mark.parametrize(
    ("call", "error", "status"),
    [
        ({"model": "nope"}, openai.NotFoundError, 404),
        ({"input": []}, openai.BadRequestError, 400),
        ({"input": [{"role": "assistant", "content": "hi"}]}, openai.BadRequestError, 400),
        ({"previous_response_id": "resp_nothing"}, openai.NotFoundError, 404),
        ({"extra_body": {"search_recency_filter": "fortnight"}}, openai.BadRequestError, 400),
    ],
)
def test_errors_come_in_openais_shape(settings, fake_model, call, error, status):
    with api(settings) as (_, client), pytest.raises(error) as info:
        client.responses.create(**{"model": "deepSeek", "input": "q", **call})
    assert info.value.status_code == status
    assert set(info.value.body) >= {"message", "type", "code"} and info.value.body["message"]


def test_a_failed_answer_is_a_failed_response(settings, fake_model):
    with api(settings) as (_, client):
        response = client.responses.create(model="deepSeek", input="q #break=2")
        events = list(client.responses.create(model="deepSeek", input="q #break=2", stream=True))
    assert response.status == "failed" and re.search("broke", response.error.message)
    assert events[-1].type == "response.failed" and events[-1].response.error.message
