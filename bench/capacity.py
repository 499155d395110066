"""How many paced streams one server carries: concurrent streams (half SSE, half
WebSocket) at 20 tokens a second each, with the added latency of every token
(the fake model's write → the client's read, one clock), for one worker and for
`WEB_CONCURRENCY=2`.

    python -m bench.capacity                                  # ~10 minutes
    python -m bench.capacity --workers 1 --streams 600,800,1000
    python -m bench.capacity --workers 2 --streams 1000,1400

Streams start over `streams / --starts-per-second` seconds and last long enough
for all of them to run together for `--steady` seconds; the latency figures are
of the tokens sent in that window (every stream running), so that a server slow
to start streams cannot look good by never having them all at once. One worker
is pinned to core 0 with the load generator and the fake model on core 1; two
workers get both cores and share them with the load generator and the model
(this machine has two: their CPU is reported beside the server's). The store is a
fresh local PostgreSQL (`--store sqlite` for the embedded default; several
workers writing one SQLite file queue on its lock).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import orjson

from bench.load import StreamResult, percentile, request, sse_stream, ws_stream
from bench.paced import cpu_split
from bench.run import (
    LOAD_CORE,
    RESULTS,
    SERVER_CORE,
    app_server,
    fast_model,
    process,
    redis_server,
)
from tests.conftest import new_database, start_postgres
from tests.servers import free_port

RATE = 20.0  # tokens a second per stream


@contextlib.contextmanager
def bare_relay(model: str) -> Iterator[tuple[str, int]]:
    """`bench.relay --bare` on the server's core: the same wire, the least work."""
    port = free_port()
    cmd = [sys.executable, "-m", "bench.relay", "--bare", "--port", str(port)]
    with process([*cmd, "--model-url", model + "/v1"], port, core=SERVER_CORE) as proc:
        yield f"http://127.0.0.1:{port}", proc.pid


def core_times() -> list[tuple[int, int]]:
    """(busy, all) jiffies of each core so far, from /proc/stat: what every process on
    it used, the other work on this machine included."""
    cores = []
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            ticks = [int(f) for f in fields]
            idle = ticks[3] + ticks[4]  # idle, iowait
            cores.append((sum(ticks[:8]) - idle, sum(ticks[:8])))
    return cores


