"""Claims on chats, the concurrency cap and one-at-a-time chores, in Redis.

A chat is claimed with SET NX on its `run` key (one key, one script: any hash slot
of a Redis Cluster); the claim is extended and released only by its owner
(compare-and-extend, compare-and-delete), and expires with a process that dies.
Whether Redis lost its data — this process's `proc` key gone, or another process's
`recovering` flag — is read in the same round trip, outside the script (those keys
live in other slots): a claim set by a process that then learns so is taken back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

from redis.asyncio.lock import Lock
from redis.exceptions import LockNotOwnedError, RedisError

from ..events import Handle
from . import rediskeys as k

# set a key that is free: 1 claimed, 0 another generation has it
CLAIM = """
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
# shorten a key's TTL only if it still holds this value (a chat's newest answer)
SHORTEN = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

#: what `claim` says
CLAIMED, TAKEN, RECOVERING = 1, 0, -1
#: the longest a claim that failed half-way takes to be given back
LET_GO_SECONDS = 1.0


def kept_for_replay(pipe: Any, chat_id: str, answer_id: str, replay_ms: int) -> None:
    """Add to a pipeline what keeps an ended answer for replay only: its handle and
    owner, and its chat's newest-answer pointer while it still names it, expire with
    the replay TTL; its cancel flag goes."""
    pipe.pexpire(k.gen(answer_id), replay_ms)
    pipe.eval(SHORTEN, 1, k.latest(chat_id), answer_id, replay_ms)
    pipe.pexpire(k.owner(answer_id), replay_ms)
    pipe.delete(k.cancel(answer_id))


def end_in(pipe: Any, handle: Handle, payload: bytes, cap_key: str | None, replay_ms: int) -> None:
    """Add to a pipeline what ends a generation's claim (see `Claims.ended`)."""
    kept_for_replay(pipe, handle.chat_id, handle.answer_id, replay_ms)
    if cap_key is not None:
        pipe.zrem(k.active(cap_key), handle.answer_id)
    pipe.eval(RELEASE, 1, k.run(handle.chat_id), payload)


