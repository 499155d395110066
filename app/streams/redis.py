"""`redis://`: the registry and event logs shared by every server process.

Keys (all under `sc:`):

    proc:{token}      this process is alive (TTL `handle_ttl`, refreshed by its heartbeat);
                      found missing, it tells the process that Redis lost its data
    run:{chatId}      the running generation's handle (JSON): claimed with SET NX,
                      extended and released only by its owner (compare-and-extend,
                      compare-and-delete); its TTL makes a dead process's claim expire
    gen:{answerId}    the handle, kept while the events are (for resume)
    latest:{chatId}   the chat's newest answer id
    owner:{answerId}  the token of the process that runs it (whose journal to read)
    journal:{token}   a Redis Stream of this process's new events: one entry per flush,
                      one field per generation (its events, JSON)
    log:{answerId}    a Redis Stream; each entry holds a batch of one generation's events
    cancel:{answerId} a short-lived cancel flag, in case pub/sub misses the owner
    active:{capKey}   running answer ids scored by expiry (the concurrency cap)
    lead:{chore}      the process that runs a one-at-a-time chore (the sweeper)
    channel sc:cancel pub/sub: answer ids to cancel

A generation appends to its local log (which local clients follow with no
Redis round trip). Every `flush_interval` a flusher writes the new events of
every generation of the process as one entry of the process's journal: one
XADD however many generations run. Each generation's own log is written from
that every `CHECKPOINT_SECONDS` (and at its end), and the journal is trimmed
to what the logs do not hold yet — so Redis is never more than a flush behind,
and a token costs a small fraction of a command. Clients on other processes
read the generation's log, then follow the owner's journal with XREAD BLOCK
(taking their generation's field), reconnecting through an outage; a reader
that finds a gap (entries trimmed before it got there) reads the log again.

Claims are extended once a quarter of their TTL old, one GETEX each (which says
whose the claim is); a claim found missing is set again (compare-and-set).

Redis restarted without its data: each owner re-asserts what it holds — claims,
handles and whole logs — at its next heartbeat, which runs at once when its
connection comes back. A process that finds its own `proc` key gone refuses new
registrations for `settle` seconds (503, retry), and any process that lost its
connection treats a missing claim as "unknown" rather than "lost" for as long,
so that no second answer starts in a running chat and no follower is cut off
while the owners catch up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ..chores import Chores
from ..errors import AppError, Unavailable
from ..events import Event, Handle
from .base import (
    GenerationLog,
    LocalRegistry,
    Running,
    StreamHub,
    already_running,
    too_many,
)

log = logging.getLogger("app.streams")

PREFIX = "sc:"
CHANNEL = PREFIX + "cancel"
#: set (with a TTL of `settle`) by the first process to find Redis empty: until it
#: expires, owners are re-asserting, so claims are refused and none counts as gone
RECOVERING = PREFIX + "recovering"
LOG_CAP = 100_000  # entries (batches) per generation, approximate
BLOCK_MS = 1000
FLUSH_AT = 256  # pending events of one generation that trigger a flush before the interval
REWRITE_BATCH = 500  # events per entry when a whole log is written again
#: how often a running generation's own log is brought up to date from the journal
CHECKPOINT_SECONDS = 2.0
#: a reader that keeps finding events missing gives up after this many reads of the log
MAX_GAPS = 20
OWNERS_KEPT = 1024  # answers of other processes whose owner is remembered
#: the longest one call to Redis may take: connecting, or a command's answer
OPERATION_SECONDS = 2.0
#: a cancel listener that heard nothing for this long asks Redis whether it is there
LISTEN_PING_SECONDS = 5.0

# claim a chat: 1 claimed, 0 another generation has it, -1 the registry is recovering
# (this process's key is gone — Redis lost its data — or another process said so)
CLAIM = """
if redis.call('EXISTS', KEYS[2]) == 0 or redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""
# keep a key that is ours: extended (1), set again because it was gone (2), or another's (0)
KEEP = """
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if not current then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 2 end
return 0
"""
# delete a key only if it is still ours
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


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


def blocking_client(redis: aioredis.Redis) -> aioredis.Redis:
    """A client on a pool of its own, with the same address and options as `redis`,
    for reads that wait on Redis (XREAD BLOCK, pub/sub); each wait is bounded by the
    caller (see `open_redis` on why not by a socket timeout)."""
    options = dict(redis.connection_pool.connection_kwargs)
    options["socket_timeout"] = None
    pool = aioredis.ConnectionPool(
        connection_class=redis.connection_pool.connection_class, **options
    )
    return aioredis.Redis.from_pool(pool)


