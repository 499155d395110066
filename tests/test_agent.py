"""The research agent: a classifier before any search, rounds of tool calls within a
budget, a JSON planner for models without tools, pasted URLs, context and event size
limits, cancel mid-round, and every step on the wire."""

from __future__ import annotations

import asyncio
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
    assert fake_search.queries == [] and fake_model.tool_requests() == []  # nothing ahead
    assert "sources" not in [e.type for e in events]
    (step,) = steps(events, "classify")
    assert step["skipSearch"] is True and step["status"] == "done"
    assert events[-1].data["status"] == "completed"


async def test_the_classifier_can_skip_search_for_a_question(settings, fake_model, fake_search):
    decided(fake_model, skipSearch=True, sources=[])
    events = await ask(settings, web("what is 17 times 23, worked out step by step please?"))
    # the first round, asked beside the classifier, was dropped: it searched nothing
    assert fake_search.queries == [] and len(fake_model.tool_requests()) <= 1
    assert steps(events, "round") == []
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


@pytest.mark.parametrize(
    "reply",
    [
        "The latest message is about rockets. Search the web for it.",  # chatter, no JSON
        '{"skipSearch": false, "sources": ["web"], "question": "You decide how a search'
        " assistant answers the user's latest message, before anything is searched.\"}",
    ],
)
async def test_a_classifier_answer_that_is_no_decision_keeps_the_question(
    settings, fake_model, fake_search, reply
):
    fake_model.replies.insert(0, (CLASSIFY, reply))
    question = RELEVANT_QUESTION + " explained"
    events = await ask(settings, web(question, mode="speed"))
    assert [q for _, q in fake_search.queries] == [question]
    assert "rewrited" not in [e.type for e in events]
    assert fake_model.streamed_requests()[-1]["messages"][-1]["content"] == question
    assert events[-1].data["status"] == "completed"


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
    # the searches' requests were closed, not left to run
    await wait_for(_async(lambda: len(fake_search.closed) == 2))
    assert sorted(q for _, q in fake_search.closed) == ["a", "b"]
    assert still_running(tail) == [] and len({s["id"] for s in steps(tail, "search")}) == 2


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


async def test_a_lone_closing_tag_is_split_from_the_first_answer_of_a_fresh_server(
    settings, fake_model
):
    """Neither the name (`fake-chat`) nor the model list says the model leaves the
    opening tag out: its first answer is held back until the tag shows (no `message`
    chunk can be taken back), and split; later answers are split from their start."""
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            first = await sse_chat(client, chat_body("explain #lonethink #reasoning=0"))
            second = await sse_chat(client, chat_body("again #lonethink #reasoning=0"))
    for events in (first, second):
        assert reasoning_of(events) == "Let me think." and answer_of(events) == "The answer."
        kinds = [e.type for e in events if e.type in ("reasoning", "message") and e.data["data"]]
        assert kinds.index("message") > kinds.index("reasoning")  # no reasoning shown as answer


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


# -- every step ends, and every event fits -----------------------------------------------


def still_running(events):
    """The ids of steps that started and never ended."""
    last = {}
    for step in steps(events):
        last[step["id"]] = step["status"]
    return [i for i, status in last.items() if status == "running"]


