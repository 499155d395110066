"""What the Redis hub does when Redis lost its data (restarted empty, or a Cluster
node that came back without its replica's copy).

Each owner re-asserts what it holds — claims, handles and whole logs — at its next
heartbeat, which runs at once when its connection comes back. A process that
finds its own `proc` key gone, or one of its answers' handles gone, knows Redis lost
data: it refuses new registrations for `settle` seconds (503, retry) and says so
in Redis (`recovering`), and any process that lost its connection treats a
missing claim as "unknown" rather than "lost" for as long, so that no second
answer starts in a running chat and no follower is cut off while the owners
catch up.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..errors import Unavailable
from . import rediskeys as k
from .base import GenerationLog
from .journal import Journal

log = logging.getLogger("app.streams")

REWRITE_BATCH = 500  # events per entry when a whole log is written again


def recovering(seconds: float) -> Unavailable:
    return Unavailable(
        "the stream registry is recovering from a restart; try again shortly",
        retry_after=max(1, round(seconds)),
    )


class Recovery:
    """The hub's view of whether Redis may have lost data, and what to write again."""

    def __init__(self, settle: float) -> None:
        #: how long owners may take to re-assert after Redis lost its data
        self.settle = settle
        self.recovering_until = 0.0  # registrations wait (Redis lost its data)
        self.doubt_until = 0.0  # a missing claim means "unknown" (an outage was seen)
        self.say_so = False  # set `recovering` in Redis at the next beat
        self.needs_reassert: set[str] = set()  # answer ids whose keys to write again

    def lost_data(self) -> None:
        """Redis came back empty: owners need `settle` seconds to re-assert. Says so in
        Redis too (at the next beat), for processes that did not see the outage."""
        until = time.monotonic() + self.settle
        self.recovering_until = max(self.recovering_until, until)
        self.doubt_until = max(self.doubt_until, until)
        self.say_so = True

    def connection_lost(self) -> None:
        self.doubt_until = max(self.doubt_until, time.monotonic() + self.settle + 2.0)

    def doubtful(self) -> bool:
        return time.monotonic() < self.doubt_until

    def refusing(self) -> float:
        """For how many more seconds new registrations are refused."""
        return self.recovering_until - time.monotonic()

    async def reassert(
        self,
        redis: Any,
        token: str,
        logs: list[GenerationLog],
        journal: Journal,
        *,
        replay_ms: int,
        running_ms: int,
    ) -> None:
        """Write again what Redis lost of this process's generations: handles, latest
        pointers, owners and whole logs (what was pending included), then release
        them to readers. Raises when Redis fails; the caller keeps them to try again.
        The caller holds the commit lock."""
        written: dict[str, int] = {}
        async with redis.pipeline(transaction=False) as pipe:
            for log_ in logs:
                h = log_.handle
                keep = replay_ms if log_.finished else replay_ms + running_ms
                pipe.set(k.gen(h.answer_id), k.dump_handle(h), px=keep)
                pipe.set(k.latest(h.chat_id), h.answer_id, px=keep)
                pipe.set(k.owner(h.answer_id), token, px=keep)
                pipe.delete(k.log(h.answer_id))
                events = list(log_.events)
                for start in range(0, len(events), REWRITE_BATCH):
                    batch = events[start : start + REWRITE_BATCH]
                    pipe.xadd(k.log(h.answer_id), {"e": k.dump_events(batch)})
                pipe.pexpire(k.log(h.answer_id), keep)
                written[h.answer_id] = events[-1].seq if events else 0
            await pipe.execute()
        for log_ in logs:  # durable again, whatever was pending
            log_.release(written[log_.handle.answer_id])
            journal.rewritten(
                log_.handle.answer_id, written[log_.handle.answer_id], not log_.finished
            )
        log.info("re-asserted %d answers after redis lost their data", len(logs))
