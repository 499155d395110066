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
from app.transport.responses import SEARCH_SOURCES
from tests.client import chat_body
from tests.fakes.search import RELEVANT_QUESTION
from tests.servers import serve

pytestmark = pytest.mark.anyio

ANSWER = "Raptor burns methane [4] with oxygen [1]."


@contextlib.contextmanager
def api(settings, **sections):
    """The server, and an `openai` client pointed at it."""
    with serve(create_app(settings.replace(**sections))) as server:
        url = server.url + "/v1"
        with openai.OpenAI(base_url=url, api_key="anything", max_retries=0) as client:
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
    seven, eight = {"userId": "7"}, {"userId": "8"}
    with api(settings) as (server, client):
        first = client.responses.create(
            model="deepSeek", input="what is methane?", extra_body=seven
        )
        second = client.responses.create(
            model="deepSeek",
            input="and then?",
            previous_response_id=first.id,
            extra_body=seven,
        )
        assert second.previous_response_id == first.id
        chats = httpx.get(server.url + "/api/chats", params={"userId": "7"}).json()["chats"]
        with pytest.raises(openai.NotFoundError):
            client.responses.create(
                model="deepSeek", input="mine?", previous_response_id=first.id, extra_body=eight
            )
    assert len(chats) == 1
    sent = fake_model.streamed_requests()[-1]["messages"]
    assert [(m["role"], m["content"]) for m in sent[1:]] == [
        ("user", "what is methane?"),
        ("assistant", "tok0 tok1 tok2 tok3 tok4 "),
        ("user", "and then?"),
    ]


def _asked(fake_model) -> list[str]:
    """The conversation the model was last given, without the system prompt."""
    return [m["content"] for m in fake_model.streamed_requests()[-1]["messages"][1:]]


def test_an_older_previous_response_id_branches_from_that_response(settings, fake_model):
    with api(settings) as (server, client):
        one = client.responses.create(model="deepSeek", input="one #tokens=1")
        two = client.responses.create(
            model="deepSeek", input="two #tokens=2", previous_response_id=one.id
        )
        three = client.responses.create(
            model="deepSeek", input="three #tokens=3", previous_response_id=one.id
        )
        assert _asked(fake_model) == ["one #tokens=1", "tok0 ", "three #tokens=3"]
        client.responses.create(model="deepSeek", input="four", previous_response_id=three.id)
        assert _asked(fake_model) == [
            "one #tokens=1",
            "tok0 ",
            "three #tokens=3",
            "tok0 tok1 tok2 ",
            "four",
        ]
        client.responses.create(model="deepSeek", input="five", previous_response_id=two.id)
        assert _asked(fake_model) == [
            "one #tokens=1",
            "tok0 ",
            "two #tokens=2",
            "tok0 tok1 ",
            "five",
        ]
        (chat,) = httpx.get(server.url + "/api/chats").json()["chats"]
    assert chat["id"]  # one chat holds every branch


def test_a_chat_of_the_web_client_continues_from_the_answer_named(settings, fake_model):
    with api(settings) as (server, client):
        answers = []
        for question in ("one #tokens=1", "two #tokens=2", "three"):
            body = chat_body(question, chatId="77")
            with httpx.stream("POST", server.url + "/api/chat/sse", json=body) as response:
                text = "".join(response.iter_text())
            answers.append(re.search(r'"messageId":"(\d+)"', text).group(1))
        client.responses.create(
            model="deepSeek",
            input="four",
            previous_response_id=f"resp_{answers[1]}",
            extra_body={"userId": "1"},
        )
    assert _asked(fake_model) == ["one #tokens=1", "tok0 ", "two #tokens=2", "tok0 tok1 ", "four"]


