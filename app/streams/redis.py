"""`redis://`: the registry and event logs shared by every server process, on one
Redis or a Redis Cluster (the same commands: each touches one hash slot).

The hub is composed of parts, each in its module:

    rediskeys   the keys (hash-tagged by chat, answer or process) and their encodings
    claims      claims on chats, the concurrency cap, one-at-a-time chores (scripts)
    commits     the group commit: the events of every generation, one XADD a commit
    journal     the group commit's bookkeeping, with no I/O: what to write where
    beat        the heartbeat's bookkeeping, with no I/O: which claims and flags to read
    listener    pub/sub: cancels, and which answers other processes follow
    follower    following a generation of another process (its log only)
    recovery    what is done when Redis lost its data

A generation appends to its local log (which local clients follow with no Redis
round trip); the committer writes it to Redis within `commit_linger` (`commits`).
Claims are extended once a quarter of their TTL old, one GETEX each (which says
whose the claim is); a claim found missing is set again (compare-and-set).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from redis.exceptions import MaxConnectionsError, RedisError

from ..chores import Chores
from ..errors import Unavailable
from ..events import Event, Handle
from . import rediskeys as k
from .base import (
    GenerationLog,
    LocalRegistry,
    Push,
    Running,
    StreamHub,
    already_running,
    too_many,
)
from .beat import Heartbeat
from .claims import RECOVERING, TAKEN, Claims
from .commits import Committer
from .connect import blocking_client, close_redis, is_cluster, refresh_cluster, shed_idle_every
from .follower import follow, gather_many
from .journal import Journal
from .listener import listen
from .recovery import Recovery, recovering
from .rediskeys import BUSY_SECONDS, WATCH_EVERY

log = logging.getLogger("app.streams")

#: how often a running generation's own log is brought up to date from the journal
CHECKPOINT_SECONDS = 2.0
OWNERS_KEPT = 1024  # answers of other processes whose owner is remembered
#: the longest one call to Redis may take: connecting, or a command's answer
OPERATION_SECONDS = 2.0


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
        self._beat_now = asyncio.Event()
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
        self.commits = Committer(
            redis,
            self.token,
            self.local,
            self.journal,
            linger=self.commit_linger,
            timeout=timeout,
            replay_ttl_ms=self.replay_ttl_ms,
            keep_ms=self.keep_ms,
            on_failure=self._commit_failed,
            on_back=self._beat_now.set,
        )
        #: a claim is extended at the first beat after it is a quarter of its TTL old
        #: (at least half its TTL is always left: an owner cut off from Redis for
        #: less than that keeps its chats)
        self.claim_refresh = handle_ttl / 4
        self.heartbeat = Heartbeat(
            self.token,
            self._cluster,
            self.handle_ttl_ms,
            self.proc_ttl_ms,
            self.keep_ms,
            self.claim_refresh,
        )
        self._extended: dict[str, float] = {}  # when each claim was set or last extended
        self._owners: dict[str, str] = {}  # answers of other processes: whose they are
        #: ended answers whose end Redis did not take (the claim released, the keys
        #: kept for replay only): done again at each heartbeat until it does
        self._unended: dict[str, tuple[Handle, str | None]] = {}
        self._chores = Chores("redis hub")
        #: whether cancels may have been published while the listener did not listen
        self._flags_unread = True
        self._fresh: set[str] = set()  # answers registered since the last beat

    # -- lifecycle ------------------------------------------------------------------

    async def open(self) -> None:
        async with self._unavailable():
            await self.redis.set(k.proc(self.token), b"1", px=self.proc_ttl_ms)
        self._chores.loop("committer", self.commits.run)
        self._chores.loop("cancel listener", self._listener)
        self._chores.loop("heartbeat", self._heartbeat)
        self._chores.loop("idle connections", self._shed_idle)

    async def _shed_idle(self) -> None:
        await shed_idle_every(self.blocking, self.timeout)

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
        return self.commits.outage

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

    async def _commit_failed(self) -> None:
        self.connection_lost()
        await self.reconnect()

    def _lost_data(self) -> None:
        self.recovery.lost_data()
        self._beat_now.set()

    # -- registry -------------------------------------------------------------------

    async def claim(
        self, handle: Handle, cap_key: str, max_running: int
    ) -> tuple[GenerationLog, str]:
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
        self._extended[handle.answer_id] = time.monotonic()
        self._fresh.add(handle.answer_id)
        return GenerationLog(handle, self.commits.queue), cap_key

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
        failed = handle.answer_id in self.commits.failed
        if log_ is not None and not failed:
            self.journal.queue(handle.answer_id, terminal)
        self.local.release(handle, keep_log=True)
        self._extended.pop(handle.answer_id, None)
        try:
            async with asyncio.timeout(self.timeout * 2):
                if log_ is not None and not self.commits.outage and not failed:
                    ended = asyncio.get_running_loop().create_future()
                    self.commits.ending[handle.answer_id] = (ended, handle, cap_key)
                    self.commits.wake.set()
                    try:
                        await ended
                    finally:
                        self.commits.ending.pop(handle.answer_id, None)
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
            self.commits.wake.set()
        finally:
            if log_ is not None and handle.answer_id not in self.commits.failed:
                log_.end(terminal)
            self.commits.failed.discard(handle.answer_id)

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
            gathered = await gather_many(self.redis, found)
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

    async def flush(self, only: str | None = None) -> None:
        """Write pending events now (see `Committer.flush`)."""
        await self.commits.flush(only)

    def subscribe(
        self, handle: Handle, after_seq: int, push: Push | None = None
    ) -> AsyncIterator[list[Event]]:
        local = self.local.log(handle.answer_id)
        if local is not None:  # straight from the log: no hop per event
            return local.follow(after_seq, push)
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
        """Every event of a generation that Redis holds, by seq (`gather_many`)."""
        return (await gather_many(self.redis, [handle]))[handle.answer_id]

    # -- background: cancels, followers and heartbeats -------------------------------------

    async def _listener(self) -> None:
        """Cancels published for this process's generations, and which of them other
        processes follow (`listen`)."""
        await listen(
            self.blocking,
            (k.CANCEL_CHANNEL, k.follow_channel(self.token)),
            cluster=self._cluster,
            timeout=self.timeout,
            subscribed=self._subscribed,
            heard=self._heard,
            lost=self.connection_lost,
            reconnect=self.reconnect,
        )

    def _subscribed(self) -> None:
        self._flags_unread = True  # cancels sent before now: at the next beat
        self._beat_now.set()

    def _heard(self, channel: str, answer_id: str) -> None:
        if channel == k.CANCEL_CHANNEL:
            self.local.cancel(answer_id)
        elif self.local.runs(answer_id):  # followed: its log is written at every commit
            if self.journal.watch(answer_id, time.monotonic() + 3 * WATCH_EVERY):
                self.commits.wake.set()

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
        beat = self.heartbeat.plan(
            self.local.running(),
            self._extended,
            now=now,
            wall_ms=int(time.time() * 1000),
            doubtful=self.recovery.doubtful(),
            flags_unread=self._flags_unread,
            fresh=self._fresh,
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
            async with self.commits.lock:
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