async def test_every_event_fits_the_limit_on_sse_and_v1(settings, fake_model, fake_search):
    long_urls = [f"{fake_search.base_url}/pages/{n}?{'x' * 2000}" for n in range(3)]
    fake_search.extra[:] = [
        {"title": f"big {i}", "url": f"https://example.com/{i}", "snippet": "x" * 20_000}
        for i in range(40)
    ]
    limit = 6000
    settings = settings.replace(stream={"max_event_bytes": limit}, search={"max_results": 48})
    # one content chunk of 20,000 characters: sent in pieces
    question = RELEVANT_QUESTION + " #tokens=2 #size=20000"
    decided(fake_model, question=question)  # kept: the first round asked ahead is taken
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            fake_model.tool_rounds[:] = [[("read_url", {"urls": long_urls})], [("done", {})]]
            async with client.stream("POST", "/api/chat/sse", json=web(question)) as response:
                raw = (await response.aread()).decode()
            fake_model.tool_rounds[:] = [[("read_url", {"urls": long_urls})], [("done", {})]]
            async with client.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "model": "webSearch:balanced",
                    "stream": True,
                    "messages": [{"role": "user", "content": question}],
                },
            ) as response:
                v1 = (await response.aread()).decode()
    for body in (raw, v1):
        blocks = [b for b in body.split("\n\n") if b.strip()]
        assert max(len(b.encode()) for b in blocks) <= limit, max(map(len, blocks))
    events = [orjson.loads(b.split("data: ", 1)[1]) for b in raw.split("\n\n") if "data: " in b]
    answer = "".join(e["data"] for e in events if e["type"] == "message")
    assert answer == "tok0 ".ljust(20000, "x") + "tok1 ".ljust(20000, "x")  # all of it
    reads = [e["step"] for e in events if e.get("step", {}).get("kind") == "read"]
    assert reads and all(len(orjson.dumps(s)) <= limit // 3 for s in reads)
    assert '"citations"' in v1 and '"search_results"' in v1


async def test_steps_cut_off_by_the_budget_end_as_failed(settings, fake_model, fake_search):
    decided(fake_model)
    fake_search.search_delay = 5.0
    fake_model.tool_rounds[:] = [[("web_search", {"query": "slow"})]] * 3
    events = await ask(settings, web(), research={"balanced_seconds": 1.0})
    assert events[-1].data["status"] == "completed"
    assert still_running(events) == []
    (search,) = [s for s in steps(events, "search") if s["status"] != "running"]
    assert search["status"] == "failed"
    rounds = steps(events, "round")
    assert rounds[-1]["status"] == "failed"  # round 2: out of time, and said so as ended


async def test_a_failing_passage_search_ends_its_step_and_is_logged(settings, caplog):
    from app.chat.tools import Research, Steps, passages
    from app.errors import AppError
    from app.search.web import until_deadline

    class Recording:
        def __init__(self):
            self.events = []

        def emit(self, type, **data):
            self.events.append((type, data))

    async def broken(query):
        raise RuntimeError("index missing")

    async def refused(query):
        raise AppError("the collection engine is away")

    out = Recording()
    loop = asyncio.get_running_loop()
    job = Research("q", Steps(out), ("web",), None, (), None, loop.time() + 5)
    told = await until_deadline(
        [
            passages(job, "collection", "collections", "q", broken),
            passages(job, "files", "your files", "q", refused),
        ],
        loop.time() + 5,
    )
    assert told[0] is None and "failed" in told[1]
    statuses = {}
    for _, data in out.events:
        statuses[data["step"]["id"]] = data["step"]["status"]
    assert sorted(statuses.values()) == ["failed", "failed"]
    assert any("index missing" in str(r.exc_info) for r in caplog.records if r.exc_info)
    assert any("engine is away" in r.getMessage() for r in caplog.records)


# -- the context window ------------------------------------------------------------------


CJK = "燃烧甲烷的火箭发动机在高压下工作，" * 200  # 3,400 characters, about as many tokens


async def test_a_cjk_prompt_fits_the_window_in_balanced_mode(settings, fake_model, fake_search):
    decided(fake_model)
    fake_search.extra[:] = [
        {"title": f"中文 {i}", "url": f"https://example.com/zh/{i}", "snippet": CJK}
        for i in range(8)
    ]
    fake_model.context_tokens = 8000
    fake_model.tool_rounds[:] = [[("web_search", {"query": "甲烷发动机"})], [("done", {})]]
    events = await ask(
        settings,
        web(systemInstructions="Answer in Chinese. " * 100),
        llm={"context_tokens": 8000},
        search={"max_results": 16},
    )
    assert events[-1].type == "messageEnd", events[-1].data
    sent = fake_model.streamed_requests()
    assert len(sent) == 1  # the first prompt fitted: no retry was needed
    system = sent[0]["messages"][0]["content"]
    assert "https://example.com/zh/" in system and "Answer in Chinese." in system


async def test_a_prompt_refused_as_too_long_is_sent_once_more_shorter(
    settings, fake_model, fake_search
):
    fake_search.extra[:] = [
        {"title": f"中文 {i}", "url": f"https://example.com/zh/{i}", "snippet": CJK}
        for i in range(8)
    ]
    fake_model.context_tokens = 8000  # smaller than the window the server is told of
    events = await ask(
        settings, web(mode="speed"), llm={"context_tokens": 16000}, search={"max_results": 16}
    )
    assert events[-1].type == "messageEnd", events[-1].data
    first, second = fake_model.streamed_requests()
    sources = [
        s["metadata"]["url"] for s in next(e for e in events if e.type == "sources").data["data"]
    ]
    assert sources[0] in second["messages"][0]["content"]
    assert len(second["messages"][0]["content"]) < len(first["messages"][0]["content"]) * 0.7
    assert [e.data["data"] for e in events if e.type == "message"][0] == ""  # said once


async def test_an_empty_answer_to_a_long_prompt_is_sent_once_more_shorter(
    settings, fake_model, fake_search
):
    fake_search.extra[:] = [
        {"title": f"中文 {i}", "url": f"https://example.com/zh/{i}", "snippet": CJK}
        for i in range(8)
    ]
    fake_model.context_tokens = 8000
    fake_model.overflow_empty = True  # as llama.cpp's server answers a prompt over its window
    events = await ask(
        settings, web(mode="speed"), llm={"context_tokens": 16000}, search={"max_results": 16}
    )
    assert events[-1].type == "messageEnd", events[-1].data
    first, second = fake_model.streamed_requests()
    assert len(second["messages"][0]["content"]) < len(first["messages"][0]["content"]) * 0.7


@pytest.mark.parametrize("refusal", ["400", "empty", "closed"])
async def test_a_question_longer_than_the_window_ends_with_an_error_naming_it(
    settings, fake_model, fake_search, refusal
):
    fake_model.context_tokens = 2000
    fake_model.overflow_empty = refusal == "empty"  # llama.cpp's server
    fake_model.overflow_closed = refusal == "closed"  # llama-cpp-python's
    events = await ask(settings, chat_body("why? " + CJK, focusMode="deepSeek"))
    error = events[-1]
    assert error.type == "error" and error.data["key"] == "STREAM_ERROR"
    assert "context window" in error.data["data"] and "empty" not in error.data["data"]
    if refusal == "400":
        assert "2000 tokens" in error.data["data"]  # the window the model named


# -- what the model may do -----------------------------------------------------------------


async def test_a_site_the_model_names_stays_within_the_modes_sources(
    settings, fake_model, fake_search
):
    decided(fake_model)
    fake_model.tool_rounds[:] = [
        [
            ("web_search", {"query": "outside", "site": "example.com"}),
            ("web_search", {"query": "inside", "site": "old.reddit.com"}),
        ],
        [("done", {})],
    ]
    await ask(
        settings,
        chat_body(RELEVANT_QUESTION, focusMode="redditSearch", optimizationMode="balanced"),
    )
    domains = {body["query"]: body.get("include_domains") for _, body in fake_search.requests}
    assert domains["outside"] == ["reddit.com"]
    assert domains["inside"] == ["old.reddit.com"]


async def test_a_tool_call_not_offered_is_not_run(settings, fake_model, fake_search):
    decided(fake_model)
    fake_model.tool_rounds[:] = [
        [("launch_rockets", {"query": "secret plan"}), ("academic_search", {"query": "paper"})],
        [("done", {})],
    ]
    # redditSearch: neither tool is offered
    await ask(
        settings,
        chat_body(RELEVANT_QUESTION, focusMode="redditSearch", optimizationMode="balanced"),
    )
    assert [q for _, q in fake_search.queries] == [RELEVANT_QUESTION]  # the plain fallback
    names = {t["function"]["name"] for t in fake_model.tool_requests()[0]["tools"]}
    assert "academic_search" not in names


async def test_files_as_the_only_source_without_files_never_searches_the_web(
    settings, fake_model, fake_search
):
    for mode in ("speed", "balanced"):
        events = await ask(settings, web(mode=mode, sources=["files"]))
        assert events[-1].data["status"] == "completed"
        assert fake_search.queries == [] and fake_model.tool_requests() == []
        assert steps(events, "classify")[0]["skipSearch"] is True


async def test_a_400_about_the_size_is_no_verdict_on_tools(settings, fake_model, fake_search):
    decided(fake_model)
    fake_model.tool_error = (
        "This model's maximum context length is 8192 tokens. However, your messages resulted "
        "in 9000 tokens (8000 in the messages, 1000 in the functions)."
    )
    app = create_app(settings)
    with serve(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            for _ in range(2):
                events = await sse_chat(client, web())
                assert events[-1].data["status"] == "completed"
    assert len(fake_model.tool_requests()) == 2  # still asked with tools the second time
    assert not any(PLAN_JSON in str(r.get("messages")) for r in fake_model.requests)


async def test_calls_without_ids_are_answered_by_the_ids_given_them(
    settings, fake_model, fake_search
):
    decided(fake_model)
    fake_model.tool_ids_empty = True
    fake_model.tool_rounds[:] = [
        [("web_search", {"query": "a"}), ("web_search", {"query": "b"})],
        [("web_search", {"query": "c"})],
        [("done", {})],
    ]
    events = await ask(settings, web())
    assert events[-1].data["status"] == "completed"
    assert sorted(q for _, q in fake_search.queries) == ["a", "b", "c"]
    assert len(fake_model.tool_requests()) == 3
    assert not any(PLAN_JSON in str(r.get("messages")) for r in fake_model.requests)


# -- pasted pages, files, collections, excluded domains --------------------------------------


async def collection_of(client, text: bytes) -> str:
    """A new collection of user "1" holding one document, indexed."""
    made = await client.post("/api/collections", json={"name": "notes", "userId": "1"})
    collection = made.json()["collection"]["id"]
    added = await client.post(
        f"/api/collections/{collection}/documents",
        files=[("files", ("raptor.md", text))],
        params={"userId": "1"},
    )
    progress = f"/api/collections/{collection}/imports/{added.json()['import']['id']}"

    async def indexed():
        answer = (await client.get(progress, params={"userId": "1"})).json()
        return answer["done"] == answer["total"]

    await wait_for(indexed, timeout=60)
    return collection


async def test_a_pasted_page_stays_first_beside_files_and_collections(
    settings, fake_model, fake_search
):
    url = fake_search.base_url + "/pages/5"
    app = create_app(settings.replace(embeddings={"model": ""}))
    with serve(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as client:
            notes = b"# Notes\n\nFalcon engines burn methane, say the notes."
            uploaded = await client.post("/api/uploads", files={"files": ("notes.md", notes)})
            file_id = uploaded.json()["files"][0]["fileId"]
            collection = await collection_of(client, b"# Falcon\n\nFalcon engines burn methane.")
            question = f"how do falcon engines burn methane, as {url} says"
            events = await sse_chat(
                client, web(question, mode="speed", files=[file_id], collections=[collection])
            )
    sources = next(e for e in events if e.type == "sources").data["data"][:-1]
    assert sources[0]["metadata"]["url"] == url
    assert any(s["metadata"].get("fileId") for s in sources)
    assert any(s["metadata"].get("collectionId") for s in sources)
    assert "source 1 " + url in fake_model.last_system_prompt()


async def test_a_pasted_page_does_not_stop_the_mode_from_reading(settings, fake_model, fake_search):
    url = fake_search.base_url + "/pages/5"
    decided(fake_model, urls=[url], question=f"{RELEVANT_QUESTION} {url}")
    fake_model.tool_rounds[:] = [[("web_search", {"query": "methane"})], [("done", {})]]
    await ask(settings, web(f"{RELEVANT_QUESTION} {url}"))
    system = fake_model.last_system_prompt()
    assert "source 1 " + url in system and "FULLTEXT-5" in system
    assert "FULLTEXT-3" in system  # balanced read the best result, as without a pasted page


async def test_collection_passages_the_agent_found_are_not_searched_twice(
    settings, fake_model, fake_search
):
    app = create_app(settings.replace(embeddings={"model": ""}))
    with serve(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as client:
            collection = await collection_of(client, b"# Raptor\n\nRaptor burns METHANE-FACT.")
            fake_model.tool_rounds[:] = [
                [("search_collection", {"query": "raptor methane"})],
                [("done", {})],
            ]
            body = chat_body(
                "compare raptor engines", focusMode="deepResearch", collections=[collection]
            )
            events = await sse_chat(client, body)
    sources = next(e for e in events if e.type == "sources").data["data"][:-1]
    passages = [s for s in sources if s["metadata"].get("collectionId")]
    assert len(passages) == 1
    progress = [e.data["data"] for e in events if e.type == "progress"]
    assert "searching your collections" not in progress  # the agent searched them itself
    assert fake_model.last_system_prompt().count("METHANE-FACT") == 1


async def test_excluded_domains_are_never_read(settings, fake_model, fake_search):
    decided(fake_model)
    port = fake_search.base_url.rsplit(":", 1)[1]
    excluded = f"http://localhost:{port}/pages/4"
    fake_model.tools_refused = True
    plans = iter(
        [orjson.dumps({"calls": [{"tool": "read_url", "args": {"urls": [excluded]}}]}).decode()]
    )
    fake_model.replies.insert(0, (PLAN_JSON, lambda _p: next(plans, '{"done": true}')))
    pasted = f"http://localhost:{port}/pages/6"
    events = await ask(
        settings,
        web(f"{RELEVANT_QUESTION} see {pasted}", search={"domains": ["-localhost"]}),
    )
    assert events[-1].data["status"] == "completed"
    assert fake_search.pages_read == [] or all(n not in (4, 6) for _, n in fake_search.pages_read)
    sources = next(e for e in events if e.type == "sources").data["data"]
    assert not any("localhost" in s["metadata"]["url"] for s in sources)
    refused = [s for s in steps(events, "read") if s["status"] == "failed"]
    assert {u for s in refused for u in s["urls"]} == {excluded, pasted}
    texts = [e.data["data"] for e in events if e.type == "progress"]
    assert any("excluded by the request's domains" in t for t in texts)


# -- deadlines -----------------------------------------------------------------------------


async def test_the_json_planner_gets_a_round_of_its_own(settings, fake_model, fake_search):
    decided(fake_model)
    fake_model.tools_refused = True
    fake_model.tool_delay = 2.5  # the refusal comes late: half a second is left of the round
    plans = iter(['{"calls": [{"tool": "web_search", "args": {"query": "json plan"}}]}'])
    fake_model.replies.insert(0, (PLAN_JSON, lambda _p: next(plans, '{"done": true}')))
    fake_model.slow_replies[PLAN_JSON] = 1.5
    events = await ask(settings, web(), research={"round_seconds": 3.0})
    assert events[-1].data["status"] == "completed"
    assert ("tavily", "json plan") in fake_search.queries


async def test_a_planner_past_its_deadline_says_which_one(
    settings, fake_model, fake_search, caplog
):
    decided(fake_model)
    fake_model.tools_refused = True
    fake_model.slow_replies[PLAN_JSON] = 30
    with caplog.at_level("INFO", logger="app.research"):
        events = await ask(settings, web(), research={"round_seconds": 1.0})
    assert events[-1].data["status"] == "completed"
    assert [q for _, q in fake_search.queries] == [RELEVANT_QUESTION]  # the plain fallback
    assert "no plan within research.round_seconds (1 s)" in caplog.text
    await wait_for(_async(lambda: PLAN_JSON in fake_model.replies_closed))


async def test_the_small_models_pick_does_not_outlast_the_budget(settings, fake_model, fake_search):
    decided(fake_model)
    fake_model.tool_rounds[:] = [[("web_search", {"query": "methane"})], [("done", {})]]
    fake_model.slow_replies["Question:"] = 30  # the quality pick (prompts/web_search_select.txt)
    started = time.monotonic()
    events = await ask(settings, web(mode="quality"), research={"quality_seconds": 2.0})
    assert time.monotonic() - started < 4
    assert events[-1].data["status"] == "completed"
    assert "sources" in [e.type for e in events]


async def test_the_classifier_is_given_a_bounded_conversation(settings, fake_model, fake_search):
    decided(fake_model)
    history = [["human", "q" * 5000], ["assistant", "a" * 5000]] * 10
    await ask(settings, web(history=history))
    (asked,) = [r for r in fake_model.requests if CLASSIFY in str(r.get("messages"))]
    assert len(asked["messages"][0]["content"]) < 10_000


async def test_a_hanging_tool_round_ends_at_round_seconds(settings, fake_model, fake_search):
    decided(fake_model)
    fake_model.tool_delay = 30
    started = time.monotonic()
    events = await ask(settings, web(), research={"round_seconds": 1.0})
    assert time.monotonic() - started < 3
    assert events[-1].data["status"] == "completed"
    assert [q for _, q in fake_search.queries] == [RELEVANT_QUESTION]
    assert steps(events, "round")[-1]["status"] == "failed"
    await wait_for(_async(lambda: fake_model.tool_streams[-1].outcome != "open"))
    assert fake_model.tool_streams[-1].outcome == "client_closed"


async def test_a_slow_classifier_falls_back_at_classify_seconds(settings, fake_model, fake_search):
    fake_model.slow_replies[CLASSIFY] = 30
    question = RELEVANT_QUESTION + " in detail"
    started = time.monotonic()
    events = await ask(settings, web(question, mode="speed"), research={"classify_seconds": 0.5})
    assert time.monotonic() - started < 2.5
    assert [q for _, q in fake_search.queries] == [question]  # the question as asked
    assert "sources" in [e.type for e in events]
    await wait_for(_async(lambda: fake_model.replies_closed))


# -- cancel with each kind of call in flight -------------------------------------------------


async def _cancel_when(settings, chat_id, ready, **fields):
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            async with client.stream(
                "POST", "/api/chat/sse", json=web(chatId=chat_id, **fields)
            ) as response:
                stream = iter_sse(response)
                await wait_for(_async(ready))
                started = time.monotonic()
                await client.post("/api/chat/cancel", json={"chatId": chat_id, "userId": "1"})
                tail = await rest(stream)
    assert time.monotonic() - started < 2
    assert tail[-1].type == "messageEnd" and tail[-1].data["status"] == "cancelled"
    return tail


async def test_cancel_closes_a_read_in_flight(settings, fake_model, fake_search):
    decided(fake_model)
    fake_search.page_delay[2] = 10
    fake_model.tool_rounds[:] = [[("read_url", {"urls": [fake_search.base_url + "/pages/2"]})]]
    tail = await _cancel_when(settings, "cr1", lambda: 2 in fake_search.pages_asked)
    await wait_for(_async(lambda: ("page", 2) in fake_search.closed))
    assert fake_search.pages_read == []
    assert still_running(tail) == [] and steps(tail, "read")[-1]["status"] == "failed"


async def test_cancel_closes_the_json_planner_in_flight(settings, fake_model, fake_search):
    decided(fake_model)
    fake_model.tools_refused = True
    fake_model.slow_replies[PLAN_JSON] = 10
    await _cancel_when(
        settings,
        "cp1",
        lambda: any(PLAN_JSON in str(r.get("messages")) for r in fake_model.requests),
    )
    await wait_for(_async(lambda: PLAN_JSON in fake_model.replies_closed))
    assert fake_search.queries == []


# -- steps after the fact ----------------------------------------------------------------------


async def test_steps_are_in_the_same_order_on_every_format(settings, fake_model, fake_search):
    fake_search.page_delay[1] = 0.5  # read beside the next round: it ends after that round

    def script():
        decided(fake_model)
        fake_model.tool_rounds[:] = [
            [
                ("web_search", {"query": "same"}),
                ("read_url", {"urls": [fake_search.base_url + "/pages/1"]}),
            ],
            [("done", {})],
        ]

    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            script()
            sse = await sse_chat(client, web(chatId="so1"))
            script()
            simple = await sse_chat(client, web(format="simple"))
            script()
            async with client.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "model": "webSearch:balanced",
                    "stream": True,
                    "messages": [{"role": "user", "content": RELEVANT_QUESTION}],
                },
            ) as response:
                v1 = (await response.aread()).decode()
            chat = (await client.get("/api/chats/so1")).json()
    lines = [e.data["data"] for e in sse if e.type == "progress" and "step" in e.data]
    order = [(s["id"], s["status"]) for s in steps(sse)]
    assert len(order) >= 7  # classify, a round, a search and a read, each started and ended
    infos = [e.data for e in simple if e.data["type"] == "info" and "step" in e.data["metadata"]]
    assert [(i["metadata"]["step"]["id"], i["metadata"]["step"]["status"]) for i in infos] == order
    assert [i["content"] for i in infos] == lines
    thinking = "".join(
        (chunk["choices"][0]["delta"].get("reasoning_content") or "")
        for chunk in (orjson.loads(b[6:]) for b in v1.split("\n\n") if b.startswith("data: {"))
        if chunk.get("choices")
    )
    assert thinking.split("\n")[: len(lines)] == lines
    # reopened: the answer's progress lines, in order
    answer = chat["messages"][-1]
    assert answer["steps"] == [e.data["data"] for e in sse if e.type == "progress"]


async def test_speed_spends_its_configured_rounds(settings, fake_model, fake_search):
    fake_model.tool_rounds[:] = [[("web_search", {"query": "quick"})], [("done", {})]]
    events = await ask(settings, web(mode="speed"), research={"speed_rounds": 2})
    assert len(fake_model.tool_requests()) == 2
    assert [q for _, q in fake_search.queries] == ["quick"]
    assert [s["of"] for s in steps(events, "round")][:1] == [2]
