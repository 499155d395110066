"""Cancel latency: cancel request sent → upstream model connection closed.

    python -m bench.cancel_latency --trials 100            # cross-process, through Redis
    python -m bench.cancel_latency --trials 100 --single   # one process, in memory

Starts redis-server, the fake model (in this process, so it can timestamp the
moment its stream is closed) and one or two server processes. Each trial
starts a generation on process A that sends one token and then waits, cancels
it on process B (or A with --single), and measures until the fake model sees
its connection go.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import tempfile
import time

import httpx

from tests.client import SseEvent, iter_sse
from tests.fakes.model import FakeModel
from tests.servers import AppProcess, free_port, serve, wait_for_port


async def trial(
    http: httpx.AsyncClient, model: FakeModel, a: str, b: str, chat_id: int
) -> tuple[float, float]:
    body = {
        "userId": "1",
        "focusMode": "deepSeek",
        "message": {"chatId": str(chat_id), "content": "#hang #reasoning=0"},
    }
    async with http.stream("POST", a + "/api/chat/sse", json=body) as response:
        stream = iter_sse(response)
        async for item in stream:  # wait for the first real token: the model call is in flight
            if isinstance(item, SseEvent) and item.type == "message" and item.data["data"]:
                break
        record = model.streams[-1]
        sent = time.monotonic()
        cancel = await http.post(
            b + "/api/chat/cancel", json={"chatId": str(chat_id), "userId": "1"}
        )
        answered = time.monotonic()
        assert cancel.status_code == 200, cancel.text
        async for _ in stream:
            pass
    await model.wait_stream_end()  # closed_at is stamped when the connection goes
    return record.closed_at - sent, answered - sent


async def run(args: argparse.Namespace, model: FakeModel, a: str, b: str) -> None:
    closed, answered = [], []
    async with httpx.AsyncClient(timeout=30) as http:
        for i in range(args.trials + 5):
            c, r = await trial(http, model, a, b, 10_000 + i)
            if i >= 5:  # warm-up
                closed.append(c * 1000)
                answered.append(r * 1000)
    for name, values in (("upstream closed", closed), ("cancel answered", answered)):
        values.sort()
        p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
        print(
            f"{name:16s} p50 {statistics.median(values):6.1f} ms   p99 {p99:6.1f} ms   max {values[-1]:6.1f} ms   (n={len(values)})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--single", action="store_true", help="one process, in-memory registry")
    args = parser.parse_args()
    model = FakeModel()
    with tempfile.TemporaryDirectory() as tmp, serve(model.app()) as model_server:
        env = {
            "LLM_BASE_URL": model_server.url + "/v1",
            "LLM_API_KEY": model.api_key,
            "STORE_URL": f"sqlite:///{tmp}/bench.db",
        }
        redis_proc = None
        if not args.single:
            port = free_port()
            redis_proc = subprocess.Popen(
                [
                    shutil.which("redis-server") or "redis-server",
                    "--port",
                    str(port),
                    "--save",
                    "",
                    "--bind",
                    "127.0.0.1",
                ],
                stdout=subprocess.DEVNULL,
            )
            wait_for_port(port)
            env["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
        servers = [AppProcess(env).start() for _ in range(1 if args.single else 2)]
        try:
            a, b = servers[0].url, servers[-1].url
            print(
                f"{'single process' if args.single else 'cross-process via Redis'}, {args.trials} cancels"
            )
            asyncio.run(run(args, model, a, b))
        finally:
            for server in servers:
                server.stop()
            if redis_proc is not None:
                redis_proc.terminate()
                redis_proc.wait()


if __name__ == "__main__":
    main()
