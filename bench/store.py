"""What a save and a chat read cost in the store, on SQLite and on PostgreSQL.

    python -m bench.store                        # a PostgreSQL of its own (initdb)
    python -m bench.store --postgres postgresql://user@host/db --turns 300

Per backend, `--turns` question/answer turns are saved into `--chats` chats: each
turn is a `begin_answer` (the question and the streaming answer), then a
`finish_answer` with usage (the answer's end: the message, the user's tokens of
the day). Then every chat is read `--reads` times as the chat page reads it:
`get_chat` and `list_messages`. Printed: microseconds per call, the median and
p90 of the calls, for `save` (begin + finish, one turn) and `read` (one chat).
Run it twice on an idle machine and compare like with like: the figures move
with the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator

from app.store import Chat, Saved, StoredMessage, Usage, open_store


def _micros(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[int(len(ordered) * 0.9)]
    return f"median {statistics.median(ordered) * 1e6:8.0f} µs   p90 {p90 * 1e6:8.0f} µs"


async def measure(url: str, turns: int, chats: int, reads: int) -> dict[str, list[float]]:
    saves: list[float] = []
    loads: list[float] = []
    async with open_store(url) as store:
        at = time.time()
        for n in range(turns):
            chat_id = f"c{n % chats}"
            chat = Chat(chat_id, "u1", "bench", "webSearch", at)
            question = StoredMessage(f"q{n}", chat_id, "user", "a question " * 5, at + n)
            answer = StoredMessage(
                f"a{n}",
                chat_id,
                "assistant",
                "",
                at + n + 0.5,
                status="streaming",
                reply_to=f"q{n}",
            )
            usage = Usage("m", 100, 200, 0, False)
            saved = Saved("an answer " * 80, "", "completed", usage=usage, question_id=f"q{n}")
            started = time.perf_counter()
            await store.begin_answer(chat, question, answer)
            await store.finish_answer(answer.id, saved)
            saves.append(time.perf_counter() - started)
        for _ in range(reads):
            for c in range(chats):
                started = time.perf_counter()
                await store.get_chat(f"c{c}")
                await store.list_messages(f"c{c}")
                loads.append(time.perf_counter() - started)
    return {"save": saves, "read": loads}


@contextlib.contextmanager
def postgres(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    from tests.conftest import new_database, start_postgres

    with start_postgres() as server:
        yield new_database(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--postgres", help="a database to use (default: start one)")
    parser.add_argument("--turns", type=int, default=400)
    parser.add_argument("--chats", type=int, default=20)
    parser.add_argument("--reads", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, postgres(args.postgres) as pg_url:
        targets = {"sqlite": f"sqlite:///{tmp}/{uuid.uuid4().hex}.db", "postgres": pg_url}
        for name, url in targets.items():
            figures = asyncio.run(measure(url, args.turns, args.chats, args.reads))
            for what, samples in figures.items():
                print(f"{name:9} {what:5} {_micros(samples)}   ({len(samples)} calls)")


if __name__ == "__main__":
    main()
