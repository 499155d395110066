"""What group commit costs: paced streams on one worker with the Redis hub (events
reach clients only once Redis has acknowledged the journal write that holds them),
beside the same worker without Redis and beside an older server with Redis (events
reach local clients at once, Redis a flush later), run interleaved in one session.

    python -m bench.commit                                      # ~25 minutes
    python -m bench.commit --streams 200,600 --runs 3 --old ../wt-old
    python -m bench.commit --targets new-redis --lingers 1,20 --runs 1
    python -m bench.commit --render bench/results/commit.json   # the tables again

Every target is a fresh `python -m app` (A) pinned to core 0, with a second one (B)
on the same Redis and store; the load generator and the fake model share core 1;
Redis, PostgreSQL and B run where they like (`--redis-core 1` pins Redis and B
with the load: a commit then waits for core 1 to run Redis, which this 2-core
machine makes far slower). Streams, half SSE and half WebSocket, at 20 tokens a
second each (the fast fake model, one time-stamped token per write), start 50 a
second on A; every `--remote-every`-th stream is also followed on B (a resume from
its first event: events that cross Redis). Once every stream runs, a window of
`--steady` - 2 seconds is measured:

* added latency per token: the fake model's write (a nanosecond timestamp in the
  token) → the client's read, one clock; p50, p99, p99.9 of the tokens sent in the
  window, for A's clients and for B's followers;
* CPU per token: A's user + system CPU (/proc) over the window ÷ the tokens sent in
  it (and the same over the whole run, starts and ends included);
* Redis commands per second (INFO commandstats deltas, scripts' inner commands
  included; B is idle but for its heartbeat), split into journal writes (XINFO
  STREAM entries-added of every journal), answer-log writes and the rest, and
  Redis's own CPU.

Targets: `new-redis` (this checkout, stream.commit_linger_ms as configured, 5 ms),
`new-memory` (no Redis: one process), `old-redis` and `old-memory` (the checkout
given by `--old`, run unmodified from there), and `NAME-redis`, `NAME-memory` for
each `--checkout NAME=PATH` (say, the commit that brought group commit, exported
with `git archive`); `--lingers 1,20` adds `new-redis`
at those lingers, measured at the largest level of `--streams` only. Each run goes
through every target in turn (old, new, old, new …), so that whatever else loads
the machine loads them alike; figures are medians of `--runs`, with the range.
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import redis
import redis.asyncio as aioredis

from bench.load import StreamResult, percentile, request, sse_stream, ws_stream
from bench.run import (
    LOAD_CORE,
    RESULTS,
    ROOT,
    app_server,
    cpu_seconds,
    fast_model,
    redis_server,
    stop_on_sigterm,
)
from tests.conftest import new_database, start_postgres

RATE = 20.0  # tokens a second per stream


@dataclass(frozen=True)
class Target:
    name: str
    root: Path
    redis: bool
    linger_ms: float | None = None  # None: as configured
    levels: tuple[int, ...] = ()  # () : every level of --streams

    def env(self, redis_url: str) -> dict[str, str]:
        out = {"REDIS_URL": redis_url} if self.redis else {}
        if self.linger_ms is not None:
            out["STREAM_COMMIT_LINGER_MS"] = f"{self.linger_ms:g}"
        return out


@dataclass
class Row:
    target: str
    streams: int
    run: int
    values: dict[str, float] = field(default_factory=dict)
    notes: dict[str, object] = field(default_factory=dict)


# -- measuring ------------------------------------------------------------------------


def pid_of_port(port: int) -> int | None:
    """The process listening on a loopback TCP port (Redis, whose pid we did not start
    directly), from /proc/net/tcp and the processes' sockets."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        local, state = parts[1], parts[3]
        if state == "0A" and int(local.split(":")[1], 16) == port:
            inode = parts[9]
            break
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == target:
                        return int(entry.name)
    return None


async def command_calls(client: aioredis.Redis) -> dict[str, int]:
    """Calls per command so far, leaving out what measuring costs (INFO, XINFO, SCAN)."""
    stats = await client.info("commandstats")
    skip = ("info", "xinfo", "scan")
    return {
        k.removeprefix("cmdstat_"): v["calls"]
        for k, v in stats.items()
        if k.removeprefix("cmdstat_").split("|")[0] not in skip
    }


