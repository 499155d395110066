"""Per-token cost at a real model's pace: one token per write, the server's CPU per
token read from /proc, beside a reference relay run in the same session.

    python -m bench.paced                       # ~2 minutes
    python -m bench.paced --streams 20 --tokens 500 --interval-ms 20 --runs 3

The fast fake model (`bench.fastmodel`, core 1 with this load generator) sends each
stream's tokens one per write, `--interval-ms` apart. Each target runs as its own
process pinned to core 0: this server (`python -m app`, full path: parse, log,
registry, save) over SSE, WebSocket and the OpenAI-compatible stream, and the three
references in `bench.relay`: the bare relay (`--bare`: an asyncio.Protocol on uvloop,
httptools, orjson, no framework: the least any relay that reads the model does),
the minimal relay (SDK raw lines + orjson + a plain streaming response: parses,
saves nothing) and a byte passthrough (aiohttp, parses nothing). Figures are
medians of `--runs`; each is also given as a ratio to the references (the bare
relay's first), which survives a noisy machine. Every target is started first and
their runs interleaved, round by round (one run of each in turn), so that a drift of
the machine's speed from one minute to the next falls on all of them alike; the last
column is the median of each round's ratio to the bare relay's run of that round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

from bench.load import request, sse_stream, ws_stream
from bench.run import RESULTS, app_server, fast_model, process, redis_server
from tests.servers import free_port


async def run_streams(kind: str, url: str, streams: int, tokens: int, rate: float) -> int:
    """Run `streams` paced streams of `kind` to their end; the tokens delivered.

    Stream i starts i/streams of an interval after the first, so that the streams'
    tokens arrive spread over each interval, as real streams' do, for every target
    alike: started together, a target that sets a stream up in microseconds keeps
    its streams in lockstep and serves all of them in one wake-up per interval,
    which no real load allows (it made a byte passthrough look ~40 % cheaper here).
    """
    content = f"#tokens={tokens} #rate={rate:g}"
    spacing = 1.0 / rate / streams

    async def one(i: int) -> int:
        await asyncio.sleep(i * spacing)
        if kind in ("relay", "passthrough", "bare"):
            payload = orjson.dumps({"content": content})
            result = await sse_stream(url, {}, parse=False, path="/" + kind, payload=payload)
            # passthrough: the model's finish and [DONE]; bare: its messageEnd
            return result.events - (2 if kind == "passthrough" else 1 if kind == "bare" else 0)
        if kind == "openai":
            payload = orjson.dumps(
                {
                    "model": "deepSeek",
                    "stream": True,
                    "messages": [{"role": "user", "content": content}],
                }
            )
            path = "/v1/chat/completions"
            result = await sse_stream(url, {}, parse=False, path=path, payload=payload)
            return result.events - 3  # role, finish, [DONE]
        reader = sse_stream if kind == "sse" else ws_stream
        result = await reader(url, request(content, userId=i + 1), parse=False)
        return result.events - 2  # message "" and messageEnd

    return sum(await asyncio.gather(*(one(i) for i in range(streams))))


def cpu_split(pid: int) -> tuple[float, float]:
    """User and system CPU seconds so far of a process and its descendants (the
    workers of a server started with WEB_CONCURRENCY)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry.name)] = fields
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    ticks = os.sysconf("SC_CLK_TCK")
    user = system = 0.0
    todo = [pid]
    while todo:
        current = todo.pop()
        fields = stats.get(current)
        if fields is not None:
            user += int(fields[11]) / ticks
            system += int(fields[12]) / ticks
        todo.extend(children.get(current, []))
    return user, system


async def measure(
    kind: str, url: str, pid: int, args: argparse.Namespace
) -> tuple[float, float, int]:
    """One run: the user and system µs of the target's CPU per token, and the tokens."""
    rate = 1000.0 / args.interval_ms
    user0, sys0 = cpu_split(pid)
    delivered = await run_streams(kind, url, args.streams, args.tokens, rate)
    user1, sys1 = cpu_split(pid)
    per = max(delivered, 1)
    return (user1 - user0) / per * 1e6, (sys1 - sys0) / per * 1e6, delivered


