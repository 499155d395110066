"""Uploaded files, their chunks and the chats they are attached to: the tables and
their SQL."""

from __future__ import annotations

from typing import Any

from .records import FileRecord, StoredChunk
from .sql import Database, mapped, prefixed

FILE_COLUMNS = "id, user_id, name, kind, size, created_at, status, pages, chunks, error"

MIGRATIONS: dict[int, str | dict[str, str]] = {
    # 3: uploaded files, their chunks (text, page, embedding) and the chats they are in
    3: """
    CREATE TABLE files (
        id TEXT PRIMARY KEY,
        user_id TEXT NOT NULL,
        name TEXT NOT NULL,
        kind TEXT NOT NULL,
        size {bigint} NOT NULL,
        created_at {real} NOT NULL,
        status TEXT NOT NULL,
        pages INTEGER NOT NULL DEFAULT 0,
        chunks INTEGER NOT NULL DEFAULT 0,
        error TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX files_by_user ON files (user_id, created_at DESC);
    CREATE TABLE file_chunks (
        file_id TEXT NOT NULL REFERENCES files (id) ON DELETE CASCADE,
        n INTEGER NOT NULL,
        page INTEGER NOT NULL,
        text TEXT NOT NULL,
        vector {blob},
        PRIMARY KEY (file_id, n)
    );
    CREATE TABLE chat_files (
        chat_id TEXT NOT NULL REFERENCES chats (id) ON DELETE CASCADE,
        file_id TEXT NOT NULL REFERENCES files (id) ON DELETE CASCADE,
        attached_at {real} NOT NULL,
        PRIMARY KEY (chat_id, file_id)
    );
    CREATE INDEX chat_files_by_file ON chat_files (file_id);
    """,
    # 6: which process reads an upload (its worker lease's token), so that one left
    # `indexing` by a process that died can be told from one still being read
    6: """
    ALTER TABLE files ADD COLUMN indexer TEXT;
    CREATE INDEX files_indexing ON files (created_at) WHERE status = 'indexing';
    """,
}


def file_from_row(row: Any) -> FileRecord:
    return FileRecord(*row)


def file_params(f: FileRecord) -> tuple[Any, ...]:
    return (
        f.id,
        f.user_id,
        f.name,
        f.kind,
        f.size,
        f.created_at,
        f.status,
        f.pages,
        f.chunks,
        f.error,
    )


class FileTables:
    """The uploads' part of a `Store` (see `Store` for each method's contract)."""

    db: Database

    @mapped
    async def add_file(self, record: FileRecord, indexer: str = "") -> None:
        await self.db.execute(
            f"INSERT INTO files ({FILE_COLUMNS}, indexer) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            *file_params(record),
            indexer or None,
        )

    @mapped
    async def fail_orphaned_files(self, error: str, created_before: float) -> int:
        return await self.db.execute(
            "UPDATE files SET status = 'failed', error = ? WHERE status = 'indexing'"
            " AND created_at < ? AND (indexer IS NULL OR indexer NOT IN"
            " (SELECT token FROM workers WHERE expires_at > {now}))",
            error,
            created_before,
        )

    @mapped
    async def finish_file(self, record: FileRecord, chunks: list[StoredChunk]) -> None:
        async with self.db.transaction() as tx:
            await tx.execute(
                "UPDATE files SET status = ?, pages = ?, chunks = ?, error = ? WHERE id = ?",
                record.status,
                record.pages,
                record.chunks,
                record.error,
                record.id,
            )
            if chunks:
                await tx.copy(
                    "file_chunks",
                    ("file_id", "n", "page", "text", "vector"),
                    [(record.id, c.n, c.page, c.text, c.vector) for c in chunks],
                )

    @mapped
    async def get_file(self, file_id: str) -> FileRecord | None:
        row = await self.db.fetchrow(f"SELECT {FILE_COLUMNS} FROM files WHERE id = ?", file_id)
        return file_from_row(tuple(row)) if row else None

    @mapped
    async def list_files(self, user_id: str) -> list[FileRecord]:
        rows = await self.db.fetch(
            f"SELECT {FILE_COLUMNS} FROM files WHERE user_id = ? ORDER BY created_at DESC, id",
            user_id,
        )
        return [file_from_row(tuple(row)) for row in rows]

    @mapped
    async def delete_file(self, file_id: str) -> bool:
        # chunks and chat attachments go with it (ON DELETE CASCADE)
        return await self.db.execute("DELETE FROM files WHERE id = ?", file_id) == 1

    @mapped
    async def file_chunks(self, file_id: str) -> list[StoredChunk]:
        rows = await self.db.fetch(
            "SELECT n, page, text, vector FROM file_chunks WHERE file_id = ? ORDER BY n",
            file_id,
        )
        return [StoredChunk(*row) for row in rows]

    @mapped
    async def attach_files(self, chat_id: str, file_ids: list[str]) -> None:
        await self.db.executemany(
            "INSERT INTO chat_files (chat_id, file_id, attached_at)"
            " VALUES (?, ?, {now}) ON CONFLICT DO NOTHING",
            [(chat_id, file_id) for file_id in file_ids],
        )

    @mapped
    async def chat_files(self, chat_ids: list[str]) -> dict[str, list[FileRecord]]:
        if not chat_ids:
            return {}
        among, params = self.db.dialect.any_of(chat_ids)
        rows = await self.db.fetch(
            f"SELECT cf.chat_id, {prefixed(FILE_COLUMNS, 'f')} FROM chat_files cf"
            f" JOIN files f ON f.id = cf.file_id WHERE cf.chat_id {among}"
            " ORDER BY cf.attached_at, f.id",
            *params,
        )
        out: dict[str, list[FileRecord]] = {}
        for row in rows:
            out.setdefault(row[0], []).append(file_from_row(tuple(row)[1:]))
        return out