class Claims:
    """The claim side of the Redis hub. Every method is one pipeline (a round trip per
    node it touches) and raises what the client raises; callers bound them with a
    deadline."""

    def __init__(self, redis: Any, token: str, *, handle_ttl_ms: int, keep_ms: int) -> None:
        self.redis = redis
        self.token = token
        self.handle_ttl_ms = handle_ttl_ms
        self.keep_ms = keep_ms  # how long an answer's handle and pointers outlive its start
        self._locks: dict[str, Lock] = {}
        self._letting_go: set[asyncio.Task[None]] = set()

    async def claim(self, handle: Handle, payload: bytes, cap_key: str) -> tuple[int, int]:
        """Claim the chat and count the cap key's running answers with this one:
        (CLAIMED | TAKEN | RECOVERING, running). Whatever fails once the claim may
        have been set (a pipeline that raised, a deadline, a cancel) has it taken
        back, as far as Redis lets it, in the background (the caller's error is not
        held up by a Redis that does not answer): else the chat would answer
        "already running" until the claim expired. `aclose` waits for that."""
        sent = False
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.exists(k.proc(self.token))
                pipe.exists(k.RECOVERING)
                pipe.eval(CLAIM, 1, k.run(handle.chat_id), payload, self.handle_ttl_ms)
                sent = True
                alive, recovering, claimed = await pipe.execute()
            if not alive or recovering:
                if claimed:
                    await self.redis.eval(RELEASE, 1, k.run(handle.chat_id), payload)
                return RECOVERING, 0
            if not claimed:
                sent = False  # another generation's: not ours to take back
                return TAKEN, 0
            now_ms = int(time.time() * 1000)
            async with self.redis.pipeline(transaction=False) as pipe:
                # the running generations of the cap key: members expire with their claims
                active = k.active(cap_key)
                pipe.zremrangebyscore(active, "-inf", now_ms)
                pipe.zadd(active, {handle.answer_id: now_ms + self.handle_ttl_ms})
                pipe.pexpire(active, self.handle_ttl_ms)
                pipe.zcard(active)
                pipe.set(k.gen(handle.answer_id), payload, px=self.keep_ms)
                pipe.set(k.latest(handle.chat_id), handle.answer_id, px=self.keep_ms)
                pipe.set(k.owner(handle.answer_id), self.token, px=self.keep_ms)
                running = (await pipe.execute())[3]
            return CLAIMED, int(running)
        except BaseException:
            if sent:
                task = asyncio.get_running_loop().create_task(
                    self._let_go(handle, payload, cap_key), name=f"unclaim {handle.chat_id}"
                )
                self._letting_go.add(task)
                task.add_done_callback(self._letting_go.discard)
            raise

    async def _let_go(self, handle: Handle, payload: bytes, cap_key: str) -> None:
        """`unclaim`, best effort, within a deadline of its own."""
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(LET_GO_SECONDS):
                await self.unclaim(handle, payload, cap_key)

    async def aclose(self) -> None:
        """Wait until the claims being taken back are (each within `LET_GO_SECONDS`)."""
        if self._letting_go:
            await asyncio.wait(set(self._letting_go))

    async def unclaim(self, handle: Handle, payload: bytes, cap_key: str) -> None:
        """A claim given up before its generation ran."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(k.active(cap_key), handle.answer_id)
            pipe.delete(k.gen(handle.answer_id))
            pipe.eval(RELEASE, 1, k.run(handle.chat_id), payload)
            await pipe.execute()

    async def ended(
        self, handle: Handle, payload: bytes, cap_key: str | None, replay_ms: int
    ) -> None:
        """The generation ended: the claim released, its cap entry and cancel flag gone,
        its handle and pointers kept for replay."""
        async with self.redis.pipeline(transaction=False) as pipe:
            end_in(pipe, handle, payload, cap_key, replay_ms)
            await pipe.execute()

    async def orphaned(self, chat_id: str, answer_id: str, replay_ms: int) -> None:
        """An answer of a dead process, saved by the sweeper: its handle, owner, log
        and (if still its chat's newest) pointer kept for replay only, not for as long
        as a running answer may run."""
        async with self.redis.pipeline(transaction=False) as pipe:
            kept_for_replay(pipe, chat_id, answer_id, replay_ms)
            pipe.pexpire(k.log(answer_id), replay_ms)  # its end was never written
            await pipe.execute()

    async def hold(self, answer_ids: Sequence[str], ms: int) -> None:
        """Keep the log, handle and owner of ended answers for `ms` from now (an answer
        the store has not taken yet)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for answer_id in answer_ids:
                for key in (k.log(answer_id), k.gen(answer_id), k.owner(answer_id)):
                    pipe.pexpire(key, ms)
            await pipe.execute()

    async def keep(self, claims: Sequence[tuple[Handle, bytes, str]]) -> list[int]:
        """Set again claims found gone (Redis lost them) where still free, with their cap
        entries: 1 ours, 2 set again, 0 another generation's — one for each."""
        expiry = int(time.time() * 1000) + self.handle_ttl_ms
        async with self.redis.pipeline(transaction=False) as pipe:
            for handle, payload, _ in claims:
                pipe.eval(KEEP, 1, k.run(handle.chat_id), payload, self.handle_ttl_ms)
            for handle, _, cap_key in claims:
                pipe.zadd(k.active(cap_key), {handle.answer_id: expiry})
                pipe.pexpire(k.active(cap_key), self.handle_ttl_ms)
            return [int(kept) for kept in (await pipe.execute())[: len(claims)]]

    async def release(self, claims: Sequence[tuple[Handle, bytes]]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for handle, payload in claims:
                pipe.eval(RELEASE, 1, k.run(handle.chat_id), payload)
            await pipe.execute()

    async def lead(self, chore: str, ttl: float) -> bool:
        """Whether this process runs `chore` for the next `ttl` seconds: a redis-py
        `Lock`, extended while held, taken when free (or lost with Redis's data)."""
        lock = self._locks.get(chore)
        if lock is None:
            lock = self._locks[chore] = Lock(
                self.redis, k.lead(chore), timeout=ttl, blocking=False, thread_local=False
            )
        if lock.local.token is not None:
            try:
                return bool(await lock.reacquire())
            except LockNotOwnedError:  # expired, or taken by another since
                pass
        return bool(await lock.acquire(blocking=False))
