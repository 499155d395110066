"""What following an answer from another process costs in Redis, beside what writing
costs: two Redis hubs (an owner and a follower, as two processes would have), the
owner running `--others` answers at `--rate` tokens/s plus the one followed.

    python -m bench.follow --others 1
    python -m bench.follow --others 200
    python -m bench.follow --others 200 --redis-url redis://127.0.0.1:7000 --cluster

Prints, per followed token: the follower's Redis commands and reply bytes; the
bytes of the owner's journal entries meanwhile (what a follower of the journal
would read); and the write side's Redis commands per token of every answer. Starts
its own redis-server unless given `--redis-url`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from app.events import Event, Handle
from app.streams import close_redis, open_redis
from app.streams.redis import RedisHub


def _size(reply: Any) -> int:
    """About the bytes of a RESP2 reply."""
    if isinstance(reply, bytes | str):
        return len(reply) + 6
    if isinstance(reply, dict):
        return 4 + sum(_size(k) + _size(v) for k, v in reply.items())
    if isinstance(reply, list | tuple):
        return 4 + sum(_size(item) for item in reply)
    return 4


class Counted:
    """Counts the commands and reply bytes of a client (and its pipelines)."""

    def __init__(self) -> None:
        self.commands = 0
        self.bytes = 0

    def wrap(self, client: Any) -> None:
        run = client.execute_command

        async def counted(*args: Any, **options: Any) -> Any:
            reply = await run(*args, **options)
            self.commands += 1
            self.bytes += _size(reply)
            return reply

        client.execute_command = counted
        pipeline = client.pipeline

        def pipe(*args: Any, **options: Any) -> Any:
            made = pipeline(*args, **options)
            execute = made.execute

            async def counted_execute(*a: Any, **o: Any) -> Any:
                replies = await execute(*a, **o)
                self.commands += len(replies)
                self.bytes += _size(replies)
                return replies

            made.execute = counted_execute
            return made

        client.pipeline = pipe


async def calls_by_node(client: Any, cluster: bool) -> dict[str, int]:
    """The commands each master (the one Redis) has run."""
    if cluster:
        found = await client.info("commandstats", target_nodes=client.PRIMARIES)
    else:
        found = {"redis": await client.info("commandstats")}
    return {
        node: sum(v["calls"] for k, v in stats.items() if k.startswith("cmdstat_"))
        for node, stats in found.items()
    }


async def run(url: str, cluster: bool, others: int, rate: float, tokens: int) -> dict[str, float]:
    admin = open_redis(url, cluster=cluster)
    owner_client, follower_client = (
        open_redis(url, cluster=cluster),
        open_redis(url, cluster=cluster),
    )
    options = {"replay_ttl": 60, "handle_ttl": 15, "max_generation_seconds": 600}
    follower_counts = Counted()
    journal_bytes = 0
    try:
        async with (
            RedisHub(owner_client, **options) as owner,
            RedisHub(follower_client, **options) as follower,
        ):
            follower_counts.wrap(follower.redis)
            follower_counts.wrap(follower.blocking)
            run_id = secrets.token_hex(4)  # a Redis kept from an earlier run holds its answers
            hs = [Handle(f"c{i}.{run_id}", f"a{i}.{run_id}", "q", "u", "q?") for i in range(others)]
            followed = Handle(f"cf.{run_id}", f"f.{run_id}", "q", "u", "q?")
            write = owner._write

            async def measured(plan: Any) -> Any:
                nonlocal journal_bytes
                journal_bytes += sum(
                    len(a) + len(orjson_dump(b)) for a, b in plan.journal.items()
                ) + sum(
                    len(w.answer_id) + len(w.dump())
                    for w in plan.logs
                    if w.answer_id == followed.answer_id
                )
                return await write(plan)

            owner._write = measured  # type: ignore[method-assign]
            logs = [await owner.register(h, lambda: None) for h in [followed, *hs]]
            got: list[Event] = []

            async def follow() -> None:
                async for batch in follower.subscribe(followed, 0):
                    got.extend(batch)

            reader = asyncio.create_task(follow())
            await asyncio.sleep(0.5)
            by_node = await calls_by_node(admin, cluster)
            before = sum(by_node.values())
            follower_before = follower_counts.commands
            follower_bytes_before = follower_counts.bytes
            journal_bytes = 0
            started = time.monotonic()
            for i in range(1, tokens + 1):
                for log in logs:
                    h = log.handle
                    log.append(Event("message", h.chat_id, h.answer_id, {"data": "word "}, i))
                await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
            for log in logs:
                h = log.handle
                await owner.finish(h, Event("messageEnd", h.chat_id, h.answer_id, {}, tokens + 1))
            await asyncio.wait_for(reader, 10)
            elapsed = time.monotonic() - started
            by_node_after = await calls_by_node(admin, cluster)
            after = sum(by_node_after.values())
            follower_commands = follower_counts.commands - follower_before
            follower_bytes = follower_counts.bytes - follower_bytes_before
            written = after - before - follower_commands
            assert [e.seq for e in got] == list(range(1, tokens + 2))
            per_node = {
                f"commands_per_s {node}": (by_node_after[node] - by_node.get(node, 0)) / elapsed
                for node in sorted(by_node_after)
            }
            return {
                **per_node,
                "follower_commands_per_token": follower_commands / tokens,
                "follower_bytes_per_token": follower_bytes / tokens,
                "journal_bytes_per_followed_token": journal_bytes / tokens,
                "write_commands_per_token": written / (tokens * (others + 1)),
            }
    finally:
        for client in (admin, owner_client, follower_client):
            await close_redis(client)


def orjson_dump(value: Any) -> bytes:
    from app.streams.rediskeys import dump_events

    return dump_events(value)


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    folder = tempfile.mkdtemp(prefix="benchredis-")
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        + ["--appendonly", "no", "--dir", folder],
        stdout=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            with socket.socket() as sock, contextlib.suppress(OSError):
                sock.connect(("127.0.0.1", port))
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--others", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0, help="tokens/s of each answer")
    parser.add_argument("--tokens", type=int, default=200, help="tokens of each answer")
    parser.add_argument("--redis-url", default="")
    parser.add_argument("--cluster", action="store_true")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(redis_server())
        figures = asyncio.run(run(url, args.cluster, args.others, args.rate, args.tokens))
    for name, value in figures.items():
        print(f"{name}: {value:.3f}")


if __name__ == "__main__":
    main()
