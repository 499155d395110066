"""The answer's stages on a critical path: speed's first question is searched while the
classifier decides (the search taken, cancelled or made again by what it decides), and
the first round of the modes with rounds is asked meanwhile; a follow-up waits for its
standalone question; a rewrite that nothing searches for does not hold the answer up;
and every stage is a span in `messageEnd.timings` and in the generation's log line. Order is asserted by
the spans the server recorded, never by the wall clock."""

from __future__ import annotations

import logging

import httpx
import orjson
import pytest

from app.main import create_app
from tests.client import chat_body, sse_chat, wait_for
from tests.conftest import USER
from tests.fakes.search import RELEVANT_QUESTION
from tests.servers import serve

pytestmark = pytest.mark.anyio

CLASSIFY = "Standalone question and decision (JSON)"
QUESTION = RELEVANT_QUESTION + " in detail please"  # long enough for the classifier


def web(question: str = QUESTION, mode: str = "speed", **fields):
    return chat_body(question, focusMode="webSearch", optimizationMode=mode, **fields)


def decided(fake_model, **decision):
    body = {"skipSearch": False, "sources": ["web"], "question": QUESTION} | decision
    fake_model.replies.insert(0, (CLASSIFY, orjson.dumps(body).decode()))


def _async(predicate):
    async def check():
        return predicate()

    return check


def timings(events):
    assert events[-1].type == "messageEnd"
    return events[-1].data["timings"]


def spans(events, stage):
    return [t for t in timings(events) if t["stage"] == stage]


def steps(events, kind=None):
    found = [e.data["step"] for e in events if e.type == "progress" and "step" in e.data]
    return [s for s in found if kind is None or s["kind"] == kind]


async def ask(settings, body):
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            return await sse_chat(client, body)


@pytest.mark.parametrize("mode", ["speed", "balanced"])
async def test_what_was_started_ahead_is_cancelled_when_the_classifier_says_skip(
    mode, settings, fake_model, fake_search
):
    decided(fake_model, skipSearch=True, sources=[])
    fake_model.slow_replies[CLASSIFY] = 0.5  # what goes ahead is asked meanwhile
    fake_search.search_delay = fake_model.tool_delay = 30  # in flight when it decides

    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as client:
            events = await sse_chat(client, web(mode=mode))
            if mode == "speed":  # the question's search
                assert [q for _, q in fake_search.queries] == [QUESTION]
                await wait_for(_async(lambda: fake_search.closed == [("tavily", QUESTION)]))
            else:  # the first round's model call
                assert len(fake_model.tool_requests()) == 1 and fake_search.queries == []
                await wait_for(_async(lambda: fake_model.tool_streams[-1].outcome != "open"))
                assert fake_model.tool_streams[-1].outcome == "client_closed"

    assert events[-1].data["status"] == "completed"
    assert "sources" not in [e.type for e in events]
    assert steps(events, "search") == [] and steps(events, "round") == []
    (ahead,) = spans(events, "search" if mode == "speed" else "round")
    assert ahead["speculative"] is True and ahead["dropped"] is True
    assert steps(events, "classify")[0]["skipSearch"] is True


async def test_the_search_ahead_is_the_answers_search_when_the_question_stands(
    settings, fake_model, fake_search
):
    decided(fake_model)
    fake_model.slow_replies[CLASSIFY] = 0.3  # the search comes back first

    events = await ask(settings, web())

    assert [q for _, q in fake_search.queries] == [QUESTION]  # once: taken, not made again
    (ahead,) = spans(events, "search")
    (classified,) = spans(events, "classify")
    assert ahead["speculative"] is True and "dropped" not in ahead
    assert ahead["startMs"] <= classified["startMs"] and ahead["endMs"] < classified["endMs"]
    # on the wire, as before: the classify step, then the search with what it found
    kinds = [s["kind"] for s in steps(events, "classify") + steps(events, "search")]
    assert kinds == ["classify", "search", "search"]
    assert steps(events, "search")[-1] | {"status": "done"} == steps(events, "search")[-1]
    assert steps(events, "search")[-1]["results"] == 8
    types = [e.type for e in events]
    assert types.index("progress") < types.index("sources") < types.index("message")


async def test_a_different_standalone_question_is_searched_again(settings, fake_model, fake_search):
    standalone = "how falcon engines burn methane, in detail"
    decided(fake_model, question=standalone)

    events = await ask(settings, web())

    assert [q for _, q in fake_search.queries][-1] == standalone
    assert [s["query"] for s in steps(events, "search")] == [standalone, standalone]
    assert next(e for e in events if e.type == "rewrited").data["content"] == standalone
    ahead, searched = spans(events, "search")
    assert ahead["speculative"] is True and ahead["dropped"] is True
    assert searched["query"] == standalone and "speculative" not in searched


async def test_a_follow_up_is_not_searched_before_its_standalone_question(
    settings, fake_model, fake_search
):
    standalone = "how falcon engines burn methane, said alone"
    decided(fake_model, question=standalone)
    history = [["human", "which rockets burn methane?"], ["assistant", "Starship does."]]

    events = await ask(settings, web("and how do they burn it?", history=history))

    assert [q for _, q in fake_search.queries] == [standalone]
    assert [t.get("speculative") for t in spans(events, "search")] == [None]


