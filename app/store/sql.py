"""What the SQL backends share: one way to run a query on either driver, the few
words in which their dialects differ, and how their errors read.

Every query and migration is written once, with `?` placeholders and, where the
dialects really differ, a word in braces that the `Dialect` fills in (`{now}`, the
database's clock; `{json}`, a column of JSON; `{for_update}`, a row lock; …).
A `Connection` runs them: aiosqlite's or asyncpg's, behind the same five calls.
"""

from __future__ import annotations

import abc
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import orjson

from ..cleaning import clean
from ..errors import AppError, BadRequest, Conflict, Forbidden, Unavailable

log = logging.getLogger("app.store")

P = ParamSpec("P")
T = TypeVar("T")
Method = Callable[P, Coroutine[Any, Any, T]]
CACHED_QUERIES = 1024


@dataclass(frozen=True, slots=True, eq=False)
class Dialect:
    """The words a query or migration leaves to its dialect, and how JSON travels.

    `words` fill the braces of the SQL (`str.format`); `numbered` turns `?` into
    PostgreSQL's `$1`, `$2`, …; `json_text` says that JSON is kept as text (SQLite)
    rather than encoded by the driver (asyncpg's jsonb codec)."""

    name: str
    words: Mapping[str, str]
    numbered: bool = False
    json_text: bool = False
    _cache: dict[str, str] = field(default_factory=dict)

    def sql(self, text: str) -> str:
        """A query as this dialect runs it (computed once per text)."""
        done = self._cache.get(text)
        if done is None:
            done = text.format_map(self.words) if "{" in text else text
            if self.numbered:
                parts = done.split("?")
                done = parts[0] + "".join(f"${n}{p}" for n, p in enumerate(parts[1:], start=1))
            if len(self._cache) >= CACHED_QUERIES:  # lists of `?` of every length, say
                self._cache.clear()
            self._cache[text] = done
        return done

    def any_of(self, values: Sequence[str]) -> tuple[str, tuple[Any, ...]]:
        """`= ANY(?)` of a text array, or `IN (?, ?, …)`: the SQL and its parameters."""
        if self.numbered:
            return "= ANY(?::text[])", (list(values),)
        return f"IN ({', '.join('?' * len(values))})", tuple(values)

    def json(self, value: Any) -> Any:
        """A value for a JSON column (`None` stays NULL)."""
        if value is None or not self.json_text:
            return value
        return orjson.dumps(value).decode()

    def unjson(self, value: Any) -> Any:
        """What a JSON column held (NULL and SQLite's empty text read as `None`)."""
        if not self.json_text:
            return value
        return orjson.loads(value) if value else None


class Connection(abc.ABC):
    """One way to run the queries on either driver. Rows read by index."""

    dialect: Dialect

    @abc.abstractmethod
    async def fetch(self, sql: str, *params: Any) -> list[Any]: ...

    async def fetchrow(self, sql: str, *params: Any) -> Any | None:
        rows = await self.fetch(sql, *params)
        return rows[0] if rows else None

    async def fetchval(self, sql: str, *params: Any) -> Any:
        row = await self.fetchrow(sql, *params)
        return None if row is None else row[0]

    @abc.abstractmethod
    async def execute(self, sql: str, *params: Any) -> int:
        """Run one statement; returns how many rows it changed."""

    @abc.abstractmethod
    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...

    async def copy(self, table: str, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
        """Insert many rows at once (PostgreSQL copies them)."""
        marks = ", ".join("?" * len(columns))
        await self.executemany(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})", rows)

    async def lock(self, key: int) -> None:  # noqa: B027 - SQLite's writer holds the file
        """Take a lock until the transaction ends (PostgreSQL's advisory lock)."""


