"""`redis://`: the registry and event logs shared by every server process, on one
Redis or a Redis Cluster (the same commands: each touches one hash slot).

The hub is composed of parts, each in its module:

    rediskeys   the keys (hash-tagged by chat, answer or process) and their encodings
    claims      claims on chats, the concurrency cap, one-at-a-time chores (scripts)
    journal     the group commit's bookkeeping, with no I/O: what to write where
    beat        the heartbeat's bookkeeping, with no I/O: which claims and flags to read
    follower    following a generation of another process (its log only)
    recovery    what is done when Redis lost its data

A generation appends to its local log (which local clients follow with no
Redis round trip). Every `commit_linger` the committer writes the new events of
every generation of the process as one entry of the process's journal — one
XADD however many generations run — and releases them to readers once Redis has
acknowledged it. Each generation's own log is written from that every
`CHECKPOINT_SECONDS`, at its end, and at every commit while another process
follows it; the journal is trimmed to what the logs do not hold yet. So Redis is
never more than a commit behind, a token costs a small fraction of a command,
and a follower reads only its answer's log.

Claims are extended once a quarter of their TTL old, one GETEX each (which says
whose the claim is); a claim found missing is set again (compare-and-set).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from redis.exceptions import MaxConnectionsError, RedisError

from ..chores import Chores
from ..errors import Unavailable
from ..events import Event, Handle
from . import rediskeys as k
from .base import (
    GenerationLog,
    LocalRegistry,
    Running,
    StreamHub,
    already_running,
    too_many,
)
from .beat import Beat
from .claims import RECOVERING, TAKEN, Claims, end_in
from .connect import blocking_client, close_redis, is_cluster, refresh_cluster, shed_idle
from .follower import follow
from .journal import Journal, Plan
from .recovery import Recovery, recovering
from .rediskeys import BUSY_SECONDS, WATCH_EVERY

log = logging.getLogger("app.streams")

LOG_CAP = 100_000  # entries (batches) per generation, approximate
#: how often a running generation's own log is brought up to date from the journal
CHECKPOINT_SECONDS = 2.0
OWNERS_KEPT = 1024  # answers of other processes whose owner is remembered
#: how often the waiting client's unused connections are closed (see `_shed_idle`)
SHED_SECONDS = 60.0
#: the longest one call to Redis may take: connecting, or a command's answer
OPERATION_SECONDS = 2.0
#: a cancel listener that heard nothing for this long asks Redis whether it is there
LISTEN_PING_SECONDS = 5.0
#: the error an answer ends with when its events cannot be written
UNWRITABLE = "the answer could not be passed on: an event of it could not be written"


@contextlib.asynccontextmanager
async def unavailable(seconds: float = OPERATION_SECONDS * 2) -> AsyncIterator[None]:
    """Redis failing under an operation that needs it — refusing, or not answering
    within `seconds` (a few round trips) —: `Unavailable` (503)."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except (RedisError, OSError, TimeoutError) as exc:
        log.warning("redis is unavailable: %r", exc)
        raise Unavailable("the stream registry is unavailable; try again shortly") from exc


