"""SQLite store (the embedded default), through aiosqlite.

One connection in WAL mode; aiosqlite runs it on its own thread, so the event
loop never blocks on disk. The schema is upgraded by numbered migrations kept
in `PRAGMA user_version`, inside one transaction. Writes go through one lock
and each runs as one transaction. Foreign keys are on: a chat's messages, a
file's chunks, a collection's documents go with it (ON DELETE CASCADE).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sqlite3
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any

import aiosqlite

from .sql import Connection, Database, Dialect, DriverErrors, mapping_errors
from .tables import SQLStore, migrations

OPEN_ATTEMPTS = 100
PING_SECONDS = 3.0

SQLITE = Dialect(
    "sqlite",
    {
        # the clock of the host, through a function each connection is given
        "now": "unix_now()",
        "greatest": "max",
        "any_true": "max",
        "false": "0",
        "m_day": "CAST(m.created_at / 86400 AS INTEGER)",
        "for_update": "",
        "real": "REAL",
        "bigint": "INTEGER",
        "bool": "INTEGER",
        "json": "TEXT",
        "blob": "BLOB",
    },
    json_text=True,
)
MIGRATIONS = migrations(SQLITE)

#: SQLite's primary result codes of a database that cannot be used now, rather than
#: of a statement that is wrong (SQLITE_ERROR: "no such column", a syntax error)
OUTAGE_CODES = {
    sqlite3.SQLITE_BUSY,
    sqlite3.SQLITE_LOCKED,
    sqlite3.SQLITE_NOMEM,
    sqlite3.SQLITE_READONLY,
    sqlite3.SQLITE_INTERRUPT,
    sqlite3.SQLITE_IOERR,
    sqlite3.SQLITE_CORRUPT,
    sqlite3.SQLITE_FULL,
    sqlite3.SQLITE_CANTOPEN,
    sqlite3.SQLITE_PROTOCOL,
    sqlite3.SQLITE_NOTADB,
}


def _outage(exc: BaseException) -> bool:
    """Whether an `OperationalError` says the database cannot be used now (locked,
    busy, a disk that failed or is full) — not that the statement is wrong."""
    code = getattr(exc, "sqlite_errorcode", None)
    if not isinstance(exc, sqlite3.Error) or code is None:
        return True
    return code & 0xFF in OUTAGE_CODES


ERRORS = DriverErrors(
    unavailable=(sqlite3.OperationalError, OSError, TimeoutError),
    conflict=(sqlite3.IntegrityError,),
    data=(sqlite3.DataError,),
    every=(sqlite3.Error,),
    outage=_outage,
)
#: the driver's errors mapped, for a function that runs statements of its own
mapped = mapping_errors(ERRORS)


def reopen_pause(exc: sqlite3.OperationalError, attempt: int) -> float | None:
    """How long to wait before opening a database file again after `exc` on try
    `attempt` (from 0), when several processes open it at once: SQLite refuses with
    "locked" instead of waiting while another connection switches a new file to WAL.
    None for any other error, or once `OPEN_ATTEMPTS` tries are spent."""
    if "locked" not in str(exc) or attempt >= OPEN_ATTEMPTS - 1:
        return None
    return 0.02 + random.random() * 0.08


def sqlite_path(url: str) -> str:
    """`sqlite:///data/x.db` → `data/x.db`; `sqlite:////abs/x.db` → `/abs/x.db`."""
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        raise ValueError(f"unsupported store URL {url!r}: expected sqlite:///path")
    path = url[len(prefix) :]
    if not path:
        raise ValueError("sqlite URL has no path")
    return path


class SQLiteConnection(Connection):
    """Statements on the one aiosqlite connection, as they come (no lock taken)."""

    dialect = SQLITE

    def __init__(self, db: aiosqlite.Connection) -> None:
        self.db = db

    # one trip each to aiosqlite's thread: its cursors are left to be freed with
    # their wrapper rather than closed by another trip

    async def fetch(self, sql: str, *params: Any) -> list[Any]:
        return list(await self.db.execute_fetchall(SQLITE.sql(sql), params))

    async def execute(self, sql: str, *params: Any) -> int:
        cursor = await self.db.execute(SQLITE.sql(sql), params)
        return cursor.rowcount

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        await self.db.executemany(SQLITE.sql(sql), rows)


class SQLiteDatabase(Database):
    """Reads run on the shared connection at once; anything that writes runs as one
    transaction under the write lock."""

    dialect = SQLITE
    errors = ERRORS
    unique_violation = (sqlite3.IntegrityError,)

    def __init__(self, path: str) -> None:
        self.path = path
        self._db: aiosqlite.Connection | None = None
        self._write_lock = asyncio.Lock()

    async def open(self) -> None:
        """Connect, switch to WAL and migrate. Several processes may open one file at
        once; the moments SQLite refuses with "locked" instead of waiting (switching
        the journal mode) are retried for a few seconds."""
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(OPEN_ATTEMPTS):
            db = await aiosqlite.connect(self.path, isolation_level=None, timeout=5.0)
            try:
                await _prepare(db)
            except sqlite3.OperationalError as exc:
                await db.close()
                pause = reopen_pause(exc, attempt)
                if pause is None:
                    raise
                await asyncio.sleep(pause)
                continue
            except BaseException:
                await db.close()
                raise
            self._db = db
            return

    async def close(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            await db.close()

    @property
    def db(self) -> aiosqlite.Connection:
        if self._db is None:
            raise OSError("store is not open")
        return self._db

    async def ping(self) -> None:
        """A write transaction is begun and rolled back (with another connection
        holding the file's lock for longer than `PING_SECONDS`, that is a failure)."""
        async with asyncio.timeout(PING_SECONDS), self.transaction():
            pass

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Connection]:
        """One write transaction on the shared connection, under the write lock.

        Cancelling is safe at any point. aiosqlite runs a statement its caller no
        longer waits for, so a `BEGIN` cancelled while it waits for the file's lock
        still begins a transaction later: the `ROLLBACK` is queued behind it (it
        runs after it, in order, whatever happens to this task), and the lock is
        released only after it ran. A transaction left open would make every later
        write fail."""
        async with self._write_lock:
            db = self.db
            try:
                await db.execute("BEGIN IMMEDIATE")
                yield SQLiteConnection(db)
                await db.execute("COMMIT")
            except BaseException:
                await _rollback(db)
                raise

    async def fetch(self, sql: str, *params: Any) -> list[Any]:
        if sql.lstrip()[:6].upper() == "SELECT":
            return await SQLiteConnection(self.db).fetch(sql, *params)
        async with self.transaction() as tx:  # an INSERT … RETURNING, say
            return await tx.fetch(sql, *params)

    async def execute(self, sql: str, *params: Any) -> int:
        async with self.transaction() as tx:
            return await tx.execute(sql, *params)

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        async with self.transaction() as tx:
            await tx.executemany(sql, rows)