def test_retrieve_cancel_and_delete_as_the_sdk_calls_them(settings, fake_model):
    with api(settings) as (_, client):
        made = client.responses.create(model="deepSeek", input="q #tokens=3", user="end-user-7")
        got = client.responses.retrieve(made.id)
        done = client.responses.cancel(made.id)  # it has ended: it stays as it was
        client.responses.delete(made.id)
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.retrieve(made.id)
    assert got.status == "completed" and got.output_text == "tok0 tok1 tok2 "
    assert got.user == "end-user-7" and done.status == "completed"
    assert info.value.body["code"] is None  # no model is missing


def test_a_response_of_another_user_is_not_found(settings, fake_model):
    with api(settings) as (_, client):
        made = client.responses.create(
            model="deepSeek", input="q #tokens=3", extra_body={"userId": "7"}
        )
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made.id)  # user "0"'s request
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(made.id, extra_query={"userId": "8"})
        got = client.responses.retrieve(made.id, extra_query={"userId": "7"})
        client.responses.delete(made.id, extra_query={"userId": "7"})
    assert got.output_text == "tok0 tok1 tok2 "


def test_a_response_reads_the_same_after_its_events_expire(settings, fake_model, fake_search):
    fake_model.answer_text = ANSWER
    quick = {"replay_ttl_seconds": 0.3}
    with api(settings, stream=quick, search={"provider": "searxng"}) as (_, client):
        first = client.responses.create(model="deepSeek", input="first")
        made = client.responses.create(
            model="webSearch:quality",
            input=RELEVANT_QUESTION,
            instructions="Answer briefly.",
            metadata={"ticket": "42"},
            include=["web_search_call.action.sources"],
            previous_response_id=first.id,
            user="end-user-7",
            extra_body={"return_images": True, "return_related_questions": True},
        )
        while_kept = client.responses.retrieve(made.id)
        time.sleep(0.6)
        expired = client.responses.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):  # its events are gone
            client.responses.retrieve(made.id, stream=True)
    assert expired.model == "webSearch:quality" and expired.instructions == "Answer briefly."
    assert expired.metadata == {"ticket": "42"} and expired.previous_response_id == first.id
    assert expired.user == "end-user-7" and expired.store is True
    assert expired.output[0].type == "web_search_call" and expired.output[0].action.sources
    assert expired.model_extra["images"] and expired.model_extra["related_questions"]
    assert expired.usage.output_tokens > 0
    assert expired.usage.model_extra["num_search_queries"] == 1
    assert expired.model_dump() == while_kept.model_dump() == made.model_dump()


def test_store_false_forgets_that_turn_only(settings, fake_model):
    with api(settings) as (server, client):
        kept = client.responses.create(model="deepSeek", input="kept #tokens=2")
        made = client.responses.create(
            model="deepSeek", input="q #tokens=3", store=False, previous_response_id=kept.id
        )
        url = server.url + f"/v1/responses/{made.id}"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and httpx.get(url).status_code != 404:
            time.sleep(0.05)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made.id)
        earlier = client.responses.retrieve(kept.id)
        (chat,) = httpx.get(server.url + "/api/chats").json()["chats"]
        messages = httpx.get(server.url + f"/api/chats/{chat['id']}").json()["messages"]
        alone = client.responses.create(model="deepSeek", input="alone", store=False)
        while (
            time.monotonic() < deadline
            and len(httpx.get(server.url + "/api/chats").json()["chats"]) > 1
        ):
            time.sleep(0.05)
        chats = httpx.get(server.url + "/api/chats").json()["chats"]
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="deepSeek", input="q", store=False, background=True)
    assert made.output_text == "tok0 tok1 tok2 " and made.store is False
    assert earlier.output_text == "tok0 tok1 "
    assert [m["content"] for m in messages] == ["kept #tokens=2", "tok0 tok1 "]
    assert alone.output_text and [c["id"] for c in chats] == [chat["id"]]