def core_busy(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> str:
    """How busy each core was between two `core_times`, as "0: 71 %, 1: 98 %"."""
    return ", ".join(
        f"{i}: {(b1 - b0) / max(a1 - a0, 1):.0%}"
        for i, ((b0, a0), (b1, a1)) in enumerate(zip(before, after, strict=True))
    )


async def carry(
    url: str, streams: int, starts_per_second: float, steady: float, sse_only: bool = False
) -> dict:
    ramp = streams / starts_per_second
    tokens = int(RATE * (ramp * 1.5 + steady))
    content = f"#tokens={tokens} #rate={RATE:g} #stamp"

    async def one(i: int) -> StreamResult | None:
        await asyncio.sleep(ramp * i / streams)
        reader = ws_stream if i % 2 and not sse_only else sse_stream
        try:
            return await reader(url, request(content, userId=i + 1), stamps=True)
        except Exception as exc:  # refused (503, 429) or cut: counted, not fatal
            errors.append(str(exc))
            return None

    errors: list[str] = []
    started = time.monotonic()
    results = [r for r in await asyncio.gather(*(one(i) for i in range(streams))) if r]
    elapsed = time.monotonic() - started
    firsts = [r.sent_ns[0] for r in results if r.sent_ns]
    lasts = [r.sent_ns[-1] for r in results if r.sent_ns]
    window = (max(firsts), min(lasts)) if firsts else (0, 0)
    together = [
        latency
        for r in results
        for latency, sent in zip(r.latencies_ms, r.sent_ns, strict=True)
        if window[0] <= sent <= window[1]
    ]
    every = [latency for r in results for latency in r.latencies_ms]
    return {
        "streams": streams,
        "complete": sum(r.tokens == tokens and r.end == "completed" for r in results),
        "failed": sorted(set(errors))[:3],
        "in_order": all(r.seqs == list(range(1, len(r.seqs) + 1)) for r in results),
        "together_s": round(max(window[1] - window[0], 0) / 1e9, 1),
        "p50_ms": round(percentile(together, 0.5), 1),
        "p99_ms": round(percentile(together, 0.99), 1),
        "p99_all_ms": round(percentile(every, 0.99), 1),
        "first_event_p99_ms": round(
            percentile([r.first_event_s * 1000 for r in results if r.first_event_s], 0.99), 1
        ),
        "elapsed_s": elapsed,
        "tokens": sum(r.tokens for r in results),
        "latencies_ms": sorted(together)[:: max(1, len(together) // 2000)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=0, help="1 or 2; both by default")
    parser.add_argument("--streams", default="400,600,800,1000,1200")
    parser.add_argument(
        "--redis",
        action="store_true",
        help="one worker with the Redis hub too (two workers always have it)",
    )
    parser.add_argument(
        "--bare",
        action="store_true",
        help="the bare relay (bench.relay --bare: no framework, nothing kept) in the "
        "server's place, on its core, every stream SSE: the floor of one core",
    )
    parser.add_argument("--starts-per-second", type=float, default=50.0)
    parser.add_argument("--steady", type=float, default=15.0)
    parser.add_argument(
        "--store",
        choices=["sqlite", "postgres"],
        default="postgres",
        help="postgres (a fresh local PostgreSQL 15, as several workers need) or sqlite",
    )
    args = parser.parse_args()
    levels = [int(n) for n in args.streams.split(",")]
    try:  # the load generator on uvloop, as the server: its core is shared with the model
        from uvloop import run as run_loop
    except ImportError:
        run_loop = asyncio.run
    rows = []
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        model = stack.enter_context(fast_model())
        redis = stack.enter_context(redis_server())
        postgres = stack.enter_context(start_postgres()) if args.store == "postgres" else ""
        for workers in [args.workers] if args.workers else [1, 2]:
            store = {"STORE_URL": new_database(postgres)} if postgres else {}
            # the per-process cap on running answers (500 by default) must not refuse them
            store["LIMITS_MAX_GENERATIONS_PER_PROCESS"] = str(2 * max(levels))
            if args.bare:
                os.sched_setaffinity(0, {int(LOAD_CORE)})
                server = bare_relay(model)
            elif workers == 1:
                os.sched_setaffinity(0, {int(LOAD_CORE)})
                hub = {"REDIS_URL": redis} if args.redis else {}
                server = app_server(model, tmp, **store, **hub)
            else:
                os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
                server = app_server(
                    model, tmp, core="0,1", WEB_CONCURRENCY=str(workers), REDIS_URL=redis, **store
                )
            with server as (url, pid):
                time.sleep(2.0)
                for streams in levels:
                    server0, load0 = sum(cpu_split(pid)), time.process_time()
                    load_average = os.getloadavg()[0]
                    cores0 = core_times()
                    row = run_loop(
                        carry(url, streams, args.starts_per_second, args.steady, args.bare)
                    )
                    # the server has core 0; the load generator, the fake model and Redis
                    # core 1: a core 1 near 100 % says the load generator limits the figures
                    row["cores_busy"] = core_busy(cores0, core_times())
                    elapsed = row.pop("elapsed_s")
                    server_s = sum(cpu_split(pid)) - server0
                    # the server's CPU per token delivered: flat when nothing of it grows
                    # with the number of streams
                    row["server_us_per_token"] = round(
                        server_s / max(row.pop("tokens"), 1) * 1e6, 1
                    )
                    row["load_average"] = round(load_average, 2)
                    row["workers"] = "bare" if args.bare else workers
                    row["redis"] = workers > 1 or args.redis
                    row["server_cpu"] = f"{server_s / elapsed:.0%}"
                    row["load_cpu"] = f"{(time.process_time() - load0) / elapsed:.0%}"
                    rows.append(row)
                    print({k: v for k, v in row.items() if k != "latencies_ms"}, flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"capacity-{args.workers or 'both'}{'-redis' if args.redis else ''}.json"
    out.write_bytes(orjson.dumps({"args": vars(args), "rows": rows}))
    print(
        "\n| workers | Redis | streams × 20 tokens/s | all running for | p50 | p99 | first event p99 "
        "| complete, in order | server CPU | server µs per token | load generator CPU "
        "| load average at start | cores busy (any process) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['workers']} | {'yes' if r['redis'] else 'no'} | {r['streams']} | {r['together_s']} s | {r['p50_ms']} ms "
            f"| {r['p99_ms']} ms | {r['first_event_p99_ms']} ms | {r['complete']}/{r['streams']}, "
            f"{'yes' if r['in_order'] else 'NO'} | {r['server_cpu']} | {r['server_us_per_token']} "
            f"| {r['load_cpu']} | {r['load_average']} | {r['cores_busy']} |"
        )
    for workers in sorted({r["workers"] for r in rows}):
        held = [r["streams"] for r in rows if r["workers"] == workers and r["p99_ms"] <= 100]
        print(f"{workers} worker(s): most streams with p99 ≤ 100 ms: {max(held) if held else '—'}")


if __name__ == "__main__":
    sys.exit(main())
