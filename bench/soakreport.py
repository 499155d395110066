"""What the soak (bench.soak) watches and what it finds: samples of every worker,
Redis and PostgreSQL while it runs, every answer checked against the store at the
end, the keys left behind, and the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import statistics
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import redis.asyncio as aioredis

from bench.run import cpu_seconds, rss_kb
from bench.soakload import Answer, Load, judge, saved_answer

if TYPE_CHECKING:  # bench.soak imports this module
    from bench.soak import Worker


def key_bounds(handle_ttl: float, replay_ttl: float, max_generation: float) -> dict[str, float]:
    keep = (max_generation + replay_ttl) * 1000
    return {
        "proc": handle_ttl * 1000,
        "run": handle_ttl * 1000,
        "active": handle_ttl * 1000,
        "gen": keep,
        "latest": keep,
        "owner": keep,
        "log": keep,
        "journal": keep,
        "cancel": max(handle_ttl * 2000, 60_000),
        "lead": handle_ttl * 1000,
        "recovering": handle_ttl * 1000,
    }


def open_fds(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{pid}/fd"))
    return None


class Sampler:
    def __init__(
        self,
        workers: list[Worker],
        redis_url: str,
        pg_url: str,
        load: Load,
        bounds: dict[str, float],
        out: Path,
        t0: float,
    ) -> None:
        self.workers, self.redis_url, self.pg_url = workers, redis_url, pg_url
        self.load, self.bounds, self.t0 = load, bounds, t0
        self.file = (out / "samples.jsonl").open("ab")
        self.samples: list[dict[str, Any]] = []
        self.redis = aioredis.from_url(redis_url, socket_timeout=3, socket_connect_timeout=3)
        self.pg: Any = None
        self.phase = "load"

    async def sample(self, http: Any) -> dict[str, Any]:
        now = time.monotonic()
        s: dict[str, Any] = {
            "t": round(now - self.t0, 1),
            "wall": round(time.time(), 1),
            "phase": self.phase,
            "load": {
                "active": self.load.active,
                "answers": len(self.load.answers),
                "refused": sum(self.load.refused.values()),
            },
            "loadavg": os.getloadavg()[0],
        }
        for w in self.workers:
            entry: dict[str, Any] = {"incarnation": w.incarnation, "up": w.pid is not None}
            if w.pid is not None:
                entry.update(
                    rss_kb=rss_kb(w.pid),
                    fds=open_fds(w.pid),
                    cpu_s=cpu_seconds(w.pid),
                    age_s=round(now - w.started_at, 1),
                )
                try:
                    reply = await http.get(w.url + "/_probe", timeout=3)
                    entry["probe"] = reply.json()
                except Exception as exc:
                    entry["probe_error"] = type(exc).__name__
            s[w.name] = entry
        s["redis"] = await self.redis_keys()
        s["pg"] = await self.pg_figures()
        self.samples.append(s)
        self.file.write(orjson.dumps(s) + b"\n")
        self.file.flush()
        return s

    async def redis_keys(self) -> dict[str, Any]:
        try:
            async with asyncio.timeout(8):
                info = await self.redis.info("memory")
                kinds: Counter[str] = Counter()
                no_ttl: list[str] = []
                too_long: list[str] = []
                keys = [k async for k in self.redis.scan_iter(match="sc:*", count=2000)]
                ttls = []
                for start in range(0, len(keys), 2000):
                    async with self.redis.pipeline(transaction=False) as pipe:
                        for key in keys[start : start + 2000]:
                            pipe.pttl(key)
                        ttls += await pipe.execute()
                for key, ttl in zip(keys, ttls, strict=True):
                    kind = key.decode().split(":")[1]
                    kinds[kind] += 1
                    if ttl == -1:
                        no_ttl.append(key.decode())
                    elif ttl > self.bounds.get(kind, float("inf")) + 1000:
                        too_long.append(f"{key.decode()} {ttl} ms")
                return {
                    "keys": len(keys),
                    "used_memory": info["used_memory"],
                    "kinds": dict(kinds),
                    "no_ttl": no_ttl[:20],
                    "no_ttl_count": len(no_ttl),
                    "too_long": too_long[:20],
                    "too_long_count": len(too_long),
                }
        except Exception as exc:
            return {"error": type(exc).__name__}

    async def pg_figures(self) -> dict[str, Any]:
        import asyncpg

        try:
            async with asyncio.timeout(5):
                if self.pg is None or self.pg.is_closed():
                    self.pg = await asyncpg.connect(self.pg_url)
                streaming = await self.pg.fetchval(
                    "SELECT count(*) FROM messages WHERE status = 'streaming'"
                )
                connections = await self.pg.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                )
                return {"streaming": streaming, "connections": connections}
        except Exception as exc:
            with contextlib.suppress(Exception):
                if self.pg is not None:
                    self.pg.terminate()
            self.pg = None
            return {"error": type(exc).__name__}

    async def aclose(self) -> None:
        self.file.close()
        await self.redis.aclose()
        if self.pg is not None:
            with contextlib.suppress(Exception):
                await self.pg.close()


async def check(http: Any, worker: Worker, load: Load) -> dict[str, Any]:
    """Every answer a client saw, against what the store saved."""
    by_fault: Counter[str] = Counter()
    ends: Counter[str] = Counter()
    examples: dict[str, list[dict[str, Any]]] = {}
    beyond = 0
    semaphore = asyncio.Semaphore(16)

    async def one(answer: Answer) -> None:
        nonlocal beyond
        async with semaphore:
            saved = None
            for _ in range(5):
                try:
                    saved = await saved_answer(http, answer)
                    break
                except Exception:
                    await asyncio.sleep(1.0)
        faults = judge(answer, saved)
        ends[f"{answer.kind} {answer.end.split(' ')[0] or '?'}"] += 1
        if saved is not None and len(saved["content"]) > len(answer.text) and not faults:
            beyond += 1
        for fault in faults:
            by_fault[fault] += 1
            cases = examples.setdefault(fault, [])
            if len(cases) < 5:
                cases.append(
                    {
                        **{k: v for k, v in asdict(answer).items() if k != "text"},
                        "shown_chars": len(answer.text),
                        "shown_tail": answer.text[-60:],
                        "saved_chars": len(saved["content"]) if saved else None,
                        "saved_tail": saved["content"][-60:] if saved else None,
                        "saved_status": saved["status"] if saved else None,
                        "saved_error": saved.get("error") if saved else None,
                    }
                )

    http.base_url = worker.url
    await asyncio.gather(*(one(a) for a in load.answers))
    return {
        "answers": len(load.answers),
        "faults": dict(by_fault),
        "ends": dict(sorted(ends.items())),
        "saved_beyond_shown": beyond,
        "resumed": sum(1 for a in load.answers if a.resumes),
        "examples": examples,
    }


async def left_keys(
    client: aioredis.Redis, bounds: dict[str, float], answers: list[Answer]
) -> dict[str, Any]:
    """The keys left once the load is over and the replay TTL has passed: only the
    processes' own may stay; any other is sorted by whether it still expires within
    its kind's longest TTL, and by whose it is (an answer a client saw, and how it
    ended, or one no client saw: a start that was refused after its claim)."""
    keys = [k.decode() async for k in client.scan_iter(match="sc:*", count=2000)]
    kinds = Counter(k.split(":")[1] for k in keys)
    allowed = {"proc", "journal", "lead"}
    left = sorted(k for k in keys if k.split(":")[1] not in allowed)
    by_answer = {a.answer_id: a for a in answers if a.answer_id}
    by_chat = {a.chat_id: a for a in answers}
    sorted_out: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}
    for key in left:
        kind, _, ident = key.partition(":")[2].partition(":")
        ttl = await client.pttl(key)
        if ttl == -1:
            expiry = "no TTL"
        elif ttl > bounds.get(kind, float("inf")) + 1000:
            expiry = "TTL past its kind's longest"
        else:
            expiry = "expires within its TTL"
        answer = by_chat.get(ident) if kind == "latest" else by_answer.get(ident)
        whose = f"{answer.kind} {answer.end.split(' ')[0]}" if answer else "no client saw it"
        label = f"{kind}: {expiry}; {whose}"
        sorted_out[label] += 1
        cases = examples.setdefault(label, [])
        if len(cases) < 3:
            cases.append(f"{key} pttl {ttl} ms")
    return {
        "kinds": dict(kinds),
        "left_behind": len(left),
        "sorted": dict(sorted_out.most_common()),
        "examples": examples,
    }


def log_summary(out: Path) -> dict[str, Any]:
    """WARNING and ERROR lines of the workers' logs, by message (their variable parts
    cut), with the first of each."""
    counts: Counter[str] = Counter()
    first: dict[str, str] = {}
    for path in sorted(out.glob("w*.log")):
        for line in path.read_bytes().splitlines():
            if b'"level":"warning"' not in line and b'"level":"error"' not in line:
                continue
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            msg = re.sub(r"\d{6,}", "N", str(entry.get("msg", "")))[:120]
            key = f"{entry.get('level')} {entry.get('logger')}: {msg}"
            counts[key] += 1
            first.setdefault(key, f"{path.name}: {line.decode(errors='replace')[:400]}")
    return {
        "counts": dict(counts.most_common(40)),
        "first": {k: first[k] for k, _ in counts.most_common(40)},
    }


def brief(s: dict[str, Any]) -> str:
    parts = [f"t={s['t']:>6}s {s['phase']:<6} load {s['loadavg']:.1f}"]
    parts.append(f"active {s['load']['active']} answers {s['load']['answers']}")
    for name in ("w1", "w2"):
        w = s.get(name, {})
        if w.get("up"):
            tasks = w.get("probe", {}).get("tasks", "?")
            parts.append(
                f"{name}#{w['incarnation']} rss {(w.get('rss_kb') or 0) / 1024:.0f}MB "
                f"fds {w.get('fds')} tasks {tasks}"
            )
        else:
            parts.append(f"{name} down")
    r = s.get("redis", {})
    if "keys" in r:
        parts.append(
            f"redis keys {r['keys']} mem {r['used_memory'] / 2**20:.1f}MB no-ttl {r['no_ttl_count']}"
        )
    else:
        parts.append(f"redis {r.get('error')}")
    parts.append(f"pg streaming {s.get('pg', {}).get('streaming', '?')}")
    return " | ".join(parts)


def series(samples: list[dict[str, Any]], path: tuple[str, ...]) -> list[tuple[float, float]]:
    out = []
    for s in samples:
        value: Any = s
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, int | float):
            out.append((s["t"], float(value)))
    return out


def flatness(points: list[tuple[float, float]], block: float) -> dict[str, float] | None:
    """Median of the first `block` seconds against the last `block` seconds."""
    if len(points) < 4:
        return None
    t_first, t_last = points[0][0], points[-1][0]
    head = [v for t, v in points if t <= t_first + block]
    tail = [v for t, v in points if t >= t_last - block]
    a, b = statistics.median(head), statistics.median(tail)
    values = sorted(v for _, v in points)
    return {
        "from_s": t_first,
        "to_s": t_last,
        "first": a,
        "last": b,
        "change_pct": (b - a) / a * 100 if a else float("nan"),
        "p5": values[len(values) // 20],
        "p95": values[len(values) * 19 // 20],
    }


def figures(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    samples = [s for s in results["samples"] if s["phase"] == "load"]
    restarts = [f["t"] for f in results["faults"] if f["fault"] == "redis-restart"]
    kills = [f["t"] for f in results["faults"] if f["fault"] == "worker-kill"]
    out: dict[str, Any] = {}
    block = args.block

    def settled(points: list[tuple[float, float]], resets: list[float], settle: float):
        """The points at least `settle` after the start and after the last reset before
        them (a restart that empties what is measured: a worker's memory, Redis)."""
        edges = [0.0, *resets]
        return [(t, v) for t, v in points if t >= max(e for e in edges if e <= t) + settle]

    for name, resets in (("w1", []), ("w2", kills)):
        for figure, path in (
            ("rss_kb", (name, "rss_kb")),
            ("fds", (name, "fds")),
            ("tasks", (name, "probe", "tasks")),
        ):
            points = settled(series(samples, path), resets, args.warmup)
            out[f"{name} {figure}"] = flatness(points, block)
    for figure, path in (
        ("redis keys", ("redis", "keys")),
        ("redis used_memory", ("redis", "used_memory")),
    ):
        points = settled(series(samples, path), restarts, max(args.warmup, args.replay_ttl + 60))
        out[figure] = flatness(points, block)
    out["pg connections"] = flatness(
        settled(series(samples, ("pg", "connections")), [], args.warmup), block
    )
    return out


def render(results: dict[str, Any], flat: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"{args.minutes:g} minutes, {args.streams} streams, a fault every {args.fault_every:g} s "
        f"({', '.join(args.faults)}, in turn)",
        "",
        "| figure | after warm-up: first → last (median of "
        f"{args.block:g} s) | change | p5–p95 | goal ±5 % |",
        "|---|---:|---:|---:|---|",
    ]
    for name, f in flat.items():
        if f is None:
            lines.append(f"| {name} | — | — | — | too few samples |")
            continue
        scale = 1 / 1024 if "rss" in name else (1 / 2**20 if "memory" in name else 1)
        unit = " MB" if scale != 1 else ""
        lines.append(
            f"| {name} ({f['from_s']:.0f}–{f['to_s']:.0f} s) | {f['first'] * scale:,.1f} → "
            f"{f['last'] * scale:,.1f}{unit} | {f['change_pct']:+.1f} % "
            f"| {f['p5'] * scale:,.1f}–{f['p95'] * scale:,.1f} "
            f"| {'yes' if abs(f['change_pct']) <= 5 else 'NO'} |"
        )
    load = [s for s in results["samples"] if s["phase"] == "load"]
    final = results.get("final_sample", {})
    for name in ("w1", "w2"):
        peak: dict[str, int] = {}
        for sample in load:
            for key, n in sample.get(name, {}).get("probe", {}).get("maps", {}).items():
                peak[key] = max(peak.get(key, 0), n)
        after = final.get(name, {}).get("probe", {}).get("maps", {})
        if peak or after:
            lines += [
                "",
                f"{name}: its maps' largest size under load → after the drain, and tasks "
                f"{final.get(name, {}).get('probe', {}).get('tasks', '—')} after the drain",
                "",
                "| map | under load, at most | after the drain |",
                "|---|---:|---:|",
            ]
            for key in sorted(set(peak) | set(after)):
                if peak.get(key) or after.get(key):
                    lines.append(f"| {key} | {peak.get(key, 0):,} | {after.get(key, '—')} |")
    c = results.get("check", {})
    lines += [
        "",
        f"answers: {c.get('answers')}; resumed: {c.get('resumed')}; refused starts: "
        f"{sum(results['refused'].values())} {results['refused']}",
        f"faults found: {c.get('faults') or 'none'}",
        f"ends: {c.get('ends')}",
        f"saved more than the client was shown (a cut /v1 stream, say): {c.get('saved_beyond_shown')}",
        f"keys after the drain: {results.get('final_keys', {}).get('kinds')}; "
        f"left behind: {results.get('final_keys', {}).get('left_behind')}",
        *(f"  {n} {label}" for label, n in results.get("final_keys", {}).get("sorted", {}).items()),
        "keys without a TTL at any sample: "
        + str(
            max((s.get("redis", {}).get("no_ttl_count", 0) for s in results["samples"]), default=0)
        )
        + "; with a TTL past their kind's longest: "
        + str(
            max(
                (s.get("redis", {}).get("too_long_count", 0) for s in results["samples"]), default=0
            )
        ),
        "faults injected: "
        + ", ".join(
            f"{f['fault']} at {f['t']:.0f} s ({f['seconds']} s)" for f in results["faults"]
        ),
    ]
    return "\n".join(lines)