async def journal_entries(client: aioredis.Redis) -> int:
    """Entries ever added to every process's journal (XINFO STREAM entries-added)."""
    total = 0
    # the key's name before and since the keys were hash-tagged for Redis Cluster
    for pattern in ("sc:journal:*", "sc:{p:*}:journal"):
        async for key in client.scan_iter(match=pattern, count=1000):
            with contextlib.suppress(Exception):
                info = await client.xinfo_stream(key)
                total += int(info.get("entries-added", 0))
    return total


@dataclass
class Snapshot:
    wall_ns: int
    cpu_a: float
    cpu_b: float
    cpu_redis: float
    calls: dict[str, int]
    journal: int
    machine: float  # CPU seconds the whole machine has been busy
    ours: float  # … of which this bench and every process it started
    load: float  # … of which this load generator's own process


def machine_busy() -> float:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


async def snapshot(
    client: aioredis.Redis | None, pid_a: int, pid_b: int | None, pid_redis: int | None
) -> Snapshot:
    calls = await command_calls(client) if client is not None else {}
    journal = await journal_entries(client) if client is not None else 0
    return Snapshot(
        time.time_ns(),
        cpu_seconds(pid_a),
        cpu_seconds(pid_b) if pid_b else 0.0,
        cpu_seconds(pid_redis) if pid_redis else 0.0,
        calls,
        journal,
        machine_busy(),
        cpu_seconds(os.getpid()),
        time.process_time(),
    )


async def carry(
    a: str,
    b: str | None,
    streams: int,
    *,
    steady: float,
    starts_per_second: float,
    remote_every: int,
    client: aioredis.Redis | None,
    pids: tuple[int, int | None, int | None],
) -> dict[str, object]:
    ramp = streams / starts_per_second
    tokens = int(RATE * (ramp * 1.5 + steady))
    content = f"#tokens={tokens} #rate={RATE:g} #stamp"
    errors: list[str] = []
    remote: list[StreamResult] = []

    async def follow(body: dict) -> None:
        chat = body["message"]["chatId"]
        path = f"/api/chat/sse/resume?chatId={chat}&userId={body['userId']}"
        for attempt in range(50):  # 404 until the answer has started (a loaded server)
            try:
                remote.append(await sse_stream(b or a, {}, path=path, stamps=True))
                return
            except RuntimeError as exc:
                if b" 404 " not in str(exc).encode() or attempt == 49:
                    errors.append(f"follower: {exc}")
                    return
                await asyncio.sleep(0.2)
            except Exception as exc:
                errors.append(f"follower: {exc}")
                return

    async def one(i: int) -> StreamResult | None:
        await asyncio.sleep(ramp * i / streams)
        body = request(content, userId=i + 1)
        reader = ws_stream if i % 2 else sse_stream
        follower = None
        if b is not None and remote_every and i % remote_every == 0:

            async def later() -> None:
                await asyncio.sleep(0.5)  # the answer runs by then
                await follow(body)

            follower = asyncio.create_task(later())
        try:
            return await reader(a, body, stamps=True)
        except Exception as exc:  # refused (503, 429) or cut: counted, not fatal
            errors.append(str(exc))
            return None
        finally:
            if follower is not None:
                await follower

    window: list[Snapshot] = []

    async def sampler() -> None:
        await asyncio.sleep(ramp + 1.0)  # every stream has started (and had a token)
        window.append(await snapshot(client, *pids))
        await asyncio.sleep(max(steady - 2.0, 1.0))
        window.append(await snapshot(client, *pids))

    begin = await snapshot(client, *pids)
    sampling = asyncio.create_task(sampler())
    results = [r for r in await asyncio.gather(*(one(i) for i in range(streams))) if r]
    await sampling
    end = await snapshot(client, *pids)
    w0, w1 = window
    in_window = [
        (latency, sent)
        for r in results
        for latency, sent in zip(r.latencies_ms, r.sent_ns, strict=True)
        if w0.wall_ns <= sent <= w1.wall_ns
    ]
    latencies = [x for x, _ in in_window]
    remote_latencies = [
        x
        for r in remote
        for x, sent in zip(r.latencies_ms, r.sent_ns, strict=True)
        if w0.wall_ns <= sent <= w1.wall_ns
    ]
    running = sum(
        1
        for r in results
        if r.sent_ns and r.sent_ns[0] <= w0.wall_ns <= w1.wall_ns <= r.sent_ns[-1]
    )
    seconds = (w1.wall_ns - w0.wall_ns) / 1e9
    delivered = sum(r.tokens for r in results)
    calls = {k: n - w0.calls.get(k, 0) for k, n in w1.calls.items() if n != w0.calls.get(k, 0)}
    total_calls = sum(calls.values())
    journal = w1.journal - w0.journal
    log_xadds = max(calls.get("xadd", 0) - journal, 0)
    all_calls = sum(n - begin.calls.get(k, 0) for k, n in end.calls.items())
    run_seconds = (end.wall_ns - begin.wall_ns) / 1e9
    values = {
        "p50_ms": percentile(latencies, 0.5),
        "p99_ms": percentile(latencies, 0.99),
        "p999_ms": percentile(latencies, 0.999),
        "max_ms": max(latencies) if latencies else float("nan"),
        "remote_p50_ms": percentile(remote_latencies, 0.5),
        "remote_p99_ms": percentile(remote_latencies, 0.99),
        "us_per_token": (w1.cpu_a - w0.cpu_a) / max(len(in_window), 1) * 1e6,
        "us_per_token_run": (end.cpu_a - begin.cpu_a) / max(delivered, 1) * 1e6,
        "server_cpu": (w1.cpu_a - w0.cpu_a) / seconds,
        "redis_cpu": (w1.cpu_redis - w0.cpu_redis) / seconds,
        "b_cpu": (w1.cpu_b - w0.cpu_b) / seconds,
        "commands_per_s": total_calls / seconds,
        "journal_per_s": journal / seconds,
        "log_xadd_per_s": log_xadds / seconds,
        "getex_per_s": calls.get("getex", 0) / seconds,
        "other_per_s": (total_calls - journal - log_xadds - calls.get("getex", 0)) / seconds,
        "commands_per_s_run": all_calls / run_seconds,
        "commands_per_answer_run": all_calls / max(streams, 1),
        "tokens_per_s": len(in_window) / seconds,
        # cores the rest of the machine took during the window (other engineers' work)
        "others_cores": ((w1.machine - w0.machine) - (w1.ours - w0.ours)) / seconds,
        "load_cpu": (w1.load - w0.load) / seconds,
    }
    notes = {
        "complete": sum(r.tokens == tokens and r.end == "completed" for r in results),
        "in_order": all(r.seqs == list(range(1, len(r.seqs) + 1)) for r in results),
        "running_in_window": running,
        "window_s": round(seconds, 1),
        "remote_streams": len(remote),
        "remote_complete": sum(r.end == "completed" for r in remote),
        "errors": sorted(set(errors))[:3],
        "by_command": dict(
            sorted(((k, round(v / seconds, 1)) for k, v in calls.items()), key=lambda kv: -kv[1])
        ),
    }
    return {"values": values, "notes": notes}


