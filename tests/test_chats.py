"""Chats are saved: titles, messages, history, rewrite, and the chats endpoints."""

from __future__ import annotations

import asyncio

import pytest

from tests.client import chat_body, sse_chat, wait_for

pytestmark = pytest.mark.anyio


async def test_new_chat_is_saved_with_title_question_and_answer(client, fake_model):
    events = await sse_chat(client, chat_body("what is deepseek", chatId="42", messageId="43"))
    answer_id = events[0].data["messageId"]

    async def titled():
        chats = (await client.get("/api/chats", params={"userId": "1"})).json()["chats"]
        return chats if chats and chats[0]["title"] == "Fake Chat Title" else None

    chats = await wait_for(titled)
    assert chats[0]["id"] == "42"
    assert chats[0]["focusMode"] == "deepSeek"
    assert chats[0]["createdAt"].endswith("Z")
    title_request = next(
        r for r in fake_model.requests if "Write a title" in r["messages"][0]["content"]
    )
    assert title_request["model"] == "fake-small"

    chat = (await client.get("/api/chats/42")).json()
    assert chat["chat"]["title"] == "Fake Chat Title"
    question, answer = chat["messages"]
    assert (question["id"], question["role"], question["content"]) == (
        "43",
        "user",
        "what is deepseek",
    )
    assert (answer["id"], answer["role"], answer["status"]) == (answer_id, "assistant", "completed")
    assert answer["content"] == "tok0 tok1 tok2 tok3 tok4 "
    assert answer["reasoning"] == "why0 why1 "
    assert answer["questionMessageId"] == "43"


async def test_title_falls_back_to_the_question_when_the_model_fails(client, fake_model):
    fake_model.replies[:] = [("Write a title", "")]
    await sse_chat(client, chat_body("tell me about rust", chatId="50"))
    await asyncio.sleep(0.2)
    chat = (await client.get("/api/chats/50")).json()
    assert chat["chat"]["title"] == "tell me about rust"


@pytest.mark.parametrize(
    "title",
    [
        "Write a title of 3 to 5 words for a chat that begins with the question below.",
        "Use the question's language. No quotes, no punctuation at the end",
        "Methane" * 15,  # longer than any title
    ],
)
async def test_a_title_that_is_no_title_leaves_the_question_as_title(client, fake_model, title):
    fake_model.replies[:] = [("Write a title", title)]
    await sse_chat(client, chat_body("tell me about rust", chatId="51"))

    async def asked():
        return any("Write a title" in str(r["messages"]) for r in fake_model.requests)

    await wait_for(asked)
    await asyncio.sleep(0.2)
    chat = (await client.get("/api/chats/51")).json()
    assert chat["chat"]["title"] == "tell me about rust"


async def test_chats_are_listed_newest_first_per_user_and_deleted(client, fake_model):
    for chat_id in ("61", "62"):
        await sse_chat(client, chat_body("q", chatId=chat_id))
    await sse_chat(client, {**chat_body("q", chatId="63"), "userId": "2"})
    listed = (await client.get("/api/chats", params={"userId": "1"})).json()["chats"]
    assert [c["id"] for c in listed] == ["62", "61"]
    assert [
        c["id"] for c in (await client.get("/api/chats", params={"userId": "2"})).json()["chats"]
    ] == ["63"]

    response = await client.delete("/api/chats/61")
    assert response.status_code == 200
    assert (await client.get("/api/chats/61")).status_code == 404
    assert (await client.delete("/api/chats/61")).json()["key"] == "NOT_FOUND"
    assert [
        c["id"] for c in (await client.get("/api/chats", params={"userId": "1"})).json()["chats"]
    ] == ["62"]


