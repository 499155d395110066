"""CPU per answer outside its tokens: many two-token answers, each in a new chat.

    python -m bench.answers                  # ~30 s
    python -m bench.answers --answers 800 --store postgres

What an answer costs besides its tokens: the request, the chat, question and
answer rows, the model request, the title (a second model request), the final
save. The server (`python -m app`) is pinned to core 0, this load generator and
the fast fake model to core 1; the server's CPU (user + system, from /proc) over
the answers, in batches of 40 started over one 20 ms interval.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time

from bench.paced import run_streams
from bench.run import LOAD_CORE, app_server, cpu_seconds, fast_model
from tests.conftest import new_database, start_postgres


async def measure(url: str, pid: int, answers: int) -> float:
    await run_streams("sse", url, 20, 2, 50)  # warm up: imports, connections, caches
    before = cpu_seconds(pid)
    for _ in range(answers // 40):
        await run_streams("sse", url, 40, 2, 50)
    return (cpu_seconds(pid) - before) / (answers // 40 * 40)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--answers", type=int, default=400)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--store", choices=["sqlite", "postgres"], default="sqlite")
    args = parser.parse_args()
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {int(LOAD_CORE)})
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        model = stack.enter_context(fast_model())
        env = {}
        if args.store == "postgres":
            env["STORE_URL"] = new_database(stack.enter_context(start_postgres()))
        url, pid = stack.enter_context(app_server(model, tmp, **env))
        time.sleep(0.5)
        each = [asyncio.run(measure(url, pid, args.answers)) for _ in range(args.runs)]
    ms = [round(e * 1000, 2) for e in each]
    print(f"{args.answers} answers × {args.runs} runs: {statistics.median(ms)} ms CPU each {ms}")


if __name__ == "__main__":
    main()
