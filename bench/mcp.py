"""`/mcp` against the chat API's own SSE: the first progress notification's latency, a
small `ask`'s whole time, and the memory an idle MCP session costs.

    python -m bench.mcp --trials 100 --sessions 1000            # sessions in the process
    python -m bench.mcp --trials 100 --sessions 1000 --redis    # sessions in Redis

Starts the fake model and the fake web (in this process) and one server process
(`python -m app`, and redis-server with --redis). Each trial asks the same small
question once over `/mcp` (`tools/call ask` with a progress token, in an open
session) and once over `POST /api/chat/sse`, and times the first `progress` (a
notification or an event) and the whole answer. Then, after 2,000 `tools/list`
requests have grown the heap to what serving takes, it opens `--sessions` MCP
sessions (`initialize` + `notifications/initialized`) and leaves them idle: the
server's resident memory before and after, per session (and the keys' size in Redis).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis

from tests.conftest import start_redis
from tests.fakes.model import FakeModel
from tests.fakes.search import RELEVANT_QUESTION, FakeSearch
from tests.servers import AppProcess, serve

HEADERS = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
VERSION = "2025-11-25"


def initialize(request_id: int = 1) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "initialize",
        "params": {
            "protocolVersion": VERSION,
            "capabilities": {},
            "clientInfo": {"name": "bench", "version": "1"},
        },
    }


async def open_session(http: httpx.AsyncClient, url: str) -> dict[str, str]:
    opened = await http.post(url + "/mcp", json=initialize(), headers=HEADERS)
    opened.raise_for_status()
    headers = {
        **HEADERS,
        "mcp-session-id": opened.headers["mcp-session-id"],
        "mcp-protocol-version": VERSION,
    }
    done = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    (await http.post(url + "/mcp", json=done, headers=headers)).raise_for_status()
    return headers


async def data_lines(response: httpx.Response) -> Any:
    async for line in response.aiter_lines():
        if line.startswith("data:") and line[5:].strip():
            yield orjson.loads(line[5:])


async def over_mcp(
    http: httpx.AsyncClient, url: str, headers: dict[str, str], n: int
) -> tuple[float, float]:
    """(first progress, whole answer) in seconds, over /mcp."""
    call = {
        "jsonrpc": "2.0",
        "id": n,
        "method": "tools/call",
        "params": {
            "name": "ask",
            "arguments": {"question": RELEVANT_QUESTION},
            "_meta": {"progressToken": n},
        },
    }
    start = time.perf_counter()
    first = 0.0
    async with http.stream("POST", url + "/mcp", json=call, headers=headers) as response:
        async for message in data_lines(response):
            if message.get("method") == "notifications/progress" and not first:
                first = time.perf_counter() - start
            if "result" in message:
                break
    return first, time.perf_counter() - start


async def over_sse(http: httpx.AsyncClient, url: str) -> tuple[float, float]:
    """(first progress, whole answer) in seconds, over /api/chat/sse."""
    body = {"message": {"content": RELEVANT_QUESTION}, "focusMode": "webSearch"}
    start = time.perf_counter()
    first = 0.0
    async with http.stream("POST", url + "/api/chat/sse", json=body) as response:
        async for event in data_lines(response):
            if event.get("type") == "progress" and not first:
                first = time.perf_counter() - start
            if event.get("type") in ("messageEnd", "error"):
                break
    return first, time.perf_counter() - start


def summary(name: str, values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return f"{name:28s} p50 {statistics.median(ms):7.1f} ms   p99 {p99:7.1f} ms   (n={len(ms)})"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def latency(url: str, trials: int) -> None:
    mcp_first, mcp_whole, sse_first, sse_whole = [], [], [], []
    async with httpx.AsyncClient(timeout=60) as http:
        headers = await open_session(http, url)
        for i in range(trials + 5):
            m = await over_mcp(http, url, headers, i + 2)
            s = await over_sse(http, url)
            if i >= 5:  # warm-up
                mcp_first.append(m[0])
                mcp_whole.append(m[1])
                sse_first.append(s[0])
                sse_whole.append(s[1])
    print(summary("first progress, /mcp", mcp_first))
    print(summary("first progress, SSE", sse_first))
    print(summary("whole small ask, /mcp", mcp_whole))
    print(summary("whole small ask, SSE", sse_whole))
    overhead = statistics.median(mcp_whole) - statistics.median(sse_whole)
    print(f"{'/mcp overhead (p50 whole)':28s} {overhead * 1000:+7.1f} ms")


async def sessions(url: str, count: int, pid: int, redis_url: str | None) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        # warm-up: what serving requests at this concurrency grows the heap to, once
        headers = await open_session(http, url)
        listed = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
        for _ in range(40):
            await asyncio.gather(
                *(http.post(url + "/mcp", json=listed, headers=headers) for _ in range(50))
            )
        before = rss_kib(pid)
        keys = redis.Redis.from_url(redis_url) if redis_url else None
        for start in range(0, count, 50):
            await asyncio.gather(*(open_session(http, url) for _ in range(min(50, count - start))))
        await asyncio.sleep(1.0)
        after = rss_kib(pid)
    print(
        f"{count} idle sessions: server RSS {before} → {after} KiB, "
        f"{(after - before) * 1024 / count:.0f} bytes a session"
    )
    if keys:  # used_memory moves with client buffers by more than 1,000 small keys
        sizes = [keys.memory_usage(k) or 0 for k in keys.scan_iter("mcp:session:*")]
        print(
            f"{'':20s}Redis: {len(sizes)} session keys, {sum(sizes) / len(sizes):.0f} bytes"
            " each (MEMORY USAGE)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--redis", action="store_true", help="sessions in Redis")
    args = parser.parse_args()
    model, search = FakeModel(), FakeSearch()
    with (
        tempfile.TemporaryDirectory() as tmp,
        serve(model.app()) as model_server,
        serve(search.app()) as search_server,
        contextlib.ExitStack() as stack,
    ):
        search.base_url = search_server.url
        env = {
            "LLM_BASE_URL": model_server.url + "/v1",
            "LLM_API_KEY": model.api_key,
            "STORE_URL": f"sqlite:///{tmp}/bench.db",
            "SEARCH_PROVIDER": "tavily",
            "TAVILY_API_KEY": search.api_key,
            "TAVILY_BASE_URL": search.base_url + "/tavily",
            "LIMITS_REQUESTS_PER_MINUTE": "0",
        }
        redis_url = None
        if args.redis:
            redis_url = env["REDIS_URL"] = stack.enter_context(start_redis())
        server = AppProcess(env).start()
        try:
            assert server.proc is not None
            print(f"/mcp and SSE, one process, sessions in {'Redis' if args.redis else 'memory'}")
            if args.trials:
                asyncio.run(latency(server.url, args.trials))
            asyncio.run(sessions(server.url, args.sessions, server.proc.pid, redis_url))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
