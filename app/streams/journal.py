"""What the Redis hub writes, and where: the bookkeeping of its group commit, with
no I/O (the hub's committer does what a `Plan` says, then reports back).

Each generation's numbered events wait in `pending` until the next commit. A
commit writes them as one entry of the process's journal — one XADD however
many generations run — except for the generations whose own log is due: those
that end, those whose last log write is `checkpoint` seconds old, and those
another process follows (`watch`), whose followers read only their log. What
went to the journal waits in `unlogged` until its log is written; the journal
is trimmed to what the logs do not hold yet, one commit after they are known
to hold it (on a Redis Cluster the log and the journal are on different nodes,
so the trim must not overtake the log write).

What waits for its log is kept as the JSON the journal entry was given, not as
events: each event is encoded once, and the thousands of tokens a busy process
holds for up to a checkpoint are a few byte strings, which the collector never
scans.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..events import Event
from .rediskeys import dump_events


@dataclass
class LogWrite:
    """One entry of an answer's log: what went to the journal for it (`journaled`,
    as encoded there), then its `events` not written anywhere yet."""

    answer_id: str
    journaled: list[bytes]
    events: list[Event]
    #: the log's expiry to set: "replay" (it ended), "running" (its first write), or ""
    expire: str

    @property
    def ended(self) -> bool:
        return bool(self.events) and self.events[-1].terminal

    def dump(self) -> bytes:
        """The entry's JSON: the events of every part, in order, as one array."""
        if not self.journaled:
            return dump_events(self.events)
        parts = [part[1:-1] for part in self.journaled]  # each a non-empty JSON array
        if self.events:
            parts.append(dump_events(self.events)[1:-1])
        return b"[" + b",".join(parts) + b"]"


@dataclass
class Plan:
    """One commit: the logs to append to, then the journal entry (`journal`: one field
    per generation) trimmed to `trim` (an entry id) if given."""

    pending: dict[str, list[Event]]
    logs: list[LogWrite] = field(default_factory=list)
    journal: dict[str, list[Event]] = field(default_factory=dict)
    #: `journal` as the entry's fields hold it, once encoded (`encode`)
    fields: dict[str, bytes] | None = None
    trim: tuple[int, int] | None = None
    #: the journal is new: give it its expiry (the heartbeat keeps it from then on)
    expire_journal: bool = False
    #: the generations whose claim the commit ends too (filled in by the writer)
    ended: list[str] = field(default_factory=list)

    def encode(self) -> dict[str, bytes]:
        """The journal entry's fields: each generation's events as JSON, encoded once
        (raises what encoding them raises)."""
        if self.fields is None:
            self.fields = {a: dump_events(batch) for a, batch in self.journal.items()}
        return self.fields


