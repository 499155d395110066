"""Scheduled research (PROTOCOL §16): a question asked on a cron schedule, each run an
ordinary answer in the schedule's own chat, and a webhook that tells the user.

`ScheduleService` is what the API asks (every operation owner only, through
`authorize`) and the scheduler every process runs: each `tick` (every
`schedules.tick_seconds`, by the `clock` it is given, which tests drive) it

1. claims the due times of the schedules that are due — the store makes each claim
   one process's (`Store.claim_run`), and a schedule whose due times were all missed
   while no process ran gets one run, for the first of them, and moves on to the
   next time after now;
2. takes over the runs whose holder went away (their lease ran out): at most once
   for a run whose answer had started (the retry is marked, attempt 2); one that
   ran out twice has failed;
3. sends the webhooks that are due (`Webhooks`).

A run starts its answer through `ChatService.start` as the transports do (so it can
be followed with resume, cancelled, and counts against the user's quota), renews
its lease while the answer's log runs, and at the end says whether the answer
changed since the schedule's previous one (the small model judges, strictly yes or
no; anything else counts as changed) and puts its webhook in the outbox, in the
transaction that ends the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import orjson

from . import cron
from .chat.service import ChatService
from .chores import Chores
from .errors import AppError, BadRequest, Conflict, Forbidden, NotFound, RateLimited
from .events import FOCUS_MODES
from .identity.quota import Quota, next_midnight
from .ids import parse_id
from .ownership import authorize
from .protocol import (
    OPTIMIZATION_MODES,
    ChatRequest,
    parse_chat_model,
    parse_collections,
    parse_sources,
)
from .store.records import Chat, Schedule, ScheduleRun, StoredMessage, iso
from .webhooks import Webhooks, check_url, new_secret

log = logging.getLogger("app.schedules")

NOTIFY = ("always", "changed")
#: what the judge of `changed` is shown of each answer, and may answer
JUDGED_CHARS = 6000
JUDGE_TOKENS = 3
_WORD = re.compile(r"[a-z]+")
MAX_CHAT_MODEL_CHARS = 500

Runner = Callable[[Schedule, ScheduleRun], Awaitable[None]]


class ScheduleService:
    def __init__(
        self,
        chat: ChatService,
        *,
        clock: Callable[[], float] = time.time,
        tick_seconds: float | None = None,
        runner: Runner | None = None,
    ) -> None:
        self.chat = chat
        self.settings = chat.settings.schedules
        self.store = chat.store
        self.clock = clock
        self.tick_seconds = self.settings.tick_seconds if tick_seconds is None else tick_seconds
        #: this process's lease token on the runs it holds
        self.owner = f"{chat.ids.worker}-{secrets.token_hex(6)}"
        self.webhooks = Webhooks(self.settings, self.store, owner=self.owner, clock=clock)
        self.quota = Quota(self.store, chat.settings.limits.tokens_per_day)
        self.runner = runner or self.execute
        self.chores = Chores("scheduler")
        self.running: dict[str, asyncio.Task[Any]] = {}  # run id → its task

    # -- the API ----------------------------------------------------------------------------

    async def create(self, user_id: str, body: Any) -> Schedule:
        """A new schedule and its chat; its webhook secret is on it this once."""
        if not isinstance(body, dict):
            raise BadRequest("the schedule must be a JSON object")
        for required in ("question", "cron"):
            if required not in body:
                raise BadRequest(f"{required} is required")
        now = self.clock()
        fields = await self._fields(user_id, body, None)
        chat_id = self.chat.ids.next_str()
        schedule = Schedule(
            id=self.chat.ids.next_str(),
            user_id=user_id,
            chat_id=chat_id,
            created_at=now,
            **fields,
        )
        options = schedule.options
        chat = Chat(chat_id, user_id, schedule.question[:80], options["focusMode"], now)
        if not await self.store.add_schedule(schedule, chat, self.settings.max_per_user):
            raise Conflict(f"at most {self.settings.max_per_user} schedules per user")
        return schedule

    async def owned(self, user_id: str, schedule_id: str) -> Schedule:
        schedule = await self.store.get_schedule(parse_id(schedule_id, "schedule id"))
        if schedule is None:
            raise NotFound("no such schedule")
        authorize(schedule.user_id, user_id, "schedule")
        return schedule

    async def listed(self, user_id: str) -> list[Schedule]:
        return await self.store.list_schedules(user_id)

    async def update(self, user_id: str, schedule_id: str, body: Any) -> tuple[Schedule, bool]:
        """Change any field; enabling a schedule clears its failures and pause, and its
        next run is the first due time from now. Returns the schedule and whether its
        webhook secret is new (a webhook added: shown this once)."""
        schedule = await self.owned(user_id, schedule_id)
        if not isinstance(body, dict):
            raise BadRequest("the change must be a JSON object")
        fields = await self._fields(user_id, body, schedule)
        changed = replace(schedule, **fields)
        enabled = body.get("enabled", schedule.enabled)
        if not isinstance(enabled, bool):
            raise BadRequest("enabled must be true or false")
        if enabled and not schedule.enabled:
            changed = replace(changed, failures=0, paused_reason=None)
        changed = replace(changed, enabled=enabled)
        if enabled and (not schedule.enabled or "cron" in body or "timezone" in body):
            changed = replace(
                changed, next_run_at=cron.next_time(changed.cron, changed.timezone, self.clock())
            )
        if not await self.store.update_schedule(changed):
            raise NotFound("no such schedule")
        return changed, changed.webhook_secret not in (None, schedule.webhook_secret)

    async def delete(self, user_id: str, schedule_id: str) -> None:
        schedule = await self.owned(user_id, schedule_id)
        await self.store.delete_schedule(schedule.id)

    async def runs(self, user_id: str, schedule_id: str) -> list[ScheduleRun]:
        schedule = await self.owned(user_id, schedule_id)
        return await self.store.list_runs(schedule.id)

    async def run_now(self, user_id: str, schedule_id: str) -> ScheduleRun:
        """Start a run now on this process (its due time is now)."""
        schedule = await self.owned(user_id, schedule_id)
        now = self.clock()
        run = ScheduleRun(self.chat.ids.next_str(), schedule.id, now, started_at=now)
        if not await self.store.add_run(run, self.owner, self.settings.lease_seconds):
            raise Conflict("a run of this schedule was started this very moment")
        self._spawn(schedule, run)
        return run

    async def _fields(self, user_id: str, body: dict[str, Any], base: Schedule | None) -> Any:
        """The fields `body` sets, checked (`BadRequest` names the first that is wrong);
        with `base`, those it leaves keep their value."""
        old = base.options if base is not None else {}
        limits = self.chat.settings.limits
        out: dict[str, Any] = {}
        question = body.get("question", base.question if base else None)
        if not isinstance(question, str) or not question.strip():
            raise BadRequest("question must be a non-empty string")
        if len(question) > limits.max_content_chars:
            raise BadRequest(f"question is longer than {limits.max_content_chars} characters")
        out["question"] = question
        timezone = body.get("timezone", base.timezone if base else "UTC") or "UTC"
        cron.zone(timezone)
        expression: Any = body.get("cron", base.cron if base else None)
        if base is None or "cron" in body or "timezone" in body:
            expression = cron.check(expression, timezone, self.settings.min_interval_seconds)
        out["cron"], out["timezone"] = expression, timezone
        if base is None:
            out["next_run_at"] = cron.next_time(expression, timezone, self.clock())
        focus = body.get("focusMode", old.get("focusMode", "webSearch"))
        if focus not in FOCUS_MODES:
            raise BadRequest(f"focusMode must be one of {', '.join(FOCUS_MODES)}")
        optimization = body.get("optimizationMode", old.get("optimizationMode", "speed"))
        if optimization not in OPTIMIZATION_MODES:
            raise BadRequest(f"optimizationMode must be one of {', '.join(OPTIMIZATION_MODES)}")
        sources = list(parse_sources(body.get("sources", old.get("sources"))))
        collections = list(parse_collections(body.get("collections", old.get("collections"))))
        if "collections" in body and collections and self.chat.collections is not None:
            await self.chat.collections.usable(user_id, collections)
        chat_model = body.get("chatModel", old.get("chatModel"))
        if chat_model is not None and (
            not isinstance(chat_model, dict)
            or len(orjson.dumps(chat_model)) > MAX_CHAT_MODEL_CHARS
            or parse_chat_model(chat_model) == (None, None)
        ):
            raise BadRequest('chatModel must be an object such as {"provider", "model"}')
        out["options"] = {
            "focusMode": focus,
            "optimizationMode": optimization,
            "sources": sources,
            "collections": collections,
            "chatModel": chat_model,
        }
        notify = body.get("notify", base.notify if base else "always")
        if notify not in NOTIFY:
            raise BadRequest(f"notify must be one of {', '.join(NOTIFY)}")
        out["notify"] = notify
        if "webhook" in body or base is None:
            hook = body.get("webhook")
            if hook is None:
                out["webhook_url"] = out["webhook_secret"] = None
            elif not isinstance(hook, dict):
                raise BadRequest('webhook must be an object {"url"} or null')
            else:
                allow = self.settings.webhook_allow_private_networks
                out["webhook_url"] = check_url(hook.get("url"), allow)
                # a new URL keeps the secret the user was shown
                had = base.webhook_secret if base is not None else None
                out["webhook_secret"] = had or new_secret()
        return out

    # -- the scheduler ------------------------------------------------------------------------

    async def open(self) -> None:
        """Start looking for due runs (when `schedules.enabled`)."""
        if self.settings.enabled:
            self.chores.loop("tick", self._loop)

    async def aclose(self) -> None:
        """Stop: the runs this process holds are let go (their answers go on; another
        process takes each over once its lease runs out)."""
        await self.chores.aclose()
        await self.webhooks.aclose()

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except AppError as exc:  # the store away: the next tick tries again
                log.warning("scheduler: %s", exc.message)
            await asyncio.sleep(self.tick_seconds)

    async def tick(self) -> list[asyncio.Task[Any]]:
        """One look for due runs, abandoned runs and due webhooks; returns the runs'
        tasks it started."""
        started = [self._spawn(s, r) for s, r in await self.claim_due()]
        started += [self._spawn(s, r) for s, r in await self.take_over()]
        await self.webhooks.deliver_due()
        return started

    async def claim_due(self) -> list[tuple[Schedule, ScheduleRun]]:
        """The due times this process won, each with its run (leased to it)."""
        now = self.clock()
        won = []
        for schedule in await self.store.due_schedules(now):
            try:
                following = cron.next_time(schedule.cron, schedule.timezone, now)
            except BadRequest:  # stored before a rule changed: never runs again
                following = float("inf")
            run = ScheduleRun(
                self.chat.ids.next_str(), schedule.id, schedule.next_run_at, started_at=now
            )
            lease = self.settings.lease_seconds
            if await self.store.claim_run(schedule, following, run, self.owner, lease):
                won.append((schedule, run))
        return won

    async def take_over(self) -> list[tuple[Schedule, ScheduleRun]]:
        """The abandoned runs this process takes over; those abandoned twice end failed."""
        taken = []
        for run in await self.store.abandoned_runs():
            if run.id in self.running:
                continue
            schedule = await self.store.get_schedule(run.schedule_id)
            if schedule is None:
                continue
            again = await self.store.take_over_run(run.id, self.owner, self.settings.lease_seconds)
            if again is not None:
                log.info(
                    "run %s of schedule %s taken over (attempt %d)",
                    run.id,
                    schedule.id,
                    again.attempt,
                )
                taken.append((schedule, again))
            elif run.attempt >= 2 and run.message_id is not None:
                failed = replace(
                    run,
                    status="failed",
                    ended_at=self.clock(),
                    error="the process running it stopped, twice",
                )
                await self._end(schedule, failed, None, owner=None)
        return taken

    def _spawn(self, schedule: Schedule, run: ScheduleRun) -> asyncio.Task[Any]:
        task = self.chores.spawn(self._held(schedule, run), name=f"schedule-run-{run.id}")
        self.running[run.id] = task
        task.add_done_callback(lambda _: self.running.pop(run.id, None))
        return task

    async def _held(self, schedule: Schedule, run: ScheduleRun) -> None:
        """Run `runner` while renewing the run's lease."""
        renew = self.chores.spawn(self._renew(run.id), name=f"schedule-lease-{run.id}")
        try:
            await self.runner(schedule, run)
        finally:
            renew.cancel()

    async def _renew(self, run_id: str) -> None:
        lease = self.settings.lease_seconds
        while True:
            await asyncio.sleep(lease / 3)
            with contextlib.suppress(AppError):  # a store away now may be back next time
                if not await self.store.renew_run(run_id, self.owner, lease):
                    log.warning("run %s: its lease was lost", run_id)
                    return

    async def execute(self, schedule: Schedule, run: ScheduleRun) -> None:
        """Answer the schedule's question in its chat, wait for the answer's end through
        its log, judge `changed`, end the run (and queue its webhook)."""
        try:
            await self._check_quota(schedule.user_id)
            handle = await self.chat.start(self.request(schedule))
        except Conflict:
            # its chat is answering (a run whose holder went, still closing): later
            await self.store.release_run(run.id, self.owner)
            return
        except AppError as exc:
            failed = replace(run, status="failed", ended_at=self.clock(), error=exc.message)
            await self._end(schedule, failed, None, owner=self.owner)
            return
        run = replace(run, message_id=handle.answer_id)
        await self.store.set_run_message(run.id, self.owner, handle.answer_id)
        last = None
        async for batch in self.chat.hub.subscribe(handle, 0):
            last = batch[-1]
        await self.chat.ended(handle)  # saved
        answer = await self.store.get_message(handle.answer_id)
        status: str = "failed"
        error: str | None = "the answer did not end"
        if last is not None and last.type == "messageEnd":
            status, error = str(last.data.get("status", "completed")), None
        elif last is not None and last.type == "error":
            error = str(last.data.get("data", "the answer failed"))
        changed = None
        if status == "completed" and answer is not None:
            changed = await self.judge(schedule, run, answer)
        ended = replace(run, status=status, ended_at=self.clock(), changed=changed, error=error)
        await self._end(schedule, ended, answer, owner=self.owner)

    async def _end(
        self,
        schedule: Schedule,
        run: ScheduleRun,
        answer: StoredMessage | None,
        *,
        owner: str | None,
    ) -> None:
        """End the run held by `owner` (None: one whose lease ran out), with its webhook."""
        delivery = None
        if schedule.webhook_url and schedule.webhook_secret and self._notify(schedule, run):
            body = await self.payload(schedule, run, answer)
            delivery = self.webhooks.delivery(
                f"msg_{run.id}", schedule.webhook_url, schedule.webhook_secret, body
            )
        ok = await self.store.end_run(run, owner, self.settings.pause_after_failures, delivery)
        if not ok:
            log.warning("run %s ended, but another process holds it now", run.id)
        elif delivery is not None:
            await self.webhooks.deliver_due()

    @staticmethod
    def _notify(schedule: Schedule, run: ScheduleRun) -> bool:
        return schedule.notify == "always" or run.changed is True

    async def payload(
        self, schedule: Schedule, run: ScheduleRun, answer: StoredMessage | None
    ) -> str:
        """The webhook's body (PROTOCOL §16)."""
        sources: list[dict[str, Any]] = []
        if answer is not None and answer.reply_to:
            question = await self.store.get_message(answer.reply_to)
            for source in question.sources if question is not None else []:
                meta = source.get("metadata") or {}
                if meta.get("url") and meta.get("title") != "All Sources":
                    sources.append({"title": meta.get("title", ""), "url": meta["url"]})
        kind = "completed" if run.status == "completed" else "failed"
        body = {
            "type": f"schedule.run.{kind}",
            "scheduleId": schedule.id,
            "runId": run.id,
            "chatId": schedule.chat_id,
            "messageId": run.message_id,
            "question": schedule.question,
            "answer": answer.content if answer is not None else "",
            "sources": sources,
            "changed": run.changed,
            "status": run.status,
        }
        if run.error:
            body["error"] = run.error
        return orjson.dumps(body).decode()

    def request(self, schedule: Schedule) -> ChatRequest:
        """The chat request of a run, as a transport would make it."""
        options = schedule.options
        provider, model = parse_chat_model(options.get("chatModel"))
        return ChatRequest(
            user_id=schedule.user_id,
            content=schedule.question,
            chat_id=schedule.chat_id,
            focus_mode=options.get("focusMode", "webSearch"),
            optimization_mode=options.get("optimizationMode", "speed"),
            sources=tuple(options.get("sources") or ()),
            collections=tuple(options.get("collections") or ()),
            model=model,
            provider=provider,
            transport="schedule",
            cap_key=f"user:{schedule.user_id}",
            host=self.chat.public_host(""),
        )

    async def _check_quota(self, user_id: str) -> None:
        """`RateLimited` once the user's answers used today's tokens (with accounts, the
        account's own quota; a disabled account's schedules do not run)."""
        account = await self.store.get_account(user_id)
        if account is not None and account.disabled:
            raise Forbidden("the account is disabled")
        limit = self.quota.default
        if account is not None and account.tokens_per_day is not None:
            limit = account.tokens_per_day
        if limit > 0 and await self.quota.used_today(user_id) >= limit:
            now = time.time()
            raise RateLimited(
                "daily token quota reached", retry_after=max(1, int(next_midnight(now) - now))
            )

    async def judge(self, schedule: Schedule, run: ScheduleRun, answer: StoredMessage) -> bool:
        """Whether the answer differs in substance from the previous run's (the small
        model says `yes` or `no`; anything else, or no previous answer, is True)."""
        previous_id = await self.store.previous_answer(schedule.id, run.id)
        previous = await self.store.get_message(previous_id) if previous_id else None
        if previous is None:
            return True
        prompt = self.chat.prompts.render(
            "schedule_changed",
            question=schedule.question,
            previous=previous.content[:JUDGED_CHARS],
            current=answer.content[:JUDGED_CHARS],
        )
        try:
            said = await self.chat.llm.complete(
                [{"role": "user", "content": prompt}], max_tokens=JUDGE_TOKENS, timeout=30.0
            )
        except AppError as exc:
            log.info("schedule %s: changed not judged: %s", schedule.id, exc.message)
            return True
        return verdict(said)


def verdict(said: str) -> bool:
    """The judge's answer, strictly: one word, `no` → False; anything else → True."""
    words = _WORD.findall(said.strip().lower())
    return words != ["no"]


def schedule_json(schedule: Schedule, *, secret: bool = False) -> dict[str, Any]:
    """A schedule as the API shows it; the webhook's secret only when `secret`."""
    out: dict[str, Any] = {
        "id": schedule.id,
        "question": schedule.question,
        "cron": schedule.cron,
        "timezone": schedule.timezone,
        "chatId": schedule.chat_id,
        "nextRunAt": iso(schedule.next_run_at) if schedule.next_run_at != float("inf") else None,
        "enabled": schedule.enabled,
        "pausedReason": schedule.paused_reason,
        "notify": schedule.notify,
        "createdAt": iso(schedule.created_at),
        "lastRunAt": iso(schedule.last_run_at) if schedule.last_run_at is not None else None,
        **schedule.options,
        "webhook": None,
    }
    if schedule.webhook_url:
        out["webhook"] = {"url": schedule.webhook_url}
        if secret and schedule.webhook_secret:
            out["webhook"]["secret"] = schedule.webhook_secret
    return out
