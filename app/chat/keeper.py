"""One home for saving answers: the final save, its retries, checkpoints of running
answers, the sweeper of what a dead process left, and the last saves at shutdown.

    save          an ended answer goes to the store within `SAVE_SECONDS`, or is
                  kept and retried — each answer on its own, with growing pauses —
                  so a store that is away or hangs never holds a client up, and one
                  answer the store refuses never holds the others back
    checkpoints   without Redis, a running answer is saved as far as it got every
                  `stream.flush_interval_ms`: a crash loses at most that much of it
    sweeper       answers left `streaming` by a process that died are saved from
                  their logged events, as `failed`; uploads left `indexing` by one
                  are marked `failed` (one process of the deployment at a time)
    shutdown      a last try at everything not yet saved; what is still refused is
                  logged by id (with Redis, another process's sweeper saves it from
                  its log, which is held for as long as the answer waits for the
                  store: see `hold`)

Errors a save meets are sorted at the store's boundary: `Unavailable` (the store
is away or too slow) is retried for up to `KEEP_TRYING_SECONDS`; anything else
(data the store refuses, a bug) is retried `MAX_ATTEMPTS` times, then given up
with one ERROR line naming the answer — a dead letter, never a blocked queue. The
sweeper treats each orphan the same way: one the store refuses is counted and,
past its cap, left alone, so it never stops the sweep of the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from ..chores import Chores
from ..cleaning import clean
from ..errors import AppError, Unavailable
from ..events import Event
from ..store import Checkpoint, Saved, Store, StoredMessage
from ..streams import LoggedEvents, StreamHub

log = logging.getLogger("app.keeper")

SAVE_SECONDS = 3.0  # the final save waits this long, then goes on in the background
SWEEP_GRACE = 2.0  # seconds an answer row exists before a sweeper looks at it
SWEEP_PAGE = 200
MAX_ATTEMPTS = 5  # saves that fail for another reason than an outage
KEEP_TRYING_SECONDS = 3600.0  # saves that fail because the store is away
FIRST_RETRY, LAST_RETRY = 0.2, 5.0
#: an unsaved answer's log is held this long past each `HOLD_EVERY` (it would expire
#: with the replay TTL otherwise, and with it what a sweeper could save it from)
HOLD_SECONDS = KEEP_TRYING_SECONDS + 600.0
HOLD_EVERY = 120.0
SHUTDOWN_SECONDS = 10.0  # the last saves at shutdown, all of them together
SAVES_AT_ONCE = 8
#: running answers checkpointed in one store call (one transaction): a checkpoint of
#: more goes in slices of this many, the loop let go between them, so how long a
#: checkpoint holds the loop at a time does not grow with the number of streams
CHECKPOINT_SLICE = 100
#: a file still `indexing` this long after its upload, by a process no longer alive
FILE_GRACE = 30.0
LOST = "generation lost: its server process stopped"
FILE_LOST = "the server stopped while reading this file; upload it again"


class Running(Protocol):
    """A generation of this process, as the keeper sees it."""

    @property
    def answer_id(self) -> str: ...

    def progress(self) -> tuple[int, Checkpoint]:
        """The seq of its last event so far, and the answer as far as it got."""
        ...


@dataclass(frozen=True, slots=True)
class _Stored:
    """How much of a running answer the store holds after a checkpoint: the characters
    of its content and reasoning read, and the bytes (UTF-8) the store kept of them (a
    NUL is dropped, a lone surrogate replaced), after which the next checkpoint's
    additions go; and how many progress lines it holds."""

    content: int = 0
    reasoning: int = 0
    kept_content: int = 0
    kept_reasoning: int = 0
    steps: int = 0

    def rest(self, progress: Checkpoint) -> Checkpoint:
        """What of `progress` (all of the answer so far: it only grows) the store does
        not hold yet; `after` says what the store holds once it is saved. All of it,
        marked to be written whole, when what the store holds is not known."""
        if self.content < 0:
            return replace(progress, content_from=-1, reasoning_from=-1)
        return Checkpoint(
            progress.answer_id,
            progress.content[self.content :],
            progress.reasoning[self.reasoning :],
            progress.steps,
            self.kept_content,
            self.kept_reasoning,
            len(progress.steps) != self.steps,
        )

    def after(self, saved: Checkpoint) -> _Stored:
        """Once `saved`, which `rest` made after this, is in the store."""
        base = self if self.content >= 0 else NOTHING_STORED
        return _Stored(
            base.content + len(saved.content),
            base.reasoning + len(saved.reasoning),
            base.kept_content + len(clean(saved.content).encode()),
            base.kept_reasoning + len(clean(saved.reasoning).encode()),
            len(saved.steps),
        )


NOTHING_STORED = _Stored()
#: a checkpoint's outcome was lost (the store went away, or did not answer in time):
#: the next one sends the answer whole
NOT_KNOWN = _Stored(-1, -1, -1, -1, -1)


@dataclass(slots=True)
class _Unsaved:
    saved: Saved
    since: float
    attempts: int = 0
    next_at: float = 0.0
    delay: float = FIRST_RETRY
    held_at: float | None = None  # when its log was last held (see `hold`)


class AnswerKeeper:
    """Owned by the chat service; `open` starts its loops, `aclose` ends them."""

    def __init__(
        self,
        store: Store,
        hub: StreamHub,
        *,
        checkpoint_interval: float,
        sweep_interval: float,
    ) -> None:
        self.store = store
        self.hub = hub
        self.checkpoint_interval = checkpoint_interval
        self.sweep_interval = sweep_interval
        self.checkpoint_slice = CHECKPOINT_SLICE
        self._running: dict[str, Running] = {}
        self._checkpointed: dict[str, int] = {}  # answer → seq last checkpointed
        #: answer → how much of its content and reasoning the store holds: the
        #: characters read of each, and the bytes the store kept of them
        self._stored: dict[str, _Stored] = {}
        self._unsaved: dict[str, _Unsaved] = {}
        self._refused_orphans: dict[str, int] = {}  # orphan → saves the store refused
        self._retry = asyncio.Event()
        self._chores = Chores("answer keeper")

    # -- the running answers of this process ---------------------------------------

    def track(self, generation: Running) -> None:
        self._running[generation.answer_id] = generation

    def untrack(self, answer_id: str) -> None:
        self._running.pop(answer_id, None)
        self._checkpointed.pop(answer_id, None)
        self._stored.pop(answer_id, None)

    def runs(self, answer_id: str) -> bool:
        return answer_id in self._running

    # -- saving ----------------------------------------------------------------------

    async def save(self, answer_id: str, saved: Saved) -> bool:
        """Save an ended answer now, or keep it and save it later; never raises for a
        store that fails or hangs. Returns whether it was saved now."""
        try:
            async with asyncio.timeout(SAVE_SECONDS):
                await self.store.finish_answer(answer_id, saved)
        except Exception as exc:  # any failure: kept and tried again, never waited on
            self._keep(answer_id, saved, exc)
            return False
        return True

    def unsaved(self, answer_id: str) -> bool:
        return answer_id in self._unsaved

    def pending(self) -> int:
        """How many ended answers wait for the store."""
        return len(self._unsaved)

    def _keep(self, answer_id: str, saved: Saved, exc: BaseException) -> None:
        if isinstance(exc, Unavailable | TimeoutError):
            log.warning(
                "answer %s could not be saved yet; retrying until the store is back", answer_id
            )
        else:
            log.error("saving answer %s failed; retrying", answer_id, exc_info=exc)
        entry = self._unsaved.get(answer_id)
        if entry is None:
            entry = self._unsaved[answer_id] = _Unsaved(saved, time.monotonic())
        entry.saved = saved
        self._fail(answer_id, entry, exc)
        self._retry.set()

    def _fail(self, answer_id: str, entry: _Unsaved, exc: BaseException) -> None:
        """Count a failed attempt; give the answer up (a dead letter) past its cap."""
        outage = isinstance(exc, Unavailable | TimeoutError)
        if not outage:
            entry.attempts += 1
        now = time.monotonic()
        if entry.attempts >= MAX_ATTEMPTS or now - entry.since > KEEP_TRYING_SECONDS:
            if self._unsaved.pop(answer_id, None) is None:
                return  # given up already (by a round that ran beside this one)
            log.error(
                "answer %s is given up: the store refused it %d times (%s)",
                answer_id,
                entry.attempts,
                type(exc).__name__ if not isinstance(exc, AppError) else exc.message,
                extra={
                    "fields": {
                        "deadLetter": answer_id,
                        "status": entry.saved.status,
                        "chars": len(entry.saved.content),
                    }
                },
            )
            return
        entry.next_at = now + entry.delay
        entry.delay = min(entry.delay * 2, LAST_RETRY)

    async def retry_now(self) -> int:
        """One round: try every kept answer whose pause is over, each on its own (at
        most `SAVES_AT_ONCE` at a time, so a store that hangs costs a round
        `SAVE_SECONDS` per that many, not per answer). Returns how many were saved."""
        now = time.monotonic()
        due = [(a, e) for a, e in self._unsaved.items() if e.next_at <= now]
        if not due:
            return 0
        slots = asyncio.Semaphore(SAVES_AT_ONCE)

        async def one(answer_id: str, entry: _Unsaved) -> bool:
            async with slots:
                if self._unsaved.get(answer_id) is not entry:
                    return False  # saved or given up meanwhile
                try:
                    async with asyncio.timeout(SAVE_SECONDS):
                        await self.store.finish_answer(answer_id, entry.saved)
                except Exception as exc:
                    self._fail(answer_id, entry, exc)
                    return False
            self._unsaved.pop(answer_id, None)
            log.info("answer %s saved after the store came back", answer_id)
            return True

        results = await asyncio.gather(*(one(a, e) for a, e in due))
        return sum(results)

    async def hold(self, answer_ids: Sequence[str] | None = None) -> None:
        """Keep the logs of answers the store has not taken yet (those named, or every
        one last held `HOLD_EVERY` ago) for `HOLD_SECONDS`: an ended answer's log
        otherwise expires with the replay TTL, and if this process died before the
        store came back, the sweeper would find nothing to save it from. Never raises:
        a registry that is away is asked again at the next round."""
        now = time.monotonic()
        if answer_ids is None:
            answer_ids = [
                a
                for a, e in self._unsaved.items()
                if e.held_at is None or now - e.held_at >= HOLD_EVERY
            ]
        held = [a for a in answer_ids if a in self._unsaved]
        if not held:
            return
        try:
            await self.hub.hold(held, HOLD_SECONDS)
        except AppError as exc:
            log.debug("logs of unsaved answers not held yet: %s", exc.message)
            return
        for answer_id in held:
            entry = self._unsaved.get(answer_id)
            if entry is not None:
                entry.held_at = now

    async def _saver(self) -> None:
        while True:
            await self._retry.wait()
            while self._unsaved:
                await self.retry_now()
                await self.hold()
                if self._unsaved:
                    wait = min(e.next_at for e in self._unsaved.values()) - time.monotonic()
                    await asyncio.sleep(max(wait, 0.05))
            self._retry.clear()

    # -- checkpoints ------------------------------------------------------------------

    async def checkpoint(self) -> int:
        """Save every running answer that grew since its last checkpoint, as far as it
        got, `checkpoint_slice` answers a transaction; after each, a hub that holds
        events back until they are durable may let that slice's through. Returns how
        many were saved. Each answer's row is sent what was added to it since its last
        checkpoint, not all of it again: what a checkpoint costs grows with the tokens
        since the last one, not with the answers' lengths. A store that is away or
        too slow ends the checkpoint at the slice it failed (raised); the slices
        before it are saved."""
        running = list(self._running)
        size = self.checkpoint_slice
        saved = 0
        for start in range(0, len(running), size):
            if start:
                await asyncio.sleep(0)  # what else the loop has to do goes first
            saved += await self._checkpoint_slice(running[start : start + size])
        return saved

    async def _checkpoint_slice(self, answer_ids: list[str]) -> int:
        due = []
        stored = self._stored
        for answer_id in answer_ids:
            generation = self._running.get(answer_id)
            if generation is None:
                continue  # it ended since the checkpoint began
            seq, progress = generation.progress()
            if seq != self._checkpointed.get(answer_id, 0):
                base = stored.get(answer_id, NOTHING_STORED)
                due.append((seq, base.rest(progress), base))
        if not due:
            return 0
        try:
            try:
                async with asyncio.timeout(SAVE_SECONDS):
                    await self.store.checkpoint_answers([progress for _, progress, _ in due])
            except AppError as exc:  # one answer the store refuses: the others still go
                if isinstance(exc, Unavailable):
                    raise
                log.warning("a checkpoint was refused (%s); saving answers one by one", exc.message)
                due = [entry for entry in due if await self._checkpoint_one(entry[1])]
        except (Unavailable, TimeoutError):
            for _, progress, _ in due:  # it may have been written, or not
                if progress.answer_id in self._running:
                    stored[progress.answer_id] = NOT_KNOWN
            raise
        for seq, progress, base in due:
            if progress.answer_id in self._running:
                self._checkpointed[progress.answer_id] = seq
                stored[progress.answer_id] = base.after(progress)
                self.hub.release_saved(progress.answer_id, seq)
        return len(due)

    async def _checkpoint_one(self, progress: Checkpoint) -> bool:
        try:
            async with asyncio.timeout(SAVE_SECONDS):
                await self.store.checkpoint_answers([progress])
        except (Unavailable, TimeoutError):
            raise
        except AppError as exc:
            log.warning("checkpoint of answer %s refused: %s", progress.answer_id, exc.message)
            return False
        return True

    async def _checkpointer(self) -> None:
        """Without Redis, every `checkpoint_interval`; with it, only while it is away
        (then the store is what makes events durable, and streams go on at this pace)."""
        while True:
            await asyncio.sleep(self.checkpoint_interval)
            if self.hub.holds_events and not self.hub.degraded:
                continue
            try:
                await self.checkpoint()
            except (AppError, TimeoutError) as exc:
                log.debug("checkpoint skipped: %r", exc)

    # -- the sweeper ------------------------------------------------------------------

    async def sweep(self) -> int:
        """Close the answers left `streaming` by a process that died (a kill -9): each
        is saved with what its log holds — what a resuming client ends with — or, for
        one that was checkpointed, with its checkpoint, whichever has more, as `failed`
        (or as its logged end said). One process of the deployment sweeps at a time;
        returns how many it closed."""
        if not await self.hub.lead("sweeper", ttl=self.sweep_interval * 3):
            return 0
        try:
            closed = await self._sweep_answers()
        except (AppError, TimeoutError) as exc:  # the files' sweep goes on regardless
            log.info("sweep of answers skipped: %s", getattr(exc, "message", repr(exc)))
            closed = 0
        await self._sweep_files()
        return closed

    async def _sweep_answers(self) -> int:
        closed = 0
        # a claim outlives a dead owner by handle_ttl: younger rows cannot be orphans yet
        before = time.time() - max(SWEEP_GRACE, self.hub.claim_ttl)
        after: tuple[float, str] | None = None
        while True:
            page = await self.store.streaming_answers(before, after, SWEEP_PAGE)
            candidates = [
                answer
                for answer in page
                if answer.id not in self._running
                and answer.id not in self._unsaved
                and self._refused_orphans.get(answer.id, 0) < MAX_ATTEMPTS
            ]
            states = await self.hub.states([(a.chat_id, a.id) for a in candidates])
            orphans = [
                answer for answer, state in zip(candidates, states, strict=True) if state == "gone"
            ]
            if orphans:  # what Redis kept of them, read at once (they share journals)
                logged = await self.hub.logged_many([answer.id for answer in orphans])
                for orphan in orphans:
                    # its text is read only now: the page lists every running answer
                    # of the deployment, every few seconds, by id alone
                    # (one ended meanwhile is left as it is: the save is only_streaming)
                    answer = await self.store.get_message(orphan.id)
                    if answer is not None:
                        closed += await self._close_orphan(answer, logged[orphan.id])
            if len(page) < SWEEP_PAGE:
                break
            after = (page[-1].created_at, page[-1].id)
        return closed

    async def _sweep_files(self) -> None:
        """Mark uploads left `indexing` by a process that died as failed (whatever
        became of the answers' sweep; the collections service sweeps its documents)."""
        files = await self.store.fail_orphaned_files(FILE_LOST, time.time() - FILE_GRACE)
        if files:
            log.info("marked %d uploads left indexing by a stopped process as failed", files)

    async def _close_orphan(self, answer: StoredMessage, logged: list[Event]) -> int:
        """Save one orphan. A store that is away stops the sweep (the next one goes
        on); one that refuses this answer is counted against it, and past
        `MAX_ATTEMPTS` the answer is left `streaming` with one ERROR line naming it,
        so it never holds back the orphans after it."""
        saved = saved_from(logged, fallback=answer)
        try:
            async with asyncio.timeout(SAVE_SECONDS):
                done = await self.store.finish_answer(answer.id, saved, only_streaming=True)
        except (Unavailable, TimeoutError):
            raise
        except Exception as exc:
            refused = self._refused_orphans[answer.id] = self._refused_orphans.get(answer.id, 0) + 1
            if refused >= MAX_ATTEMPTS:
                log.error(
                    "orphaned answer %s is given up: the store refused it %d times",
                    answer.id,
                    refused,
                    exc_info=exc,
                    extra={"fields": {"deadLetter": answer.id, "chars": len(saved.content)}},
                )
            else:
                log.warning("orphaned answer %s could not be saved: %r", answer.id, exc)
            return 0
        self._refused_orphans.pop(answer.id, None)
        if not done:
            return 0
        log.info("closed orphaned answer %s as %s", answer.id, saved.status)
        try:
            await self.hub.orphaned(answer.chat_id, answer.id)
        except AppError as exc:  # its keys expire anyway, later
            log.debug("orphan %s kept in the registry: %s", answer.id, exc.message)
        return 1

    async def _sweeper(self) -> None:
        while True:
            try:
                await self.sweep()
            except (AppError, TimeoutError) as exc:
                log.info("sweep skipped: %s", getattr(exc, "message", repr(exc)))
            await asyncio.sleep(self.sweep_interval)

    # -- lifecycle --------------------------------------------------------------------

    async def open(self) -> None:
        """Start the loops (the sweeper first closes what a crash left)."""
        self._chores.loop("sweeper", self._sweeper)
        self._chores.loop("saver", self._saver)
        self._chores.loop("checkpoints", self._checkpointer)

    async def aclose(self) -> None:
        """Stop the loops, then a last try at every answer still unsaved (all of them
        within `SHUTDOWN_SECONDS`); what the store still has not taken is logged by id,
        its log held for another process's sweeper."""
        await self._chores.aclose()
        for entry in self._unsaved.values():
            entry.next_at = 0.0
        if self._unsaved:
            try:
                async with asyncio.timeout(SHUTDOWN_SECONDS):
                    await self.retry_now()
            except TimeoutError:
                pass
            await self.hold(list(self._unsaved))
        for answer_id in self._unsaved:
            log.error("answer %s is not saved: the store is unavailable", answer_id)


def saved_from(logged: Sequence[Event], fallback: StoredMessage | None = None) -> Saved:
    """What to save for an answer from its logged events: their text and progress
    lines, and the status its end gave (`failed` when it has none: its process died,
    or it ended with an error, which is saved too). A `fallback` row (a checkpoint)
    with more text than the log wins: both are the start of the same answer."""
    content = "".join(e.data.get("data", "") for e in logged if e.type == "message")
    reasoning = "".join(e.data.get("data", "") for e in logged if e.type == "reasoning")
    if fallback is not None and len(fallback.content) + len(fallback.reasoning) > len(
        content
    ) + len(reasoning):
        content, reasoning = fallback.content, fallback.reasoning
    status, error, truncated = "failed", None, False
    last = logged[-1] if logged else None
    if last is not None and last.type == "messageEnd":
        status = last.data.get("status", "completed")
        truncated = last.data.get("truncated") is True
    elif last is not None and last.type == "error":
        error = {"key": str(last.data.get("key")), "data": str(last.data.get("data"))}
    else:
        error = {"key": "STREAM_ERROR", "data": LOST}
    return Saved(
        content=content,
        reasoning=reasoning,
        status=status,
        steps=steps_of(logged),
        error=error,
        truncated=truncated,
    )


def steps_of(logged: Sequence[Event]) -> list[str]:
    """An answer's progress lines, in order."""
    return [str(e.data.get("data", "")) for e in logged if e.type == "progress"]


class Progress:
    """A running answer as far as it got, kept up as it grows: each `update` reads
    only what was added since the last one. A checkpoint every `flush_interval_ms`
    that joined the whole answer and walked all of its events again cost, over a
    long answer, time growing with the square of its length."""

    __slots__ = ("content", "reasoning", "steps", "_content", "_reasoning", "_events")

    def __init__(self) -> None:
        self.content = self.reasoning = ""
        self.steps: list[str] = []
        self._content = self._reasoning = self._events = 0  # how many were read

    def update(
        self, content: Sequence[str], reasoning: Sequence[str], events: LoggedEvents
    ) -> None:
        """Take in what was appended to these (append-only) sequences since last time."""
        if len(content) > self._content:
            self.content += "".join(content[self._content :])
            self._content = len(content)
        if len(reasoning) > self._reasoning:
            self.reasoning += "".join(reasoning[self._reasoning :])
            self._reasoning = len(reasoning)
        if len(events) > self._events:
            self.steps.extend(steps_of(events.of_type("progress", self._events)))
            self._events = len(events)