async def measure(
    a: str,
    b: str | None,
    streams: int,
    args: argparse.Namespace,
    redis_url: str,
    pids: tuple[int, int | None, int | None],
) -> dict[str, object]:
    """A short warm-up (imports, connections, caches), then `carry` at `streams`."""
    client = aioredis.from_url(redis_url) if redis_url else None
    try:
        options = {"remote_every": args.remote_every, "client": client, "pids": pids}
        await carry(a, b, 20, steady=3, starts_per_second=50, **options)  # type: ignore[arg-type]
        return await carry(
            a,
            b,
            streams,
            steady=args.steady,
            starts_per_second=args.starts_per_second,
            **options,  # type: ignore[arg-type]
        )
    finally:
        if client is not None:
            await client.aclose()


def cpu_elsewhere(seconds: float = 3.0) -> float:
    """Cores busy on this machine over `seconds`, while the bench's own processes idle
    between measurements: what other work takes."""
    busy, start = machine_busy(), time.monotonic()
    time.sleep(seconds)
    return (machine_busy() - busy) / (time.monotonic() - start)


def wait_for_calm(limit: float, patience: float) -> float:
    """Wait (up to `patience` seconds) until other work takes less than `limit`
    cores; returns what it took when the measurement starts."""
    deadline = time.monotonic() + patience
    while True:
        elsewhere = cpu_elsewhere()
        if elsewhere < limit or time.monotonic() > deadline:
            return elsewhere
        print(f"  waiting: other work takes {elsewhere:.2f} cores", flush=True)
        time.sleep(7.0)


# -- the run -------------------------------------------------------------------------------


@contextlib.contextmanager
def servers(
    target: Target, model: str, tmp: str, redis_url: str, store: dict[str, str], b_core: str
) -> Iterator[tuple[str, int, str | None, int | None]]:
    env = {**target.env(redis_url), **store}
    with contextlib.ExitStack() as stack:
        a, pid_a = stack.enter_context(app_server(model, tmp, root=target.root, **env))
        b = pid_b = None
        if target.redis:
            b, pid_b = stack.enter_context(
                app_server(model, tmp, core=b_core, root=target.root, **env)
            )
        yield a, pid_a, b, pid_b