async def test_history_comes_from_the_store_in_order(client, fake_model):
    await sse_chat(client, chat_body("first question", chatId="70"))
    await sse_chat(client, chat_body("second question", chatId="70"))
    await sse_chat(client, chat_body("third", chatId="70"))
    sent = fake_model.streamed_requests()[-1]["messages"]
    assert [(m["role"], m["content"]) for m in sent[1:]] == [
        ("user", "first question"),
        ("assistant", "tok0 tok1 tok2 tok3 tok4 "),
        ("user", "second question"),
        ("assistant", "tok0 tok1 tok2 tok3 tok4 "),
        ("user", "third"),
    ]
    messages = (await client.get("/api/chats/70")).json()["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3


async def test_history_in_the_request_wins_over_the_store(client, fake_model):
    await sse_chat(client, chat_body("stored question", chatId="71"))
    await sse_chat(
        client,
        chat_body("now", chatId="71", history=[["human", "given q"], ["assistant", "given a"]]),
    )
    sent = fake_model.streamed_requests()[-1]["messages"]
    assert [(m["role"], m["content"]) for m in sent[1:]] == [
        ("user", "given q"),
        ("assistant", "given a"),
        ("user", "now"),
    ]


async def test_long_question_is_rewritten_and_the_rewrite_is_saved(client, fake_model):
    fake_model.replies.insert(0, ("Standalone question", "What is the DeepSeek R1 model?"))
    question = "and what about that model they released last week?"
    events = await sse_chat(client, chat_body(question, chatId="80", messageId="81"))
    # nothing searches for it: made beside the answer, sent when it comes
    (rewrited,) = [e for e in events if e.type == "rewrited"]
    assert rewrited.data == {
        "type": "rewrited",
        "content": "What is the DeepSeek R1 model?",
        "chatId": "80",
    }
    assert events[-1].type == "messageEnd"
    rewrite = next(
        r for r in fake_model.requests if "Standalone question" in r["messages"][0]["content"]
    )
    assert question in rewrite["messages"][0]["content"]
    assert rewrite["model"] == "fake-small"
    saved = (await client.get("/api/chats/80")).json()["messages"][0]
    assert saved["content"] == question
    assert saved["rewritten"] == "What is the DeepSeek R1 model?"


@pytest.mark.parametrize(
    "reply",
    [
        "You rewrite a user's latest question so that it can be understood and searched",
        "- Keep the user's language, names, numbers and intent: falcon engines",
        "What is the DeepSeek R1 model? " * 8,  # far longer than the question
    ],
)
async def test_a_rewrite_that_is_no_rewrite_leaves_the_question_as_asked(client, fake_model, reply):
    fake_model.replies.insert(0, ("Standalone question", reply))
    question = "and what about that model they released last week?"
    events = await sse_chat(client, chat_body(question, chatId="85", messageId="86"))
    assert "rewrited" not in [e.type for e in events]
    assert any("Standalone question" in str(r["messages"]) for r in fake_model.requests)
    assert fake_model.streamed_requests()[-1]["messages"][-1]["content"] == question
    saved = (await client.get("/api/chats/85")).json()["messages"][0]
    assert saved["content"] == question and saved.get("rewritten") is None


async def test_short_question_without_history_is_not_rewritten(client, fake_model):
    events = await sse_chat(client, chat_body("short one"))
    assert events[0].type == "message"
    assert not any(
        "Standalone question" in r["messages"][0]["content"] for r in fake_model.requests
    )


async def test_not_needed_keeps_the_original_question(client, fake_model):
    await sse_chat(client, chat_body("q1", chatId="90"))
    events = await sse_chat(
        client, chat_body("q2", chatId="90")
    )  # has history: asks, model says not_needed
    assert "rewrited" not in [e.type for e in events]
    assert any("Standalone question" in r["messages"][0]["content"] for r in fake_model.requests)


async def test_a_chat_of_another_user_is_refused(client, fake_model):
    await sse_chat(client, chat_body("mine", chatId="100"))
    response = await client.post(
        "/api/chat/sse", json={**chat_body("yours?", chatId="100"), "userId": "2"}
    )
    assert response.status_code == 403
    assert response.json()["key"] == "FORBIDDEN"
    assert (await client.get("/api/chats/100", params={"userId": "2"})).status_code == 403


async def test_a_message_id_of_another_chat_is_refused(client, fake_model):
    await sse_chat(client, chat_body("one", chatId="110", messageId="111"))
    response = await client.post(
        "/api/chat/sse", json=chat_body("two", chatId="112", messageId="111")
    )
    assert response.status_code == 409
    assert "messageId" in response.json()["data"]


async def test_suggestions_from_history_and_from_a_chat(client, fake_model):
    response = await client.post(
        "/api/suggestions",
        json={"history": [["human", "what is rust"], ["assistant", "a language"]]},
    )
    assert response.status_code == 200
    assert response.json()["suggestions"] == [
        "What is next?",
        "Why does it matter?",
        "Who made it?",
        "When did it start?",
    ]
    await sse_chat(client, chat_body("q", chatId="120"))
    response = await client.post("/api/suggestions", json={"chatId": "120", "userId": "1"})
    assert len(response.json()["suggestions"]) == 4
    assert (
        await client.post("/api/suggestions", json={"chatId": "999", "userId": "1"})
    ).status_code == 404
    assert (await client.post("/api/suggestions", json={})).status_code == 400


async def test_config_and_health(client):
    config = (await client.get("/api/config")).json()
    assert "webSearch" in config["focusModes"] and config["optimizationModes"] == [
        "speed",
        "balanced",
        "quality",
    ]
    assert config["chatModel"] == "fake-chat"
    assert "test-key" not in str(config)
    assert config["searchProblem"] is None  # the fake search provider is configured
    assert (await client.get("/healthz")).status_code == 200
    ready = await client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


async def test_an_answer_follows_its_question_whatever_ids_the_client_picks(client, fake_model):
    await sse_chat(client, chat_body("big id", chatId="130", messageId=str(2**62 + 5)))
    roles = [m["role"] for m in (await client.get("/api/chats/130")).json()["messages"]]
    assert roles == ["user", "assistant"]
