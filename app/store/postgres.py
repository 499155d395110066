"""PostgreSQL store, through an asyncpg pool.

The schema is created and upgraded by numbered migrations recorded in
`schema_migrations`; they run on start inside one transaction holding an
advisory lock, so several workers starting at once apply each migration once.
Worker leases use the database's clock, so hosts whose clocks differ agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import asyncpg
import orjson

from .sql import Connection, Database, Dialect, DriverErrors, mapping_errors, unavailable
from .tables import SQLStore, migrations

LOCK_ID = 7_138_337_258  # pg_advisory_xact_lock key of the migrations
COMMAND_SECONDS = 10.0

POSTGRES = Dialect(
    "postgresql",
    {
        "now": "extract(epoch from clock_timestamp())",
        "greatest": "greatest",
        "any_true": "bool_or",
        "false": "false",
        "m_day": "floor(m.created_at / 86400)::integer",
        "for_update": " FOR UPDATE",
        "real": "DOUBLE PRECISION",
        "bigint": "BIGINT",
        "bool": "BOOLEAN",
        "json": "JSONB",
        "blob": "BYTEA",
    },
    numbered=True,
)
MIGRATIONS = migrations(POSTGRES)


#: how asyncpg's errors read: the database cannot be reached or used now (connection
#: trouble; refusing writes after a failover; out of resources; shutting down; a
#: statement timeout; a deadlock or serialization failure, which a retry resolves), a
#: broken constraint, a value it cannot keep (a NUL in text, say); anything else is a bug
def _misused(exc: BaseException) -> bool:
    """An `InterfaceError` that is a mistake of ours, not a connection that went:
    a query given the wrong number of arguments, a setting the driver refuses."""
    if isinstance(exc, asyncpg.exceptions._base.ClientConfigurationError):
        return True
    return type(exc) is asyncpg.InterfaceError and "argument" in str(exc)


ERRORS = DriverErrors(
    unavailable=(
        OSError,
        TimeoutError,
        asyncpg.PostgresConnectionError,
        asyncpg.InterfaceError,
        asyncpg.exceptions.InsufficientResourcesError,
        asyncpg.exceptions.OperatorInterventionError,
        asyncpg.exceptions.ReadOnlySQLTransactionError,
        asyncpg.exceptions.TransactionRollbackError,
        asyncpg.exceptions.PostgresSystemError,
        # "cannot switch to state N; another operation is in progress": a pooled
        # connection whose session the server ended under a statement, before
        # asyncpg saw it close (a restart, a failover, pg_terminate_backend)
        asyncpg.exceptions.InternalClientError,
    ),
    conflict=(asyncpg.IntegrityConstraintViolationError,),
    # class 22 from the server, and a value asyncpg itself cannot send as its type
    data=(asyncpg.DataError, asyncpg.exceptions._base.DataError),
    every=(asyncpg.PostgresError,),
    outage=lambda exc: not _misused(exc),
)
#: the driver's errors mapped, for a function that runs statements of its own
mapped = mapping_errors(ERRORS)


class PostgresConnection(Connection):
    """Statements on one connection of the pool (or on the pool, each on its own)."""

    dialect = POSTGRES

    def __init__(self, conn: asyncpg.Connection | asyncpg.Pool) -> None:
        self.conn = conn

    async def fetch(self, sql: str, *params: Any) -> list[Any]:
        rows: list[Any] = await self.conn.fetch(POSTGRES.sql(sql), *params)
        return rows

    async def fetchrow(self, sql: str, *params: Any) -> Any | None:
        return await self.conn.fetchrow(POSTGRES.sql(sql), *params)

    async def fetchval(self, sql: str, *params: Any) -> Any:
        return await self.conn.fetchval(POSTGRES.sql(sql), *params)

    async def execute(self, sql: str, *params: Any) -> int:
        status: str = await self.conn.execute(POSTGRES.sql(sql), *params)
        # the command tag (`INSERT 0 1`, `DELETE 3`) ends with the rows it changed
        count = status.rsplit(" ", 1)[-1]
        return int(count) if count.isdigit() else 0

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        await self.conn.executemany(POSTGRES.sql(sql), rows)

    async def copy(self, table: str, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
        await self.conn.copy_records_to_table(table, records=rows, columns=list(columns))

    async def lock(self, key: int) -> None:
        await self.conn.execute("SELECT pg_advisory_xact_lock($1)", key)


class PostgresDatabase(Database):
    """The pool: a statement outside a transaction runs on any connection."""

    dialect = POSTGRES
    errors = ERRORS
    unique_violation = (asyncpg.UniqueViolationError,)

    def __init__(
        self, url: str, *, min_size: int = 1, max_size: int = 10, statement_cache_size: int = 100
    ) -> None:
        self.url = url
        self.min_size = min_size
        self.max_size = max_size
        self.statement_cache_size = statement_cache_size
        self._pool: asyncpg.Pool | None = None
        self._on_pool: PostgresConnection | None = None

    async def open(self) -> None:
        self._pool = await asyncpg.create_pool(
            self.url,
            min_size=self.min_size,
            max_size=self.max_size,
            init=_init_connection,
            reset=_nothing_to_reset,
            command_timeout=COMMAND_SECONDS,
            statement_cache_size=self.statement_cache_size,
        )
        try:
            await migrate(self._pool)
        except BaseException:
            await self.close()
            raise
        self._on_pool = PostgresConnection(self._pool)

    async def close(self) -> None:
        pool, self._pool, self._on_pool = self._pool, None, None
        if pool is not None:
            await pool.close()

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise OSError("store is not open")
        return self._pool

    @property
    def _any(self) -> PostgresConnection:
        if self._on_pool is None:
            raise OSError("store is not open")
        return self._on_pool

    async def fetch(self, sql: str, *params: Any) -> list[Any]:
        return await self._any.fetch(sql, *params)

    async def fetchrow(self, sql: str, *params: Any) -> Any | None:
        return await self._any.fetchrow(sql, *params)

    async def fetchval(self, sql: str, *params: Any) -> Any:
        return await self._any.fetchval(sql, *params)

    async def execute(self, sql: str, *params: Any) -> int:
        return await self._any.execute(sql, *params)

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        await self._any.executemany(sql, rows)

    async def ping(self) -> None:
        """Raise unless the database answers and takes writes (a replica promoted
        back to read-only, say, answers but does not)."""
        writable = await self.pool.fetchval(
            "SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'"
        )
        if not writable:
            raise unavailable(RuntimeError("the database is read-only"))

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Connection]:
        async with self.pool.acquire() as conn, conn.transaction():
            yield PostgresConnection(conn)


class PostgresStore(SQLStore):
    def __init__(
        self, url: str, *, min_size: int = 1, max_size: int = 10, statement_cache_size: int = 100
    ) -> None:
        self.url = url
        self.database = PostgresDatabase(
            url, min_size=min_size, max_size=max_size, statement_cache_size=statement_cache_size
        )
        super().__init__(self.database)

    @property
    def pool(self) -> asyncpg.Pool:
        return self.database.pool


async def migrate(pool: asyncpg.Pool) -> int:
    """Apply the migrations not yet applied; returns how many ran. Safe to run concurrently."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", LOCK_ID)
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        )
        applied: int = await conn.fetchval(
            "SELECT coalesce(max(version), 0) FROM schema_migrations"
        )
        for version in range(applied + 1, len(MIGRATIONS) + 1):
            await conn.execute(MIGRATIONS[version - 1])
            await conn.execute("INSERT INTO schema_migrations (version) VALUES ($1)", version)
        return len(MIGRATIONS) - applied


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec(
        "jsonb",
        encoder=lambda value: orjson.dumps(value).decode(),
        decoder=orjson.loads,
        schema="pg_catalog",
    )


async def _nothing_to_reset(conn: asyncpg.Connection) -> None:
    """A connection goes back to the pool as it is: this store leaves no session state
    on one (no SET, LISTEN, cursors or session advisory locks; transactions always
    end), and asyncpg's default reset costs a round trip per query."""
