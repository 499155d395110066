"""What one heartbeat of the Redis hub sends, and what its answers mean: the
bookkeeping of the beat, with no I/O (the hub's `Heartbeat` plans each `Beat`; the
hub sends what it says in one pipeline, then reads the answers back through it).

A beat says the process lives (its key, read back: found missing, Redis lost its
data) and keeps its journal. It extends each claim a quarter of its TTL old (one
GETEX, which also says whose the claim is) and its cap entry — every claim while the
hub doubts Redis (a node that failed may come back empty: a lost claim must be found
before another process can take its chat) — and on a cluster sees that its handle is
still there (its node may have lost its data alone). It reads the cancel flags of the
answers registered since the last beat (a cancel can come before an answer is held
here), or of every running answer after the cancel listener was (re)subscribed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import rediskeys as k
from .base import Running

#: one command of the beat's pipeline: its name, arguments and keyword arguments
Command = tuple[str, tuple[Any, ...], dict[str, Any]]


@dataclass
class Heard:
    """What the answers of a beat said."""

    #: the process's key was missing: Redis lost its data (every claim is missing)
    lost_data: bool
    #: claims found gone, to be set again
    missing: list[Running]
    #: the claims read, and for each 1 if it is this process's (or gone), 0 if another
    #: generation's (empty when the data was lost)
    kept: list[int] = field(default_factory=list)
    #: claims still there whose handle is gone (on a cluster: their node lost its data)
    lost: list[Running] = field(default_factory=list)
    #: answers whose cancel flag was set
    cancelled: list[Running] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """What every beat of one hub shares: its process's token, whether Redis is a
    cluster, the TTLs, and how old a claim is when a beat extends it (`refresh`)."""

    token: str
    cluster: bool
    handle_ttl_ms: int
    proc_ttl_ms: int
    keep_ms: int
    refresh: float

    def plan(
        self,
        running: list[Running],
        extended: Mapping[str, float],
        *,
        now: float,
        wall_ms: int,
        doubtful: bool,
        flags_unread: bool,
        fresh: Collection[str],
    ) -> Beat:
        """The beat for `running` at `now` (monotonic; `wall_ms` the Unix time in
        milliseconds), each claim extended last at `extended[answer_id]`: the claims
        `refresh` seconds old (all of them while the hub is `doubtful` of Redis), and
        the cancel flags of all of them if `flags_unread`, else of the `fresh` ones."""
        if doubtful:
            due = running
        else:
            due = [
                r for r in running if now - extended.get(r.handle.answer_id, 0.0) >= self.refresh
            ]
        flags = running if flags_unread else [r for r in running if r.handle.answer_id in fresh]
        return Beat(self, running, due, flags, wall_ms + self.handle_ttl_ms)


@dataclass(frozen=True, slots=True)
class Beat:
    """One heartbeat: `commands()` to send in one pipeline, `read(results)` for what
    their answers say."""

    heart: Heartbeat
    running: list[Running]
    #: the claims to read and extend
    due: list[Running]
    #: the answers whose cancel flag to read
    flags: list[Running]
    #: when an extended claim expires (Unix milliseconds: the cap's scores)
    expiry: int

    def commands(self) -> list[Command]:
        heart = self.heart
        out: list[Command] = [
            ("set", (k.proc(heart.token), b"1"), {"px": heart.proc_ttl_ms, "get": True}),
            ("pexpire", (k.journal(heart.token), heart.keep_ms), {}),
        ]
        for r in self.due:
            out.append(("getex", (k.run(r.handle.chat_id),), {"px": heart.handle_ttl_ms}))
            if heart.cluster:
                out.append(("exists", (k.gen(r.handle.answer_id),), {}))
        out += [("get", (k.cancel(r.handle.answer_id),), {}) for r in self.flags]
        by_cap: dict[str, dict[str, int]] = {}
        for r in self.due:
            by_cap.setdefault(r.cap_key, {})[r.handle.answer_id] = self.expiry
        for cap_key, members in by_cap.items():
            out.append(("zadd", (k.active(cap_key), members), {}))
            out.append(("pexpire", (k.active(cap_key), heart.handle_ttl_ms), {}))
        return out

    def read(self, results: Sequence[Any]) -> Heard:
        """What the answers to `commands()`, in order, say."""
        cluster = self.heart.cluster
        stride = 2 if cluster else 1
        per_claim = [
            (results[2 + stride * i], results[3 + stride * i] if cluster else 1)
            for i in range(len(self.due))
        ]
        start = 2 + stride * len(self.due)
        flagged = results[start : start + len(self.flags)]
        cancelled = [r for r, flag in zip(self.flags, flagged, strict=True) if flag]
        if results[0] is None:
            return Heard(lost_data=True, missing=self.running, cancelled=cancelled)
        claims = list(zip(self.due, per_claim, strict=True))
        return Heard(
            lost_data=False,
            missing=[r for r, (claim, _) in claims if claim is None],
            kept=[1 if claim in (None, k.dump_handle(r.handle)) else 0 for r, (claim, _) in claims],
            lost=[r for r, (claim, gen) in claims if claim and not gen],
            cancelled=cancelled,
        )