def main() -> None:
    stop_on_sigterm()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", default="200,600")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--targets", default="old-redis,new-redis,old-memory,new-memory")
    parser.add_argument("--lingers", default="1,20", help="extra new-redis lingers (ms)")
    parser.add_argument(
        "--old", type=Path, default=ROOT.parent / "wt-old", help="the older checkout"
    )
    parser.add_argument(
        "--checkout",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="another checkout to measure, as targets NAME-redis and NAME-memory",
    )
    parser.add_argument("--steady", type=float, default=15.0)
    parser.add_argument("--starts-per-second", type=float, default=50.0)
    parser.add_argument("--remote-every", type=int, default=10)
    parser.add_argument("--store", choices=["sqlite", "postgres"], default="postgres")
    parser.add_argument(
        "--redis-core",
        default="0,1",
        help="where Redis (and B) may run: 0,1 (where they like), or 1 (with the load)",
    )
    parser.add_argument(
        "--calm",
        type=float,
        default=0.5,
        help="before each measurement, wait until other work takes fewer cores than this",
    )
    parser.add_argument("--calm-wait", type=float, default=30.0, help="… for at most this long")
    parser.add_argument("--out", default="commit.json")
    parser.add_argument(
        "--render", type=Path, help="print the tables of a saved run (a --out file), run nothing"
    )
    args = parser.parse_args()
    if args.render:
        rows = [Row(**r) for r in orjson.loads(args.render.read_bytes())["rows"]]
        print(render(rows, [(_load_at_start(r), 0.0, 0.0) for r in rows]))
        return
    levels = tuple(int(n) for n in args.streams.split(","))
    roots = {"new": ROOT, "old": args.old.resolve()}
    for named in args.checkout:
        name, _, path = named.partition("=")
        roots[name] = Path(path).resolve()
    targets = []
    for name in args.targets.split(","):
        version, _, hub = name.partition("-")
        targets.append(Target(name, roots[version], hub == "redis"))
    for linger in filter(None, args.lingers.split(",")):
        targets.append(
            Target(f"new-redis-{linger}ms", ROOT, True, float(linger), levels=(max(levels),))
        )
    try:
        from uvloop import run as run_loop
    except ImportError:
        run_loop = asyncio.run
    rows: list[Row] = []
    loads: list[tuple[float, float, float]] = []
    out = RESULTS / args.out
    RESULTS.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        model = stack.enter_context(fast_model())
        redis_url = stack.enter_context(redis_server(core=args.redis_core))
        # started before this process is pinned: PostgreSQL runs where it likes
        postgres = stack.enter_context(start_postgres()) if args.store == "postgres" else ""
        if (os.cpu_count() or 1) > 1:
            os.sched_setaffinity(0, {int(LOAD_CORE)})  # the load generator
        pid_redis = pid_of_port(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
        for run in range(args.runs):
            for target in targets:
                store = {"STORE_URL": new_database(postgres)} if postgres else {}
                with redis.Redis.from_url(redis_url) as flush:
                    flush.flushall()  # each target starts on an empty Redis
                with servers(target, model, tmp, redis_url, store, args.redis_core) as (
                    a,
                    pid_a,
                    b,
                    pid_b,
                ):
                    time.sleep(1.0)
                    for streams in target.levels or levels:
                        elsewhere = wait_for_calm(args.calm, args.calm_wait)
                        loads.append(os.getloadavg())

                        measured = run_loop(
                            measure(
                                a,
                                b,
                                streams,
                                args,
                                redis_url if target.redis else "",
                                (pid_a, pid_b, pid_redis),
                            )
                        )
                        row = Row(target.name, streams, run, measured["values"], measured["notes"])  # type: ignore[arg-type]
                        row.notes["loadavg"] = [loads[-1], os.getloadavg()]  # start, end
                        row.values["cpu_elsewhere"] = elsewhere
                        rows.append(row)
                        print(
                            f"run {run + 1} {target.name} {streams}: "
                            + " ".join(f"{k}={v:.1f}" for k, v in row.values.items())
                            + f" {row.notes}",
                            flush=True,
                        )
                        out.write_bytes(
                            orjson.dumps(
                                {
                                    "args": {k: str(v) for k, v in vars(args).items()},
                                    "rows": [vars(r) for r in rows],
                                },
                                option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY,
                            )
                        )
                        time.sleep(1.0)
    print(render(rows, loads))


def _fmt(values: list[float], digits: int = 1) -> str:
    values = [v for v in values if v == v]  # not NaN
    if not values:
        return "—"
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid:.{digits}f}"
    return f"{mid:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def _load_at_start(row: Row) -> float:
    """The 1-minute load average when the row's measurement began (files of older
    versions of this bench kept only the one at its end)."""
    loads = row.notes.get("loadavg")
    if not isinstance(loads, list) or not loads:
        return float("nan")
    return loads[0][0] if isinstance(loads[0], (list, tuple)) else loads[0]


