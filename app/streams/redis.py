"""`redis://`: the registry and event logs shared by every server process.

Keys (all under `sc:`):

    run:{chatId}      the running generation's handle (JSON); SET NX claims the chat,
                      a TTL of `handle_ttl` refreshed by the owner's heartbeat makes
                      a dead process's claim expire
    gen:{answerId}    the handle, kept while the events are (for resume)
    latest:{chatId}   the chat's newest answer id
    log:{answerId}    a Redis Stream; each entry holds a batch of events (JSON)
    cancel:{answerId} a short-lived cancel flag, in case pub/sub misses the owner
    channel sc:cancel pub/sub: answer ids to cancel

A generation appends to its local log (which local clients follow with no
Redis round trip); a flusher writes the new events of every generation of the
process in one pipeline every `flush_interval` (one XADD per generation per
flush, never a rewrite of what was written). Clients on other processes replay
the stream and follow it with XREAD BLOCK.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ..errors import Unavailable
from ..protocol import Event
from .base import GenerationLog, Handle, LocalRegistry, StreamHub, already_running, too_many

log = logging.getLogger("app.streams")

PREFIX = "sc:"
CHANNEL = PREFIX + "cancel"
LOG_CAP = 100_000  # entries (batches) per generation, approximate
BLOCK_MS = 1000
FLUSH_AT = 256  # pending events of one generation that trigger a flush before the interval


@contextlib.contextmanager
def unavailable() -> Iterator[None]:
    """Redis failing under an operation that needs it: `Unavailable` (503)."""
    try:
        yield
    except (RedisError, OSError) as exc:
        log.warning("redis is unavailable: %s", exc)
        raise Unavailable("the stream registry (redis) is unavailable; try again") from exc


class RedisHub(StreamHub):
    """Shares the registry and the logs through Redis; this process's own part lives
    in a `LocalRegistry`, so local readers never wait on Redis. The Redis client is
    the caller's (opened and closed with the app)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        replay_ttl: float,
        handle_ttl: float,
        flush_interval: float,
        max_generation_seconds: float,
    ) -> None:
        self.redis = redis
        self.local = LocalRegistry(replay_ttl)
        self.replay_ttl_ms = int(replay_ttl * 1000)
        self.handle_ttl_ms = int(handle_ttl * 1000)
        self.flush_interval = flush_interval
        self.max_generation_ms = int(max_generation_seconds * 1000)
        self._pending: dict[str, list[Event]] = {}
        self._dirty: dict[str, GenerationLog] = {}
        self._flushed: set[str] = set()
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ------------------------------------------------------------------

    async def open(self) -> None:
        self._tasks = [
            asyncio.create_task(self._flusher(), name="redis-flusher"),
            asyncio.create_task(self._listener(), name="redis-cancel-listener"),
            asyncio.create_task(self._heartbeat(), name="redis-heartbeat"),
        ]

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self.flush()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                await task
        self.local.close()

    async def ping(self) -> None:
        await self.redis.ping()

    # -- registry -------------------------------------------------------------------

    async def register(
        self, handle: Handle, on_cancel: Callable[[], None], *, max_per_user: int = 0
    ) -> GenerationLog:
        payload = _dump_handle(handle)
        with unavailable():
            claimed = await self.redis.set(
                _run(handle.chat_id), payload, nx=True, px=self.handle_ttl_ms
            )
            if not claimed:
                raise already_running()
            now_ms = int(time.time() * 1000)
            keep = self.max_generation_ms + self.replay_ttl_ms
            async with self.redis.pipeline(transaction=False) as pipe:
                # the user's running generations: members expire with their claims
                pipe.zremrangebyscore(_active(handle.user_id), "-inf", now_ms)
                pipe.zadd(_active(handle.user_id), {handle.answer_id: now_ms + self.handle_ttl_ms})
                pipe.pexpire(_active(handle.user_id), self.handle_ttl_ms)
                pipe.zcard(_active(handle.user_id))
                pipe.set(_gen(handle.answer_id), payload, px=keep)
                pipe.set(_latest(handle.chat_id), handle.answer_id, px=keep)
                running = (await pipe.execute())[3]
            if max_per_user and running > max_per_user:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.zrem(_active(handle.user_id), handle.answer_id)
                    pipe.delete(_run(handle.chat_id), _gen(handle.answer_id))
                    await pipe.execute()
                raise too_many(max_per_user)
        log_ = GenerationLog(handle, self._queue)
        self.local.add(log_, on_cancel)
        return log_

    async def finish(self, handle: Handle, terminal: Event) -> None:
        log_ = self.local.log(handle.answer_id)
        self.local.release(handle)
        try:
            self._pending.setdefault(handle.answer_id, []).append(terminal)
            await self.flush(only=handle.answer_id)
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.pexpire(_log(handle.answer_id), self.replay_ttl_ms)
                pipe.pexpire(_gen(handle.answer_id), self.replay_ttl_ms)
                pipe.pexpire(_latest(handle.chat_id), self.replay_ttl_ms)
                pipe.delete(_cancel(handle.answer_id))
                pipe.zrem(_active(handle.user_id), handle.answer_id)
                await pipe.execute()
            # release the claim only if it is still ours
            current = await self.redis.get(_run(handle.chat_id))
            if current is not None and _load_handle(current).answer_id == handle.answer_id:
                await self.redis.delete(_run(handle.chat_id))
        except (RedisError, OSError) as exc:
            log.warning("redis unavailable while finishing %s: %s", handle.answer_id, exc)
        finally:
            self._flushed.discard(handle.answer_id)
            if log_ is not None:
                log_.append(terminal)

    async def lookup(self, chat_id: str) -> Handle | None:
        with unavailable():
            raw = await self.redis.get(_run(chat_id))
        return _load_handle(raw) if raw else None

    async def cancel(self, handle: Handle) -> None:
        if self.local.cancel(handle.answer_id):
            return
        with unavailable():
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.set(_cancel(handle.answer_id), b"1", px=max(self.handle_ttl_ms * 2, 60_000))
                pipe.publish(CHANNEL, handle.answer_id)
                await pipe.execute()

    async def latest(self, chat_id: str) -> Handle | None:
        with unavailable():
            answer_id = await self.redis.get(_latest(chat_id))
        if answer_id:
            return await self.find(_text(answer_id))
        # Redis lost it (restarted without persistence): this process may still hold it
        return self.local.latest(chat_id)

    async def find(self, answer_id: str) -> Handle | None:
        local = self.local.log(answer_id)
        if local is not None:
            return local.handle
        with unavailable():
            raw = await self.redis.get(_gen(answer_id))
        return _load_handle(raw) if raw else None

    # -- the event log ----------------------------------------------------------------

    def _queue(self, log_: GenerationLog, event: Event) -> None:
        """A log's sink: queue a numbered event for the next flush."""
        answer_id = log_.handle.answer_id
        pending = self._pending.get(answer_id)
        if pending is None:
            pending = self._pending[answer_id] = []
        pending.append(event)
        self._wake.set()
        if event.terminal or len(pending) >= FLUSH_AT:
            self._urgent.set()

    async def _flusher(self) -> None:
        while True:
            await self._wake.wait()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.flush_interval):
                    await self._urgent.wait()
            try:
                await self.flush()
            except (RedisError, OSError) as exc:
                log.warning(
                    "redis unavailable, %d generations not flushed: %s", len(self._pending), exc
                )
                await asyncio.sleep(0.5)
                if self._pending:
                    self._wake.set()  # try again: finished generations append nothing more

    async def flush(self, only: str | None = None) -> None:
        """Write pending events — of every generation, or of the answer id `only` (a
        generation that ends should not make all the others write early).
        Serialised, so each log's entries stay in order."""
        async with self._flush_lock:
            if only is not None:
                pending = {only: self._pending.pop(only)} if only in self._pending else {}
            else:
                self._wake.clear()
                self._urgent.clear()
                pending, self._pending = self._pending, {}
            if not pending:
                return
            keep = self.max_generation_ms + self.replay_ttl_ms
            async with self.redis.pipeline(transaction=False) as pipe:
                for answer_id, batch in pending.items():
                    key = _log(answer_id)
                    pipe.xadd(key, {"e": _dump_events(batch)}, maxlen=LOG_CAP, approximate=True)
                    if answer_id not in self._flushed:
                        pipe.pexpire(key, keep)
                try:
                    await pipe.execute()
                except BaseException:
                    for answer_id, batch in pending.items():  # back, in front of newer ones
                        self._pending.setdefault(answer_id, [])[:0] = batch
                    raise
            self._flushed.update(pending)

    async def subscribe(self, handle: Handle, after_seq: int) -> AsyncIterator[list[Event]]:
        local = self.local.log(handle.answer_id)
        if local is not None:
            async for batch in local.follow(after_seq):
                yield batch
            return
        async for batch in self._follow_remote(handle, after_seq):
            yield batch

    async def _follow_remote(self, handle: Handle, after_seq: int) -> AsyncIterator[list[Event]]:
        key = _log(handle.answer_id)
        last_id: bytes | str = "0-0"
        seq = after_seq
        while True:
            with unavailable():
                response = await self.redis.xread({key: last_id}, block=BLOCK_MS)
            entries = _entries(response)
            if not entries:
                if await self._alive(handle):
                    continue
                # one last read: the terminal entry may have landed just now
                entries = _entries(await self.redis.xread({key: last_id}))
                if not entries:
                    if self.on_lost is not None:
                        await self.on_lost(handle, await self._logged(handle))
                    yield [
                        Event(
                            "error",
                            handle.chat_id,
                            handle.answer_id,
                            {
                                "key": "STREAM_ERROR",
                                "data": "generation lost: its server process stopped",
                            },
                            seq + 1,
                        )
                    ]
                    return
            for entry_id, fields in entries:
                last_id = entry_id
                batch = [e for e in _load_events(fields[b"e"], handle) if e.seq > seq]
                if not batch:
                    continue
                seq = batch[-1].seq
                yield batch
                if batch[-1].terminal:
                    return

    async def _logged(self, handle: Handle) -> list[Event]:
        """Every event of a generation that reached Redis."""
        entries = _entries([(b"", await self.redis.xrange(_log(handle.answer_id)))])
        return [event for _id, fields in entries for event in _load_events(fields[b"e"], handle)]

    async def _alive(self, handle: Handle) -> bool:
        raw = await self.redis.get(_run(handle.chat_id))
        return raw is not None and _load_handle(raw).answer_id == handle.answer_id

    # -- background: cancels and heartbeats ------------------------------------------------

    async def _listener(self) -> None:
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(CHANNEL)
                async for message in pubsub.listen():
                    if message and message.get("type") == "message":
                        self.local.cancel(message["data"].decode())
            except (RedisError, OSError) as exc:
                log.warning("cancel listener lost redis: %s", exc)
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _heartbeat(self) -> None:
        """Keep this process's claims alive and pick up cancel flags, in one pipeline
        of about one command per running generation."""
        interval = min(self.handle_ttl_ms / 3000, 5.0)
        while True:
            await asyncio.sleep(interval)
            running = self.local.running()
            if not running:
                continue
            expiry = int(time.time() * 1000) + self.handle_ttl_ms
            by_user: dict[str, dict[str, int]] = {}
            for handle in running:
                by_user.setdefault(handle.user_id, {})[handle.answer_id] = expiry
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for handle in running:
                        pipe.pexpire(_run(handle.chat_id), self.handle_ttl_ms)
                    for user_id, members in by_user.items():
                        pipe.zadd(_active(user_id), members)
                        pipe.pexpire(_active(user_id), self.handle_ttl_ms)
                    pipe.mget([_cancel(handle.answer_id) for handle in running])
                    flags = (await pipe.execute())[-1]
            except (RedisError, OSError) as exc:
                log.warning("heartbeat: redis unavailable: %s", exc)
                continue
            for handle, flagged in zip(running, flags, strict=True):
                if flagged:
                    self.local.cancel(handle.answer_id)


