"""The Node clients people write against the API: the `openai` npm SDK (Responses API
and chat completions) and the Vercel AI SDK's `@ai-sdk/openai` provider, which calls
`/v1/responses` by default — installed from npm into a cache by
scripts/node_clients.sh, run as a real process against real uvicorn with the fake
model and the fake web."""

from __future__ import annotations

import json
import os
import subprocess

from tests.fakes.search import RELEVANT_QUESTION
from tests.servers import ROOT, npm_packages

ANSWER = "Raptor burns methane [4] with oxygen [1]."


def run_clients(base_url: str) -> dict:
    env = {
        **os.environ,
        "NODE_CLIENTS_HOME": npm_packages("node_clients.sh"),
        "BASE_URL": base_url,
        "QUESTION": RELEVANT_QUESTION,
    }
    done = subprocess.run(
        ["node", str(ROOT / "tests" / "node_clients" / "clients.mjs")],
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
