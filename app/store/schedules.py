"""Scheduled research (PROTOCOL §16): schedules, their runs, and the webhooks to send
(an outbox): the tables and their SQL.

Exactly once per due time: a due time is claimed by moving the schedule's
`next_run_at` from it to the next one — an update that only one transaction can
make, on PostgreSQL (the row lock makes the loser see the new value) as on SQLite
(one writer) — and the run's row is written in the same transaction, unique by
(schedule, due time). A run's holder keeps a lease on it (`owner`, `lease_until`,
on the database's clock, so hosts whose clocks differ agree); a run whose lease
ran out is taken over once.
"""

from __future__ import annotations

from typing import Any

from .chats import insert_chat
from .records import Chat, Delivery, Schedule, ScheduleRun
from .sql import Database, mapped

#: the lock under which a user's schedules are counted and one added, so two at once
#: cannot both pass the limit
SCHEDULES_LOCK_ID = 7_138_337_260
SCHEDULE_COLUMNS = (
    "id, user_id, chat_id, question, cron, timezone, next_run_at, created_at, options,"
    " webhook_url, webhook_secret, notify, enabled, paused_reason, failures"
)
RUN_COLUMNS = (
    "id, schedule_id, due_at, status, attempt, started_at, ended_at, message_id, changed, error"
)
DELIVERY_COLUMNS = "id, url, secret, body, next_at, expires_at, attempts, status, error"
#: when a schedule's latest completed run ended
LAST_RUN = (
    "(SELECT max(r.ended_at) FROM schedule_runs r"
    " WHERE r.schedule_id = schedules.id AND r.status = 'completed')"
)

MIGRATIONS: dict[int, str | dict[str, str]] = {
    # 14: schedules, their runs (one per due time, under a lease) and the webhooks to send
    14: """
    CREATE TABLE schedules (
        id TEXT PRIMARY KEY,
        user_id TEXT NOT NULL,
        chat_id TEXT NOT NULL,
        question TEXT NOT NULL,
        cron TEXT NOT NULL,
        timezone TEXT NOT NULL,
        next_run_at {real} NOT NULL,
        created_at {real} NOT NULL,
        options {json} NOT NULL,
        webhook_url TEXT,
        webhook_secret TEXT,
        notify TEXT NOT NULL,
        enabled {bool} NOT NULL,
        paused_reason TEXT,
        failures INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX schedules_by_user ON schedules (user_id, created_at);
    CREATE INDEX schedules_due ON schedules (next_run_at) WHERE enabled;
    CREATE TABLE schedule_runs (
        id TEXT PRIMARY KEY,
        schedule_id TEXT NOT NULL REFERENCES schedules (id) ON DELETE CASCADE,
        due_at {real} NOT NULL,
        status TEXT NOT NULL,
        attempt INTEGER NOT NULL DEFAULT 1,
        owner TEXT,
        lease_until {real},
        started_at {real},
        ended_at {real},
        message_id TEXT,
        changed {bool},
        error TEXT,
        UNIQUE (schedule_id, due_at)
    );
    CREATE INDEX schedule_runs_by_schedule ON schedule_runs (schedule_id, started_at);
    CREATE INDEX schedule_runs_running ON schedule_runs (lease_until) WHERE status = 'running';
    CREATE TABLE webhook_deliveries (
        id TEXT PRIMARY KEY,
        url TEXT NOT NULL,
        secret TEXT NOT NULL,
        body TEXT NOT NULL,
        next_at {real} NOT NULL,
        expires_at {real} NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0,
        status TEXT NOT NULL,
        error TEXT,
        owner TEXT,
        lease_until {real}
    );
    CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_at) WHERE status = 'pending';
    """,
}


def _bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


