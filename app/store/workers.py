"""What the processes of a deployment share: leased worker numbers and secrets.

Leases are counted on the database's clock (`{now}`), so hosts whose clocks
differ agree on them."""

from __future__ import annotations

import random
import secrets as random_secrets

from .sql import Database, mapped, unavailable

LEASE_ATTEMPTS = 8

MIGRATIONS: dict[int, str | dict[str, str]] = {
    # 2: worker leases and shared secrets
    2: """
    CREATE TABLE workers (n INTEGER PRIMARY KEY, token TEXT NOT NULL, expires_at {real} NOT NULL);
    CREATE TABLE secrets (name TEXT PRIMARY KEY, value TEXT NOT NULL);
    """,
}


class WorkerTables:
    """The deployment's part of a `Store` (see `Store` for each method's contract)."""

    db: Database

    @mapped
    async def lease_worker(self, token: str, ttl: float, workers: int) -> int:
        # a free number at random (not the lowest), so that starts racing for one
        # rarely meet; the upsert takes it only if it is still free
        for _attempt in range(LEASE_ATTEMPTS):
            held = {
                row[0]
                for row in await self.db.fetch("SELECT n FROM workers WHERE expires_at > {now}")
            }
            free = [n for n in range(workers) if n not in held]
            if not free:
                break
            worker = random.choice(free)
            leased = await self.db.fetchval(
                "INSERT INTO workers (n, token, expires_at) VALUES (?, ?, {now} + ?)"
                " ON CONFLICT (n) DO UPDATE SET token = excluded.token,"
                " expires_at = excluded.expires_at WHERE workers.expires_at <= {now}"
                " RETURNING n",
                worker,
                token,
                ttl,
            )
            if leased is not None:
                return worker
        raise unavailable(RuntimeError(f"all {workers} worker numbers are leased"))

    @mapped
    async def renew_worker(self, worker: int, token: str, ttl: float) -> bool:
        count = await self.db.execute(
            "UPDATE workers SET expires_at = {now} + ? WHERE n = ? AND token = ?",
            ttl,
            worker,
            token,
        )
        return count == 1

    @mapped
    async def release_worker(self, worker: int, token: str) -> None:
        await self.db.execute("DELETE FROM workers WHERE n = ? AND token = ?", worker, token)

    @mapped
    async def secret(self, name: str) -> str:
        await self.db.execute(
            "INSERT INTO secrets (name, value) VALUES (?, ?) ON CONFLICT (name) DO NOTHING",
            name,
            random_secrets.token_hex(32),
        )
        return str(await self.db.fetchval("SELECT value FROM secrets WHERE name = ?", name))