async def test_every_stage_is_a_span_in_message_end_and_the_log(
    settings, fake_model, fake_search, caplog
):
    decided(fake_model)
    fake_model.tool_rounds[:] = [
        [("web_search", {"query": "raptor engine methane"})],
        [("read_url", {"urls": [fake_search.base_url + "/pages/3"]})],
        [("done", {})],
    ]
    caplog.set_level(logging.INFO, logger="app.generation")

    events = await ask(settings, web(mode="balanced"))

    stages = [t["stage"] for t in timings(events)]
    assert stages == [
        "round",  # the first, asked beside the classifier
        "classify",
        "research",
        "search",
        "round",
        "read",
        "round",
        "modelFirstByte",
        "firstToken",
    ]
    assert [t["n"] for t in spans(events, "round")] == [1, 2, 3]
    assert spans(events, "search")[0]["query"] == "raptor engine methane"
    assert spans(events, "read")[0]["pages"] == 1
    for span in timings(events):
        assert 0 <= span["startMs"] <= span["endMs"]
    (model,) = spans(events, "modelFirstByte")
    (first,) = spans(events, "firstToken")
    assert spans(events, "research")[0]["endMs"] <= model["startMs"]
    assert model["endMs"] == first["startMs"] == first["endMs"]
    (line,) = [r for r in caplog.records if r.name == "app.generation"]
    assert [t["stage"] for t in line.fields["timings"]] == stages  # type: ignore[attr-defined]


async def test_a_rewrite_that_nothing_searches_for_does_not_hold_the_answer(
    settings, fake_model, fake_search
):
    fake_model.replies.insert(0, ("Standalone question", "What is the DeepSeek R1 model?"))
    fake_model.slow_replies["Standalone question"] = 0.5
    question = "and what about that model they released last week?"

    events = await ask(settings, chat_body(question))

    (rewrite,) = spans(events, "rewrite")
    (model,) = spans(events, "modelFirstByte")
    assert model["startMs"] < rewrite["endMs"]  # asked before the rewrite came back
    assert [e.data["content"] for e in events if e.type == "rewrited"] == [
        "What is the DeepSeek R1 model?"
    ]
    assert fake_model.streamed_requests()[-1]["messages"][-1]["content"] == question


async def test_the_first_round_asked_ahead_is_the_researchs_first_round(
    settings, fake_model, fake_search
):
    decided(fake_model)
    fake_model.slow_replies[CLASSIFY] = 0.3
    fake_model.tool_rounds[:] = [[("web_search", {"query": "raptor"})], [("done", {})]]

    events = await ask(settings, web(mode="quality"))

    assert len(fake_model.tool_requests()) == 2  # the first round asked once, not again
    assert [q for _, q in fake_search.queries] == ["raptor"]
    first, second = spans(events, "round")
    (classified,) = spans(events, "classify")
    assert first["n"] == 1 and first["speculative"] is True and "dropped" not in first
    assert first["startMs"] <= classified["startMs"] and second["n"] == 2
    assert [s["n"] for s in steps(events, "round") if s["status"] == "done"] == [1, 2]
    assert steps(events, "classify")[0]["status"] == "done"
    assert [s["kind"] for s in steps(events)][:2] == ["classify", "round"]  # as before


async def test_a_follow_up_waits_for_its_standalone_question_before_its_first_round(
    settings, fake_model, fake_search
):
    standalone = "how falcon engines burn methane, said alone"
    decided(fake_model, question=standalone)
    fake_model.tool_rounds[:] = [[("done", {})]]
    history = [["human", "which rockets burn methane?"], ["assistant", "Starship does."]]

    events = await ask(settings, web("and how do they burn it?", mode="balanced", history=history))

    (asked,) = fake_model.tool_requests()
    assert asked["messages"][-1]["content"] == standalone
    assert [t.get("speculative") for t in spans(events, "round")] == [None]


async def test_no_round_is_asked_ahead_when_research_round_ahead_is_off(
    settings, fake_model, fake_search
):
    decided(fake_model)
    fake_model.slow_replies[CLASSIFY] = 0.3
    fake_model.tool_rounds[:] = [[("web_search", {"query": "raptor"})], [("done", {})]]
    settings = settings.replace(research={"round_ahead": False})

    events = await ask(settings, web(mode="quality"))

    (classified,) = spans(events, "classify")
    first, _ = spans(events, "round")
    assert "speculative" not in first and first["startMs"] >= classified["endMs"]
    assert len(fake_model.tool_requests()) == 2


async def test_a_read_goes_on_beside_the_next_round_and_reaches_the_answer(
    settings, fake_model, fake_search
):
    decided(fake_model)
    fake_search.page_delay[3] = 0.5  # still reading when the next round is asked
    fake_model.tool_rounds[:] = [
        [("read_url", {"urls": [fake_search.base_url + "/pages/3"]})],
        [("done", {})],
    ]

    events = await ask(settings, web(mode="balanced"))

    (read,) = spans(events, "read")
    second = spans(events, "round")[-1]
    assert second["n"] == 2 and second["startMs"] < read["endMs"]  # asked while reading
    told = fake_model.tool_requests()[1]["messages"][-1]
    assert told["role"] == "tool" and "still reading" in told["content"]
    assert "FULLTEXT-3" in fake_model.last_system_prompt()  # the answer waited for the page
    assert read["endMs"] <= spans(events, "modelFirstByte")[0]["startMs"]
    assert [s["status"] for s in steps(events, "read")] == ["running", "done"]