def render(rows: list[Row], loads: list[tuple[float, float, float]]) -> str:
    groups: dict[tuple[str, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.target, r.streams), []).append(r)

    def col(g: list[Row], key: str, digits: int = 1, scale: float = 1.0) -> str:
        return _fmt([r.values[key] * scale for r in g], digits)

    lines = [
        "| target | streams | p50 ms | p99 ms | p99.9 ms | followers on B: p50 / p99 ms "
        "| µs CPU/token (window) | µs CPU/token (whole run) | server CPU | complete, in order "
        "| other work, cores | load avg (1 min) at start |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for (target, streams), g in groups.items():
        remote = (
            f"{col(g, 'remote_p50_ms')} / {col(g, 'remote_p99_ms')}"
            if g[0].notes.get("remote_streams")
            else "—"
        )
        complete = ", ".join(
            f"{r.notes['complete']}/{streams}{'' if r.notes['in_order'] else ' NOT in order'}"
            for r in g
        )
        lines.append(
            f"| {target} | {streams} | {col(g, 'p50_ms')} | {col(g, 'p99_ms')} | {col(g, 'p999_ms')} "
            f"| {remote} | {col(g, 'us_per_token')} | {col(g, 'us_per_token_run')} "
            f"| {col(g, 'server_cpu', 0, 100)} % | {complete} "
            f"| {_fmt([r.values.get('others_cores', float('nan')) for r in g], 2)} "
            f"| {', '.join(f'{_load_at_start(r):.2f}' for r in g)} |"
        )
    lines += [
        "",
        "| target | streams | Redis commands/s (window) | journal XADD/s | answer-log XADD/s "
        "| GETEX/s | other/s | commands/s, whole run | commands per answer | Redis CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (target, streams), g in groups.items():
        if "redis" not in target:
            continue
        lines.append(
            f"| {target} | {streams} | {col(g, 'commands_per_s', 0)} | {col(g, 'journal_per_s', 0)} "
            f"| {col(g, 'log_xadd_per_s', 0)} | {col(g, 'getex_per_s', 0)} | {col(g, 'other_per_s', 0)} "
            f"| {col(g, 'commands_per_s_run', 0)} | {col(g, 'commands_per_answer_run', 1)} "
            f"| {col(g, 'redis_cpu', 0, 100)} % |"
        )
    by_version: dict[str, dict[int, float]] = {}
    for (target, streams), g in groups.items():
        by_version.setdefault(target, {})[streams] = statistics.median(
            r.values["us_per_token"] for r in g
        )
    ratios = []
    for hub in ("redis", "memory"):
        new, old = by_version.get(f"new-{hub}", {}), by_version.get(f"old-{hub}", {})
        for streams in sorted(set(new) & set(old)):
            ratios.append(f"{hub} {streams}: {new[streams] / old[streams]:.2f}")
    if ratios:
        lines += ["", "CPU per token, new ÷ old (medians, window): " + "; ".join(ratios)]
    during = [r.values["others_cores"] for r in rows if "others_cores" in r.values]
    if during:
        lines.append(
            f"Cores other work took during the measured windows: {min(during):.2f}–"
            f"{max(during):.2f}, median {statistics.median(during):.2f} (of 2)"
        )
    elsewhere = [r.values["cpu_elsewhere"] for r in rows if "cpu_elsewhere" in r.values]
    if elsewhere:
        lines.append(
            f"Cores other work took just before each measurement: {min(elsewhere):.2f}–"
            f"{max(elsewhere):.2f}, median {statistics.median(elsewhere):.2f}"
        )
    if loads:
        ones = [x[0] for x in loads]
        lines.append(
            f"Load average (1 min) at the start of each measurement: "
            f"{min(ones):.1f}–{max(ones):.1f}, median {statistics.median(ones):.1f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
