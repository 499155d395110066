"""A real model behind the server: how long each mode waits for its first answer token,
how fast the model writes, and how much of the model server's work was thrown away.

    python -m bench.real_model                      # this checkout
    python -m bench.real_model --app /tmp/main_app  # another one (a folder holding app/
                                                    # and prompts/, e.g. `git archive`)

The model is Gemma 3 270M served by llama.cpp's server on loopback (`tests.real_model`,
built once by `scripts/real_model.sh`), one request at a time (as llama.cpp serves it);
the web is the fake search. For each question the server (`python -m app` in its own
process) gets a new chat: speed mode's first question (long enough for the classifier),
balanced mode, and a plain chat (deepSeek). Reported per question: the time to the first
answer token and to the end, the model server's CPU time while the answer ran and after
it ended until it went idle (the title of a new chat is made then; beyond that it is work
on calls the server had abandoned), and the model's decode speed measured on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.client import SseEvent, iter_sse
from tests.fakes.search import RELEVANT_QUESTION, FakeSearch
from tests.real_model import ALIAS, LlamaServer, start_llama, stop_llama
from tests.servers import ROOT, free_port, serve, wait_for_port

CASES = {
    "speed": {"focusMode": "webSearch", "optimizationMode": "speed"},
    "balanced": {"focusMode": "webSearch", "optimizationMode": "balanced"},
    "plain": {"focusMode": "deepSeek"},
}


def decode_speed(llama: LlamaServer, tokens: int = 96) -> float:
    """Tokens a second the model writes (after its first), streamed, on its own."""
    body = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "Tell me a long story about a river."}],
        "max_tokens": tokens,
        "stream": True,
    }
    chunks, first, last = 0, 0.0, 0.0
    with httpx.stream("POST", llama.url + "/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and '"content"' in line:
                last = time.perf_counter()
                first = first or last
                chunks += 1
    return (chunks - 1) / (last - first) if chunks > 1 and last > first else 0.0


def wait_idle(llama: LlamaServer, limit: float = 120.0) -> float:
    """Wait until the model server is idle; the CPU seconds it used meanwhile."""
    before = llama.cpu_seconds()
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and not llama.idle_after(0.5):
        pass
    return llama.cpu_seconds() - before


async def one(client: httpx.AsyncClient, llama: LlamaServer, case: str, i: int) -> dict[str, float]:
    content = f"{RELEVANT_QUESTION} and why, question {i}" if case != "plain" else "hello there"
    body = {"userId": "1", "message": {"content": content}, **CASES[case]}
    cpu = llama.cpu_seconds()
    started = time.perf_counter()
    first = end = 0.0
    async with client.stream("POST", "/api/chat/sse", json=body) as response:
        async for item in iter_sse(response):
            if not isinstance(item, SseEvent):
                continue
            if item.type == "message" and item.data.get("data") and not first:
                first = time.perf_counter() - started
            if item.type in ("messageEnd", "error"):
                end = time.perf_counter() - started
    during = llama.cpu_seconds() - cpu
    after = await asyncio.to_thread(wait_idle, llama)
    return {"first": first, "end": end, "cpu_during": during, "cpu_after": after}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--app", type=Path, default=ROOT, help="the folder holding app/")
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0, help="llm.timeout_seconds")
    parser.add_argument(
        "--max-output-tokens", type=int, default=128, help="llm.max_output_tokens (where known)"
    )
    args = parser.parse_args()
    search = FakeSearch()
    with (
        tempfile.TemporaryDirectory() as tmp,
        serve(search.app()) as search_server,
    ):
        search.base_url = search_server.url
        llama = start_llama(Path(tmp))
        port = free_port()
        env = {
            **os.environ,
            "APP_CONFIG": "",
            "PORT": str(port),
            "SERVER_HOST": "127.0.0.1",
            "LLM_BASE_URL": llama.url,
            "LLM_API_KEY": "local",
            "LLM_MODEL": ALIAS,
            "LLM_SMALL_MODEL": ALIAS,
            "LLM_TIMEOUT_SECONDS": str(args.timeout),
            "LLM_MAX_OUTPUT_TOKENS": str(args.max_output_tokens),
            "STORE_URL": f"sqlite:///{tmp}/chat.db",
            "COLLECTIONS_URL": f"tantivy:///{tmp}/collections",
            "SEARCH_PROVIDER": "tavily",
            "TAVILY_API_KEY": search.api_key,
            "TAVILY_BASE_URL": search_server.url + "/tavily",
            "READER_PROVIDER": "jina",
            "READER_BASE_URL": search_server.url + "/jina",
            "PYTHONPATH": str(args.app.resolve()),
        }
        server = subprocess.Popen(
            [sys.executable, "-m", "app"],
            cwd=args.app,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for_port(port, timeout=30)
            speed = decode_speed(llama)
            found = asyncio.run(measure(f"http://127.0.0.1:{port}", llama, args.questions))
        finally:
            server.terminate()
            server.wait(10)
            stop_llama(llama)
    print(f"{args.app}: model decode speed {speed:.1f} tokens/s")
    print(f"{'case':<10}{'first token s':>15}{'end s':>9}{'cpu during':>12}{'cpu after':>11}")
    for case, runs in found.items():
        row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"{case:<10}{row['first']:>15.1f}{row['end']:>9.1f}"
            f"{row['cpu_during']:>12.1f}{row['cpu_after']:>11.1f}"
        )


async def measure(
    url: str, llama: LlamaServer, questions: int
) -> dict[str, list[dict[str, float]]]:
    found: dict[str, list[dict[str, float]]] = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for i in range(questions):
            for case in CASES:
                found.setdefault(case, []).append(await one(client, llama, case, i))
    return found


if __name__ == "__main__":
    main()
