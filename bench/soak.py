"""A long run that should lose nothing and grow nothing: two workers on PostgreSQL
and Redis, a few hundred mixed streams for the whole run, a fault every few minutes.

    python -m bench.soak --minutes 30                # ~38 minutes in all (see below)
    python -m bench.soak --minutes 5 --streams 100 --fault-every 60 --drain 0

Two `python -m bench.probe` processes (`python -m app` with a `GET /_probe` route
that counts the worker's asyncio tasks and the sizes of its hub's and keeper's
maps; nothing in `app/` changes) on one PostgreSQL database and one Redis, with the
fast fake model. `--streams` clients run all along, each starting a new answer
as its last one ends, in turn over SSE, WebSocket and `/v1/chat/completions`, on
either worker, at 20 tokens/s, 40–400 tokens each; every answer's tokens carry
its own tag (`#tag=`), so that text of one answer found in another shows. A client
whose stream breaks resumes it (SSE and WebSocket, `Last-Event-ID`) on the other
worker; a `/v1` client cannot, and keeps what it got.

Every `--fault-every` seconds one fault, in turn: Redis restarted (empty), Redis
blackholed `--outage` seconds (SIGSTOP, then SIGCONT), PostgreSQL stopped
`--outage` seconds (`pg_ctl stop -m fast`, then started), the second worker killed
(SIGKILL) and started again 3 s later (the first worker lives through the run, so
its figures span all of it).

Every `--sample-every` seconds: each worker's RSS, open file descriptors, CPU,
asyncio tasks and maps (`/_probe`); Redis's keys (by kind, and any without a TTL
or with a TTL longer than its kind's longest) and `used_memory`; answers left
`streaming` in PostgreSQL and its connections. When the load ends it waits for the
sweeper (claims expire after `stream.handle_ttl_seconds`), then checks every answer
a client was shown against the store (`GET /api/chats/{id}`):

    lost      the saved text is not what the client was shown, or does not start
              with it (a client shown more than was saved)
    mixed     a client, or the saved answer, has text that is not its own answer's
    stuck     still `streaming` after the sweeper's grace

Then (`--drain`, default the replay TTL + 30 s) it keeps sampling with no load, and
lists the keys left: only the processes' own (`proc`, `journal`, `lead`) may stay.

Everything goes to `--out` (default bench/results/soak/): samples.jsonl, the
workers' logs, answers.jsonl, summary.json, and the tables printed at the end.
The clients and their judge are in bench/soakload.py, the sampling, the checks
and the tables in bench/soakreport.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from bench.run import RESULTS, ROOT, fast_model, stop_on_sigterm
from bench.soakload import RESUME_FOR, Load
from bench.soakreport import (
    Sampler,
    brief,
    check,
    figures,
    key_bounds,
    left_keys,
    log_summary,
    render,
)
from tests.conftest import PostgresServer, RedisServer, new_database
from tests.servers import free_port, wait_for_port

FAULTS = ("redis-restart", "redis-blackhole", "postgres-stop", "worker-kill")


# -- the processes -------------------------------------------------------------------------


class Worker:
    """One `python -m bench.probe` on a fixed port, its log appended to a file."""

    def __init__(self, name: str, port: int, env: dict[str, str], logs: Path) -> None:
        self.name, self.port, self.env, self.logs = name, port, env, logs
        self.proc: subprocess.Popen[bytes] | None = None
        self.incarnation = 0
        self.started_at = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.incarnation += 1
        log = (self.logs / f"{self.name}.{self.incarnation}.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.probe"],
            env={**os.environ, **self.env, "PORT": str(self.port)},
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        log.close()
        wait_for_port(self.port, timeout=60)
        self.started_at = time.monotonic()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(45)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


# -- faults -----------------------------------------------------------------------------------


async def inject(
    kind: str, redis: RedisServer, pg: PostgresServer, victim: Worker, outage: float
) -> dict[str, Any]:
    started = time.monotonic()
    note: dict[str, Any] = {"fault": kind}
    if kind == "redis-restart":
        await asyncio.to_thread(redis.stop)
        await asyncio.to_thread(redis.start)
    elif kind == "redis-blackhole":
        if redis.proc is None:
            raise RuntimeError("redis is not running")
        os.kill(redis.proc.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(outage)
        finally:  # interrupted too: a stopped Redis would not stop on the way out
            os.kill(redis.proc.pid, signal.SIGCONT)
    elif kind == "postgres-stop":
        await asyncio.to_thread(pg.stop)
        await asyncio.sleep(outage)
        await asyncio.to_thread(pg.start)
    elif kind == "worker-kill":
        note["pid"] = victim.pid
        victim.kill()
        await asyncio.sleep(3.0)
        await asyncio.to_thread(victim.start)
    note["seconds"] = round(time.monotonic() - started, 1)
    return note


# -- the run ----------------------------------------------------------------------------------


async def soak(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import httpx

    with contextlib.ExitStack() as stack:  # every process this starts, stopped on the way out
        redis = stack.enter_context(RedisServer())
        pg = PostgresServer()
        stack.callback(pg.remove)
        pg.start()
        database = new_database(pg.url)
        env = {
            "LLM_BASE_URL": stack.enter_context(fast_model()) + "/v1",
            "LLM_API_KEY": "bench",
            "STORE_URL": database,
            "REDIS_URL": redis.url,
            "SERVER_HOST": "127.0.0.1",
            "LIMITS_MAX_CONCURRENT_GENERATIONS": "0",
            "LIMITS_WS_MESSAGES_PER_SECOND": "0",
            "STREAM_REPLAY_TTL_SECONDS": f"{args.replay_ttl:g}",
            "APP_CONFIG": "",
        }
        workers = [Worker(f"w{i + 1}", free_port(), env, out) for i in range(2)]
        for w in workers:
            stack.callback(w.stop)
            w.start()
        await asyncio.sleep(2.0)
        load = Load(workers, args.streams, args.seed)
        bounds = key_bounds(15.0, args.replay_ttl, 600.0)
        sampler = Sampler(workers, redis.url, database, load, bounds, out, time.monotonic())
        try:
            async with httpx.AsyncClient(timeout=10) as http:
                results = await run(args, redis, pg, workers, load, sampler, http)
        finally:
            await sampler.aclose()
    with (out / "answers.jsonl").open("wb") as fh:
        for answer in load.answers:
            fh.write(orjson.dumps(asdict(answer)) + b"\n")
    results["refused"] = dict(load.refused)
    results["samples"] = sampler.samples
    results["logs"] = log_summary(out)
    return results


async def run(
    args: argparse.Namespace,
    redis: RedisServer,
    pg: PostgresServer,
    workers: list[Worker],
    load: Load,
    sampler: Sampler,
    http: Any,
) -> dict[str, Any]:
    """The load with its faults for `--minutes`, the end of the load, the sweeper's
    grace, the check, the drain."""
    t0 = sampler.t0
    duration = args.minutes * 60
    faults: list[dict[str, Any]] = []

    async def sampling() -> None:
        while True:
            print(brief(await sampler.sample(http)), flush=True)
            await asyncio.sleep(args.sample_every)

    async def faulting() -> None:
        for k in itertools.count():
            at = args.fault_every * (k + 1)
            if at > duration - 30:
                return
            await asyncio.sleep(at - (time.monotonic() - t0))
            begin = round(time.monotonic() - t0, 1)
            note = await inject(
                args.faults[k % len(args.faults)], redis, pg, workers[1], args.outage
            )
            faults.append(note | {"t": begin})
            print(f"fault at {begin} s: {note}", flush=True)

    clients = [asyncio.create_task(load.client(i)) for i in range(args.streams)]
    background = [asyncio.create_task(sampling()), asyncio.create_task(faulting())]
    try:
        await asyncio.sleep(duration)
        background[1].cancel()
        await asyncio.gather(background[1], return_exceptions=True)
        load.stopping = True  # each client ends with its answer
        sampler.phase = "ending"
        await asyncio.wait(clients, timeout=RESUME_FOR + 60)
        # the sweeper's grace: a dead process's claim expires, then one sweep
        sampler.phase = "grace"
        await asyncio.sleep(args.grace)
        sampler.phase = "check"
        results: dict[str, Any] = {"check": await check(http, workers[0], load)}
        sampler.phase = "drain"
        await asyncio.sleep(args.drain)
    finally:
        for task in clients + background:
            task.cancel()
        await asyncio.gather(*clients, *background, return_exceptions=True)
    results["final_sample"] = await sampler.sample(http)
    results["final_keys"] = await left_keys(sampler.redis, sampler.bounds, load.answers)
    results["faults"] = faults
    return results


def main() -> None:
    stop_on_sigterm()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--fault-every", type=float, default=180.0)
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help="the faults, in turn (a subset, to tell which one a finding follows)",
    )
    parser.add_argument("--outage", type=float, default=5.0)
    parser.add_argument("--sample-every", type=float, default=10.0)
    parser.add_argument("--replay-ttl", type=float, default=300.0, help="stream.replay_ttl_seconds")
    parser.add_argument(
        "--warmup", type=float, default=360.0, help="seconds left out of the figures"
    )
    parser.add_argument("--block", type=float, default=120.0, help="seconds compared at each end")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds for the sweeper")
    parser.add_argument("--drain", type=float, default=None, help="default: replay TTL + 30 s")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "soak")
    args = parser.parse_args()
    args.faults = [f for f in args.faults.split(",") if f]
    unknown = set(args.faults) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}: choose from {', '.join(FAULTS)}")
    if args.drain is None:
        args.drain = args.replay_ttl + 30
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*"):
        old.unlink()
    try:
        from uvloop import run as run_loop
    except ImportError:
        run_loop = asyncio.run
    results = run_loop(soak(args, out))
    flat = figures(results, args)
    results["flatness"] = flat
    (out / "summary.json").write_bytes(
        orjson.dumps(
            {k: v for k, v in results.items() if k != "samples"} | {"args": vars(args)},
            option=orjson.OPT_INDENT_2,
            default=str,
        )
    )
    table = render(results, flat, args)
    (out / "summary.md").write_text(table + "\n")
    print(table)
    print("warnings and errors in the workers' logs:")
    for key, n in results["logs"]["counts"].items():
        print(f"  {n:>6}  {key}")


if __name__ == "__main__":
    main()
