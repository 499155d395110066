"""The Node clients people write against the API: the `openai` npm SDK (Responses API
and chat completions) and the Vercel AI SDK's `@ai-sdk/openai` provider, which calls
`/v1/responses` by default — installed from npm into a cache by
scripts/node_clients.sh, run as a real process against real uvicorn with the fake
model and the fake web."""

from __future__ import annotations

import json
import os
import subprocess

from app.main import create_app
from tests.fakes.search import RELEVANT_QUESTION
from tests.servers import ROOT, npm_packages, serve

ANSWER = "Raptor burns methane [4] with oxygen [1]."


def run_clients(
    base_url: str, script: str = "clients.mjs", question: str = RELEVANT_QUESTION
) -> dict:
    env = {
        **os.environ,
        "NODE_CLIENTS_HOME": npm_packages("node_clients.sh"),
        "BASE_URL": base_url,
        "QUESTION": question,
    }
    done = subprocess.run(
        ["node", str(ROOT / "tests" / "node_clients" / script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_the_node_clients_get_answers_sources_reasoning_and_usage(server, fake_model, fake_search):
    fake_model.answer_text = ANSWER
    got = run_clients(server.url + "/v1")
    cited = [f"{fake_search.base_url}/pages/{n}" for n in (3, 0)]

    whole = got["openaiResponse"]
    assert whole["status"] == "completed" and whole["text"] == ANSWER
    assert whole["types"] == ["web_search_call", "reasoning", "message"]
    assert [a["url"] for a in whole["annotations"]] == cited
    assert [ANSWER[a["start_index"] : a["end_index"]] for a in whole["annotations"]] == [
        "[4]",
        "[1]",
    ]
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 2

    stream = got["openaiStream"]
    assert stream["text"] == ANSWER
    assert stream["numbers"] == list(range(len(stream["types"])))
    assert stream["types"][:2] == ["response.created", "response.in_progress"]
    assert stream["types"][-1] == "response.completed"

    assert got["openaiFollowUp"]["status"] == "completed"
    assert got["openaiFollowUp"]["previous"].startswith("resp_")
    assert got["openaiError"]["status"] == 404
    assert got["openaiCompletion"]["text"] == ANSWER
    assert len(got["openaiCompletion"]["citations"]) == 8

    for vercel in (got["vercelGenerate"], got["vercelStream"]):
        assert vercel["reasoning"] == "why0 why1 "
        assert vercel["sources"] == cited
        assert vercel["finishReason"] == "stop"
    assert got["vercelGenerate"]["text"] == ANSWER == got["vercelStream"]["text"]
    assert got["vercelGenerate"]["usage"]["outputTokenDetails"]["reasoningTokens"] == 2
    parts = got["vercelStream"]["parts"]
    assert "error" not in parts and parts[-1] == "finish"
    assert parts.index("reasoning-start") < parts.index("text-start")


def test_fetch_event_source_gets_no_message_without_data_in_an_answer_and_a_resume(
    settings, fake_model
):
    """`@microsoft/fetch-event-source` hands every blank-line-ended block to `onmessage`,
    where clients `JSON.parse` the data: `retry:` and the pings mid-answer must not reach it."""
    quick_pings = settings.replace(server={"keepalive_seconds": 0.1})
    with serve(create_app(quick_pings)) as server:
        got = run_clients(server.url, "fetch_event_source.mjs", "slow #tokens=4 #delay=0.3")
    answer, resume = got["answer"], got["resume"]
    assert answer["status"] == 200 and answer["errors"] == []
    types = [event["type"] for event in answer["events"]]
    assert types[-1] == "messageEnd" and types.count("messageEnd") == 1
    text = "".join(e["data"] for e in answer["events"] if e["type"] == "message")
    assert text == "tok0 tok1 tok2 tok3 "
    seqs = [int(i.rsplit(":", 1)[1]) for i in answer["ids"]]
    assert seqs == list(range(1, len(seqs) + 1))
    assert resume["status"] == 200 and resume["errors"] == []
    assert resume["events"] == answer["events"][2:]
    assert resume["ids"] == answer["ids"][2:]
