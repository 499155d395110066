"""Following a generation that runs on another process, through Redis.

A follower reads its answer's log and nothing else: XREAD BLOCK on that one
stream, from the start, so its Redis traffic grows with its own answer's events,
not with everything the owner runs. It tells the owner (pub/sub on the owner's
`follow` channel, again every `WATCH_EVERY` seconds) that the answer is
followed, and the owner then writes that answer's events to its log at every
commit instead of every checkpoint; a message that is lost costs latency (the
checkpoint still comes), never events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from redis.exceptions import MaxConnectionsError, RedisError

from ..errors import AppError
from ..events import Event, Handle
from . import rediskeys as k
from .connect import is_cluster
from .rediskeys import BUSY_SECONDS, WATCH_EVERY

log = logging.getLogger("app.streams")

BLOCK_MS = 1000
#: a follower that keeps finding events missing gives up after this many reads of the log
MAX_GAPS = 20


class Followed(Protocol):
    """What a follower needs of its hub (the Redis hub is one)."""

    #: the client for commands, and the one for reads that wait (XREAD BLOCK)
    redis: Any
    blocking: Any
    #: the longest one call to Redis may take
    timeout: float
    #: how long a lost claim or a Redis away is waited for: `settle` + `claim_ttl`
    settle: float
    claim_ttl: float

    async def owner_of(self, answer_id: str) -> str: ...

    async def states(self, answers: list[tuple[str, str]]) -> list[str]: ...

    async def alive(self, token: str) -> bool: ...

    async def gather(self, handle: Handle) -> dict[int, Event]: ...

    def connection_lost(self) -> None: ...

    async def reconnect(self) -> None: ...


async def _xread(client: Any, key: str, last_id: bytes | str) -> Any:
    """XREAD BLOCK on one stream. On a cluster, sent to the node of the key's slot
    as the client's map has it (redis-py would otherwise ask the server for the keys
    of every XREAD, a `COMMAND GETKEYS` round trip each); a MOVED answer is still
    followed."""
    if not is_cluster(client):
        return await client.xread({key: last_id}, block=BLOCK_MS)
    await client.initialize()  # the slot map, once
    node = client.get_node_from_key(key)
    return await client.execute_command(
        "XREAD", "BLOCK", BLOCK_MS, "STREAMS", key, last_id, target_nodes=node
    )


async def gather_many(redis: Any, handles: Sequence[Handle]) -> dict[str, dict[int, Event]]:
    """Every event of each generation that Redis holds — its log and, unless the log
    has its end, its owner's journal — by seq (a commit sent again after a failure may
    have written some twice), each owner's journal read once for all of them (a dead
    process's orphans share it). The journal is read first: what it no longer holds
    was trimmed after the log had it."""
    async with redis.pipeline(transaction=False) as pipe:
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
    async with redis.pipeline(transaction=False) as pipe:
        for handle in open_:
            pipe.get(k.owner(handle.answer_id))
        owners = await pipe.execute()
    by_owner: dict[str, list[Handle]] = {}
    for handle, owner in zip(open_, owners, strict=True):
        if owner:
            by_owner.setdefault(k.text(owner), []).append(handle)
    for owner, owned in by_owner.items():
        fields_of = {h.answer_id.encode(): h for h in owned}
        for _id, fields in await redis.xrange(k.journal(owner)):
            for field, raw in fields.items():
                handle_ = fields_of.get(field)
                if handle_ is not None:
                    kept = events[handle_.answer_id]
                    for event in k.load_events(raw, handle_):
                        kept.setdefault(event.seq, event)
    async with redis.pipeline(transaction=False) as pipe:
        for handle in handles:
            pipe.xrange(k.log(handle.answer_id))
        logs = await pipe.execute()
    for handle, entries in zip(handles, logs, strict=True):
        kept = events[handle.answer_id]
        for _id, fields in entries:
            for event in k.load_events(fields[b"e"], handle):
                kept.setdefault(event.seq, event)
    return events


async def follow(hub: Followed, handle: Handle, after_seq: int) -> AsyncIterator[list[Event]]:
    """The events after `after_seq` of another process's generation, in order, each
    once, until its terminal event. Through an outage it reconnects and goes on from
    the last event it had; it ends with an `error` event when the generation is
    lost (its claim and its process gone), or Redis stays away past `settle` + the
    claim's TTL. Closing it is safe."""
    key = k.log(handle.answer_id)
    owner = ""
    last_id: bytes | str = "0-0"
    seq = after_seq
    gaps = 0
    announced = float("-inf")
    gone_since: float | None = None  # when its claim was first found gone, its owner alive
    failing_since: float | None = None
    delay = 0.1
    patience = hub.settle + hub.claim_ttl
    while True:
        try:
            now = time.monotonic()
            if now - announced >= WATCH_EVERY:
                async with asyncio.timeout(hub.timeout * 2):
                    owner = owner or await hub.owner_of(handle.answer_id)
                    if owner:
                        await hub.redis.publish(k.follow_channel(owner), handle.answer_id)
                announced = now
            async with asyncio.timeout(BLOCK_MS / 1000 + hub.timeout):
                found = k.entries(await _xread(hub.blocking, key, last_id))
            if not found:
                # nothing for a while: does it still run?
                (state,) = await hub.states([(handle.chat_id, handle.answer_id)])
                if state != "gone":
                    gone_since = None
                    continue
                # ended (its end is in the log: read next) or lost with its process
                async with asyncio.timeout(hub.timeout * 2):
                    alive = bool(owner) and await hub.alive(owner)
                now = time.monotonic()
                if alive and (gone_since is None or now - gone_since < patience):
                    gone_since = gone_since or now
                    continue
                # one last look at all Redis holds of it (its log, its owner's journal)
                async with asyncio.timeout(hub.timeout * 2):
                    batch = k.after(await hub.gather(handle), seq)
                if batch:
                    yield batch
                    seq = batch[-1].seq
                    if batch[-1].terminal:
                        return
                # the sweeper saves what was logged
                yield [k.error(handle, seq + 1, "generation lost: its server process stopped")]
                return
            failing_since, delay = None, 0.1
        except MaxConnectionsError:
            # every connection the client may open to that node is taken (on a
            # cluster: it refuses at once where one Redis's pool waits): back-pressure,
            # not Redis failing, so neither an outage nor a new slot map
            await asyncio.sleep(BUSY_SECONDS)
            continue
        except (RedisError, OSError, AppError, TimeoutError) as exc:
            hub.connection_lost()
            await hub.reconnect()
            now = time.monotonic()
            if failing_since is None:
                failing_since = now
                log.warning("following %s: redis unavailable: %r", handle.answer_id, exc)
            if now - failing_since > patience:
                yield [k.error(handle, seq + 1, "the stream registry is unavailable")]
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            continue
        from_start = last_id == "0-0"
        for entry_id, fields in found:
            raw = fields.get(b"e")
            batch = [e for e in k.load_events(raw, handle) if e.seq > seq] if raw else []
            if batch and batch[0].seq != seq + 1:
                # entries missing (lost by Redis, to be written again by the owner):
                # the whole log again
                gaps += 1
                if gaps > MAX_GAPS:
                    log.error("following %s: events missing after %d", handle.answer_id, seq)
                    yield [k.error(handle, seq + 1, "the stream lost events")]
                    return
                # read from the start, unless this read was one already: then wait
                # for what comes after it (the log written again)
                last_id = found[-1][0] if from_start else "0-0"
                break
            last_id = entry_id
            if not batch:
                continue
            gaps = 0
            seq = batch[-1].seq
            yield batch
            if batch[-1].terminal:
                return
