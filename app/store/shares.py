"""Shared chats (PROTOCOL §15): a snapshot of a chat, kept under a random id that a
link names, until its owner takes it back or the chat goes (ON DELETE CASCADE)."""

from __future__ import annotations

from typing import Any

from .records import ShareRecord
from .sql import Database, mapped

#: what a list of shares reads (the snapshots, which may be large, are left out)
SHARE_COLUMNS = "id, chat_id, user_id, title, display_name, created_at, updated_at"

MIGRATIONS: dict[int, str | dict[str, str]] = {
    # 12: shared chats: one share per chat, its snapshot as JSON
    12: """
    CREATE TABLE shares (
        id TEXT PRIMARY KEY,
        chat_id TEXT NOT NULL UNIQUE REFERENCES chats (id) ON DELETE CASCADE,
        user_id TEXT NOT NULL,
        title TEXT NOT NULL,
        display_name TEXT,
        snapshot {json} NOT NULL,
        created_at {real} NOT NULL,
        updated_at {real} NOT NULL
    );
    CREATE INDEX shares_by_user ON shares (user_id, updated_at DESC);
    """,
}


def share_from_row(row: Any, snapshot: dict[str, Any] | None = None) -> ShareRecord:
    """A row of `SHARE_COLUMNS` as a `ShareRecord`."""
    return ShareRecord(
        id=str(row[0]),
        chat_id=str(row[1]),
        user_id=str(row[2]),
        title=row[3],
        display_name=row[4],
        created_at=row[5],
        updated_at=row[6],
        snapshot=snapshot,
    )


class ShareTables:
    """The shares' part of a `Store` (see `Store` for each method's contract)."""

    db: Database

    @mapped
    async def put_share(self, share: ShareRecord) -> ShareRecord:
        row = await self.db.fetchrow(
            f"INSERT INTO shares ({SHARE_COLUMNS}, snapshot) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (chat_id) DO UPDATE SET title = excluded.title,"
            " display_name = excluded.display_name, snapshot = excluded.snapshot,"
            " updated_at = excluded.updated_at"
            f" RETURNING {SHARE_COLUMNS}",
            share.id,
            share.chat_id,
            share.user_id,
            share.title,
            share.display_name,
            share.created_at,
            share.updated_at,
            self.db.dialect.json(share.snapshot or {}),
        )
        return share_from_row(row, share.snapshot)

    @mapped
    async def get_share(self, share_id: str) -> ShareRecord | None:
        row = await self.db.fetchrow(
            f"SELECT {SHARE_COLUMNS}, snapshot FROM shares WHERE id = ?", share_id
        )
        return share_from_row(row, self.db.dialect.unjson(row[7])) if row else None

    @mapped
    async def list_shares(self, user_id: str) -> list[ShareRecord]:
        rows = await self.db.fetch(
            f"SELECT {SHARE_COLUMNS} FROM shares WHERE user_id = ?"
            " ORDER BY updated_at DESC, id DESC",
            user_id,
        )
        return [share_from_row(row) for row in rows]

    @mapped
    async def delete_share(self, chat_id: str) -> bool:
        return await self.db.execute("DELETE FROM shares WHERE chat_id = ?", chat_id) == 1
