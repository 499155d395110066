"""The benchmark suite: how many streams, how fast, how cheap.

    python -m bench.run                 # ~5 minutes; the table, and bench/results/run.json
    python -m bench.run --only throughput,ttfe --runs 5

The server runs as `python -m app` (uvloop, httptools: the production
settings) pinned to core 0; this load generator and the fast fake model
(`bench/fastmodel.py`) share core 1. Redis is started for the scenarios that
need it. Each figure is the median of `--runs` runs where it says so.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
from websockets.asyncio.client import connect as ws_connect

from bench.load import mixed_load, percentile, request, sse_stream, ws_stream
from tests.servers import free_port, wait_for_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SERVER_CORE, LOAD_CORE = "0", "1"


# -- processes ---------------------------------------------------------------------------


def stop_on_sigterm() -> None:
    """SIGTERM as Ctrl-C: a bench that is stopped stops every process it started on the
    way out (each is a context manager)."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _pinned(cmd: list[str], core: str) -> list[str]:
    return (
        ["taskset", "-c", core, *cmd]
        if shutil.which("taskset") and (os.cpu_count() or 1) > 1
        else cmd
    )


@contextmanager
def process(
    cmd: list[str],
    port: int,
    env: dict[str, str] | None = None,
    core: str = LOAD_CORE,
    cwd: Path = ROOT,
) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        _pinned(cmd, core),
        env={**os.environ, **(env or {})},
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, timeout=30)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def fast_model() -> Iterator[str]:
    port = free_port()
    with process([sys.executable, "-m", "bench.fastmodel", "--port", str(port)], port):
        yield f"http://127.0.0.1:{port}"


@contextmanager
def redis_server(core: str = LOAD_CORE) -> Iterator[str]:
    port = free_port()
    binary = shutil.which("redis-server") or "redis-server"
    with process(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        port,
        core=core,
    ):
        yield f"redis://127.0.0.1:{port}/0"