def recovering(seconds: float) -> Unavailable:
    return Unavailable(
        "the stream registry is recovering from a restart; try again shortly",
        retry_after=max(1, round(seconds)),
    )


class RedisHub(StreamHub):
    """Shares the registry and the logs through Redis; this process's own part lives
    in a `LocalRegistry`, so local readers never wait on Redis. The Redis client is
    the caller's (opened and closed with the app)."""

    name = "redis"
    holds_events = True

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        replay_ttl: float,
        handle_ttl: float,
        max_generation_seconds: float,
        commit_linger: float = 0.005,
        flush_interval: float | None = None,
        blocking: aioredis.Redis | None = None,
        timeout: float = OPERATION_SECONDS,
    ) -> None:
        self.redis = redis
        #: the longest one call to Redis may take (a few round trips: twice that)
        self.timeout = timeout
        #: for reads that wait on Redis (XREAD BLOCK, pub/sub): a pool of their own, so
        #: that waiting readers never hold the connections commits need
        self.blocking = blocking or blocking_client(redis)
        self._owns_blocking = blocking is None
        self.local = LocalRegistry(replay_ttl)
        self.token = secrets.token_hex(8)
        self.replay_ttl_ms = int(replay_ttl * 1000)
        self.handle_ttl_ms = int(handle_ttl * 1000)
        self.claim_ttl = handle_ttl
        #: how long new events wait for others to share their journal write; a flush
        #: interval given by older callers caps it
        self.commit_linger = (
            commit_linger if flush_interval is None else min(commit_linger, flush_interval)
        )
        self.max_generation_ms = int(max_generation_seconds * 1000)
        self.beat_interval = min(handle_ttl / 3, 2.0)
        #: how long owners may take to re-assert after Redis lost its data
        self.settle = self.beat_interval + 1.0
        self._claim = redis.register_script(CLAIM)
        self._keep = redis.register_script(KEEP)
        self._release = redis.register_script(RELEASE)
        #: a claim is extended at the first beat after it is a quarter of its TTL old
        #: (at least half its TTL is always left: an owner cut off from Redis for
        #: less than that keeps its chats)
        self.claim_refresh = handle_ttl / 4
        #: events not yet in Redis
        self._pending: dict[str, list[Event]] = {}
        #: events in the journal, not yet in their generation's log; and when the first
        #: of them went to the journal, with that entry's id (what trims the journal)
        self._unlogged: dict[str, list[Event]] = {}
        self._unlogged_since: dict[str, tuple[float, tuple[int, int]]] = {}
        self._last_entry: tuple[int, int] | None = None
        self._logged: set[str] = set()  # generations whose log key has its running expiry
        self._extended: dict[str, float] = {}  # when each claim was set or last extended
        self._owners: dict[str, str] = {}  # answers of other processes: whose they are
        self._wake = asyncio.Event()
        self._beat_now = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._chores = Chores("redis hub")
        self._recovering_until = 0.0  # registrations wait (Redis lost its data)
        self._doubt_until = 0.0  # a missing claim means "unknown" (an outage was seen)
        self._outage = False
        self._say_recovering = False
        self._needs_reassert: set[str] = set()

    # -- lifecycle ------------------------------------------------------------------

    async def open(self) -> None:
        async with unavailable(self.timeout * 2):
            await self.redis.set(_proc(self.token), b"1", px=self.handle_ttl_ms)
        self._chores.loop("committer", self._committer)
        self._chores.loop("cancel listener", self._listener)
        self._chores.loop("heartbeat", self._heartbeat)

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(self.timeout):
                await self.flush()
        await self._chores.aclose()
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(self.timeout):
                await self.redis.delete(_proc(self.token))
        if self._owns_blocking:
            with contextlib.suppress(RedisError, OSError):
                await self.blocking.aclose()
        self.local.close()

    @property
    def degraded(self) -> bool:
        return self._outage

    async def ping(self) -> None:
        async with unavailable(self.timeout * 2):
            await self.redis.ping()

    def _payload(self, handle: Handle) -> bytes:
        """A handle as Redis keeps it (compared byte for byte)."""
        return _dump_handle(handle)

    def _doubtful(self) -> bool:
        return time.monotonic() < self._doubt_until

    def _lost_data(self) -> None:
        """Redis came back empty: owners need `settle` seconds to re-assert. Says so in
        Redis too, for processes that did not see the outage."""
        until = time.monotonic() + self.settle
        self._recovering_until = max(self._recovering_until, until)
        self._doubt_until = max(self._doubt_until, until)
        self._beat_now.set()
        self._say_recovering = True

    def _connection_lost(self) -> None:
        self._doubt_until = max(self._doubt_until, time.monotonic() + self.settle + 2.0)

    # -- registry -------------------------------------------------------------------

    async def register(
        self,
        handle: Handle,
        on_cancel: Callable[[], None],
        *,
        cap_key: str = "",
        max_running: int = 0,
    ) -> GenerationLog:
        wait = self._recovering_until - time.monotonic()
        if wait > 0:
            raise recovering(wait)
        payload = self._payload(handle)
        cap_key = cap_key or handle.user_id
        async with unavailable(self.timeout * 2):
            claimed = await self._claim(
                keys=[_run(handle.chat_id), _proc(self.token), RECOVERING],
                args=[payload, self.handle_ttl_ms],
            )
            if claimed == -1:
                self._lost_data()
                raise recovering(self.settle)
            if claimed == 0:
                raise already_running()
            now_ms = int(time.time() * 1000)
            keep = self.max_generation_ms + self.replay_ttl_ms
            async with self.redis.pipeline(transaction=False) as pipe:
                # the running generations of the cap key: members expire with their claims
                pipe.zremrangebyscore(_active(cap_key), "-inf", now_ms)
                pipe.zadd(_active(cap_key), {handle.answer_id: now_ms + self.handle_ttl_ms})
                pipe.pexpire(_active(cap_key), self.handle_ttl_ms)
                pipe.zcard(_active(cap_key))
                pipe.set(_gen(handle.answer_id), payload, px=keep)
                pipe.set(_latest(handle.chat_id), handle.answer_id, px=keep)
                pipe.set(_owner(handle.answer_id), self.token, px=keep)
                running = (await pipe.execute())[3]
            if max_running and running > max_running:
                await self._unclaim(handle, payload, cap_key)
                raise too_many(max_running)
        log_ = GenerationLog(handle, self._queue)
        self.local.add(log_, on_cancel, cap_key)
        self._extended[handle.answer_id] = time.monotonic()
        return log_

    async def _unclaim(self, handle: Handle, payload: bytes, cap_key: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(_active(cap_key), handle.answer_id)
            pipe.delete(_gen(handle.answer_id))
            await self._release(keys=[_run(handle.chat_id)], args=[payload], client=pipe)
            await pipe.execute()

    async def abandon(self, handle: Handle) -> None:
        entry = self.local.entry(handle.chat_id)
        self.local.release(handle, keep_log=False)
        self._extended.pop(handle.answer_id, None)
        self._logged.discard(handle.answer_id)
        try:
            async with asyncio.timeout(self.timeout * 2):
                await self._unclaim(handle, self._payload(handle), entry.cap_key if entry else "")
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("redis unavailable while abandoning %s: %r", handle.answer_id, exc)

    async def finish(self, handle: Handle, terminal: Event) -> None:
        log_ = self.local.log(handle.answer_id)
        entry = self.local.entry(handle.chat_id)
        self.local.release(handle)
        self._extended.pop(handle.answer_id, None)
        try:
            self._pending.setdefault(handle.answer_id, []).append(terminal)
            async with asyncio.timeout(self.timeout * 2):
                await self.flush(only=handle.answer_id)
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.pexpire(_gen(handle.answer_id), self.replay_ttl_ms)
                    pipe.pexpire(_latest(handle.chat_id), self.replay_ttl_ms)
                    pipe.pexpire(_owner(handle.answer_id), self.replay_ttl_ms)
                    pipe.delete(_cancel(handle.answer_id))
                    if entry is not None:
                        pipe.zrem(_active(entry.cap_key), handle.answer_id)
                    await self._release(
                        keys=[_run(handle.chat_id)], args=[self._payload(handle)], client=pipe
                    )
                    await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            # the claim expires by itself; the terminal event stays queued, and the
            # committer writes it when Redis is back. Local readers get the end now:
            # the answer is in the store (its generation saved it first), or kept in
            # memory until the store takes it
            log.warning("redis unavailable while finishing %s: %r", handle.answer_id, exc)
            self._wake.set()
        finally:
            if log_ is not None:
                log_.end(terminal)

    async def lookup(self, chat_id: str) -> Handle | None:
        local = self.local.lookup(chat_id)
        if local is not None:
            return local
        async with unavailable(self.timeout * 2):
            raw = await self.redis.get(_run(chat_id))
        if raw is None and self._doubtful():
            raise recovering(self._doubt_until - time.monotonic())
        return _load_handle(raw) if raw else None

    async def cancel(self, handle: Handle) -> None:
        if self.local.cancel(handle.answer_id):
            return
        async with unavailable(self.timeout * 2):
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.set(_cancel(handle.answer_id), b"1", px=max(self.handle_ttl_ms * 2, 60_000))
                pipe.publish(CHANNEL, handle.answer_id)
                await pipe.execute()

    async def latest(self, chat_id: str) -> Handle | None:
        async with unavailable(self.timeout * 2):
            answer_id = await self.redis.get(_latest(chat_id))
        if answer_id:
            return await self.find(_text(answer_id))
        # Redis lost it (restarted without its data): this process may still hold it
        return self.local.latest(chat_id)

    async def find(self, answer_id: str) -> Handle | None:
        local = self.local.log(answer_id)
        if local is not None:
            return local.handle
        async with unavailable(self.timeout * 2):
            raw = await self.redis.get(_gen(answer_id))
        if raw is None and self._doubtful():
            raise recovering(self._doubt_until - time.monotonic())
        return _load_handle(raw) if raw else None

    async def states(self, answers: list[tuple[str, str]]) -> list[str]:
        if not answers:
            return []
        try:
            async with asyncio.timeout(self.timeout):
                *claims, recovering_now = await self.redis.mget(
                    [_run(chat_id) for chat_id, _ in answers] + [RECOVERING]
                )
        except (RedisError, OSError, TimeoutError):
            self._connection_lost()
            return ["unknown"] * len(answers)
        doubtful = self._doubtful() or recovering_now is not None
        out = []
        for (_, answer_id), raw in zip(answers, claims, strict=True):
            if self.local.runs(answer_id) or (
                raw is not None and _load_handle(raw).answer_id == answer_id
            ):
                out.append("running")
            else:
                out.append("unknown" if doubtful else "gone")
        return out

    async def logged(self, answer_id: str) -> list[Event]:
        local = self.local.log(answer_id)
        if local is not None:
            return list(local.events)
        handle = await self.find(answer_id)
        if handle is None:
            return []
        async with unavailable(self.timeout * 2):
            events, _ = await self._gather(handle)
        return [events[seq] for seq in sorted(events)]

    async def lead(self, chore: str, ttl: float) -> bool:
        if self._doubtful():
            return False
        try:
            async with asyncio.timeout(self.timeout * 2):
                if await self.redis.exists(RECOVERING):
                    return False
                held = await self._keep(keys=[_lead(chore)], args=[self.token, int(ttl * 1000)])
        except (RedisError, OSError, TimeoutError):
            return False
        return bool(held)

    # -- the event log ----------------------------------------------------------------

    def _queue(self, log_: GenerationLog, event: Event) -> None:
        """A log's sink: queue a numbered event for the next commit, which releases it
        to readers once Redis has acknowledged it."""
        answer_id = log_.handle.answer_id
        pending = self._pending.get(answer_id)
        if pending is None:
            pending = self._pending[answer_id] = []
        pending.append(event)
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
            except (RedisError, OSError, TimeoutError) as exc:
                if not self._outage:
                    log.warning(
                        "redis unavailable: events of %d answers wait: %r", len(self._pending), exc
                    )
                self._outage = True
                self._connection_lost()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                if self._pending:
                    self._wake.set()  # try again: finished generations append nothing more
            else:
                if self._outage:
                    log.info("redis is back: events are written again")
                self._outage, delay = False, 0.05

    async def flush(self, only: str | None = None) -> None:
        """Write pending events — of every generation, or of the answer id `only` (a
        generation that ends should not make all the others write early) — as one
        journal entry, bring the logs that are due up to date, and release what was
        written to the generations' readers. Serialised, so each log's entries stay in
        order. Raises when Redis fails (the events stay pending)."""
        async with self._flush_lock:
            now = time.monotonic()
            if only is not None:
                pending = {only: self._pending.pop(only)} if only in self._pending else {}
                due = {only} if only in pending or only in self._unlogged else set()
            else:
                self._wake.clear()
                pending, self._pending = self._pending, {}
                due = {
                    answer_id
                    for answer_id, (since, _) in self._unlogged_since.items()
                    if now - since >= CHECKPOINT_SECONDS
                }
                for answer_id, batch in pending.items():
                    if batch[-1].terminal:
                        due.add(answer_id)
            if not pending and not due:
                return
            keep = self.max_generation_ms + self.replay_ttl_ms
            async with self.redis.pipeline(transaction=False) as pipe:
                # the logs first: the journal entry after them may trim what they now hold
                for answer_id in due:
                    batch = self._unlogged.get(answer_id, []) + pending.get(answer_id, [])
                    key = _log(answer_id)
                    pipe.xadd(key, {"e": _dump_events(batch)}, maxlen=LOG_CAP, approximate=True)
                    if batch[-1].terminal:  # kept for replay from now on
                        pipe.pexpire(key, self.replay_ttl_ms)
                    elif answer_id not in self._logged:
                        pipe.pexpire(key, keep)
                journal_at = len(pipe)
                if pending:
                    journal = _journal(self.token)
                    fields = {
                        answer_id: _dump_events(batch) for answer_id, batch in pending.items()
                    }
                    held = [at for a, (_, at) in self._unlogged_since.items() if a not in due]
                    oldest = min(held) if held else self._last_entry
                    if only is None and oldest is not None:
                        # trimmed exactly: a handful of entries at a time
                        pipe.xadd(journal, fields, minid=_entry_id(oldest), approximate=False)  # type: ignore[arg-type]
                    else:
                        pipe.xadd(journal, fields)  # type: ignore[arg-type]
                    if self._last_entry is None:  # the heartbeat keeps it from now on
                        pipe.pexpire(journal, keep)
                try:
                    results = await pipe.execute()
                except BaseException:
                    for answer_id, batch in pending.items():  # back, in front of newer ones
                        self._pending.setdefault(answer_id, [])[:0] = batch
                    raise
            for answer_id, batch in pending.items():  # durable: readers may have them
                written = self.local.log(answer_id)
                if written is not None:
                    written.release(batch[-1].seq)
            for answer_id in due:
                batch = pending.get(answer_id) or self._unlogged[answer_id]
                self._unlogged.pop(answer_id, None)
                self._unlogged_since.pop(answer_id, None)
                if batch[-1].terminal:
                    self._logged.discard(answer_id)
                else:
                    self._logged.add(answer_id)
            if not pending:
                return
            entry = _parse_id(results[journal_at])
            self._last_entry = entry
            for answer_id, batch in pending.items():
                if answer_id in due:
                    continue
                unlogged = self._unlogged.get(answer_id)
                if unlogged is None:
                    self._unlogged[answer_id] = list(batch)
                    self._unlogged_since[answer_id] = (now, entry)
                else:
                    unlogged.extend(batch)

    async def _reassert(self, logs: list[GenerationLog]) -> None:
        """Write again what Redis lost of this process's generations: handles, latest
        pointers and whole logs (what was pending included). Raises when Redis fails;
        the caller keeps them to try again."""
        async with self._flush_lock:
            written: dict[str, int] = {}
            running = {log_.handle.answer_id for log_ in logs if not log_.finished}
            async with self.redis.pipeline(transaction=False) as pipe:
                for log_ in logs:
                    h = log_.handle
                    keep = self.replay_ttl_ms
                    if not log_.finished:
                        keep += self.max_generation_ms
                    pipe.set(_gen(h.answer_id), self._payload(h), px=keep)
                    pipe.set(_latest(h.chat_id), h.answer_id, px=keep)
                    pipe.set(_owner(h.answer_id), self.token, px=keep)
                    pipe.delete(_log(h.answer_id))
                    events = list(log_.events)
                    for start in range(0, len(events), REWRITE_BATCH):
                        batch = events[start : start + REWRITE_BATCH]
                        pipe.xadd(_log(h.answer_id), {"e": _dump_events(batch)})
                    pipe.pexpire(_log(h.answer_id), keep)
                    written[h.answer_id] = events[-1].seq if events else 0
                await pipe.execute()
            for log_ in logs:  # durable again, whatever was pending
                log_.release(written[log_.handle.answer_id])
            for answer_id, last in written.items():  # what was pending is written now
                pending = [e for e in self._pending.pop(answer_id, []) if e.seq > last]
                if pending:
                    self._pending[answer_id] = pending
                self._unlogged.pop(answer_id, None)
                self._unlogged_since.pop(answer_id, None)
                if answer_id in running:
                    self._logged.add(answer_id)
        log.info("re-asserted %d answers after redis lost its data", len(logs))

    def subscribe(self, handle: Handle, after_seq: int) -> AsyncIterator[list[Event]]:
        local = self.local.log(handle.answer_id)
        if local is not None:  # straight from the log: no hop per event
            return local.follow(after_seq)
        return self._follow_remote(handle, after_seq)

    async def _follow_remote(self, handle: Handle, after_seq: int) -> AsyncIterator[list[Event]]:
        """Follow another process's generation: what its log and its owner's journal
        hold, then the journal as it grows. Through an outage it reconnects and goes
        on from the last event it had; it ends with an `error` event when the
        generation is lost, or Redis stays away past `settle` + the claim's TTL."""
        async with unavailable(self.timeout * 2):
            owner = await self._owner_of(handle.answer_id)
        if owner:
            key, field = _journal(owner), handle.answer_id.encode()
        else:  # written by a version without journals: the log alone, as it is written
            key, field = _log(handle.answer_id), b"e"
        last_id: bytes | str = "0-0"
        seq = after_seq
        gaps = 0
        catch_up = True  # first, and whenever the journal lacks what came before
        heard = time.monotonic()  # when this answer last had news
        failing_since: float | None = None
        delay = 0.1
        while True:
            try:
                if catch_up:
                    catch_up = False
                    async with asyncio.timeout(self.timeout * 2):
                        found, last_id = await self._gather(handle)
                    batch = _after(found, seq)
                    if batch:
                        seq, heard = batch[-1].seq, time.monotonic()
                        yield batch
                        if batch[-1].terminal:
                            return
                async with asyncio.timeout(BLOCK_MS / 1000 + self.timeout):
                    entries = _entries(await self.blocking.xread({key: last_id}, block=BLOCK_MS))
                if not entries or time.monotonic() - heard > BLOCK_MS / 1000:
                    # nothing for this answer for a while: does it still run, and has
                    # its log what the journal lacks (re-asserted after Redis lost it)?
                    heard = time.monotonic()
                    (state,) = await self.states([(handle.chat_id, handle.answer_id)])
                    if state == "gone":  # one last look: the end may have landed just now
                        async with asyncio.timeout(self.timeout * 2):
                            batch = _after((await self._gather(handle))[0], seq)
                        if batch:
                            seq = batch[-1].seq
                            yield batch
                            if batch[-1].terminal:
                                return
                        # the sweeper saves what was logged
                        yield [
                            _error(handle, seq + 1, "generation lost: its server process stopped")
                        ]
                        return
                    catch_up = True
                    if not entries:
                        continue
                failing_since, delay = None, 0.1
            except (RedisError, OSError, AppError, TimeoutError) as exc:
                self._connection_lost()
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                    log.warning("following %s: redis unavailable: %r", handle.answer_id, exc)
                if now - failing_since > self.settle + self.handle_ttl_ms / 1000:
                    yield [_error(handle, seq + 1, "the stream registry is unavailable")]
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            for entry_id, fields in entries:
                raw = fields.get(field)
                batch = [e for e in _load_events(raw, handle) if e.seq > seq] if raw else []
                if batch and batch[0].seq != seq + 1:
                    # what came before was trimmed from the journal: the log has it now
                    gaps += 1
                    if gaps > MAX_GAPS:
                        log.error("following %s: events missing after %d", handle.answer_id, seq)
                        yield [_error(handle, seq + 1, "the stream lost events")]
                        return
                    catch_up = True
                    break
                last_id = entry_id
                if not batch:
                    continue
                gaps = 0
                seq, heard = batch[-1].seq, time.monotonic()
                yield batch
                if batch[-1].terminal:
                    return

    async def _owner_of(self, answer_id: str) -> str:
        """The token of the process that runs (or ran) an answer, whose journal holds
        its newest events; empty when unknown."""
        owner = self._owners.get(answer_id)
        if owner is None:
            raw = await self.redis.get(_owner(answer_id))
            owner = _text(raw) if raw else ""
            if owner:  # it never changes
                self._owners[answer_id] = owner
                if len(self._owners) > OWNERS_KEPT:
                    del self._owners[next(iter(self._owners))]
        return owner

    async def _gather(self, handle: Handle) -> tuple[dict[int, Event], bytes | str]:
        """Every event of a generation that Redis holds — its log and its owner's
        journal — by seq (a flush sent again after a failure may have written some
        twice), and the id of the last entry of what a reader follows next."""
        owner = await self._owner_of(handle.answer_id)
        async with self.redis.pipeline(transaction=True) as pipe:  # one moment of both
            pipe.xrange(_log(handle.answer_id))
            if owner:
                pipe.xrange(_journal(owner))
            found = await pipe.execute()
        events: dict[int, Event] = {}
        for _id, fields in found[0]:
            for event in _load_events(fields[b"e"], handle):
                events.setdefault(event.seq, event)
        field = handle.answer_id.encode()
        for _id, fields in found[1] if owner else ():
            if field in fields:
                for event in _load_events(fields[field], handle):
                    events.setdefault(event.seq, event)
        followed = found[-1]
        return events, followed[-1][0] if followed else "0-0"

    # -- background: cancels and heartbeats ------------------------------------------------

    async def _listener(self) -> None:
        """Cancels published for this process's generations, on a connection of its
        own. A connection that answers nothing for `LISTEN_PING_SECONDS` (Redis hung,
        or moved to another address) is dropped and made again."""
        delay, failing = 0.1, False
        while True:
            pubsub = self.blocking.pubsub(ignore_subscribe_messages=True)
            try:
                async with asyncio.timeout(self.timeout):
                    await pubsub.subscribe(CHANNEL)
                if failing:
                    log.info("cancel listener: redis is back")
                    failing = False
                    self._beat_now.set()  # re-assert what we hold at once
                delay = 0.1
                heard = time.monotonic()
                pinged = False
                while True:
                    message = await pubsub.get_message(timeout=LISTEN_PING_SECONDS / 2)
                    now = time.monotonic()
                    if message is not None:
                        heard, pinged = now, False
                        if message.get("type") == "message":
                            self.local.cancel(_text(message["data"]))
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
                self._connection_lost()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
            finally:
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    async with asyncio.timeout(1.0):
                        await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _heartbeat(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.beat_interval):
                    await self._beat_now.wait()
            self._beat_now.clear()
            try:
                async with asyncio.timeout(self.timeout * 2):
                    await self.beat()
            except (RedisError, OSError, TimeoutError) as exc:
                log.debug("heartbeat: redis unavailable: %r", exc)
                self._connection_lost()

    async def beat(self) -> None:
        """One heartbeat, in one pipeline: say this process lives (and keep its journal),
        extend the claims and cap entries a quarter of their TTL old (one GETEX each,
        which also says whose the claim is), pick up cancel flags; set again a claim
        found missing, and re-assert everything when Redis lost its data."""
        running = self.local.running()
        now = time.monotonic()
        due = [
            r
            for r in running
            if now - self._extended.get(r.handle.answer_id, 0.0) >= self.claim_refresh
        ]
        expiry = int(time.time() * 1000) + self.handle_ttl_ms
        by_cap: dict[str, dict[str, int]] = {}
        for r in due:
            by_cap.setdefault(r.cap_key, {})[r.handle.answer_id] = expiry
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(_proc(self.token), b"1", px=self.handle_ttl_ms, get=True)
            pipe.pexpire(_journal(self.token), self.max_generation_ms + self.replay_ttl_ms)
            for r in due:
                pipe.getex(_run(r.handle.chat_id), px=self.handle_ttl_ms)
            for cap_key, members in by_cap.items():
                pipe.zadd(_active(cap_key), members)
                pipe.pexpire(_active(cap_key), self.handle_ttl_ms)
            if running:
                pipe.mget([_cancel(r.handle.answer_id) for r in running])
            results = await pipe.execute()
        was_alive, claims = results[0], results[2 : 2 + len(due)]
        flags = results[-1] if running else []
        for r in due:
            if self.local.runs(r.handle.answer_id):  # not ended while this beat ran
                self._extended[r.handle.answer_id] = now
        if was_alive is None:
            self._lost_data()
            self._needs_reassert.update(log_.handle.answer_id for log_ in self.local.kept_logs())
            missing = running
        else:
            missing = [r for r, claim in zip(due, claims, strict=True) if claim is None]
            self._check_kept(
                due,
                [
                    1 if claim in (None, self._payload(r.handle)) else 0
                    for r, claim in zip(due, claims, strict=True)
                ],
            )
        if self._say_recovering:
            await self.redis.set(RECOVERING, self.token, px=int(self.settle * 1000), nx=True)
            self._say_recovering = False
        if missing:
            await self._claim_again(missing)
        if self._needs_reassert:
            logs = [self.local.log(answer_id) for answer_id in self._needs_reassert]
            await self._reassert([log_ for log_ in logs if log_ is not None])
            self._needs_reassert.clear()
        for r, flagged in zip(running, flags, strict=False):
            if flagged:
                self.local.cancel(r.handle.answer_id)

    async def _claim_again(self, missing: list[Running]) -> None:
        """Claims found gone (Redis lost them): set again where still free, and the
        generations' logs re-asserted."""
        expiry = int(time.time() * 1000) + self.handle_ttl_ms
        async with self.redis.pipeline(transaction=False) as pipe:
            for r in missing:
                await self._keep(
                    keys=[_run(r.handle.chat_id)],
                    args=[self._payload(r.handle), self.handle_ttl_ms],
                    client=pipe,
                )
            for r in missing:  # their cap entries may be gone with them
                pipe.zadd(_active(r.cap_key), {r.handle.answer_id: expiry})
                pipe.pexpire(_active(r.cap_key), self.handle_ttl_ms)
            kept = (await pipe.execute())[: len(missing)]
        self._check_kept(missing, kept)
        again = [r for r, k in zip(missing, kept, strict=True) if k == 2]
        ended = [r for r in again if not self.local.runs(r.handle.answer_id)]
        if ended:  # it ended while this beat ran: the claim was set again, take it back
            async with self.redis.pipeline(transaction=False) as pipe:
                for r in ended:
                    await self._release(
                        keys=[_run(r.handle.chat_id)], args=[self._payload(r.handle)], client=pipe
                    )
                await pipe.execute()
        self._needs_reassert.update(r.handle.answer_id for r in again if r not in ended)

    def _check_kept(self, running: list[Running], kept: list[Any]) -> None:
        for r, k in zip(running, kept, strict=True):
            if k == 0:
                log.error(
                    "chat %s is claimed by another generation while %s runs here",
                    r.handle.chat_id,
                    r.handle.answer_id,
                )


def _proc(token: str) -> str:
    return f"{PREFIX}proc:{token}"


def _run(chat_id: str) -> str:
    return f"{PREFIX}run:{chat_id}"


def _gen(answer_id: str) -> str:
    return f"{PREFIX}gen:{answer_id}"


def _latest(chat_id: str) -> str:
    return f"{PREFIX}latest:{chat_id}"


def _log(answer_id: str) -> str:
    return f"{PREFIX}log:{answer_id}"


def _journal(token: str) -> str:
    return f"{PREFIX}journal:{token}"


def _parse_id(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, n = _text(entry_id).partition("-")
    return int(ms), int(n or 0)


def _entry_id(entry: tuple[int, int]) -> str:
    return f"{entry[0]}-{entry[1]}"


def _owner(answer_id: str) -> str:
    return f"{PREFIX}owner:{answer_id}"


def _active(cap_key: str) -> str:
    return f"{PREFIX}active:{cap_key}"


def _cancel(answer_id: str) -> str:
    return f"{PREFIX}cancel:{answer_id}"


def _lead(chore: str) -> str:
    return f"{PREFIX}lead:{chore}"


_HANDLE_FIELDS = ("chat_id", "answer_id", "question_id", "user_id", "question")


def _dump_handle(handle: Handle) -> bytes:
    return orjson.dumps({name: getattr(handle, name) for name in _HANDLE_FIELDS})


def _load_handle(raw: bytes | str) -> Handle:
    fields = orjson.loads(raw)  # what a newer version adds is left out
    return Handle(**{name: fields[name] for name in _HANDLE_FIELDS})


def _dump_events(events: list[Event]) -> bytes:
    return orjson.dumps([[e.seq, e.type, e.data, e.ts] for e in events])


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _load_events(raw: bytes, handle: Handle) -> list[Event]:
    return [
        Event(kind, handle.chat_id, handle.answer_id, data, seq, ts)
        for seq, kind, data, ts in orjson.loads(raw)
    ]


def _after(events: dict[int, Event], seq: int) -> list[Event]:
    """The events after `seq`, up to the first one missing."""
    out = []
    while (event := events.get(seq + 1)) is not None:
        out.append(event)
        seq += 1
    return out


def _error(handle: Handle, seq: int, text: str) -> Event:
    return Event(
        "error", handle.chat_id, handle.answer_id, {"key": "STREAM_ERROR", "data": text}, seq
    )


def _entries(response: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    return [entry for _key, entries in response or () for entry in entries]
