"""Chats and messages, files, collections, accounts, behind one interface; the
backend is chosen by URL."""

from __future__ import annotations

from . import records
from .base import Store
from .records import *  # noqa: F403 - the records are the store's vocabulary


def open_store(url: str, *, pool_size: int = 10, statement_cache_size: int = 100) -> Store:
    """`sqlite:///relative.db`, `sqlite:////absolute.db` or `postgresql://…`
    (`pool_size` connections at most; `statement_cache_size` 0 behind PgBouncer in
    transaction mode, which cannot keep a connection's prepared statements).

    Drivers are imported lazily. Raises ValueError for another scheme.
    """
    scheme = url.partition(":")[0].lower()
    if scheme == "sqlite":
        from .sqlite import SQLiteStore

        return SQLiteStore(url)
    if scheme in ("postgresql", "postgres"):
        from .postgres import PostgresStore

        return PostgresStore(url, max_size=pool_size, statement_cache_size=statement_cache_size)
    raise ValueError(f"unsupported store URL {url!r}: use sqlite:/// or postgresql://")


__all__ = ["Store", "open_store", *records.__all__]
