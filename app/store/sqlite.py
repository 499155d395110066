"""SQLite store (the embedded default), through aiosqlite.

One connection in WAL mode; aiosqlite runs it on its own thread, so the event
loop never blocks on disk. The schema is upgraded by numbered migrations kept
in `PRAGMA user_version`, inside one transaction.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
from pathlib import Path
from typing import Any

import aiosqlite
import orjson

from .base import (
    CHAT_COLUMNS,
    MESSAGE_COLUMNS,
    Chat,
    Store,
    StoredMessage,
    chat_from_row,
    message_from_row,
    message_params,
)

OPEN_ATTEMPTS = 100

MIGRATIONS = (
    """
    CREATE TABLE IF NOT EXISTS chats (
        id INTEGER PRIMARY KEY,
        user_id INTEGER NOT NULL,
        title TEXT NOT NULL,
        focus_mode TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE INDEX IF NOT EXISTS chats_by_user ON chats (user_id, created_at DESC);
    CREATE TABLE IF NOT EXISTS messages (
        id INTEGER PRIMARY KEY,
        chat_id INTEGER NOT NULL REFERENCES chats (id) ON DELETE CASCADE,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        reasoning TEXT NOT NULL DEFAULT '',
        rewritten TEXT,
        sources TEXT NOT NULL DEFAULT '[]',
        status TEXT NOT NULL,
        reply_to INTEGER,
        created_at REAL NOT NULL
    );
    CREATE INDEX IF NOT EXISTS messages_by_chat ON messages (chat_id, created_at, id);
    """,
)


def sqlite_path(url: str) -> str:
    """`sqlite:///data/x.db` → `data/x.db`; `sqlite:////abs/x.db` → `/abs/x.db`."""
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        raise ValueError(f"unsupported store URL {url!r}: expected sqlite:///path")
    path = url[len(prefix) :]
    if not path:
        raise ValueError("sqlite URL has no path")
    return path


class SQLiteStore(Store):
    def __init__(self, url: str) -> None:
        self.path = sqlite_path(url)
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
                if "locked" not in str(exc) or attempt == OPEN_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(0.02 + random.random() * 0.08)
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
        async with self.db.execute("SELECT 1") as cur:
            await cur.fetchone()

    async def _write(self, sql: str, params: tuple[Any, ...]) -> int:
        async with self._write_lock:
            cursor = await self.db.execute(sql, params)
            count = cursor.rowcount
            await cursor.close()
            return count

    async def create_chat(self, chat: Chat) -> bool:
        count = await self._write(
            "INSERT OR IGNORE INTO chats (id, user_id, title, focus_mode, created_at) VALUES (?, ?, ?, ?, ?)",
            (int(chat.id), int(chat.user_id), chat.title, chat.focus_mode, chat.created_at),
        )
        return count == 1

    async def get_chat(self, chat_id: str) -> Chat | None:
        async with self.db.execute(
            f"SELECT {CHAT_COLUMNS} FROM chats WHERE id = ?",
            (int(chat_id),),
        ) as cur:
            row = await cur.fetchone()
        return _chat(row) if row else None

    async def set_title(self, chat_id: str, title: str) -> None:
        await self._write("UPDATE chats SET title = ? WHERE id = ?", (title, int(chat_id)))

    async def list_chats(self, user_id: str, limit: int = 100) -> list[Chat]:
        async with self.db.execute(
            f"SELECT {CHAT_COLUMNS} FROM chats WHERE user_id = ?"
            " ORDER BY created_at DESC, id DESC LIMIT ?",
            (int(user_id), limit),
        ) as cur:
            rows = await cur.fetchall()
        return [_chat(row) for row in rows]

    async def delete_chat(self, chat_id: str) -> bool:
        async with self._write_lock:
            await self.db.execute("BEGIN")
            try:
                await self.db.execute("DELETE FROM messages WHERE chat_id = ?", (int(chat_id),))
                cursor = await self.db.execute("DELETE FROM chats WHERE id = ?", (int(chat_id),))
                count = cursor.rowcount
                await self.db.execute("COMMIT")
            except BaseException:
                await self.db.execute("ROLLBACK")
                raise
        return count == 1

    async def add_messages(self, messages: list[StoredMessage]) -> None:
        async with self._write_lock:
            await self.db.executemany(_INSERT_MESSAGE, [_params(m) for m in messages])

    async def finish_message(
        self, message_id: str, *, content: str, reasoning: str, status: str
    ) -> None:
        await self._write(
            "UPDATE messages SET content = ?, reasoning = ?, status = ? WHERE id = ?",
            (content, reasoning, status, int(message_id)),
        )

    async def set_sources(self, message_id: str, sources: list[dict[str, Any]]) -> None:
        await self._write(
            "UPDATE messages SET sources = ? WHERE id = ?",
            (orjson.dumps(sources).decode(), int(message_id)),
        )

    async def get_message(self, message_id: str) -> StoredMessage | None:
        async with self.db.execute(
            f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE id = ?", (int(message_id),)
        ) as cur:
            row = await cur.fetchone()
        return _message(row) if row else None

    async def list_messages(self, chat_id: str) -> list[StoredMessage]:
        async with self.db.execute(
            f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE chat_id = ? ORDER BY created_at, id",
            (int(chat_id),),
        ) as cur:
            rows = await cur.fetchall()
        return [_message(row) for row in rows]


async def _prepare(db: aiosqlite.Connection) -> None:
    await db.execute("PRAGMA busy_timeout=5000")
    await db.execute("PRAGMA journal_mode=WAL")
    await db.execute("PRAGMA foreign_keys=ON")
    await db.execute("PRAGMA synchronous=NORMAL")
    await db.execute(
        "BEGIN IMMEDIATE"
    )  # one migrator at a time; the version is read under the lock
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


_INSERT_MESSAGE = (
    f"INSERT OR IGNORE INTO messages ({MESSAGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _params(message: StoredMessage) -> tuple[Any, ...]:
    return message_params(message, orjson.dumps(message.sources).decode())


def _chat(row: Any) -> Chat:
    return chat_from_row(row)


def _message(row: Any) -> StoredMessage:
    return message_from_row(row, orjson.loads(row[6]))
