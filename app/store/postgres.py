"""PostgreSQL store, through an asyncpg pool.

The schema is created and upgraded by numbered migrations recorded in
`schema_migrations`; they run on start inside one transaction holding an
advisory lock, so several workers starting at once apply each migration once.
"""

from __future__ import annotations

from typing import Any

import asyncpg
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

LOCK_ID = 7_138_337_258  # pg_advisory_xact_lock key of the migrations

MIGRATIONS = (
    """
    CREATE TABLE chats (
        id BIGINT PRIMARY KEY,
        user_id BIGINT NOT NULL,
        title TEXT NOT NULL,
        focus_mode TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL
    );
    CREATE INDEX chats_by_user ON chats (user_id, created_at DESC, id DESC);
    CREATE TABLE messages (
        id BIGINT PRIMARY KEY,
        chat_id BIGINT NOT NULL REFERENCES chats (id) ON DELETE CASCADE,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        reasoning TEXT NOT NULL DEFAULT '',
        rewritten TEXT,
        sources JSONB NOT NULL DEFAULT '[]',
        status TEXT NOT NULL,
        reply_to BIGINT,
        created_at DOUBLE PRECISION NOT NULL
    );
    CREATE INDEX messages_by_chat ON messages (chat_id, created_at, id);
    """,
)


class PostgresStore(Store):
    def __init__(self, url: str, *, min_size: int = 1, max_size: int = 10) -> None:
        self.url = url
        self.min_size = min_size
        self.max_size = max_size
        self._pool: asyncpg.Pool | None = None

    async def open(self) -> None:
        self._pool = await asyncpg.create_pool(
            self.url, min_size=self.min_size, max_size=self.max_size, init=_init_connection
        )
        try:
            await migrate(self._pool)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise OSError("store is not open")
        return self._pool

    async def ping(self) -> None:
        await self.pool.fetchval("SELECT 1")

    async def create_chat(self, chat: Chat) -> bool:
        status = await self.pool.execute(
            "INSERT INTO chats (id, user_id, title, focus_mode, created_at) VALUES ($1, $2, $3, $4, $5)"
            " ON CONFLICT (id) DO NOTHING",
            int(chat.id),
            int(chat.user_id),
            chat.title,
            chat.focus_mode,
            chat.created_at,
        )
        return _one_row(status)

    async def get_chat(self, chat_id: str) -> Chat | None:
        row = await self.pool.fetchrow(
            f"SELECT {CHAT_COLUMNS} FROM chats WHERE id = $1",
            int(chat_id),
        )
        return _chat(row) if row else None

    async def set_title(self, chat_id: str, title: str) -> None:
        await self.pool.execute("UPDATE chats SET title = $1 WHERE id = $2", title, int(chat_id))

    async def list_chats(self, user_id: str, limit: int = 100) -> list[Chat]:
        rows = await self.pool.fetch(
            f"SELECT {CHAT_COLUMNS} FROM chats WHERE user_id = $1"
            " ORDER BY created_at DESC, id DESC LIMIT $2",
            int(user_id),
            limit,
        )
        return [_chat(row) for row in rows]

    async def delete_chat(self, chat_id: str) -> bool:
        # messages go with it (ON DELETE CASCADE)
        status = await self.pool.execute("DELETE FROM chats WHERE id = $1", int(chat_id))
        return _one_row(status)

    async def add_messages(self, messages: list[StoredMessage]) -> None:
        await self.pool.executemany(
            _INSERT_MESSAGE, [message_params(m, m.sources) for m in messages]
        )

    async def finish_message(
        self, message_id: str, *, content: str, reasoning: str, status: str
    ) -> None:
        await self.pool.execute(
            "UPDATE messages SET content = $1, reasoning = $2, status = $3 WHERE id = $4",
            content,
            reasoning,
            status,
            int(message_id),
        )

    async def set_sources(self, message_id: str, sources: list[dict[str, Any]]) -> None:
        await self.pool.execute(
            "UPDATE messages SET sources = $1 WHERE id = $2", sources, int(message_id)
        )

    async def get_message(self, message_id: str) -> StoredMessage | None:
        row = await self.pool.fetchrow(
            f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE id = $1", int(message_id)
        )
        return _message(row) if row else None

    async def list_messages(self, chat_id: str) -> list[StoredMessage]:
        rows = await self.pool.fetch(
            f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE chat_id = $1 ORDER BY created_at, id",
            int(chat_id),
        )
        return [_message(row) for row in rows]


_INSERT_MESSAGE = (
    f"INSERT INTO messages ({MESSAGE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"
    " ON CONFLICT (id) DO NOTHING"
)


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


def _chat(row: Any) -> Chat:
    return chat_from_row(row)


def _message(row: Any) -> StoredMessage:
    return message_from_row(row, row[6])


def _one_row(status: str) -> bool:
    """Whether a command tag (`INSERT 0 1`, `DELETE 1`) says one row."""
    return status.endswith(" 1")
