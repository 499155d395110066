"""What the scheduler costs: 10,000 schedules of which 100 fall due in the same minute.

    python -m bench.schedules                      # SQLite in a temporary folder
    python -m bench.schedules --store postgresql://user@host/db

One scheduler (its clock driven) ticks once a tick interval over a simulated minute
in which `--due` of `--schedules` schedules fall due; runs are recorded, not
answered. Printed: the store statements one idle minute of ticks costs, the
statements and the time the due minute's claims cost, the delay from the due time
to each run's start (tick interval excluded: the claim's own cost), and how many
webhooks a second one process signs and posts to a receiver on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.config import Settings
from app.main import open_service
from app.metrics import Metrics
from app.schedules import ScheduleService
from app.store.records import Chat, Delivery, Schedule, ScheduleRun
from app.webhooks import Webhooks, new_secret

MINUTE = 1_798_416_000.0  # a Monday, 00:00 UTC


def counting(db: Any) -> list[int]:
    """Count the trips to `db`: statements outside a transaction, and transactions
    (each one trip here, whatever it runs)."""
    count = [0]
    for name in ("fetch", "execute", "executemany", "transaction"):
        inner = getattr(db, name)

        def wrapped(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            count[0] += 1
            return _inner(*args, **kwargs)

        setattr(db, name, wrapped)
    return count


async def main(args: argparse.Namespace) -> None:
    folder = tempfile.mkdtemp(prefix="bench-schedules-")
    settings = Settings().replace(
        llm={"base_url": "demo"},
        search={"provider": "searxng"},
        searxng={"url": "http://127.0.0.1:9"},
        store={"url": args.store or f"sqlite:///{folder}/chat.db"},
        collections={"url": f"tantivy:///{folder}/collections"},
        schedules={"min_interval_seconds": 60, "webhook_allow_private_networks": True},
    )
    clock_now = [MINUTE - 120]
    starts: list[float] = []

    async def record(schedule: Schedule, run: ScheduleRun) -> None:
        starts.append(time.perf_counter())

    async with open_service(settings, metrics=Metrics()) as chat:
        scheduler = ScheduleService(chat, clock=lambda: clock_now[0], runner=record)
        store = chat.store
        made = time.perf_counter()
        for n in range(args.schedules):
            due = MINUTE if n < args.due else MINUTE + 86400 * 30
            schedule = Schedule(
                f"s{n}", f"u{n}", f"c{n}", "q", "0 0 * * *", "UTC", due, MINUTE - 3600
            )
            await store.add_schedule(schedule, Chat(f"c{n}", f"u{n}", "q", "deepSeek", 0), 10)
        print(f"{args.schedules} schedules made in {time.perf_counter() - made:.1f} s")
        count = counting(store.db)  # type: ignore[attr-defined]
        ticks = int(60 / args.tick)
        for _ in range(ticks):  # an idle minute
            await scheduler.tick()
            clock_now[0] += args.tick
        print(f"idle minute: {count[0]} store calls ({ticks} ticks of {args.tick:.0f} s)")
        count[0] = 0
        clock_now[0] = MINUTE
        began = time.perf_counter()
        tasks = await scheduler.tick()
        await asyncio.gather(*tasks)
        took = time.perf_counter() - began
        delays = sorted(s - began for s in starts)
        print(
            f"due minute: {len(tasks)} runs claimed by one tick in {took * 1000:.0f} ms,"
            f" {count[0]} store calls (statements or transactions); delay from the tick to a run's start:"
            f" median {statistics.median(delays) * 1000:.0f} ms,"
            f" max {delays[-1] * 1000:.0f} ms"
        )
        await scheduler.aclose()
        await webhooks(settings, store, args.webhooks)


async def webhooks(settings: Settings, store: Any, count: int) -> None:
    import uvicorn

    got = [0]

    async def receive(request: Request) -> Response:
        await request.body()
        got[0] += 1
        return Response(b"{}")

    server = uvicorn.Server(
        uvicorn.Config(
            Starlette(routes=[Route("/", receive, methods=["POST"])]),
            host="127.0.0.1",
            port=0,
            log_level="warning",
        )
    )
    serving = asyncio.create_task(server.serve())
    for _ in range(1000):
        if server.started:
            break
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    sender = Webhooks(settings.schedules, store, owner="bench")
    secret = new_secret()
    body = '{"type": "schedule.run.completed", "answer": "' + "x" * 2000 + '"}'
    now = time.time()
    deliveries = [
        Delivery(f"msg_{n}", f"http://127.0.0.1:{port}/", secret, body, now, now + 60)
        for n in range(count)
    ]
    began = time.perf_counter()
    for start in range(0, count, 20):
        await asyncio.gather(*(sender.send(d) for d in deliveries[start : start + 20]))
    took = time.perf_counter() - began
    print(f"webhooks: {got[0]} signed and posted in {took:.2f} s, {got[0] / took:.0f} a second")
    await sender.aclose()
    server.should_exit = True
    await serving


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default="", help="a store URL (default: SQLite, temporary)")
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--due", type=int, default=100)
    parser.add_argument("--tick", type=float, default=10.0)
    parser.add_argument("--webhooks", type=int, default=500)
    asyncio.run(main(parser.parse_args()))
