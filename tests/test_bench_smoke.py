"""Short runs of the benchmarks' load generators (the benchmarks themselves are
`python -m bench.run`, `bench.commit`, `bench.soak`…)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from app.main import create_app
from bench.load import mixed_load, report
from tests.servers import ROOT, free_port, serve, wait_for_port

pytestmark = pytest.mark.anyio


@pytest.fixture
def fast_model():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.fastmodel", "--port", str(port)], cwd=ROOT
    )
    try:
        wait_for_port(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def fast_app(settings, fast_model):
    """The server (in-process, SQLite, no Redis) on the fast fake model, uncapped."""
    return create_app(
        settings.replace(
            llm={"base_url": fast_model + "/v1", "think_tags": "paired"},
            limits={"max_concurrent_generations": 0},
        )
    )


async def test_the_load_generator_runs_a_mixed_load(fast_app):
    with serve(fast_app) as server:
        results = await mixed_load(
            server.url, streams=40, tokens=60, rate=20, stamps=True, ramp_seconds=1.0
        )
    summary = report(results, 60)
    assert summary["complete"] == 40
    assert summary["in_order"] == 1.0
    assert all(r.answer and r.answer[0].startswith("t") for r in results)
    assert 0 < summary["p50_ms"] < 1000


async def test_the_soak_clients_follow_each_transport_and_agree_with_the_store(fast_app):
    import httpx

    from bench.soakload import Answer, Load, judge, saved_answer

    with serve(fast_app) as server:
        load = Load([SimpleNamespace(name="w1", url=server.url)], streams=3, seed=1)
        answers = [
            Answer(kind, str(100 + i), str(10**15 + i), f"s{i}n0", tokens=12)
            for i, kind in enumerate(("sse", "ws", "openai"))
        ]
        await asyncio.gather(*(load.run(a) for a in answers))
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            saved = [await saved_answer(http, a) for a in answers]
    assert [a.end for a in answers] == ["completed"] * 3
    assert [judge(a, s) for a, s in zip(answers, saved, strict=True)] == [[], [], []]
    assert saved[0]["content"] == "".join(f"s0n0.{i} " for i in range(12))
    assert judge(answers[0], saved[1]) == ["mixed: saved", "lost"]


async def test_the_group_commit_bench_measures_a_window(fast_app):
    from bench.commit import carry

    with serve(fast_app) as server:
        measured = await carry(
            server.url,
            None,
            10,
            steady=2.0,
            starts_per_second=50,
            remote_every=0,
            client=None,
            pids=(os.getpid(), None, None),
        )
    assert measured["notes"]["complete"] == 10
    assert measured["notes"]["in_order"]
    assert 0 < measured["values"]["p50_ms"] < 1000
    assert measured["values"]["tokens_per_s"] > 100


@pytest.fixture
def bare_relay(fast_model):
    port = free_port()
    cmd = [sys.executable, "-m", "bench.relay", "--bare", "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--model-url", fast_model + "/v1"], cwd=ROOT)
    try:
        wait_for_port(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


async def test_the_bare_relay_reference_relays_every_token(bare_relay):
    """bench.paced's bare relay (no framework) reads the model's stream and relays each
    token as one SSE event, over connections it keeps alive for the next stream."""
    from bench.paced import run_streams

    for _ in range(2):  # the second round reuses the upstream connections
        assert await run_streams("bare", bare_relay, 5, 30, 200.0) == 150


async def test_the_checkpoint_bench_keeps_the_whole_answer_either_way(tmp_path):
    """Both ways of checkpointing in `bench.checkpoints` leave every row holding the
    whole answer (the bench checks its last one)."""
    from bench.checkpoints import run

    args = SimpleNamespace(answers=5, tokens=4, rounds=10)
    url = f"sqlite:///{tmp_path}/checkpoints.db"
    for mode in ("whole", "added"):
        row = await run(url, mode, args, None)
        assert row["mode"] == mode and row["chars_at_end"] > 40


async def test_the_collector_bench_pushes_every_token_to_its_reader():
    """`bench.collector` writes its answers through the server's own log, each token
    pushed to a caught-up reader."""
    from bench.collector import fill

    logs, per_token = await fill(3, 5)
    assert [len(log.events) for log in logs] == [5, 5, 5] and per_token > 0
    assert [e.data["data"] for e in logs[0].events] == [f" token{n}" for n in range(5)]


async def test_the_fast_model_cuts_a_streamed_answer_at_its_max_tokens(fast_model):
    """As a real model server does: a new chat's title, asked for in a few tokens with
    the question's directives in its prompt, is not streamed as long as the answer."""
    import httpx

    ask = {"stream": True, "messages": [{"role": "user", "content": "#tokens=10"}]}
    async with httpx.AsyncClient(base_url=fast_model + "/v1") as client:
        cut = (await client.post("/chat/completions", json={**ask, "max_tokens": 3})).text
        whole = (await client.post("/chat/completions", json=ask)).text
    assert cut.count('"content":"tok') == 3 and '"finish_reason":"length"' in cut
    assert whole.count('"content":"tok') == 10 and '"finish_reason":"stop"' in whole
