"""Events per second through one SSE stream and one WebSocket, against the fake model.

    python -m bench.stream_rate --tokens 20000

Starts the fake model and the server (production settings: uvloop, httptools)
as separate processes on loopback, then reads one long answer over each
transport and prints events/s. Also reads the fake model directly, which is
the ceiling the server is measured against.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
from httpx_ws import aconnect_ws

from tests.servers import free_port, wait_for_port

ROOT = Path(__file__).resolve().parent.parent


def start(cmd: list[str], env: dict[str, str], cpu: str | None) -> subprocess.Popen[bytes]:
    if cpu is not None and sys.platform.startswith("linux"):
        cmd = ["taskset", "-c", cpu, *cmd]
    return subprocess.Popen(cmd, env={**os.environ, **env}, cwd=ROOT)


async def read_sse(url: str, body: dict) -> tuple[int, float]:
    count = 0
    async with httpx.AsyncClient(timeout=120) as client:
        start_t = time.perf_counter()
        async with client.stream("POST", url + "/api/chat/sse", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    count += 1
        return count, time.perf_counter() - start_t


async def read_ws(url: str, body: dict) -> tuple[int, float]:
    count = 0
    async with httpx.AsyncClient(timeout=120) as client:
        async with aconnect_ws(
            url.replace("http", "ws") + "/api/chat/ws", client, max_message_size_bytes=2**20
        ) as ws:
            await ws.receive_text()
            start_t = time.perf_counter()
            await ws.send_text(orjson.dumps(body).decode())
            while True:
                frame = orjson.loads(await ws.receive_text())
                count += 1
                if frame["type"] in ("messageEnd", "error"):
                    return count, time.perf_counter() - start_t


async def read_model(url: str, tokens: int) -> tuple[int, float]:
    body = {
        "model": "m",
        "stream": True,
        "messages": [{"role": "user", "content": f"#tokens={tokens} #reasoning=0"}],
    }
    count = 0
    async with httpx.AsyncClient(
        timeout=120, headers={"authorization": "Bearer test-key"}
    ) as client:
        start_t = time.perf_counter()
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    count += 1
        return count, time.perf_counter() - start_t


async def run(args: argparse.Namespace, app_url: str, model_url: str) -> None:
    body = {
        "userId": "1",
        "focusMode": "deepSeek",
        "message": {"content": f"#tokens={args.tokens} #reasoning=0"},
    }
    for name, reader in (("model direct", None), ("sse", read_sse), ("websocket", read_ws)):
        rates = []
        for _ in range(args.runs):
            if reader is None:
                count, seconds = await read_model(model_url, args.tokens)
            else:
                count, seconds = await reader(app_url, body)
            rates.append(count / seconds)
        rates.sort()
        print(
            f"{name:13s} {count:7d} events  median {rates[len(rates) // 2]:10,.0f} events/s  (runs: {', '.join(f'{r:,.0f}' for r in rates)})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    model_port, app_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            "LLM_BASE_URL": f"http://127.0.0.1:{model_port}/v1",
            "LLM_API_KEY": "test-key",
            "STORE_URL": f"sqlite:///{tmp}/bench.db",
            "PORT": str(app_port),
            "SERVER_HOST": "127.0.0.1",
        }
        model = start(
            [sys.executable, "-m", "tests.fakes.model", "--port", str(model_port)], env, "1"
        )
        server = start([sys.executable, "-m", "app"], env, "0")
        try:
            wait_for_port(model_port)
            wait_for_port(app_port)
            asyncio.run(run(args, f"http://127.0.0.1:{app_port}", f"http://127.0.0.1:{model_port}"))
        finally:
            for proc in (server, model):
                proc.terminate()
                proc.wait(10)


if __name__ == "__main__":
    main()
