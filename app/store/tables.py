"""The store over SQL: the aggregates' tables on one `Database`, and the schema's
migrations, numbered as they always were, gathered from the aggregates.

A backend (SQLite, PostgreSQL) is a `Database` and its `Dialect`; everything else
is written once here and in the aggregates' modules. Another aggregate (shares,
schedules) is one more module: its `MIGRATIONS` under the next numbers, listed in
`AGGREGATES`, and its tables' class mixed into `SQLStore`."""

from __future__ import annotations

from . import accounts, chats, collections, files, schedules, shares, workers
from .accounts import AccountTables
from .base import Store
from .chats import ChatTables
from .collections import CollectionTables
from .files import FileTables
from .schedules import ScheduleTables
from .shares import ShareTables
from .sql import Database, Dialect, mapped
from .workers import WorkerTables

#: the aggregates in the order their parts of one migration run (chats before the
#: files attached to them, collections before their groups' shares)
AGGREGATES = (chats, workers, files, accounts, collections, shares, schedules)


def migrations(dialect: Dialect) -> tuple[str, ...]:
    """Every migration as this dialect runs it: number N is the N-th (from 1)."""
    numbers = sorted({n for aggregate in AGGREGATES for n in aggregate.MIGRATIONS})
    if numbers != list(range(1, len(numbers) + 1)):
        raise RuntimeError(f"the migrations are not numbered 1 to N: {numbers}")
    scripts = []
    for number in numbers:
        parts = []
        for aggregate in AGGREGATES:
            part = aggregate.MIGRATIONS.get(number)
            if isinstance(part, dict):
                part = part[dialect.name]
            if part is not None:
                parts.append(part.format_map(dialect.words))
        scripts.append("".join(parts))
    return tuple(scripts)


class SQLStore(
    ChatTables,
    FileTables,
    CollectionTables,
    AccountTables,
    WorkerTables,
    ShareTables,
    ScheduleTables,
    Store,
):
    """A `Store` on a SQL `Database` (see `Store` for each method's contract)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def open(self) -> None:
        await self.db.open()

    async def close(self) -> None:
        await self.db.close()

    @mapped
    async def ping(self) -> None:
        await self.db.ping()