def summary(runs: list[tuple[float, float, int]]) -> dict[str, float]:
    us = statistics.median(u + s for u, s, _ in runs)
    return {
        "us_per_token": round(us, 1),
        "user_us": round(statistics.median(u for u, _, _ in runs), 1),
        "system_us": round(statistics.median(s for _, s, _ in runs), 1),
        "tokens_per_cpu_s": round(1e6 / us),
        "tokens": min(t for _, _, t in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--interval-ms", type=float, default=20.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--only",
        default="bare,passthrough,relay,sse,ws,openai,sse-redis,sse-2-workers",
        help="sse-redis: one worker with the Redis hub; "
        "sse-2-workers: WEB_CONCURRENCY=2 with Redis, on both cores",
    )
    args = parser.parse_args()
    wanted = args.only.split(",")
    # every target is started first, and their runs interleaved, round by round: this
    # VM's speed drifts by tens of per cent between minutes, and a target measured
    # minutes after another would carry that drift into their ratio
    targets: list[tuple[str, str, str, int]] = []  # (name, kind, url, pid)
    with contextlib.ExitStack() as stack:
        model = stack.enter_context(fast_model())
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        if "bare" in wanted:
            port = free_port()
            cmd = [sys.executable, "-m", "bench.relay", "--bare", "--port", str(port)]
            bare = stack.enter_context(
                process([*cmd, "--model-url", model + "/v1"], port, core="0")
            )
            targets.append(("bare", "bare", f"http://127.0.0.1:{port}", bare.pid))
        references = [kind for kind in ("passthrough", "relay") if kind in wanted]
        if references:
            port = free_port()
            cmd = [sys.executable, "-m", "bench.relay", "--port", str(port)]
            relay = stack.enter_context(
                process([*cmd, "--model-url", model + "/v1"], port, core="0")
            )
            for kind in references:
                targets.append((kind, kind, f"http://127.0.0.1:{port}", relay.pid))
        for kind in ("sse", "ws", "openai"):
            if kind in wanted:
                url, pid = stack.enter_context(app_server(model, tmp))
                targets.append((kind, kind, url, pid))
        if "sse-redis" in wanted or "sse-2-workers" in wanted:
            redis_url = stack.enter_context(redis_server())
            if "sse-redis" in wanted:
                url, pid = stack.enter_context(app_server(model, tmp, REDIS_URL=redis_url))
                targets.append(("sse-redis", "sse", url, pid))
            if "sse-2-workers" in wanted:
                two = {"WEB_CONCURRENCY": "2", "REDIS_URL": redis_url}
                url, pid = stack.enter_context(app_server(model, tmp, core="0,1", **two))
                targets.append(("sse-2-workers", "sse", url, pid))
        time.sleep(2.0)  # every worker up
        rate = 1000.0 / args.interval_ms
        for _, kind, url, _ in targets:  # warm up: imports, connections, caches
            asyncio.run(run_streams(kind, url, 4, 20, rate))
        runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name, *_ in targets}
        for round_ in range(args.runs):
            for name, kind, url, pid in targets:
                runs[name].append(asyncio.run(measure(kind, url, pid, args)))
                print(round_ + 1, name, [round(x, 1) for x in runs[name][-1]], flush=True)
    results = {name: summary(taken) for name, taken in runs.items()}
    if "bare" in runs:  # each round's ratio to the bare relay's run of the same round
        bare_us = [u + s for u, s, _ in runs["bare"]]
        for name, taken in runs.items():
            ratios = [(u + s) / b for (u, s, _), b in zip(taken, bare_us, strict=True) if b]
            results[name]["ratio_to_bare_by_round"] = [round(r, 2) for r in ratios]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "paced.json").write_bytes(
        orjson.dumps({"args": vars(args), "results": results}, option=orjson.OPT_INDENT_2)
    )
    print(
        f"\n{args.streams} streams × {args.tokens} tokens, one per write, {args.interval_ms:g} ms apart"
    )
    references = ("bare", "passthrough", "relay")
    floors = {kind: results.get(kind, {}).get("us_per_token") for kind in references}
    print(
        "| target | µs of server CPU per token (user + system) | tokens per CPU-second | "
        + " | ".join(f"× {kind}" for kind in references)
        + " | × bare, each round's |"
    )
    print("|---|---:|---:|" + "---:|" * len(references) + "---:|")
    for kind, r in results.items():
        ratios = [f"{r['us_per_token'] / f:.2f}" if f else "—" for f in floors.values()]
        by_round = r.get("ratio_to_bare_by_round")
        rounds = (
            f"{statistics.median(by_round):.2f} ({', '.join(f'{x:.2f}' for x in by_round)})"
            if by_round
            else "—"
        )
        print(
            f"| {kind} | {r['us_per_token']} ({r['user_us']} + {r['system_us']}) "
            f"| {r['tokens_per_cpu_s']:,} | " + " | ".join(ratios) + f" | {rounds} |"
        )


if __name__ == "__main__":
    main()