class SQLiteStore(SQLStore):
    def __init__(self, url: str) -> None:
        self.path = sqlite_path(url)
        super().__init__(SQLiteDatabase(self.path))


async def _rollback(db: aiosqlite.Connection) -> None:
    """End whatever transaction the connection is in (none, when the BEGIN failed),
    waiting for the ROLLBACK to have run even through further cancels — which are
    passed on once it has: until then the connection is not the next writer's."""
    done = asyncio.ensure_future(_run_rollback(db))
    cancelled = False
    while not done.done():
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def _run_rollback(db: aiosqlite.Connection) -> None:
    with contextlib.suppress(sqlite3.Error):
        await db.execute("ROLLBACK")


async def _prepare(db: aiosqlite.Connection) -> None:
    await db.create_function("unix_now", 0, time.time)
    await db.execute("PRAGMA busy_timeout=5000")
    await db.execute("PRAGMA journal_mode=WAL")
    await db.execute("PRAGMA foreign_keys=ON")
    await db.execute("PRAGMA synchronous=NORMAL")
    # one migrator at a time; the version is read under the lock
    await db.execute("BEGIN IMMEDIATE")
    try:
        async with db.execute("PRAGMA user_version") as cur:
            row = await cur.fetchone()
        version = row[0] if row else 0
        for number in range(version, len(MIGRATIONS)):
            await _run_script(db, MIGRATIONS[number])
        if version < len(MIGRATIONS):
            await db.execute(f"PRAGMA user_version={len(MIGRATIONS)}")
        await db.execute("COMMIT")
    except BaseException:
        await db.execute("ROLLBACK")
        raise


async def _run_script(db: aiosqlite.Connection, script: str) -> None:
    # executescript() would COMMIT the open transaction; run statement by statement
    for statement in script.split(";"):
        if statement.strip():
            await db.execute(statement)