@contextmanager
def app_server(
    model_url: str, store_dir: str, core: str = SERVER_CORE, root: Path = ROOT, **env: str
) -> Iterator[tuple[str, int]]:
    """`python -m app` on a free port; `root` is the checkout it runs from (another
    worktree for an older server: its `app/` and `config.toml`)."""
    port = free_port()
    settings = {
        "LLM_BASE_URL": model_url + "/v1",
        "LLM_API_KEY": "bench",
        "STORE_URL": f"sqlite:///{store_dir}/bench-{port}.db",
        "PORT": str(port),
        "SERVER_HOST": "127.0.0.1",
        "LIMITS_MAX_CONCURRENT_GENERATIONS": "0",
        "LIMITS_WS_MESSAGES_PER_SECOND": "0",
        "APP_CONFIG": "",
        # the fast model's text has no <think> tags: its first answers are not held back
        "LLM_THINK_TAGS": "paired",
        # answers as long as a bench asks (the fast model cuts a request at its max_tokens)
        "LLM_MAX_OUTPUT_TOKENS": "0",
        # the small model's calls (a new chat's title, after its answer) are given a
        # short call's max_tokens, not a reasoning model's 4,096 more: the fast model
        # would stream a title as long as the answer, beside the next answers
        "LLM_SMALL_MODEL": "fast",
        **env,
    }
    if root != ROOT:  # its bytecode kept out of that checkout
        settings["PYTHONPATH"] = str(root)
        settings.setdefault("PYTHONPYCACHEPREFIX", tempfile.gettempdir() + "/bench-pycache")
    with process([sys.executable, "-m", "app"], port, settings, core=core, cwd=root) as proc:
        yield f"http://127.0.0.1:{port}", proc.pid


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its children so far (the server's own pid is
    the python under taskset's exec)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


# -- scenarios ---------------------------------------------------------------------------


async def throughput(
    url: str, pid: int, model: str, runs: int, tokens: int, streams: int
) -> dict[str, dict[str, float]]:
    """Tokens/s delivered with the model as fast as it can, `streams` at once per transport."""
    out: dict[str, dict[str, float]] = {}
    openai_body = orjson.dumps(
        {
            "model": "m",
            "stream": True,
            "messages": [{"role": "user", "content": f"#tokens={tokens}"}],
        }
    )
    for name in ("raw", "sse", "ws"):
        rates, cpus = [], []
        for _ in range(runs):
            cpu0, t0 = cpu_seconds(pid), time.perf_counter()
            if name == "raw":
                results = await asyncio.gather(
                    *(
                        sse_stream(
                            model, {}, parse=False, path="/v1/chat/completions", payload=openai_body
                        )
                        for _ in range(streams)
                    )
                )
                delivered = (
                    sum(r.events for r in results) - 2 * streams
                )  # the finish chunk and [DONE]
            else:
                reader = sse_stream if name == "sse" else ws_stream
                results = await asyncio.gather(
                    *(
                        reader(url, request(f"#tokens={tokens}", userId=i + 1), parse=False)
                        for i in range(streams)
                    )
                )
                delivered = (
                    sum(r.events for r in results) - 2 * streams
                )  # message "" and messageEnd
            seconds = time.perf_counter() - t0
            rates.append(delivered / seconds)
            cpus.append((cpu_seconds(pid) - cpu0) / max(delivered, 1) * 1e6)
        out[name] = {
            "tokens_per_s": statistics.median(rates),
            "cpu_us_per_token": statistics.median(cpus),
        }
    return out


async def concurrent(
    url: str, streams: int, tokens: int, rate: float, ramp: float = 3.0
) -> dict[str, float]:
    """`streams` at once, started over `ramp` seconds; latency percentiles over all
    tokens, and over the steady part (tokens sent once every stream had started)."""
    started_ns = time.time_ns()
    results = await mixed_load(url, streams, tokens, rate, stamps=True, ramp_seconds=ramp)
    steady_from = started_ns + int((ramp + 0.5) * 1e9)
    steady = [
        x
        for r in results
        for x, sent in zip(r.latencies_ms, r.sent_ns, strict=True)
        if sent >= steady_from
    ]
    latencies = [x for r in results for x in r.latencies_ms]
    in_order = all(r.seqs == list(range(1, len(r.seqs) + 1)) for r in results)
    complete = sum(r.tokens == tokens and r.end == "completed" for r in results)
    return {
        "streams": streams,
        "complete": complete,
        "in_order": in_order,
        "p50_ms": percentile(latencies, 0.5),
        "p99_ms": percentile(latencies, 0.99),
        "max_ms": max(latencies) if latencies else float("nan"),
        "latencies": latencies,
        "steady_p50_ms": percentile(steady, 0.5),
        "steady_p99_ms": percentile(steady, 0.99),
        "steady_tokens": len(steady),
        "ramp_s": ramp,
    }


async def idle_memory(url: str, pid: int, count: int) -> dict[str, float]:
    """RSS per open connection: half WebSockets that only opened, half SSE streams
    whose model has not answered yet."""
    await asyncio.sleep(1)
    base = rss_kb(pid)
    sockets = []
    for _ in range(count // 2):
        ws = await ws_connect(url.replace("http", "ws", 1) + "/api/chat/ws", compression=None)
        await ws.recv()
        sockets.append(ws)
    after_ws = rss_kb(pid)
    waiting = []
    for i in range(count // 2):
        reader = sse_stream(
            url, request("#wait=120 #tokens=1", userId=i + 1), parse=False, stop_after=1
        )
        waiting.append(asyncio.create_task(reader))
        if i % 100 == 99:
            await asyncio.sleep(0.2)
    await asyncio.sleep(3)
    after_sse = rss_kb(pid)
    for ws in sockets:
        await ws.close()
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    return {
        "connections": count,
        "ws_kb_each": (after_ws - base) / (count // 2),
        "sse_kb_each": (after_sse - after_ws) / (count // 2),
        "all_kb_each": (after_sse - base) / count,
        "rss_mb": after_sse / 1024,
    }


async def time_to_first_event(url: str, count: int) -> dict[str, float]:
    times = []
    for i in range(count):
        result = await sse_stream(url, request("hi #tokens=1", userId=i + 1), parse=False)
        times.append(result.first_event_s * 1000)
    return {"p50_ms": statistics.median(times), "p99_ms": percentile(times, 0.99)}


async def resume_trials(a: str, b: str, trials: int, tokens: int) -> dict[str, int]:
    gaps = duplicates = wrong = 0
    expected = "".join(f"tok{i} " for i in range(tokens))
    for trial in range(trials):
        body = request(f"#tokens={tokens} #rate=2000")
        head = await sse_stream(a, body, stop_after=random.randint(2, tokens - 50))
        last_id = f"{head.answer_id}:{head.seqs[-1]}"
        path = f"/api/chat/sse/resume?chatId={body['message']['chatId']}&userId={body['userId']}"
        tail = await sse_stream(b, {}, path=path, headers={"Last-Event-ID": last_id})
        seqs = head.seqs + tail.seqs
        gaps += sum(1 for x, y in zip(seqs, seqs[1:], strict=False) if y > x + 1)
        duplicates += len(seqs) - len(set(seqs))
        wrong += "".join(head.answer + tail.answer) != expected or tail.end != "completed"
        if trial % 10 == 9:
            await asyncio.sleep(0.1)
    return {"trials": trials, "gaps": gaps, "duplicates": duplicates, "wrong_answers": wrong}


async def redis_cost(
    url: str, redis_url: str, streams: int, tokens: int, rate: float
) -> dict[str, float]:
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    before = await _calls(client)
    results = await mixed_load(url, streams, tokens, rate, stamps=False, ramp_seconds=1.0)
    await asyncio.sleep(1.0)
    after = await _calls(client)
    await client.aclose()
    generated = sum(r.tokens for r in results)
    by_command = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    total = sum(by_command.values())
    return {
        "streams": streams,
        "tokens": generated,
        "commands": total,
        "per_token": total / max(generated, 1),
        "rate": rate,
        "answer_tokens": tokens,
        "by_command": dict(sorted(by_command.items(), key=lambda kv: -kv[1])),
    }


async def _calls(client) -> dict[str, int]:
    """Calls per command so far, leaving out what measuring costs (INFO)."""
    stats = await client.info("commandstats")
    return {
        k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items() if not k.endswith("info")
    }


def cancel_latency(trials: int) -> str:
    lines = []
    for flag in ([], ["--single"]):
        out = subprocess.run(
            [sys.executable, "-m", "bench.cancel_latency", "--trials", str(trials), *flag],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        ).stdout
        lines.extend(
            line for line in out.splitlines() if "upstream closed" in line or "process" in line
        )
    return "\n".join(lines)


# -- the run -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only",
        default="throughput,memory,ttfe,cancel,resume,redis",
        help="also: concurrent (a quick look; bench.capacity measures it properly)",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--connections", type=int, default=5000)
    args = parser.parse_args()
    wanted = set(args.only.split(","))
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {int(LOAD_CORE)})
    RESULTS.mkdir(parents=True, exist_ok=True)
    results: dict[str, object] = {}
    try:
        from uvloop import run as run_loop
    except ImportError:
        run_loop = asyncio.run
    with tempfile.TemporaryDirectory() as tmp, fast_model() as model:
        if wanted & {"throughput", "concurrent", "memory", "ttfe"}:
            with app_server(model, tmp) as (url, pid):
                if "ttfe" in wanted:
                    results["ttfe"] = run_loop(time_to_first_event(url, 200 * args.runs))
                    print("time to first event", results["ttfe"])
                if "throughput" in wanted:
                    results["throughput"] = run_loop(
                        throughput(url, pid, model, args.runs, 20000, 4)
                    )
                    print("throughput", results["throughput"])
                if "concurrent" in wanted:
                    results["concurrent"] = run_loop(concurrent(url, args.streams, 200, 20))
                    print(
                        "concurrent",
                        {k: v for k, v in results["concurrent"].items() if k != "latencies"},
                    )
                if "memory" in wanted:
                    results["memory"] = run_loop(idle_memory(url, pid, args.connections))
                    print("memory", results["memory"])
        if wanted & {"resume", "redis"}:
            with (
                redis_server() as redis_url,
                app_server(model, tmp, REDIS_URL=redis_url) as (a, _),
                app_server(model, tmp, REDIS_URL=redis_url) as (b, _),
            ):
                if "resume" in wanted:
                    results["resume"] = run_loop(resume_trials(a, b, 100, 1000))
                    print("resume", results["resume"])
                if "redis" in wanted:
                    results["redis"] = {
                        "slow": run_loop(redis_cost(a, redis_url, 200, 200, 20)),
                        "fast": run_loop(redis_cost(a, redis_url, 20, 2000, 0)),
                    }
                    print("redis", results["redis"])
    if "cancel" in wanted:
        results["cancel"] = cancel_latency(100)
        print(results["cancel"])
    table = render_table(results)
    (RESULTS / "latest.md").write_text(table)
    saved = {k: v for k, v in results.items() if k != "concurrent"}
    (RESULTS / "run.json").write_bytes(orjson.dumps(saved, option=orjson.OPT_INDENT_2))
    print(table)


def render_table(r: dict) -> str:
    rows = ["| figure | goal | measured |", "|---|---|---|"]
    if "throughput" in r:
        t = r["throughput"]
        for name, label in (("sse", "SSE"), ("ws", "WebSocket")):
            rows.append(
                f"| relay throughput, {label} | ≥ 25,000 tokens/s per core, ≤ 40 µs CPU/token | "
                f"{t[name]['tokens_per_s']:,.0f} tokens/s; {t[name]['cpu_us_per_token']:.1f} µs server CPU/token |"
            )
        rows.append(
            f"| ratio to reading the model directly | report | SSE {t['sse']['tokens_per_s'] / t['raw']['tokens_per_s']:.2f}, "
            f"WebSocket {t['ws']['tokens_per_s'] / t['raw']['tokens_per_s']:.2f} (direct: {t['raw']['tokens_per_s']:,.0f} tokens/s) |"
        )
    if "concurrent" in r:
        c = r["concurrent"]
        rows.append(
            f"| {c['streams']} streams × 200 tokens at 20 tokens/s (started over {c['ramp_s']:g} s) "
            f"| all in order; p99 added latency ≤ 50 ms | {c['complete']}/{c['streams']} complete, "
            f"in order: {c['in_order']}; all tokens p50 {c['p50_ms']:.1f} ms, p99 {c['p99_ms']:.1f} ms; "
            f"once all had started p50 {c['steady_p50_ms']:.1f} ms, p99 {c['steady_p99_ms']:.1f} ms |"
        )
    if "memory" in r:
        m = r["memory"]
        rows.append(
            f"| RSS per idle connection ({m['connections']:,}) | ≤ 50 KB | {m['all_kb_each']:.1f} KB "
            f"(WebSocket {m['ws_kb_each']:.1f} KB, SSE waiting for the model {m['sse_kb_each']:.1f} KB); {m['rss_mb']:.0f} MB in all |"
        )
    if "ttfe" in r:
        rows.append(
            f"| time to first event | p50 ≤ 5 ms | p50 {r['ttfe']['p50_ms']:.2f} ms, p99 {r['ttfe']['p99_ms']:.2f} ms |"
        )
    if "cancel" in r:
        rows.append(
            "| cancel latency (sent → upstream closed) | cross-process p99 ≤ 100 ms; single p99 ≤ 20 ms | "
            + "; ".join(line.strip() for line in r["cancel"].splitlines())
            + " |"
        )
    if "resume" in r:
        s = r["resume"]
        rows.append(
            f"| kill-and-resume, 1,000-token streams | 0 gaps, 0 duplicates | {s['trials']} trials: {s['gaps']} gaps, "
            f"{s['duplicates']} duplicates, {s['wrong_answers']} wrong answers |"
        )
    if "redis" in r:
        slow, fast = r["redis"]["slow"], r["redis"]["fast"]
        rows.append(
            f"| Redis commands per generated token | ≤ 0.2 | {slow['per_token']:.3f} at 20 tokens/s "
            f"({slow['streams']} streams of {slow['answer_tokens']} tokens); {fast['per_token']:.4f} with the "
            f"model at full speed ({fast['streams']} × {fast['answer_tokens']}) |"
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