class Database(Connection):
    """A backend's connections: statements run outside a transaction each commit
    on their own; `transaction()` gives one connection for several."""

    errors: DriverErrors
    #: the driver's error for a unique key that is taken
    unique_violation: tuple[type[BaseException], ...]

    @abc.abstractmethod
    def transaction(self) -> AbstractAsyncContextManager[Connection]: ...

    @abc.abstractmethod
    async def open(self) -> None:
        """Connect and migrate."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def ping(self) -> None:
        """Raise unless the database answers and takes writes."""


def _always(exc: BaseException) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class DriverErrors:
    """How a backend's driver errors read (a tuple of classes each, checked in this
    order): `conflict`, a key or constraint the write broke; `data`, a value the
    database cannot keep; `unavailable`, the database cannot be reached or used now
    (retry later) — where `outage` says so of the error: a class a driver raises for
    an outage and for a mistake alike (SQLite's `OperationalError` is both "database
    is locked" and "no such column") is told apart by it. Any other driver error is
    a bug: 500 `INTERNAL`, logged."""

    unavailable: tuple[type[BaseException], ...]
    conflict: tuple[type[BaseException], ...] = ()
    data: tuple[type[BaseException], ...] = ()
    every: tuple[type[BaseException], ...] = ()  # the driver's root error(s)
    outage: Callable[[BaseException], bool] = _always


async def _mapping(errors: DriverErrors, name: str, call: Callable[[], Awaitable[T]]) -> T:
    try:
        return await call()
    except AppError:
        raise
    except errors.conflict as exc:
        log.warning("store refused a write: %r", exc)
        raise Conflict("the store refused a conflicting write") from exc
    except errors.data as exc:
        log.warning("store refused a value: %r", exc)
        raise BadRequest("the store cannot keep a value of this request") from exc
    except errors.unavailable as exc:
        if errors.outage(exc):
            raise unavailable(exc) from exc
        log.error("store failed in %s", name, exc_info=exc)
        raise AppError("internal error") from exc
    except errors.every as exc:
        log.error("store failed in %s", name, exc_info=exc)
        raise AppError("internal error") from exc


def mapping_errors(errors: DriverErrors) -> Callable[[Method[P, T]], Method[P, T]]:
    """A decorator for a backend's methods: the arguments are cleaned of NUL
    characters and lone surrogates (which PostgreSQL's text and jsonb refuse, and
    model output or a web page may hold: see `clean`), and the driver's errors become
    ours (see `DriverErrors`); our own errors (`Conflict` raised where a key is taken)
    pass."""

    def decorate(method: Method[P, T]) -> Method[P, T]:
        @functools.wraps(method)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
            args = clean(args)
            kwargs = clean(kwargs)
            return await _mapping(errors, method.__name__, lambda: method(*args, **kwargs))

        return wrapper

    return decorate


class HasDatabase(Protocol):
    @property
    def db(self) -> Database: ...


S = TypeVar("S", bound=HasDatabase)


def mapped(
    method: Callable[Concatenate[S, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, T]]:
    """`mapping_errors` for a method of a store of tables, with its database's errors."""

    @functools.wraps(method)
    async def wrapper(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        args = clean(args)
        kwargs = clean(kwargs)
        return await _mapping(
            self.db.errors, method.__name__, lambda: method(self, *args, **kwargs)
        )

    return wrapper


def unavailable(exc: BaseException) -> Unavailable:
    """The error a client sees for a store that cannot be reached (details go to the log)."""
    log.warning("store unavailable: %r", exc)
    return Unavailable("the chat store is unavailable; try again shortly")


def taken(what: str) -> Conflict:
    return Conflict(f"{what} is already used")


def not_yours() -> Forbidden:
    return Forbidden("this chat belongs to another user")


def no_admin_left() -> Conflict:
    return Conflict("at least one enabled admin must remain")


def bad_invite() -> Forbidden:
    return Forbidden("this invite code is not valid (unknown, used or expired)")


def prefixed(columns: str, alias: str) -> str:
    """`a, b` as `x.a, x.b`."""
    return ", ".join(f"{alias}.{c.strip()}" for c in columns.split(","))
