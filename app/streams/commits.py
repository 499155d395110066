"""The Redis hub's group commit.

A generation appends to its local log (which local clients follow with no Redis
round trip). Every `linger` the committer writes the new events of every generation
of the process as one entry of the process's journal — one XADD however many
generations run — and releases them to readers once Redis has acknowledged it. Each
generation's own log is written from that every checkpoint, at its end, and at
every commit while another process follows it; the journal is trimmed to what the
logs do not hold yet (the `Journal` says what to write where). So Redis is never
more than a commit behind, a token costs a small fraction of a command, and a
follower reads only its answer's log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import MaxConnectionsError, RedisError

from ..events import Event, Handle
from . import rediskeys as k
from .base import GenerationLog, LocalRegistry
from .claims import end_in
from .journal import Journal, Plan
from .rediskeys import BUSY_SECONDS

log = logging.getLogger("app.streams")

LOG_CAP = 100_000  # entries (batches) per generation, approximate
#: the error an answer ends with when its events cannot be written
UNWRITABLE = "the answer could not be passed on: an event of it could not be written"


class Committer:
    """Writes what the `journal` says, one commit at a time. `queue` is every local
    log's sink; `run` is the committer's loop (the hub's chore). Through an outage
    (`outage`) it retries, calling `on_failure` after each failed commit and
    `on_back` once a commit succeeds again."""

    def __init__(
        self,
        redis: Any,
        token: str,
        local: LocalRegistry,
        journal: Journal,
        *,
        linger: float,
        timeout: float,
        replay_ttl_ms: int,
        keep_ms: int,
        on_failure: Callable[[], Awaitable[None]],
        on_back: Callable[[], None],
    ) -> None:
        self.redis = redis
        self.token = token
        self.local = local
        self.journal = journal
        self.linger = linger
        self.timeout = timeout
        self.replay_ttl_ms = replay_ttl_ms
        self.keep_ms = keep_ms
        self.on_failure = on_failure
        self.on_back = on_back
        #: generations whose end waits for the next commit: it says so, ends the claim
        self.ending: dict[str, tuple[asyncio.Future[None], Handle, str | None]] = {}
        self.wake = asyncio.Event()
        self.lock = asyncio.Lock()
        self.outage = False
        #: answers ended with an error because their events could not be written
        self.failed: set[str] = set()

    def queue(self, log_: GenerationLog, event: Event) -> None:
        """A log's sink: queue a numbered event for the next commit, which releases it
        to readers once Redis has acknowledged it."""
        self.journal.queue(log_.handle.answer_id, event)
        self.wake.set()

    async def run(self) -> None:
        """Group commit: the events every generation of this process wrote within
        `linger` go to Redis in one journal entry, and reach readers when Redis
        has acknowledged it. Through an outage it retries with growing pauses; the
        events wait, unseen (or until their generation ends, see `finish`)."""
        delay = 0.05
        while True:
            await self.wake.wait()
            if self.linger > 0:
                await asyncio.sleep(self.linger)
            try:
                async with asyncio.timeout(self.timeout * 2):
                    await self.flush()
            except MaxConnectionsError:  # every connection to a node is taken: soon again
                await asyncio.sleep(BUSY_SECONDS)
                self.wake.set()
            except (RedisError, OSError, TimeoutError) as exc:
                if not self.outage:
                    log.warning(
                        "redis unavailable: events of %d answers wait: %r",
                        len(self.journal.pending),
                        exc,
                    )
                self.outage = True
                await self.on_failure()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                if self.journal.pending:
                    self.wake.set()  # try again: finished generations append nothing more
            else:
                if self.outage:
                    log.info("redis is back: events are written again")
                    self.on_back()  # are the claims still there?
                self.outage, delay = False, 0.05

    async def flush(self, only: str | None = None) -> None:
        """Write pending events — of every generation, or of the answer id `only` — as
        the journal says (`Journal.plan`), and release what was written to the
        generations' readers. Serialised, so each log's entries stay in order. Raises
        when Redis fails (the events stay pending). A commit that fails otherwise (an
        event that cannot be encoded) ends the answers it cannot write with an error
        (`_quarantine`), and the others are written at once: one answer never holds
        back the rest."""
        async with self.lock:
            if only is None:
                self.wake.clear()
            while True:
                now = time.monotonic()
                plan = self.journal.plan(now, only)
                if plan is None:
                    return
                try:
                    entry = await self._write(plan)
                except (RedisError, OSError, TimeoutError):
                    self.journal.failed(plan)
                    raise
                except Exception as exc:
                    self.journal.failed(plan)
                    if not self._quarantine(plan, exc):
                        raise
                    continue
                except BaseException:
                    self.journal.failed(plan)
                    raise
                break
            self.journal.written(plan, entry, now)
            for answer_id, batch in plan.pending.items():  # durable: readers may have them
                written = self.local.log(answer_id)
                if written is not None:
                    written.release(batch[-1].seq)
            for answer_id in plan.ended:
                ending = self.ending.get(answer_id)
                if ending is not None and not ending[0].done():
                    ending[0].set_result(None)

    def _quarantine(self, plan: Plan, exc: Exception) -> bool:
        """A commit failed with something other than Redis failing: end the answers it
        could not write — those whose new events do not encode, else (the cause is not
        known) all of it — with an `INTERNAL` error, numbered right after what their
        readers were shown, in place of their unwritten events, and cancel their
        generations. An answer already ended so whose error cannot be written either
        is given up here (readers elsewhere end when its claim goes). False when
        nothing changed."""
        culprits = []
        for answer_id, batch in plan.pending.items():
            try:
                k.dump_events(batch)
            except Exception:  # orjson: a lone surrogate, a value it does not know
                culprits.append(answer_id)
        if not culprits:
            culprits = [*plan.pending, *(w.answer_id for w in plan.logs)]
        log.error(
            "the events of %s could not be written: ended with an error: %r",
            ", ".join(culprits),
            exc,
        )
        changed = False
        for answer_id in dict.fromkeys(culprits):
            log_ = self.local.log(answer_id)
            if answer_id in self.failed or log_ is None or log_.finished:
                if answer_id in self.journal.pending or answer_id in self.journal.unlogged:
                    self.journal.forget(answer_id)
                    changed = True
                continue
            h = log_.handle
            data = {"key": "INTERNAL", "data": UNWRITABLE}
            error = Event("error", h.chat_id, h.answer_id, data, log_.durable + 1)
            self.journal.replace(answer_id, error)
            self.failed.add(answer_id)
            log_.fail(error)
            self.local.cancel(answer_id)
            changed = True
        return changed

    async def _write(self, plan: Plan) -> tuple[int, int] | None:
        """One commit, in one pipeline; the id of its journal entry, if any. The claims
        of the generations that end in it (and wait for it, see `finish`) end there
        too, after their log: `plan.ended` says which."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for write in plan.logs:
                key = k.log(write.answer_id)
                pipe.xadd(key, {"e": write.dump()}, maxlen=LOG_CAP, approximate=True)
                if write.expire == "replay":  # kept for replay from now on
                    pipe.pexpire(key, self.replay_ttl_ms)
                    ending = self.ending.get(write.answer_id)
                    if ending is not None:
                        _, handle, cap_key = ending
                        end_in(pipe, handle, k.dump_handle(handle), cap_key, self.replay_ttl_ms)
                        plan.ended.append(write.answer_id)
                elif write.expire == "running":
                    pipe.pexpire(key, self.keep_ms)
            if not plan.journal:
                await pipe.execute()
                return None
            at = len(pipe)
            journal = k.journal(self.token)
            fields = plan.encode()
            if plan.trim is not None:  # trimmed exactly: a handful of entries at a time
                pipe.xadd(journal, fields, minid=k.entry_id(plan.trim), approximate=False)
            else:
                pipe.xadd(journal, fields)
            if plan.expire_journal:  # the heartbeat keeps it from now on
                pipe.pexpire(journal, self.keep_ms)
            results = await pipe.execute()
        return k.parse_id(results[at])
