"""The research agent: a classifier before any search, rounds of tool calls within a
budget, a JSON planner for models without tools, pasted URLs, context and event size
limits, cancel mid-round, and every step on the wire."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest
from httpx_ws import aconnect_ws

from app.main import create_app
from tests.client import answer_of, chat_body, iter_sse, reasoning_of, rest, sse_chat, wait_for
from tests.conftest import USER
from tests.fakes.search import RELEVANT_QUESTION
from tests.servers import processes, serve

pytestmark = pytest.mark.anyio

CLASSIFY = "Standalone question and decision (JSON)"
PLAN_JSON = "Next calls (JSON)"


def web(question: str = RELEVANT_QUESTION, mode: str = "balanced", **fields):
    """A webSearch request (user "1", as `chat_body` names it)."""
    return chat_body(question, focusMode="webSearch", optimizationMode=mode, **fields)


def steps(events, kind: str | None = None):
    found = [e.data["step"] for e in events if e.type == "progress" and "step" in e.data]
    return [s for s in found if kind is None or s["kind"] == kind]


def _async(predicate):
    async def check():
        return predicate()

    return check


def decided(fake_model, **decision):
    body = {"skipSearch": False, "sources": ["web"], "question": RELEVANT_QUESTION} | decision
    fake_model.replies.insert(0, (CLASSIFY, orjson.dumps(body).decode()))


async def ask(settings, body, **replace):
    app = create_app(settings.replace(**replace) if replace else settings)
    with serve(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            return await sse_chat(client, body)


async def test_a_greeting_is_answered_without_searching(settings, fake_model, fake_search):
    events = await ask(settings, web("hello!"))
    assert fake_search.queries == []
    assert "sources" not in [e.type for e in events]
    (step,) = steps(events, "classify")
    assert step["skipSearch"] is True and step["status"] == "done"
    assert events[-1].data["status"] == "completed"


async def test_the_classifier_can_skip_search_for_a_question(settings, fake_model, fake_search):
    decided(fake_model, skipSearch=True, sources=[])
    events = await ask(settings, web("what is 17 times 23, worked out step by step please?"))
    assert fake_search.queries == [] and fake_model.tool_requests() == []
    assert steps(events, "classify")[0]["skipSearch"] is True


async def test_balanced_runs_rounds_until_done(settings, fake_model, fake_search):
    decided(fake_model)
    fake_model.tool_rounds[:] = [
        [("web_search", {"query": "raptor engine methane"})],
        [("read_url", {"urls": [fake_search.base_url + "/pages/3"]})],
        [("done", {})],
        [("web_search", {"query": "never asked"})],
    ]
    events = await ask(settings, web())
    assert [q for _, q in fake_search.queries] == ["raptor engine methane"]
    assert len(fake_model.tool_requests()) == 3  # the third round said done
    rounds = [s for s in steps(events, "round") if s["status"] == "done"]
    assert [s["n"] for s in rounds] == [1, 2, 3] and all(s["of"] == 6 for s in rounds)
    # the answer is written from what was found, the page read in full
    assert "FULLTEXT-3" in fake_model.last_system_prompt()
    assert "round 3: enough found" in [e.data["data"] for e in events if e.type == "progress"]
    # the second round saw the first one's results as tool answers
    second = fake_model.tool_requests()[1]["messages"]
    assert any(m["role"] == "tool" and "SNIPPET-" in m["content"] for m in second)
    assert any(m.get("tool_calls") for m in second if m["role"] == "assistant")


async def test_parallel_tool_calls_run_concurrently(settings, fake_model, fake_search):
    decided(fake_model)
    fake_search.search_delay = 0.6
    fake_model.tool_rounds[:] = [
        [(("web_search", {"query": f"angle {i}"})) for i in range(3)],
        [("done", {})],
    ]
    events = await ask(settings, web())
    assert sorted(q for _, q in fake_search.queries) == ["angle 0", "angle 1", "angle 2"]
    started = fake_search.searched_at
    assert max(started) - min(started) < 0.4  # all three in flight at once
    searches = steps(events, "search")
    assert len({s["id"] for s in searches}) == 3
    assert all(s["provider"] == "Tavily" for s in searches)
    assert {s["results"] for s in searches if s["status"] == "done"} == {8}


async def test_a_model_without_tools_plans_in_json_and_the_verdict_is_kept(
    settings, fake_model, fake_search
):
    decided(fake_model)
    fake_model.tools_refused = True
    plans = iter(
        ['```json\n{"calls": [{"tool": "web_search", "args": {"query": "json plan"},},]}\n```']
    )
    fake_model.replies.insert(0, (PLAN_JSON, lambda _p: next(plans, '{"done": true}')))
    app = create_app(settings)
    with serve(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            first = await sse_chat(client, web())
            second = await sse_chat(client, web())
    assert ("tavily", "json plan") in fake_search.queries
    assert len(fake_model.tool_requests()) == 1  # asked once with tools, then never again
    for events in (first, second):
        assert events[-1].data["status"] == "completed"
        assert "sources" in [e.type for e in events]


async def test_a_model_that_ignores_tools_gets_the_planner(settings, fake_model, fake_search):
    decided(fake_model)
    fake_model.tools_ignored = True
    fake_model.replies.insert(
        0, (PLAN_JSON, '{"calls": [{"tool": "web_search", "args": {"query": "from text"}}]}')
    )
    events = await ask(settings, web(), research={"balanced_rounds": 2})
    assert ("tavily", "from text") in fake_search.queries
    assert events[-1].data["status"] == "completed"


async def test_a_planner_that_cannot_plan_falls_back_to_one_search(
    settings, fake_model, fake_search
):
    decided(fake_model)
    fake_model.tools_refused = True
    fake_model.replies.insert(0, (PLAN_JSON, "I cannot do that"))
    events = await ask(settings, web())
    assert [q for _, q in fake_search.queries] == [RELEVANT_QUESTION]
    assert "sources" in [e.type for e in events]


async def test_a_model_that_never_says_done_stops_at_the_budget(settings, fake_model, fake_search):
    decided(fake_model)
    fake_model.tool_rounds[:] = [[("web_search", {"query": f"q{i}"})] for i in range(10)]
    events = await ask(settings, web(), research={"balanced_rounds": 3})
    assert len(fake_model.tool_requests()) == 3
    assert [q for _, q in fake_search.queries] == ["q0", "q1", "q2"]
    assert events[-1].data["status"] == "completed"


async def test_a_classifier_that_answers_garbage_falls_back(settings, fake_model, fake_search):
    fake_model.replies.insert(0, (CLASSIFY, '{"skipSearch": "maybe", sources: 7, "question": '))
    events = await ask(settings, web(RELEVANT_QUESTION + " explained", mode="speed"))
    assert [q for _, q in fake_search.queries] == [RELEVANT_QUESTION + " explained"]
    assert "sources" in [e.type for e in events]


async def test_a_pasted_url_is_read_first_and_cited(settings, fake_model, fake_search):
    url = fake_search.base_url + "/pages/5"
    events = await ask(settings, web(f"summarise {url} for me", mode="speed"))
    sources = next(e for e in events if e.type == "sources").data["data"]
    assert sources[0]["metadata"]["url"] == url
    assert "FULLTEXT-5" in fake_model.last_system_prompt()
    (read,) = [s for s in steps(events, "read") if s["status"] == "done"]
    assert read["urls"] == [url]


async def test_no_event_is_larger_than_the_limit(settings, fake_model, fake_search):
    fake_search.extra[:] = [
        {"title": f"big {i}", "url": f"https://example.com/{i}", "snippet": "x" * 20_000}
        for i in range(40)
    ]
    limit = 6000
    settings = settings.replace(stream={"max_event_bytes": limit}, search={"max_results": 48})
    app = create_app(settings)
    with serve(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            async with client.stream(
                "POST", "/api/chat/sse", json=web(mode="speed", chatId="big1")
            ) as response:
                raw = (await response.aread()).decode()
    blocks = [b for b in raw.split("\n\n") if b.strip()]
    assert any('"type":"sources"' in b for b in blocks)
    assert max(len(b.encode()) for b in blocks) <= limit


async def test_the_answer_prompt_fits_the_context(settings, fake_model, fake_search):
    fake_search.extra[:] = [
        {"title": f"long {i}", "url": f"https://example.com/{i}", "snippet": "word " * 2000}
        for i in range(8)
    ]
    fake_model.context_limit = 12_000  # characters: the fake's window
    history = [["human", "earlier " * 600], ["assistant", "answer " * 600]] * 4
    events = await ask(
        settings,
        web(mode="speed", history=history),
        llm={"context_tokens": 4000},
        search={"max_results": 16},
    )
    assert events[-1].type == "messageEnd", events[-1].data
    sent = fake_model.streamed_requests()[-1]["messages"]
    assert sum(len(m["content"]) for m in sent) <= 12_000
    assert "https://example.com/0" in sent[0]["content"]  # trimmed, not dropped wholesale


async def test_cancel_mid_round_closes_the_model_request(settings, fake_model, fake_search):
    decided(fake_model)
    fake_model.tool_delay = 10
    app = create_app(settings)
    with serve(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            async with client.stream("POST", "/api/chat/sse", json=web(chatId="cx1")) as response:
                stream = iter_sse(response)
                await wait_for(_async(lambda: fake_model.tool_streams))
                started = time.monotonic()
                await client.post("/api/chat/cancel", json={"chatId": "cx1", "userId": "1"})
                tail = await rest(stream)
    assert time.monotonic() - started < 2
    assert tail[-1].type == "messageEnd" and tail[-1].data["status"] == "cancelled"
    await wait_for(_async(lambda: fake_model.tool_streams[-1].outcome != "open"))
    assert fake_model.tool_streams[-1].outcome == "client_closed"


async def test_cancel_while_searches_are_in_flight(settings, fake_model, fake_search):
    decided(fake_model)
    fake_search.search_delay = 10
    fake_model.tool_rounds[:] = [[("web_search", {"query": "a"}), ("web_search", {"query": "b"})]]
    app = create_app(settings)
    with serve(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            async with client.stream("POST", "/api/chat/sse", json=web(chatId="cx2")) as response:
                stream = iter_sse(response)
                await wait_for(_async(lambda: len(fake_search.queries) >= 2))
                started = time.monotonic()
                await client.post("/api/chat/cancel", json={"chatId": "cx2", "userId": "1"})
                tail = await rest(stream)
    assert time.monotonic() - started < 2
    assert tail[-1].data["status"] == "cancelled"


async def test_steps_on_every_transport_and_on_resume(settings, fake_model, fake_search):
    decided(fake_model)
    fake_model.tool_rounds[:] = [[("web_search", {"query": "one"})], [("done", {})]]
    app = create_app(settings)
    with serve(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            events = await sse_chat(client, web(chatId="st1", messageId="st2"))
            answer = events[-1].id.split(":")[0]
            async with client.stream(
                "GET",
                "/api/chat/sse/resume",
                params={"chatId": "st1", "userId": "1"},
                headers={"Last-Event-ID": f"{answer}:0"},
            ) as response:
                replayed = [e async for e in iter_sse(response) if not isinstance(e, str)]
            sent = steps(events)
            assert steps(replayed) == sent
            kinds = [s["kind"] for s in sent]
            assert kinds[0] == "classify" and "round" in kinds and "search" in kinds

            # simple format: info events with metadata.step
            fake_model.replies.insert(0, (CLASSIFY, '{"question": "' + RELEVANT_QUESTION + '"}'))
            fake_model.tool_rounds[:] = [[("web_search", {"query": "two"})], [("done", {})]]
            simple = await sse_chat(client, web(format="simple"))
            infos = [e.data for e in simple if e.data["type"] == "info"]
            assert [i["metadata"]["step"]["kind"] for i in infos if "step" in i["metadata"]][
                :1
            ] == ["classify"]

            # WebSocket: the same steps
            fake_model.tool_rounds[:] = [[("web_search", {"query": "three"})], [("done", {})]]
            async with aconnect_ws(server.url + "/api/chat/ws", client) as ws:
                await ws.receive_text()  # open
                await ws.send_text(orjson.dumps(web(chatId="st3")).decode())
                frames = []
                while True:
                    frame = orjson.loads(await ws.receive_text())
                    frames.append(frame)
                    if frame["type"] in ("messageEnd", "error"):
                        break
            ws_steps = [f["step"] for f in frames if f["type"] == "progress" and "step" in f]
            assert [s["kind"] for s in ws_steps] == kinds

            # /v1: as reasoning lines
            fake_model.tool_rounds[:] = [[("web_search", {"query": "four"})], [("done", {})]]
            async with client.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "model": "webSearch:balanced",
                    "stream": True,
                    "messages": [{"role": "user", "content": RELEVANT_QUESTION}],
                },
            ) as response:
                body = (await response.aread()).decode()
    assert "searching the web: four" in body


async def test_a_lone_closing_think_tag_is_split(settings, fake_model):
    app = create_app(settings.replace(llm={"model": "deepseek-r1-distill-qwen"}))
    with serve(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            events = await sse_chat(client, chat_body("explain #lonethink #reasoning=0"))
    assert reasoning_of(events) == "Let me think."
    assert answer_of(events) == "The answer."


async def test_a_model_seen_leaving_the_tag_out_is_split_from_then_on(settings, fake_model):
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            first = await sse_chat(client, chat_body("explain #lonethink #reasoning=0"))
            second = await sse_chat(client, chat_body("again #lonethink #reasoning=0"))
    assert "</think>" not in answer_of(first)
    assert reasoning_of(second) == "Let me think." and answer_of(second) == "The answer."


async def test_sources_keep_the_search_to_their_kinds(settings, fake_model, fake_search):
    events = await ask(settings, web(mode="speed", sources=["academic"]))
    assert "sources" in [e.type for e in events]
    ((_, query),) = fake_search.queries
    assert query == RELEVANT_QUESTION  # tavily: kept to academic sites by include_domains
    body = fake_search.requests[-1][1]
    assert "arxiv.org" in body.get("include_domains", [])


async def test_unknown_sources_are_a_bad_request(client):
    response = await client.post("/api/chat/sse", json=web(sources=["web", "tv"]))
    assert response.status_code == 400 and response.json()["key"] == "BAD_REQUEST"


async def test_steps_replay_identically_on_resume_from_another_process(
    hosts_env, fake_model, fake_search
):
    decided(fake_model)
    fake_model.tool_rounds[:] = [
        [("web_search", {"query": "one"}), ("web_search", {"query": "two"})],
        [("done", {})],
    ]
    with processes(2, hosts_env) as (a, b):
        async with httpx.AsyncClient(timeout=30, event_hooks=USER) as http:
            body = web(chatId="xp1", question=RELEVANT_QUESTION + " #tokens=200 #delay=0.01")
            async with http.stream("POST", a.url + "/api/chat/sse", json=body) as response:
                stream = iter_sse(response)
                head = []
                async for event in stream:
                    if not isinstance(event, str):
                        head.append(event)
                        if event.type == "message" and event.data["data"]:
                            break  # the answer is being written: every step is behind it
                answer = head[-1].id.split(":")[0]
                async with http.stream(
                    "GET",
                    b.url + "/api/chat/sse/resume",
                    params={"chatId": "xp1"},
                    headers={"Last-Event-ID": f"{answer}:0"},
                ) as other:
                    replayed = [e async for e in iter_sse(other) if not isinstance(e, str)]
                tail = await rest(stream)
    assert steps(head) and steps(replayed) == steps(head)
    assert [e.id for e in replayed] == [e.id for e in head + tail]


async def test_a_recency_the_model_asks_for_reaches_the_provider(settings, fake_model, fake_search):
    decided(fake_model)
    fake_model.tool_rounds[:] = [
        [("web_search", {"query": "latest news", "recency": "week"})],
        [("done", {})],
    ]
    await ask(settings, web())
    provider, body = fake_search.requests[-1]
    assert provider == "tavily" and fake_search.queries[-1][1] == "latest news"
    assert body.get("time_range") == "week" or body.get("days") == 7, body
