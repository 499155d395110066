"""What the answers' logs cost the garbage collector: `--answers` running answers of
`--tokens` tokens each, written through the server's own `LogWriter` with a reader
pushed every event (as a caught-up client is), under the server's collector
settings (`app.main.tune_gc`).

    python -m bench.collector                       # 1,000 answers × 400 tokens
    python -m bench.collector --answers 1000 --tokens 1000

Prints the objects the collector tracks beyond those before the answers started;
the collections that writing the tokens set off (each one a pause of the event
loop in the server), their number, total and longest; a full collection's time
afterwards; the time a token's write and push took; and the memory the process
grew by, a token.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import time
from typing import Any

from app.events import Handle
from app.main import tune_gc
from app.streams import GenerationLog, LogWriter
from bench.run import rss_kb


async def fill(answers: int, tokens: int) -> tuple[list[GenerationLog], float]:
    """The answers' logs, each token written and pushed to its reader; the µs each
    token took."""
    logs = []
    readers = []
    for i in range(answers):
        log = GenerationLog(Handle(str(i), f"a{i}", f"q{i}", "7", "q?"))
        logs.append(log)
        readers.append(asyncio.create_task(_read(log)))
    await asyncio.sleep(0)
    writers = [LogWriter(log) for log in logs]
    started = time.perf_counter()
    for n in range(tokens):
        text = f" token{n}"
        for writer in writers:
            writer.emit("message", data=text)
    took = time.perf_counter() - started
    for task in readers:
        task.cancel()
    for outcome in await asyncio.gather(*readers, return_exceptions=True):
        if isinstance(outcome, AssertionError):
            raise outcome
    return logs, took / (answers * tokens) * 1e6


async def _read(log: GenerationLog) -> None:
    def push(batch: list[Any]) -> bool:
        return True

    async for _ in log.follow(0, push):
        raise AssertionError("a caught-up reader is pushed every event")


class Pauses:
    """Every collection's time, from `gc.callbacks`."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.times.append((time.perf_counter() - self._start) * 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=400)
    args = parser.parse_args()
    tune_gc()
    rss = rss_kb(os.getpid())
    before = len(gc.get_objects())
    pauses = Pauses()
    gc.callbacks.append(pauses)
    logs, per_token = asyncio.run(fill(args.answers, args.tokens))
    gc.callbacks.remove(pauses)
    tracked = len(gc.get_objects()) - before
    grown = (rss_kb(os.getpid()) - rss) * 1024 / (args.answers * args.tokens)
    started = time.perf_counter()
    gc.collect()
    full = (time.perf_counter() - started) * 1000
    times = pauses.times
    print(
        f"{args.answers} answers × {args.tokens} tokens: {tracked:,} objects tracked;"
        f" {len(times)} collections while writing, {sum(times):.0f} ms in all,"
        f" the longest {max(times, default=0):.1f} ms; a full collection then {full:.1f} ms;"
        f" write and push {per_token:.2f} µs a token; {grown:.0f} bytes a token"
    )
    del logs


if __name__ == "__main__":
    main()
