"""What the checkpoints without Redis cost as the running answers grow: `--answers`
running answers, each growing by `--tokens` tokens between two checkpoints (20
tokens a second and the default `stream.flush_interval_ms` of 200 ms: 4), saved
as a checkpoint saves them, first whole (what every checkpoint sent before) and
then only what was added (what it sends now), in the same store.

    python -m bench.checkpoints                          # ~2 minutes
    python -m bench.checkpoints --answers 1000 --rounds 225 --store sqlite

Each mode runs on answers of its own, from empty to `--rounds` checkpoints long
(225 rounds of 4 tokens: the 900-token answers of `bench.capacity`'s 1,000
streams); figures are the CPU per checkpoint of this process (the server's side:
parameters encoded, the driver) and of PostgreSQL (its server and backends), in
the first and the last tenth of the rounds: flat when nothing grows with the
answers' length.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time

from app.cleaning import clean
from app.store import Chat, Checkpoint, StoredMessage, open_store
from bench.paced import cpu_split
from tests.conftest import PostgresServer, new_database

WHOLE = (
    "UPDATE messages SET content = ?, reasoning = ?, steps = ? WHERE id = ?"
    " AND status = 'streaming'"
)
WORDS = ("the ", "engine ", "burns ", "methane ", "and ", "oxygen, ", "which ", "cools ")


async def run(url: str, mode: str, args: argparse.Namespace, store_pid: int | None) -> dict:
    store = open_store(url)
    async with store:
        ids = [f"{mode}-{i}" for i in range(args.answers)]
        now = time.time()
        for i, answer_id in enumerate(ids):
            await store.begin_answer(
                Chat(f"c-{answer_id}", "1", "t", "deepSeek", now + i),
                StoredMessage(f"q-{answer_id}", f"c-{answer_id}", "user", "q", now + i),
                StoredMessage(answer_id, f"c-{answer_id}", "assistant", "", now + i, "streaming"),
            )
        content = {answer_id: "" for answer_id in ids}
        ours, theirs = [], []
        for round_ in range(args.rounds):
            batch = []
            for i, answer_id in enumerate(ids):
                before = content[answer_id]
                added = "".join(WORDS[(round_ + i + t) % len(WORDS)] for t in range(args.tokens))
                content[answer_id] = before + added
                if mode == "whole":
                    batch.append(Checkpoint(answer_id, before + added, "", []))
                else:
                    batch.append(  # as the keeper sends it: the steps once, then when they change
                        Checkpoint(answer_id, added, "", [], len(before), steps_changed=not round_)
                    )
            store0 = sum(cpu_split(store_pid)) if store_pid else 0.0
            cpu0 = time.process_time()
            if mode == "whole":  # what every checkpoint did before: cleaned, then sent
                json = store.db.dialect.json  # type: ignore[attr-defined]
                await store.db.executemany(  # type: ignore[attr-defined]
                    WHOLE,
                    [(c.content, c.reasoning, json(c.steps), c.answer_id) for c in clean(batch)],
                )
            else:
                await store.checkpoint_answers(batch)
            ours.append(time.process_time() - cpu0)
            theirs.append(sum(cpu_split(store_pid)) - store0 if store_pid else 0.0)
        last = await store.get_message(ids[-1])
        assert last is not None, "the row is gone"
        assert last.content == content[ids[-1]], f"{len(last.content)} of {len(content[ids[-1]])}"
    tenth = max(1, args.rounds // 10)
    return {
        "mode": mode,
        "chars_at_end": len(content[ids[-1]]),
        "ours_first_ms": round(statistics.mean(ours[:tenth]) * 1000, 1),
        "ours_last_ms": round(statistics.mean(ours[-tenth:]) * 1000, 1),
        "store_first_ms": round(statistics.mean(theirs[:tenth]) * 1000, 1),
        "store_last_ms": round(statistics.mean(theirs[-tenth:]) * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--answers", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=4, help="tokens added between checkpoints")
    parser.add_argument("--rounds", type=int, default=225)
    parser.add_argument("--store", choices=["sqlite", "postgres"], default="postgres")
    parser.add_argument("--modes", default="whole,added", help="in this order")
    args = parser.parse_args()
    rows = []
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        pid = None
        if args.store == "postgres":
            server = PostgresServer()
            server.start()
            stack.callback(server.remove)
            assert server.proc is not None
            url, pid = new_database(server.url), server.proc.pid
        else:
            url = f"sqlite:///{tmp}/checkpoints.db"
        for mode in args.modes.split(","):
            rows.append(asyncio.run(run(url, mode, args, pid)))
            print(rows[-1], flush=True)
    print(
        f"\n{args.answers} running answers, {args.tokens} tokens added between checkpoints, "
        f"{args.rounds} checkpoints ({args.store})"
    )
    print(
        "| a checkpoint sends | answer length at the end | this process, first tenth "
        "| last tenth | the store's server, first tenth | last tenth |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        store = (
            f"{r['store_first_ms']} ms | {r['store_last_ms']} ms" if pid else "— (in process) | —"
        )
        print(
            f"| {r['mode']} | {r['chars_at_end']:,} chars | {r['ours_first_ms']} ms "
            f"| {r['ours_last_ms']} ms | {store} |"
        )


if __name__ == "__main__":
    main()
