"""Chats and messages, behind one interface; the backend is chosen by URL."""

from __future__ import annotations

from .base import Chat, FileRecord, Saved, Store, StoredChunk, StoredMessage, Usage


def open_store(url: str) -> Store:
    """`sqlite:///relative.db`, `sqlite:////absolute.db` or `postgresql://…`.

    Drivers are imported lazily. Raises ValueError for another scheme.
    """
    scheme = url.partition(":")[0].lower()
    if scheme == "sqlite":
        from .sqlite import SQLiteStore

        return SQLiteStore(url)
    if scheme in ("postgresql", "postgres"):
        from .postgres import PostgresStore

        return PostgresStore(url)
    raise ValueError(f"unsupported store URL {url!r}: use sqlite:/// or postgresql://")


__all__ = [
    "Chat",
    "FileRecord",
    "Saved",
    "Store",
    "StoredChunk",
    "StoredMessage",
    "Usage",
    "open_store",
]