class Journal:
    """The events of this process's generations not yet in Redis, or in the journal
    only. Not thread-safe; one commit at a time (`plan`, then `written` or `failed`)."""

    def __init__(self, checkpoint: float) -> None:
        self.checkpoint = checkpoint
        self.pending: dict[str, list[Event]] = {}
        #: in the journal, not yet in their log, as encoded there; when the first of
        #: them went there, with that entry's id (what trims the journal)
        self.unlogged: dict[str, list[bytes]] = {}
        #: in the order they went there, so oldest first (and their entry ids rising):
        #: a commit finds the due logs and the trim without reading every generation's
        self.unlogged_since: dict[str, tuple[float, tuple[int, int]]] = {}
        self.last_entry: tuple[int, int] | None = None
        self.logged: set[str] = set()  # generations whose log has its running expiry
        #: generations another process follows, until when (monotonic)
        self.watched: dict[str, float] = {}
        self._catch_up: set[str] = set()  # newly followed: their log is due at once

    def queue(self, answer_id: str, event: Event) -> None:
        pending = self.pending.get(answer_id)
        if pending is None:
            pending = self.pending[answer_id] = []
        pending.append(event)

    def watch(self, answer_id: str, until: float) -> bool:
        """Another process follows `answer_id` until `until`: its events go to its log
        at every commit. True when its log needs a commit now (to catch up)."""
        new = answer_id not in self.watched
        self.watched[answer_id] = until
        if new and answer_id in self.unlogged:
            self._catch_up.add(answer_id)
            return True
        return False

    def replace(self, answer_id: str, event: Event) -> None:
        """What of `answer_id` waits is dropped, and `event` waits instead (its end,
        in place of events that cannot be written)."""
        self.pending[answer_id] = [event]

    def forget(self, answer_id: str) -> None:
        """The generation is over here (abandoned): nothing of it is kept."""
        self.pending.pop(answer_id, None)
        self.unlogged.pop(answer_id, None)
        self.unlogged_since.pop(answer_id, None)
        self.logged.discard(answer_id)
        self.watched.pop(answer_id, None)
        self._catch_up.discard(answer_id)

    def plan(self, now: float, only: str | None = None) -> Plan | None:
        """The next commit — of every generation, or of `only` (one that ends should not
        make all the others write early) — or None when there is nothing to write.
        Takes the pending events: `failed` gives them back."""
        for answer_id, until in list(self.watched.items()):
            if until <= now:
                del self.watched[answer_id]
        if only is not None:
            pending = {only: self.pending.pop(only)} if only in self.pending else {}
            due = {only} if only in pending or only in self.unlogged else set()
        else:
            pending, self.pending = self.pending, {}
            due = set()
            for answer_id, (since, _) in self.unlogged_since.items():  # oldest first
                if now - since < self.checkpoint:
                    break
                due.add(answer_id)
            due |= self._catch_up & self.unlogged.keys()
            for answer_id, batch in pending.items():
                if batch[-1].terminal or answer_id in self.watched:
                    due.add(answer_id)
        if not pending and not due:
            return None
        plan = Plan(pending)
        for answer_id in due:
            write = LogWrite(
                answer_id, list(self.unlogged.get(answer_id, ())), pending.get(answer_id, []), ""
            )
            if write.ended:
                expire = "replay"
            elif answer_id not in self.logged:
                expire = "running"
            else:
                expire = ""
            write.expire = expire
            plan.logs.append(write)
        plan.journal = {a: batch for a, batch in pending.items() if a not in due}
        if plan.journal:
            # what every log holds by now, as acknowledged by earlier commits (the
            # oldest unlogged entry is the first: see `unlogged_since`)
            first = next(iter(self.unlogged_since.values()), None)
            oldest = first[1] if first is not None else self.last_entry
            if only is None and oldest is not None:
                plan.trim = oldest
            plan.expire_journal = self.last_entry is None
        return plan

    def failed(self, plan: Plan) -> None:
        """Redis did not take the commit: its events are pending again, in front of
        newer ones."""
        for answer_id, batch in plan.pending.items():
            self.pending.setdefault(answer_id, [])[:0] = batch

    def written(self, plan: Plan, entry: tuple[int, int] | None, now: float) -> None:
        """Redis acknowledged the commit; `entry` is the id of its journal entry (whose
        fields the plan encoded)."""
        for write in plan.logs:
            self.unlogged.pop(write.answer_id, None)
            self.unlogged_since.pop(write.answer_id, None)
            self._catch_up.discard(write.answer_id)
            if write.ended:
                self.logged.discard(write.answer_id)
                self.watched.pop(write.answer_id, None)
            else:
                self.logged.add(write.answer_id)
        if entry is None:
            return
        self.last_entry = entry
        for answer_id, part in plan.encode().items():
            unlogged = self.unlogged.get(answer_id)
            if unlogged is None:
                self.unlogged[answer_id] = [part]
                self.unlogged_since[answer_id] = (now, entry)
            else:
                unlogged.append(part)

    def rewritten(self, answer_id: str, last: int, running: bool) -> None:
        """The whole log of `answer_id` was written again, up to seq `last` (Redis lost
        it): what was pending or in the journal up to there is in it."""
        pending = [e for e in self.pending.pop(answer_id, []) if e.seq > last]
        if pending:
            self.pending[answer_id] = pending
        self.unlogged.pop(answer_id, None)
        self.unlogged_since.pop(answer_id, None)
        if running:
            self.logged.add(answer_id)