class ScheduleTables:
    """The schedules' part of a `Store` (see `Store` for each method's contract)."""

    db: Database

    def _schedule(self, row: Any) -> Schedule:
        return Schedule(
            id=row[0],
            user_id=row[1],
            chat_id=row[2],
            question=row[3],
            cron=row[4],
            timezone=row[5],
            next_run_at=row[6],
            created_at=row[7],
            options=self.db.dialect.unjson(row[8]) or {},
            webhook_url=row[9],
            webhook_secret=row[10],
            notify=row[11],
            enabled=bool(row[12]),
            paused_reason=row[13],
            failures=row[14],
            last_run_at=row[15] if len(row) > 15 else None,
        )

    def _schedule_params(self, s: Schedule) -> tuple[Any, ...]:
        return (
            s.id,
            s.user_id,
            s.chat_id,
            s.question,
            s.cron,
            s.timezone,
            s.next_run_at,
            s.created_at,
            self.db.dialect.json(s.options),
            s.webhook_url,
            s.webhook_secret,
            s.notify,
            s.enabled,
            s.paused_reason,
            s.failures,
        )

    @staticmethod
    def _run(row: Any) -> ScheduleRun:
        return ScheduleRun(
            id=row[0],
            schedule_id=row[1],
            due_at=row[2],
            status=row[3],
            attempt=row[4],
            started_at=row[5],
            ended_at=row[6],
            message_id=row[7],
            changed=_bool(row[8]),
            error=row[9],
        )

    @mapped
    async def add_schedule(self, schedule: Schedule, chat: Chat, max_per_user: int) -> bool:
        marks = ", ".join("?" * 15)
        async with self.db.transaction() as tx:
            await tx.lock(SCHEDULES_LOCK_ID)
            count = await tx.fetchval(
                "SELECT count(*) FROM schedules WHERE user_id = ?", schedule.user_id
            )
            if count >= max_per_user:
                return False
            await insert_chat(tx, chat)
            await tx.execute(
                f"INSERT INTO schedules ({SCHEDULE_COLUMNS}) VALUES ({marks})",
                *self._schedule_params(schedule),
            )
            return True

    @mapped
    async def get_schedule(self, schedule_id: str) -> Schedule | None:
        row = await self.db.fetchrow(
            f"SELECT {SCHEDULE_COLUMNS}, {LAST_RUN} FROM schedules WHERE id = ?", schedule_id
        )
        return self._schedule(row) if row else None

    @mapped
    async def list_schedules(self, user_id: str) -> list[Schedule]:
        rows = await self.db.fetch(
            f"SELECT {SCHEDULE_COLUMNS}, {LAST_RUN} FROM schedules WHERE user_id = ?"
            " ORDER BY created_at, id",
            user_id,
        )
        return [self._schedule(row) for row in rows]

    @mapped
    async def update_schedule(self, schedule: Schedule) -> bool:
        changed = await self.db.execute(
            "UPDATE schedules SET question = ?, cron = ?, timezone = ?, next_run_at = ?,"
            " options = ?, webhook_url = ?, webhook_secret = ?, notify = ?, enabled = ?,"
            " paused_reason = ?, failures = ? WHERE id = ?",
            schedule.question,
            schedule.cron,
            schedule.timezone,
            schedule.next_run_at,
            self.db.dialect.json(schedule.options),
            schedule.webhook_url,
            schedule.webhook_secret,
            schedule.notify,
            schedule.enabled,
            schedule.paused_reason,
            schedule.failures,
            schedule.id,
        )
        return changed == 1

    @mapped
    async def delete_schedule(self, schedule_id: str) -> bool:
        # its runs go with it (ON DELETE CASCADE); its chat stays
        return await self.db.execute("DELETE FROM schedules WHERE id = ?", schedule_id) == 1

    @mapped
    async def delete_user_schedules(self, user_id: str) -> int:
        async with self.db.transaction() as tx:
            chats = [
                row[0]
                for row in await tx.fetch(
                    "SELECT chat_id FROM schedules WHERE user_id = ?", user_id
                )
            ]
            count = await tx.execute("DELETE FROM schedules WHERE user_id = ?", user_id)
            if chats:
                where, params = tx.dialect.any_of(chats)
                await tx.execute(f"DELETE FROM chats WHERE id {where}", *params)
            return count

    @mapped
    async def due_schedules(self, now: float, limit: int = 100) -> list[Schedule]:
        rows = await self.db.fetch(
            f"SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE enabled AND next_run_at <= ?"
            " ORDER BY next_run_at LIMIT ?",
            now,
            limit,
        )
        return [self._schedule(row) for row in rows]

    @mapped
    async def claim_run(
        self, schedule: Schedule, next_run_at: float, run: ScheduleRun, owner: str, ttl: float
    ) -> bool:
        async with self.db.transaction() as tx:
            moved = await tx.execute(
                "UPDATE schedules SET next_run_at = ? WHERE id = ? AND next_run_at = ? AND enabled",
                next_run_at,
                schedule.id,
                schedule.next_run_at,
            )
            if moved != 1:
                return False
            return await self._insert_run(tx, run, owner, ttl)

    @mapped
    async def add_run(self, run: ScheduleRun, owner: str, ttl: float) -> bool:
        return await self._insert_run(self.db, run, owner, ttl)

    @staticmethod
    async def _insert_run(db: Any, run: ScheduleRun, owner: str, ttl: float) -> bool:
        inserted: int = await db.execute(
            "INSERT INTO schedule_runs (id, schedule_id, due_at, status, attempt, owner,"
            " lease_until, started_at) VALUES (?, ?, ?, 'running', 1, ?, {now} + ?, ?)"
            " ON CONFLICT (schedule_id, due_at) DO NOTHING",
            run.id,
            run.schedule_id,
            run.due_at,
            owner,
            ttl,
            run.started_at,
        )
        return inserted == 1

    @mapped
    async def renew_run(self, run_id: str, owner: str, ttl: float) -> bool:
        count = await self.db.execute(
            "UPDATE schedule_runs SET lease_until = {now} + ?"
            " WHERE id = ? AND owner = ? AND status = 'running'",
            ttl,
            run_id,
            owner,
        )
        return count == 1

    @mapped
    async def set_run_message(self, run_id: str, owner: str, message_id: str) -> bool:
        count = await self.db.execute(
            "UPDATE schedule_runs SET message_id = ? WHERE id = ? AND owner = ?",
            message_id,
            run_id,
            owner,
        )
        return count == 1

    @mapped
    async def release_run(self, run_id: str, owner: str) -> None:
        await self.db.execute(
            "UPDATE schedule_runs SET lease_until = {now} - 1"
            " WHERE id = ? AND owner = ? AND status = 'running'",
            run_id,
            owner,
        )

    @mapped
    async def abandoned_runs(self, limit: int = 100) -> list[ScheduleRun]:
        rows = await self.db.fetch(
            f"SELECT {RUN_COLUMNS} FROM schedule_runs"
            " WHERE status = 'running' AND lease_until < {now} ORDER BY lease_until LIMIT ?",
            limit,
        )
        return [self._run(row) for row in rows]

    @mapped
    async def take_over_run(self, run_id: str, owner: str, ttl: float) -> ScheduleRun | None:
        # an attempt that started no answer is not counted: taking it over is no retry
        row = await self.db.fetchrow(
            "UPDATE schedule_runs SET owner = ?, lease_until = {now} + ?,"
            " attempt = attempt + CASE WHEN message_id IS NULL THEN 0 ELSE 1 END,"
            " message_id = NULL"
            " WHERE id = ? AND status = 'running' AND lease_until < {now}"
            " AND (attempt < 2 OR message_id IS NULL)"
            f" RETURNING {RUN_COLUMNS}",
            owner,
            ttl,
            run_id,
        )
        return self._run(row) if row else None

    @mapped
    async def end_run(
        self,
        run: ScheduleRun,
        owner: str | None,
        pause_after: int,
        delivery: Delivery | None = None,
    ) -> bool:
        json_ok = run.status == "completed"
        async with self.db.transaction() as tx:
            ended = await tx.execute(
                "UPDATE schedule_runs SET status = ?, ended_at = ?, changed = ?, error = ?,"
                " message_id = coalesce(?, message_id), owner = NULL"
                " WHERE id = ? AND status = 'running'"
                + (" AND owner = ?" if owner is not None else " AND lease_until < {now}"),
                run.status,
                run.ended_at,
                run.changed,
                run.error,
                run.message_id,
                run.id,
                *((owner,) if owner is not None else ()),
            )
            if ended != 1:
                return False
            if json_ok or run.status == "cancelled":
                await tx.execute("UPDATE schedules SET failures = 0 WHERE id = ?", run.schedule_id)
            else:
                await tx.execute(
                    "UPDATE schedules SET failures = failures + 1,"
                    " enabled = CASE WHEN failures + 1 >= ? THEN {false} ELSE enabled END,"
                    " paused_reason = CASE WHEN failures + 1 >= ? THEN ? ELSE paused_reason END"
                    " WHERE id = ?",
                    pause_after,
                    pause_after,
                    f"paused after {pause_after} failed runs in a row; the last: {run.error}",
                    run.schedule_id,
                )
            if delivery is not None:
                await tx.execute(
                    f"INSERT INTO webhook_deliveries ({DELIVERY_COLUMNS})"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    delivery.id,
                    delivery.url,
                    delivery.secret,
                    delivery.body,
                    delivery.next_at,
                    delivery.expires_at,
                    delivery.attempts,
                    delivery.status,
                    delivery.error,
                )
            return True

    @mapped
    async def get_run(self, run_id: str) -> ScheduleRun | None:
        row = await self.db.fetchrow(
            f"SELECT {RUN_COLUMNS} FROM schedule_runs WHERE id = ?", run_id
        )
        return self._run(row) if row else None

    @mapped
    async def list_runs(self, schedule_id: str, limit: int = 50) -> list[ScheduleRun]:
        rows = await self.db.fetch(
            f"SELECT {RUN_COLUMNS} FROM schedule_runs WHERE schedule_id = ?"
            " ORDER BY started_at DESC, id DESC LIMIT ?",
            schedule_id,
            limit,
        )
        return [self._run(row) for row in rows]

    @mapped
    async def previous_answer(self, schedule_id: str, run_id: str) -> str | None:
        return await self.db.fetchval(  # type: ignore[no-any-return]
            "SELECT message_id FROM schedule_runs WHERE schedule_id = ? AND id != ?"
            " AND status = 'completed' AND message_id IS NOT NULL"
            " ORDER BY ended_at DESC, id DESC LIMIT 1",
            schedule_id,
            run_id,
        )

    # -- the webhooks' outbox ---------------------------------------------------------------

    @mapped
    async def claim_deliveries(
        self, now: float, owner: str, ttl: float, limit: int = 20
    ) -> list[Delivery]:
        rows = await self.db.fetch(
            "SELECT id FROM webhook_deliveries WHERE status = 'pending' AND next_at <= ?"
            " AND (lease_until IS NULL OR lease_until < {now}) ORDER BY next_at LIMIT ?",
            now,
            limit,
        )
        taken = []
        for (delivery_id,) in rows:
            row = await self.db.fetchrow(
                "UPDATE webhook_deliveries SET owner = ?, lease_until = {now} + ?"
                " WHERE id = ? AND status = 'pending'"
                " AND (lease_until IS NULL OR lease_until < {now})"
                f" RETURNING {DELIVERY_COLUMNS}",
                owner,
                ttl,
                delivery_id,
            )
            if row is not None:
                taken.append(Delivery(*row))
        return taken

    @mapped
    async def end_delivery(self, delivery: Delivery, owner: str) -> bool:
        count = await self.db.execute(
            "UPDATE webhook_deliveries SET status = ?, attempts = ?, next_at = ?, error = ?,"
            " owner = NULL, lease_until = NULL WHERE id = ? AND owner = ?",
            delivery.status,
            delivery.attempts,
            delivery.next_at,
            delivery.error,
            delivery.id,
            owner,
        )
        return count == 1

    @mapped
    async def get_delivery(self, delivery_id: str) -> Delivery | None:
        row = await self.db.fetchrow(
            f"SELECT {DELIVERY_COLUMNS} FROM webhook_deliveries WHERE id = ?", delivery_id
        )
        return Delivery(*row) if row else None