class RedisHub(StreamHub):
    """Shares the registry and the logs through Redis; this process's own part lives
    in a `LocalRegistry`, so local readers never wait on Redis. The Redis client (a
    `Redis` or a `RedisCluster`) is the caller's (opened and closed with the app)."""

    name = "redis"
    holds_events = True

    def __init__(
        self,
        redis: Any,
        *,
        replay_ttl: float,
        handle_ttl: float,
        max_generation_seconds: float,
        commit_linger: float = 0.005,
        flush_interval: float | None = None,
        blocking: Any = None,
        timeout: float = OPERATION_SECONDS,
    ) -> None:
        self.redis = redis
        #: the longest one call to Redis may take (a few round trips: twice that)
        self.timeout = timeout
        #: for reads that wait on Redis (XREAD BLOCK, pub/sub): connections of their
        #: own, so that waiting readers never hold the connections commits need
        self.blocking = blocking or blocking_client(redis)
        self._owns_blocking = blocking is None
        self._cluster = is_cluster(redis)
        self._mapped = 0.0  # when the cluster's slot map was last read after a failure
        self.local = LocalRegistry(replay_ttl)
        self.token = secrets.token_hex(8)
        self.replay_ttl_ms = int(replay_ttl * 1000)
        self.handle_ttl_ms = int(handle_ttl * 1000)
        self.claim_ttl = handle_ttl
        #: this process's liveness key outlives a beat or two that a busy loop delays:
        #: found missing, it means Redis lost its data
        self.proc_ttl_ms = self.handle_ttl_ms * 2
        #: how long new events wait for others to share their journal write; a flush
        #: interval given by older callers caps it
        self.commit_linger = (
            commit_linger if flush_interval is None else min(commit_linger, flush_interval)
        )
        self.max_generation_ms = int(max_generation_seconds * 1000)
        self.keep_ms = self.max_generation_ms + self.replay_ttl_ms
        self.beat_interval = min(handle_ttl / 3, 2.0)
        self.recovery = Recovery(settle=self.beat_interval + 1.0)
        self.settle = self.recovery.settle
        self.claims = Claims(
            redis, self.token, handle_ttl_ms=self.handle_ttl_ms, keep_ms=self.keep_ms
        )
        self.journal = Journal(CHECKPOINT_SECONDS)
        #: a claim is extended at the first beat after it is a quarter of its TTL old
        #: (at least half its TTL is always left: an owner cut off from Redis for
        #: less than that keeps its chats)
        self.claim_refresh = handle_ttl / 4
        self._extended: dict[str, float] = {}  # when each claim was set or last extended
        self._owners: dict[str, str] = {}  # answers of other processes: whose they are
        #: ended answers whose end Redis did not take (the claim released, the keys
        #: kept for replay only): done again at each heartbeat until it does
        self._unended: dict[str, tuple[Handle, str | None]] = {}
        #: generations whose end waits for the next commit: it says so, ends the claim
        self._ending: dict[str, tuple[asyncio.Future[None], Handle, str | None]] = {}
        self._wake = asyncio.Event()
        self._beat_now = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._chores = Chores("redis hub")
        self._outage = False
        #: whether cancels may have been published while the listener did not listen
        self._flags_unread = True
        self._fresh: set[str] = set()  # answers registered since the last beat
        #: answers ended with an error because their events could not be written
        self._failed: set[str] = set()

    # -- lifecycle ------------------------------------------------------------------

    async def open(self) -> None:
        async with self._unavailable():
            await self.redis.set(k.proc(self.token), b"1", px=self.proc_ttl_ms)
        self._chores.loop("committer", self._committer)
        self._chores.loop("cancel listener", self._listener)
        self._chores.loop("heartbeat", self._heartbeat)
        self._chores.loop("idle connections", self._shed_idle)

    async def _shed_idle(self) -> None:
        """Every `SHED_SECONDS`, close the waiting client's connections that no reader
        uses (each follower held one while it waited): a worker that once followed
        hundreds of answers does not keep their sockets."""
        while True:
            await asyncio.sleep(SHED_SECONDS)
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(self.timeout):
                    await shed_idle(self.blocking)

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(self.timeout):
                await self.flush()
        await self._chores.aclose()
        await self.claims.aclose()
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(self.timeout):
                await self.redis.delete(k.proc(self.token))
        if self._owns_blocking:
            with contextlib.suppress(RedisError, OSError):
                await close_redis(self.blocking)
        self.local.close()

    @property
    def degraded(self) -> bool:
        return self._outage

    async def ping(self) -> None:
        async with self._unavailable():
            await self.redis.ping()

    @contextlib.asynccontextmanager
    async def _unavailable(self) -> AsyncIterator[None]:
        """`unavailable`, and the cluster's slot map read again after a failure."""
        try:
            async with unavailable(self.timeout * 2):
                yield
        except Unavailable as exc:
            if not isinstance(exc.__cause__, MaxConnectionsError):  # busy, not failing
                await self.reconnect()
            raise

    def connection_lost(self) -> None:
        self.recovery.connection_lost()

    async def reconnect(self) -> None:
        """After a failed call: on a cluster, read where the slots are now (a replica
        may have taken over a failed master), at most twice a second. redis-py reads
        it again by itself after a failed command, not after a failed pipeline."""
        now = time.monotonic()
        if not self._cluster or now - self._mapped < 0.5:
            return
        self._mapped = now
        for client in (self.redis, self.blocking):
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(self.timeout):
                    await refresh_cluster(client)

    def _lost_data(self) -> None:
        self.recovery.lost_data()
        self._beat_now.set()

    # -- registry -------------------------------------------------------------------

    async def register(
        self,
        handle: Handle,
        on_cancel: Callable[[], None],
        *,
        cap_key: str = "",
        max_running: int = 0,
    ) -> GenerationLog:
        wait = self.recovery.refusing()
        if wait > 0:
            raise recovering(wait)
        payload = k.dump_handle(handle)
        cap_key = cap_key or handle.user_id
        async with self._unavailable():
            claimed, running = await self.claims.claim(handle, payload, cap_key)
            if claimed == RECOVERING:
                self._lost_data()
                raise recovering(self.settle)
            if claimed == TAKEN:
                raise already_running()
            if max_running and running > max_running:
                await self.claims.unclaim(handle, payload, cap_key)
                raise too_many(max_running)
        log_ = GenerationLog(handle, self._queue)
        self.local.add(log_, on_cancel, cap_key)
        self._extended[handle.answer_id] = time.monotonic()
        self._fresh.add(handle.answer_id)
        return log_

    async def abandon(self, handle: Handle) -> None:
        entry = self.local.entry(handle.chat_id)
        self.local.release(handle, keep_log=False)
        self._extended.pop(handle.answer_id, None)
        self.journal.forget(handle.answer_id)
        try:
            async with asyncio.timeout(self.timeout * 2):
                await self.claims.unclaim(
                    handle, k.dump_handle(handle), entry.cap_key if entry else ""
                )
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("redis unavailable while abandoning %s: %r", handle.answer_id, exc)

    async def finish(self, handle: Handle, terminal: Event) -> None:
        """The generation's end: its terminal event committed with the others' events
        (the next group commit writes its log and ends its claim in the same round
        trip), then given to local readers. Through an outage it is written directly,
        and what Redis does not take is done again later. A generation whose events
        could not be written ended with an error already (see `_quarantine`): its
        terminal event is dropped, and its error is written in its place."""
        log_ = self.local.log(handle.answer_id)
        entry = self.local.entry(handle.chat_id)
        cap_key = entry.cap_key if entry is not None else None
        failed = handle.answer_id in self._failed
        if log_ is not None and not failed:
            self.journal.queue(handle.answer_id, terminal)
        self.local.release(handle, keep_log=True)
        self._extended.pop(handle.answer_id, None)
        try:
            async with asyncio.timeout(self.timeout * 2):
                if log_ is not None and not self._outage and not failed:
                    ended = asyncio.get_running_loop().create_future()
                    self._ending[handle.answer_id] = (ended, handle, cap_key)
                    self._wake.set()
                    try:
                        await ended
                    finally:
                        self._ending.pop(handle.answer_id, None)
                else:
                    await self.flush(only=handle.answer_id)
                    await self.claims.ended(
                        handle, k.dump_handle(handle), cap_key, self.replay_ttl_ms
                    )
        except (RedisError, OSError, TimeoutError) as exc:
            # the claim expires by itself; the terminal event stays queued, and the
            # committer writes it when Redis is back. Local readers get the end now:
            # the answer is in the store (its generation saved it first), or kept in
            # memory until the store takes it
            log.warning("redis unavailable while finishing %s: %r", handle.answer_id, exc)
            self._unended[handle.answer_id] = (handle, cap_key)
            self._wake.set()
        finally:
            if log_ is not None and handle.answer_id not in self._failed:
                log_.end(terminal)
            self._failed.discard(handle.answer_id)

    async def orphaned(self, chat_id: str, answer_id: str) -> None:
        async with self._unavailable():
            await self.claims.orphaned(chat_id, answer_id, self.replay_ttl_ms)

    async def hold(self, answer_ids: Sequence[str], seconds: float) -> None:
        async with self._unavailable():
            await self.claims.hold(answer_ids, int(seconds * 1000))

    async def _end_again(self) -> None:
        """The ends Redis did not take (see `finish`), once their events are written:
        until then a follower could still need the log to go on."""
        for answer_id, (handle, cap_key) in list(self._unended.items()):
            if answer_id in self.journal.pending:
                continue
            await self.claims.ended(handle, k.dump_handle(handle), cap_key, self.replay_ttl_ms)
            del self._unended[answer_id]

    async def lookup(self, chat_id: str) -> Handle | None:
        local = self.local.lookup(chat_id)
        if local is not None:
            return local
        async with self._unavailable():
            raw = await self.redis.get(k.run(chat_id))
        if raw is None and self.recovery.doubtful():
            raise recovering(self.recovery.doubt_until - time.monotonic())
        return k.load_handle(raw) if raw else None

    async def cancel(self, handle: Handle) -> None:
        if self.local.cancel(handle.answer_id):
            return
        async with self._unavailable():
            ttl = max(self.handle_ttl_ms * 2, 60_000)
            await self.redis.set(k.cancel(handle.answer_id), b"1", px=ttl)
            await self.redis.publish(k.CANCEL_CHANNEL, handle.answer_id)

    async def latest(self, chat_id: str) -> Handle | None:
        async with self._unavailable():
            answer_id = await self.redis.get(k.latest(chat_id))
        if answer_id:
            return await self.find(k.text(answer_id))
        # Redis lost it (restarted without its data): this process may still hold it
        return self.local.latest(chat_id)

    async def find(self, answer_id: str) -> Handle | None:
        local = self.local.log(answer_id)
        if local is not None:
            return local.handle
        async with self._unavailable():
            raw = await self.redis.get(k.gen(answer_id))
        if raw is None and self.recovery.doubtful():
            raise recovering(self.recovery.doubt_until - time.monotonic())
        return k.load_handle(raw) if raw else None

    async def states(self, answers: list[tuple[str, str]]) -> list[str]:
        if not answers:
            return []
        try:
            async with asyncio.timeout(self.timeout):
                async with self.redis.pipeline(transaction=False) as pipe:
                    for chat_id, _ in answers:
                        pipe.get(k.run(chat_id))
                    pipe.exists(k.RECOVERING)
                    *claims, recovering_now = await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            if not isinstance(exc, MaxConnectionsError):  # busy, not failing
                self.connection_lost()
            return ["unknown"] * len(answers)
        doubtful = self.recovery.doubtful() or bool(recovering_now)
        out = []
        for (_, answer_id), raw in zip(answers, claims, strict=True):
            if self.local.runs(answer_id) or (
                raw is not None and k.load_handle(raw).answer_id == answer_id
            ):
                out.append("running")
            else:
                out.append("unknown" if doubtful else "gone")
        return out

    async def alive(self, token: str) -> bool:
        """Whether the process `token` is alive (its heartbeat keeps its key)."""
        return bool(await self.redis.exists(k.proc(token)))

    async def logged(self, answer_id: str) -> list[Event]:
        return (await self.logged_many([answer_id]))[answer_id]

    async def logged_many(self, answer_ids: Sequence[str]) -> dict[str, list[Event]]:
        out: dict[str, list[Event]] = {}
        handles = []
        for answer_id in answer_ids:
            local = self.local.log(answer_id)
            out[answer_id] = list(local.events) if local is not None else []
            if local is None:
                handles.append(answer_id)
        if not handles:
            return out
        async with self._unavailable():
            async with self.redis.pipeline(transaction=False) as pipe:
                for answer_id in handles:
                    pipe.get(k.gen(answer_id))
                raws = await pipe.execute()
            if None in raws and self.recovery.doubtful():
                raise recovering(self.recovery.doubt_until - time.monotonic())
            found = [k.load_handle(raw) for raw in raws if raw]
            gathered = await self.gather_many(found)
        for answer_id, events in gathered.items():
            out[answer_id] = [events[seq] for seq in sorted(events)]
        return out

    async def lead(self, chore: str, ttl: float) -> bool:
        if self.recovery.doubtful():
            return False
        try:
            async with asyncio.timeout(self.timeout * 2):
                if await self.redis.exists(k.RECOVERING):
                    return False
                return await self.claims.lead(chore, ttl)
        except (RedisError, OSError, TimeoutError):
            return False

    # -- the event log ----------------------------------------------------------------

    def _queue(self, log_: GenerationLog, event: Event) -> None:
        """A log's sink: queue a numbered event for the next commit, which releases it
        to readers once Redis has acknowledged it."""
        self.journal.queue(log_.handle.answer_id, event)
        self._wake.set()

    async def _committer(self) -> None:
        """Group commit: the events every generation of this process wrote within
        `commit_linger` go to Redis in one journal entry, and reach readers when Redis
        has acknowledged it. Through an outage it retries with growing pauses; the
        events wait, unseen (or until their generation ends, see `finish`)."""
        delay = 0.05
        while True:
            await self._wake.wait()
            if self.commit_linger > 0:
                await asyncio.sleep(self.commit_linger)
            try:
                async with asyncio.timeout(self.timeout * 2):
                    await self.flush()
            except MaxConnectionsError:  # every connection to a node is taken: soon again
                await asyncio.sleep(BUSY_SECONDS)
                self._wake.set()
            except (RedisError, OSError, TimeoutError) as exc:
                if not self._outage:
                    log.warning(
                        "redis unavailable: events of %d answers wait: %r",
                        len(self.journal.pending),
                        exc,
                    )
                self._outage = True
                self.connection_lost()
                await self.reconnect()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                if self.journal.pending:
                    self._wake.set()  # try again: finished generations append nothing more
            else:
                if self._outage:
                    log.info("redis is back: events are written again")
                    self._beat_now.set()  # are the claims still there?
                self._outage, delay = False, 0.05

    async def flush(self, only: str | None = None) -> None:
        """Write pending events — of every generation, or of the answer id `only` — as
        the journal says (`Journal.plan`), and release what was written to the
        generations' readers. Serialised, so each log's entries stay in order. Raises
        when Redis fails (the events stay pending). A commit that fails otherwise (an
        event that cannot be encoded) ends the answers it cannot write with an error
        (`_quarantine`), and the others are written at once: one answer never holds
        back the rest."""
        async with self._flush_lock:
            if only is None:
                self._wake.clear()
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
                ending = self._ending.get(answer_id)
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
            if answer_id in self._failed or log_ is None or log_.finished:
                if answer_id in self.journal.pending or answer_id in self.journal.unlogged:
                    self.journal.forget(answer_id)
                    changed = True
                continue
            h = log_.handle
            data = {"key": "INTERNAL", "data": UNWRITABLE}
            error = Event("error", h.chat_id, h.answer_id, data, log_.durable + 1)
            self.journal.replace(answer_id, error)
            self._failed.add(answer_id)
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
                pipe.xadd(key, {"e": k.dump_events(write.events)}, maxlen=LOG_CAP, approximate=True)
                if write.expire == "replay":  # kept for replay from now on
                    pipe.pexpire(key, self.replay_ttl_ms)
                    ending = self._ending.get(write.answer_id)
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
            fields = {answer_id: k.dump_events(batch) for answer_id, batch in plan.journal.items()}
            if plan.trim is not None:  # trimmed exactly: a handful of entries at a time
                pipe.xadd(journal, fields, minid=k.entry_id(plan.trim), approximate=False)
            else:
                pipe.xadd(journal, fields)
            if plan.expire_journal:  # the heartbeat keeps it from now on
                pipe.pexpire(journal, self.keep_ms)
            results = await pipe.execute()
        return k.parse_id(results[at])

    def subscribe(self, handle: Handle, after_seq: int) -> AsyncIterator[list[Event]]:
        local = self.local.log(handle.answer_id)
        if local is not None:  # straight from the log: no hop per event
            return local.follow(after_seq)
        return follow(self, handle, after_seq)

    async def owner_of(self, answer_id: str) -> str:
        """The token of the process that runs (or ran) an answer; empty when unknown."""
        owner = self._owners.get(answer_id)
        if owner is None:
            raw = await self.redis.get(k.owner(answer_id))
            owner = k.text(raw) if raw else ""
            if owner:  # it never changes
                self._owners[answer_id] = owner
                if len(self._owners) > OWNERS_KEPT:
                    del self._owners[next(iter(self._owners))]
        return owner

    async def gather(self, handle: Handle) -> dict[int, Event]:
        """Every event of a generation that Redis holds — its log and, unless the log
        has its end, its owner's journal — by seq (a commit sent again after a failure
        may have written some twice). The journal is read first: what it no longer
        holds was trimmed after the log had it (see `journal`)."""
        return (await self.gather_many([handle]))[handle.answer_id]

    async def gather_many(self, handles: Sequence[Handle]) -> dict[str, dict[int, Event]]:
        """`gather` of several generations, each owner's journal read once for all
        of them (a dead process's orphans share it)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for handle in handles:
                pipe.xrevrange(k.log(handle.answer_id), count=1)
            lasts = await pipe.execute()
        events: dict[str, dict[int, Event]] = {h.answer_id: {} for h in handles}
        open_ = [
            handle
            for handle, found in zip(handles, lasts, strict=True)
            # a log that has its end holds all of it
            if not (found and any(e.terminal for e in k.load_events(found[0][1][b"e"], handle)))
        ]
        async with self.redis.pipeline(transaction=False) as pipe:
            for handle in open_:
                pipe.get(k.owner(handle.answer_id))
            owners = await pipe.execute()
        by_owner: dict[str, list[Handle]] = {}
        for handle, owner in zip(open_, owners, strict=True):
            if owner:
                by_owner.setdefault(k.text(owner), []).append(handle)
        for owner, owned in by_owner.items():
            fields_of = {h.answer_id.encode(): h for h in owned}
            for _id, fields in await self.redis.xrange(k.journal(owner)):
                for field, raw in fields.items():
                    handle_ = fields_of.get(field)
                    if handle_ is not None:
                        kept = events[handle_.answer_id]
                        for event in k.load_events(raw, handle_):
                            kept.setdefault(event.seq, event)
        async with self.redis.pipeline(transaction=False) as pipe:
            for handle in handles:
                pipe.xrange(k.log(handle.answer_id))
            logs = await pipe.execute()
        for handle, entries in zip(handles, logs, strict=True):
            kept = events[handle.answer_id]
            for _id, fields in entries:
                for event in k.load_events(fields[b"e"], handle):
                    kept.setdefault(event.seq, event)
        return events

    # -- background: cancels, followers and heartbeats -------------------------------------

    async def _listener(self) -> None:
        """Cancels published for this process's generations, and which of them other
        processes follow, on a connection of its own. A connection that answers nothing for `LISTEN_PING_SECONDS` (Redis hung,
        or moved to another address) is dropped and made again."""
        delay, failing = 0.1, False
        follows = k.follow_channel(self.token)
        while True:
            if failing:
                await self.reconnect()
            pubsub = self.blocking.pubsub(ignore_subscribe_messages=True)
            try:
                if self._cluster:  # the slot map, to pick the node to listen on
                    async with asyncio.timeout(self.timeout):
                        await self.blocking.initialize()
                async with asyncio.timeout(self.timeout):
                    await pubsub.subscribe(k.CANCEL_CHANNEL, follows)
                self._flags_unread = True  # cancels sent before now: at the next beat
                self._beat_now.set()
                if failing:
                    log.info("cancel listener: redis is back")
                    failing = False
                delay = 0.1
                heard = time.monotonic()
                pinged = False
                while True:
                    message = await pubsub.get_message(timeout=LISTEN_PING_SECONDS / 2)
                    now = time.monotonic()
                    if message is not None:
                        heard, pinged = now, False
                        if message.get("type") == "message":
                            self._heard(k.text(message["channel"]), k.text(message["data"]))
                        continue
                    if now - heard < LISTEN_PING_SECONDS / 2:
                        continue
                    if pinged:  # asked, and nothing came back
                        raise TimeoutError("the cancel channel stopped answering")
                    await pubsub.ping()
                    pinged = True
            except (RedisError, OSError, TimeoutError) as exc:
                if not failing:
                    log.warning("cancel listener lost redis: %r", exc)
                    failing = True
                self.connection_lost()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
            finally:
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    async with asyncio.timeout(1.0):
                        await pubsub.aclose()

    def _heard(self, channel: str, answer_id: str) -> None:
        if channel == k.CANCEL_CHANNEL:
            self.local.cancel(answer_id)
        elif self.local.runs(answer_id):  # followed: its log is written at every commit
            if self.journal.watch(answer_id, time.monotonic() + 3 * WATCH_EVERY):
                self._wake.set()

    async def _heartbeat(self) -> None:
        #: after a failed beat the next comes soon (≤ 0.5 s): a node back empty is found,
        #: and its lost claims set again, before other processes take their chats
        delay = 0.1
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.beat_interval):
                    await self._beat_now.wait()
            self._beat_now.clear()
            try:
                async with asyncio.timeout(self.timeout * 2):
                    await self.beat()
                delay = 0.1
            except MaxConnectionsError:  # every connection to a node is taken: soon again
                await asyncio.sleep(BUSY_SECONDS)
                self._beat_now.set()
            except (RedisError, OSError, TimeoutError) as exc:
                log.debug("heartbeat: redis unavailable: %r", exc)
                self.connection_lost()
                await self.reconnect()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
                self._beat_now.set()

    async def beat(self) -> None:
        """One heartbeat, in one pipeline, as a `Beat` plans it; then set again a claim
        found missing, re-assert what Redis lost, and cancel what was flagged."""
        now = time.monotonic()
        beat = Beat.plan(
            self.local.running(),
            self._extended,
            now=now,
            wall_ms=int(time.time() * 1000),
            refresh=self.claim_refresh,
            doubtful=self.recovery.doubtful(),
            flags_unread=self._flags_unread,
            fresh=self._fresh,
            token=self.token,
            cluster=self._cluster,
            handle_ttl_ms=self.handle_ttl_ms,
            proc_ttl_ms=self.proc_ttl_ms,
            keep_ms=self.keep_ms,
        )
        self._flags_unread = False
        self._fresh.clear()
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for name, args, kwargs in beat.commands():
                    getattr(pipe, name)(*args, **kwargs)
                results = await pipe.execute()
        except BaseException:
            self._flags_unread = self._flags_unread or bool(beat.flags)  # read them next time
            raise
        heard = beat.read(results)
        for r in beat.due:
            if self.local.runs(r.handle.answer_id):  # not ended while this beat ran
                self._extended[r.handle.answer_id] = now
        if heard.lost_data:
            self._lost_data()
            kept = self.local.kept_logs()
            self.recovery.needs_reassert.update(log_.handle.answer_id for log_ in kept)
        else:
            self._check_kept(beat.due, heard.kept)
            if heard.lost:  # a handle gone with its claim still there: its node lost data
                self._lost_data()
                self.recovery.needs_reassert.update(r.handle.answer_id for r in heard.lost)
        if self.recovery.say_so:
            await self.redis.set(k.RECOVERING, self.token, px=int(self.settle * 1000), nx=True)
            self.recovery.say_so = False
        if heard.missing:
            await self._claim_again(heard.missing)
        if self.recovery.needs_reassert:
            logs = [self.local.log(answer_id) for answer_id in self.recovery.needs_reassert]
            async with self._flush_lock:
                await self.recovery.reassert(
                    self.redis,
                    self.token,
                    [log_ for log_ in logs if log_ is not None],
                    self.journal,
                    replay_ms=self.replay_ttl_ms,
                    running_ms=self.max_generation_ms,
                )
            self.recovery.needs_reassert.clear()
        for r in heard.cancelled:
            self.local.cancel(r.handle.answer_id)
        if self._unended:
            await self._end_again()

    async def _claim_again(self, missing: list[Running]) -> None:
        """Claims found gone (Redis lost them): set again where still free, and the
        generations' logs re-asserted."""
        kept = await self.claims.keep(
            [(r.handle, k.dump_handle(r.handle), r.cap_key) for r in missing]
        )
        self._check_kept(missing, kept)
        again = [r for r, kept_ in zip(missing, kept, strict=True) if kept_ == 2]
        ended = [r for r in again if not self.local.runs(r.handle.answer_id)]
        if ended:  # it ended while this beat ran: the claim was set again, take it back
            await self.claims.release([(r.handle, k.dump_handle(r.handle)) for r in ended])
        self.recovery.needs_reassert.update(r.handle.answer_id for r in again if r not in ended)

    def _check_kept(self, running: list[Running], kept: list[Any]) -> None:
        for r, kept_ in zip(running, kept, strict=True):
            if kept_ == 0:
                log.error(
                    "chat %s is claimed by another generation while %s runs here",
                    r.handle.chat_id,
                    r.handle.answer_id,
                )