def _run(chat_id: str) -> str:
    return f"{PREFIX}run:{chat_id}"


def _gen(answer_id: str) -> str:
    return f"{PREFIX}gen:{answer_id}"


def _latest(chat_id: str) -> str:
    return f"{PREFIX}latest:{chat_id}"


def _log(answer_id: str) -> str:
    return f"{PREFIX}log:{answer_id}"


def _active(user_id: str) -> str:
    return f"{PREFIX}active:{user_id}"


def _cancel(answer_id: str) -> str:
    return f"{PREFIX}cancel:{answer_id}"


_HANDLE_FIELDS = ("chat_id", "answer_id", "question_id", "user_id", "question")


def _dump_handle(handle: Handle) -> bytes:
    return orjson.dumps({name: getattr(handle, name) for name in _HANDLE_FIELDS})


def _load_handle(raw: bytes | str) -> Handle:
    return Handle(**orjson.loads(raw))


def _dump_events(events: list[Event]) -> bytes:
    return orjson.dumps([[e.seq, e.type, e.data, e.ts] for e in events])


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _load_events(raw: bytes, handle: Handle) -> list[Event]:
    return [
        Event(kind, handle.chat_id, handle.answer_id, data, seq, ts)
        for seq, kind, data, ts in orjson.loads(raw)
    ]


def _entries(response: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    return [entry for _key, entries in response or () for entry in entries]