def test_delete_takes_that_turn_only(settings, fake_model):
    with api(settings) as (server, client):
        first = client.responses.create(model="deepSeek", input="first #tokens=1")
        second = client.responses.create(
            model="deepSeek", input="second", previous_response_id=first.id
        )
        deleted = client.responses.delete(second.id)
        (chat,) = httpx.get(server.url + "/api/chats").json()["chats"]
        messages = httpx.get(server.url + f"/api/chats/{chat['id']}").json()["messages"]
        client.responses.delete(first.id)
        chats = httpx.get(server.url + "/api/chats").json()["chats"]
    assert deleted is None or deleted.deleted
    assert [m["content"] for m in messages] == ["first #tokens=1", "tok0 "]
    assert chats == []


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
    if status == 404:  # only a missing model is `model_not_found`
        assert info.value.body["code"] == ("model_not_found" if "model" in call else None)


def test_a_response_that_fails_at_once_is_numbered_alike_everywhere(settings, fake_model):
    with api(settings) as (server, client):
        events = list(
            client.responses.create(
                model="deepSeek", input="q #fail=400", background=True, stream=True
            )
        )
        url = f"{server.url}/v1/responses/{events[0].response.id}"
        again = _sse(url, {"stream": "true"})
        seen = client.responses.retrieve(events[0].response.id)
    kinds = ["response.created", "response.in_progress", "response.failed"]
    assert [e.type for e in events] == kinds == [e["type"] for e in again]
    assert [e.sequence_number for e in events] == [0, 1, 2]
    assert [e["sequence_number"] for e in again] == [0, 1, 2]
    assert events[-1].response.background is True and seen.background is True
    assert seen.status == "failed" and seen.error.message == events[-1].response.error.message


def test_annotations_count_code_points_before_a_marker(settings, fake_model, fake_search):
    fake_model.answer_text = "Ünïcødé 🚀 and 中文 say [2], then [1]."
    with api(settings) as (_, client):
        response = client.responses.create(model="webSearch", input=RELEVANT_QUESTION)
    text = response.output_text
    notes = response.output[-1].content[0].annotations
    assert [text[n.start_index : n.end_index] for n in notes] == ["[2]", "[1]"]
    assert notes[0].start_index == len("Ünïcødé 🚀 and 中文 say ")  # not its UTF-16 length


def test_include_lists_web_pages_only():
    from app.events import Event
    from app.transport.responses import ResponseRequest, ResponseState

    state = ResponseState("1", ResponseRequest("webSearch", include=(SEARCH_SOURCES,)))
    search = {"id": "search-1", "kind": "search", "query": "q"}
    for kind, data in [
        ("progress", {"data": "s", "step": {**search, "status": "running"}}),
        ("progress", {"data": "s", "step": {**search, "status": "done", "results": 1}}),
        (
            "sources",
            {
                "data": [
                    {"metadata": {"title": "Page", "url": "https://a.example/1"}},
                    {"metadata": {"title": "notes.pdf", "url": "File", "fileId": "9"}},
                    {"metadata": {"title": "All Sources", "url": "//host/sources/1"}},
                ]
            },
        ),
        ("messageEnd", {"status": "completed"}),
    ]:
        state.feed(Event(kind, "c", "1", data))
    (call,) = [i for i in state.response()["output"] if i["type"] == "web_search_call"]
    assert call["action"]["sources"] == [{"type": "url", "url": "https://a.example/1"}]


def test_a_failed_answer_is_a_failed_response(settings, fake_model):
    with api(settings) as (_, client):
        response = client.responses.create(model="deepSeek", input="q #break=2")
        events = list(client.responses.create(model="deepSeek", input="q #break=2", stream=True))
    assert response.status == "failed" and re.search("broke", response.error.message)
    assert events[-1].type == "response.failed" and events[-1].response.error.message


def test_an_answer_cut_at_max_output_tokens_is_incomplete(settings, fake_model):
    with api(settings, llm={"max_output_tokens": 3}) as (_, client):
        whole = client.responses.create(model="deepSeek", input="never stops #endless")
        events = list(
            client.responses.create(model="deepSeek", input="never stops #endless", stream=True)
        )
        again = client.responses.retrieve(whole.id)
    for response in (whole, events[-1].response, again):
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.output_text == "tok0 tok1 tok2 "
    assert events[-1].type == "response.incomplete"
