"""SQLite store (the embedded default), through aiosqlite.

One connection in WAL mode; aiosqlite runs it on its own thread, so the event
loop never blocks on disk. The schema is upgraded by numbered migrations kept
in `PRAGMA user_version`, inside one transaction. Writes go through one lock
and each runs as one transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets as random_secrets
import sqlite3
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiosqlite
import orjson

from ..errors import NotFound
from .base import (
    ACCOUNT_COLUMNS,
    API_KEY_COLUMNS,
    CHAT_COLUMNS,
    COLLECTION_COLUMNS,
    FILE_COLUMNS,
    GROUP_COLUMNS,
    MESSAGE_COLUMNS,
    MESSAGE_SELECT,
    SQL_ADD_DOCUMENT,
    SQL_COUNT_DOCUMENTS,
    SQL_FINISH_DOCUMENT,
    SQL_GET_COLLECTION,
    SQL_GET_DOCUMENT,
    SQL_GROUP_SHARES,
    SQL_IMPORT_COUNTS,
    SQL_IMPORT_DOCUMENTS,
    SQL_IMPORT_FAILED,
    SQL_LIST_COLLECTIONS,
    SQL_LIST_DOCUMENTS,
    SQL_SHARES,
    SQL_SWEEP_DOCUMENTS,
    Account,
    AccountChange,
    ApiKey,
    Chat,
    Checkpoint,
    CollectionRecord,
    DocumentRecord,
    DriverErrors,
    FileRecord,
    GroupRecord,
    Saved,
    Store,
    StoredChunk,
    StoredMessage,
    StoredResponse,
    Usage,
    account_change_sql,
    account_from_row,
    account_params,
    api_key_from_row,
    bad_invite,
    chat_from_row,
    collection_from_row,
    document_from_row,
    document_params,
    file_from_row,
    file_params,
    finish_document_params,
    limit_documents,
    mapping_errors,
    message_from_row,
    message_params,
    no_admin_left,
    not_yours,
    taken,
    unavailable,
)

OPEN_ATTEMPTS = 100
PING_SECONDS = 3.0

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
    # 2: opaque text ids (existing integer ids become their decimal text), the
    # answers a sweeper looks for, worker leases and shared secrets
    """
    CREATE TABLE chats_v2 (
        id TEXT PRIMARY KEY,
        user_id TEXT NOT NULL,
        title TEXT NOT NULL,
        focus_mode TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    INSERT INTO chats_v2
        SELECT CAST(id AS TEXT), CAST(user_id AS TEXT), title, focus_mode, created_at FROM chats;
    CREATE TABLE messages_v2 (
        id TEXT PRIMARY KEY,
        chat_id TEXT NOT NULL REFERENCES chats_v2 (id) ON DELETE CASCADE,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        reasoning TEXT NOT NULL DEFAULT '',
        rewritten TEXT,
        sources TEXT NOT NULL DEFAULT '[]',
        status TEXT NOT NULL,
        reply_to TEXT,
        created_at REAL NOT NULL
    );
    INSERT INTO messages_v2
        SELECT CAST(id AS TEXT), CAST(chat_id AS TEXT), role, content, reasoning, rewritten,
               sources, status, CAST(reply_to AS TEXT), created_at
        FROM messages;
    DROP TABLE messages;
    DROP TABLE chats;
    ALTER TABLE chats_v2 RENAME TO chats;
    ALTER TABLE messages_v2 RENAME TO messages;
    CREATE INDEX chats_by_user ON chats (user_id, created_at DESC, id DESC);
    CREATE INDEX messages_by_chat ON messages (chat_id, created_at, id);
    CREATE INDEX messages_streaming ON messages (created_at) WHERE status = 'streaming';
    CREATE TABLE workers (n INTEGER PRIMARY KEY, token TEXT NOT NULL, expires_at REAL NOT NULL);
    CREATE TABLE secrets (name TEXT PRIMARY KEY, value TEXT NOT NULL);
    """,
    # 3: uploaded files, their chunks (text, page, embedding) and the chats they are in
    """
    CREATE TABLE files (
        id TEXT PRIMARY KEY,
        user_id TEXT NOT NULL,
        name TEXT NOT NULL,
        kind TEXT NOT NULL,
        size INTEGER NOT NULL,
        created_at REAL NOT NULL,
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
        vector BLOB,
        PRIMARY KEY (file_id, n)
    );
    CREATE TABLE chat_files (
        chat_id TEXT NOT NULL REFERENCES chats (id) ON DELETE CASCADE,
        file_id TEXT NOT NULL REFERENCES files (id) ON DELETE CASCADE,
        attached_at REAL NOT NULL,
        PRIMARY KEY (chat_id, file_id)
    );
    CREATE INDEX chat_files_by_file ON chat_files (file_id);
    """,
    # 4: what each answer cost, in tokens
    """
    ALTER TABLE messages ADD COLUMN model TEXT;
    ALTER TABLE messages ADD COLUMN prompt_tokens INTEGER;
    ALTER TABLE messages ADD COLUMN completion_tokens INTEGER;
    ALTER TABLE messages ADD COLUMN reasoning_tokens INTEGER;
    ALTER TABLE messages ADD COLUMN usage_estimated INTEGER;
    """,
    # 5: an answer's progress lines and, when it failed, its error (JSON)
    """
    ALTER TABLE messages ADD COLUMN steps TEXT;
    ALTER TABLE messages ADD COLUMN error TEXT;
    """,
    # 6: which process reads an upload (its worker lease's token), so that one left
    # `indexing` by a process that died can be told from one still being read
    """
    ALTER TABLE files ADD COLUMN indexer TEXT;
    CREATE INDEX files_indexing ON files (created_at) WHERE status = 'indexing';
    """,
    # 7: accounts, their sessions and API keys (by the SHA-256 of the secret), invites
    """
    CREATE TABLE accounts (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        role TEXT NOT NULL,
        email TEXT UNIQUE,
        password_hash TEXT,
        disabled INTEGER NOT NULL DEFAULT 0,
        tokens_per_day INTEGER,
        issuer TEXT,
        subject TEXT,
        created_at REAL NOT NULL,
        UNIQUE (issuer, subject)
    );
    CREATE TABLE sessions (
        token_hash TEXT PRIMARY KEY,
        account_id TEXT NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL
    );
    CREATE INDEX sessions_by_account ON sessions (account_id);
    CREATE INDEX sessions_by_expiry ON sessions (expires_at);
    CREATE TABLE api_keys (
        id TEXT PRIMARY KEY,
        account_id TEXT NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
        name TEXT NOT NULL,
        prefix TEXT NOT NULL,
        key_hash TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL
    );
    CREATE INDEX api_keys_by_account ON api_keys (account_id, created_at);
    CREATE TABLE invites (
        code_hash TEXT PRIMARY KEY,
        created_by TEXT NOT NULL,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL,
        used_by TEXT,
        used_at REAL
    );
    """,
    # 8: knowledge collections (their passages are in the collections engine)
    """
    CREATE TABLE collections (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        name TEXT NOT NULL,
        description TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE INDEX collections_by_owner ON collections (owner, created_at);
    CREATE TABLE collection_shares (
        collection_id TEXT NOT NULL REFERENCES collections (id) ON DELETE CASCADE,
        user_id TEXT NOT NULL,
        PRIMARY KEY (collection_id, user_id)
    );
    CREATE INDEX collection_shares_by_user ON collection_shares (user_id);
    CREATE TABLE collection_documents (
        id TEXT PRIMARY KEY,
        collection_id TEXT NOT NULL REFERENCES collections (id) ON DELETE CASCADE,
        import_id TEXT NOT NULL,
        title TEXT NOT NULL,
        kind TEXT NOT NULL,
        size INTEGER NOT NULL,
        created_at REAL NOT NULL,
        url TEXT NOT NULL DEFAULT '',
        status TEXT NOT NULL,
        pages INTEGER NOT NULL DEFAULT 0,
        chunks INTEGER NOT NULL DEFAULT 0,
        error TEXT NOT NULL DEFAULT '',
        code INTEGER NOT NULL DEFAULT 0,
        indexer TEXT
    );
    CREATE INDEX collection_documents_indexing ON collection_documents (created_at)
        WHERE status = 'indexing';
    CREATE INDEX collection_documents_by_collection ON collection_documents (collection_id, created_at);
    CREATE INDEX collection_documents_by_import ON collection_documents (import_id);
    """,
    # 9: the tokens each user's answers used, per UTC day (days since 1970): added to
    # when an answer's usage is saved and never lowered, so deleting chats or answers
    # gives no quota back (today's count starts from the answers saved so far)
    """
    CREATE TABLE tokens_by_day (
        user_id TEXT NOT NULL,
        day INTEGER NOT NULL,
        tokens INTEGER NOT NULL,
        PRIMARY KEY (user_id, day)
    );
    INSERT INTO tokens_by_day (user_id, day, tokens)
        SELECT c.user_id, CAST(m.created_at / 86400 AS INTEGER),
               sum(coalesce(m.prompt_tokens, 0) + coalesce(m.completion_tokens, 0))
        FROM messages m JOIN chats c ON c.id = m.chat_id
        WHERE m.role = 'assistant' AND m.model IS NOT NULL
        GROUP BY c.user_id, CAST(m.created_at / 86400 AS INTEGER);
    """,
    # 10: what a Responses API answer keeps beside it: its request's echo, the answer it
    # continued, and what its stream showed beyond the text (JSON)
    """
    CREATE TABLE responses (
        answer_id TEXT PRIMARY KEY REFERENCES messages (id) ON DELETE CASCADE,
        previous_id TEXT,
        request TEXT NOT NULL,
        outcome TEXT
    );
    """,
    # 11: groups of accounts, made by the admin; a collection shared with a group is
    # readable by its members
    """
    CREATE TABLE user_groups (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL
    );
    CREATE TABLE user_group_members (
        group_id TEXT NOT NULL REFERENCES user_groups (id) ON DELETE CASCADE,
        user_id TEXT NOT NULL,
        PRIMARY KEY (group_id, user_id)
    );
    CREATE INDEX user_group_members_by_user ON user_group_members (user_id);
    CREATE TABLE collection_group_shares (
        collection_id TEXT NOT NULL REFERENCES collections (id) ON DELETE CASCADE,
        group_id TEXT NOT NULL REFERENCES user_groups (id) ON DELETE CASCADE,
        PRIMARY KEY (collection_id, group_id)
    );
    CREATE INDEX collection_group_shares_by_group ON collection_group_shares (group_id);
    """,
    # 12: an answer cut at the model's output cap (llm.max_output_tokens)
    """
    ALTER TABLE messages ADD COLUMN truncated INTEGER;
    """,
)

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


mapped = mapping_errors(
    DriverErrors(
        unavailable=(sqlite3.OperationalError, OSError, TimeoutError),
        conflict=(sqlite3.IntegrityError,),
        data=(sqlite3.DataError,),
        every=(sqlite3.Error,),
        outage=_outage,
    )
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

    @mapped
    async def ping(self) -> None:
        """Raise unless the store can be written: a write transaction is begun and
        rolled back (with another connection holding the file's lock for longer than
        `PING_SECONDS`, that is a failure too)."""
        async with asyncio.timeout(PING_SECONDS), self._transaction():
            pass

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[aiosqlite.Connection]:
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
                yield db
                await db.execute("COMMIT")
            except BaseException:
                await _rollback(db)
                raise

    async def _write(self, sql: str, params: tuple[Any, ...]) -> int:
        async with self._transaction() as db:
            cursor = await db.execute(sql, params)
            count = cursor.rowcount
            await cursor.close()
            return count

    async def _rows(self, sql: str, params: tuple[Any, ...]) -> list[Any]:
        async with self.db.execute(sql, params) as cur:
            return list(await cur.fetchall())

    # -- chats --------------------------------------------------------------------------

    @mapped
    async def get_chat(self, chat_id: str) -> Chat | None:
        rows = await self._rows(f"SELECT {CHAT_COLUMNS} FROM chats WHERE id = ?", (chat_id,))
        return chat_from_row(rows[0]) if rows else None

    @mapped
    async def set_title(self, chat_id: str, title: str) -> None:
        await self._write("UPDATE chats SET title = ? WHERE id = ?", (title, chat_id))

    @mapped
    async def list_chats(self, user_id: str, limit: int = 100) -> list[Chat]:
        rows = await self._rows(
            f"SELECT {CHAT_COLUMNS} FROM chats WHERE user_id = ?"
            " ORDER BY created_at DESC, id DESC LIMIT ?",
            (user_id, limit),
        )
        return [chat_from_row(row) for row in rows]

    @mapped
    async def delete_chat(self, chat_id: str) -> bool:
        async with self._transaction() as db:
            await db.execute("DELETE FROM chat_files WHERE chat_id = ?", (chat_id,))
            await db.execute("DELETE FROM messages WHERE chat_id = ?", (chat_id,))
            cursor = await db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))
            return cursor.rowcount == 1

    # -- messages -----------------------------------------------------------------------

    @mapped
    async def begin_answer(
        self,
        chat: Chat,
        question: StoredMessage,
        answer: StoredMessage,
        *,
        regenerate: bool = False,
        files: Sequence[str] = (),
    ) -> bool:
        async with self._transaction() as db:
            cursor = await db.execute(
                "INSERT OR IGNORE INTO chats (id, user_id, title, focus_mode, created_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (chat.id, chat.user_id, chat.title, chat.focus_mode, chat.created_at),
            )
            created = cursor.rowcount == 1
            if not created:
                rows = await db.execute_fetchall(
                    "SELECT user_id FROM chats WHERE id = ?", (chat.id,)
                )
                if list(rows)[0][0] != chat.user_id:
                    raise not_yours()
            try:
                if regenerate:
                    await db.execute(
                        "DELETE FROM messages WHERE chat_id = ? AND (created_at > ?"
                        " OR (created_at = ? AND id > ?)) AND id != ?",
                        (
                            question.chat_id,
                            question.created_at,
                            question.created_at,
                            question.id,
                            question.id,
                        ),
                    )
                    await db.execute(
                        "UPDATE messages SET content = ?, rewritten = NULL, sources = '[]'"
                        " WHERE id = ?",
                        (question.content, question.id),
                    )
                    await db.execute(_INSERT_MESSAGE, _params(answer))
                else:
                    await db.executemany(_INSERT_MESSAGE, [_params(question), _params(answer)])
            except sqlite3.IntegrityError as exc:
                raise taken("message.messageId") from exc
            await db.executemany(
                "INSERT OR IGNORE INTO chat_files (chat_id, file_id, attached_at) VALUES (?, ?, ?)",
                [(chat.id, file_id, question.created_at) for file_id in files],
            )
        return created

    @mapped
    async def set_sources(self, message_id: str, sources: list[dict[str, Any]]) -> None:
        await self._write(
            "UPDATE messages SET sources = ? WHERE id = ?",
            (orjson.dumps(sources).decode(), message_id),
        )

    @mapped
    async def finish_answer(
        self, answer_id: str, saved: Saved, *, only_streaming: bool = False
    ) -> bool:
        async with self._transaction() as db:
            cursor = await db.execute(
                "UPDATE messages SET content = ?, reasoning = ?, status = ?, steps = ?, error = ?,"
                " truncated = ? WHERE id = ?"
                + (" AND status = 'streaming'" if only_streaming else ""),
                (
                    saved.content,
                    saved.reasoning,
                    saved.status,
                    _json(saved.steps),
                    _json(saved.error),
                    int(saved.truncated),
                    answer_id,
                ),
            )
            changed = cursor.rowcount == 1
            if changed and saved.usage is not None:
                u = saved.usage
                # what this save adds to the user's day (nothing when saved before)
                await db.execute(
                    "INSERT INTO tokens_by_day (user_id, day, tokens)"
                    " SELECT c.user_id, CAST(m.created_at / 86400 AS INTEGER),"
                    " max(? - coalesce(m.prompt_tokens + m.completion_tokens, 0), 0)"
                    " FROM messages m JOIN chats c ON c.id = m.chat_id WHERE m.id = ?"
                    " ON CONFLICT (user_id, day) DO UPDATE SET tokens = tokens + excluded.tokens",
                    (u.total_tokens, answer_id),
                )
                await db.execute(
                    "UPDATE messages SET model = ?, prompt_tokens = ?, completion_tokens = ?,"
                    " reasoning_tokens = ?, usage_estimated = ? WHERE id = ?",
                    (
                        u.model,
                        u.prompt_tokens,
                        u.completion_tokens,
                        u.reasoning_tokens,
                        int(u.estimated),
                        answer_id,
                    ),
                )
            if changed and saved.question_id is not None and saved.rewritten is not None:
                await db.execute(
                    "UPDATE messages SET rewritten = ? WHERE id = ?",
                    (saved.rewritten, saved.question_id),
                )
            if changed and saved.question_id is not None and saved.sources is not None:
                await db.execute(
                    "UPDATE messages SET sources = ? WHERE id = ?",
                    (orjson.dumps(saved.sources).decode(), saved.question_id),
                )
            return changed

    @mapped
    async def checkpoint_answers(self, progress: Sequence[Checkpoint]) -> None:
        async with self._transaction() as db:
            await db.executemany(
                "UPDATE messages SET content = ?, reasoning = ?, steps = ? WHERE id = ?"
                " AND status = 'streaming'",
                [(c.content, c.reasoning, _json(c.steps), c.answer_id) for c in progress],
            )

    @mapped
    async def get_message(self, message_id: str) -> StoredMessage | None:
        rows = await self._rows(
            f"SELECT {MESSAGE_SELECT} FROM messages WHERE id = ?", (message_id,)
        )
        return _message(rows[0]) if rows else None

    @mapped
    async def list_messages(self, chat_id: str) -> list[StoredMessage]:
        rows = await self._rows(
            f"SELECT {MESSAGE_SELECT} FROM messages WHERE chat_id = ? ORDER BY created_at, id",
            (chat_id,),
        )
        return [_message(row) for row in rows]

    @mapped
    async def delete_turn(self, answer_id: str) -> bool:
        async with self._transaction() as db:
            rows = await db.execute_fetchall(
                "SELECT chat_id, reply_to FROM messages WHERE id = ? AND role = 'assistant'",
                (answer_id,),
            )
            if not rows:
                return False
            chat_id, question_id = list(rows)[0]
            await db.execute(
                "DELETE FROM messages WHERE id IN (?, ?)", (answer_id, question_id or answer_id)
            )
            left = await db.execute_fetchall(
                "SELECT 1 FROM messages WHERE chat_id = ? LIMIT 1", (chat_id,)
            )
            if not list(left):
                await db.execute("DELETE FROM chat_files WHERE chat_id = ?", (chat_id,))
                await db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))
            return True

    @mapped
    async def add_response(self, response: StoredResponse) -> None:
        await self._write(
            "INSERT INTO responses (answer_id, previous_id, request, outcome) VALUES (?, ?, ?, ?)",
            (
                response.answer_id,
                response.previous,
                orjson.dumps(response.request).decode(),
                None if response.outcome is None else orjson.dumps(response.outcome).decode(),
            ),
        )

    @mapped
    async def end_response(self, answer_id: str, outcome: list[dict[str, Any]]) -> None:
        await self._write(
            "UPDATE responses SET outcome = ? WHERE answer_id = ?",
            (orjson.dumps(outcome).decode(), answer_id),
        )

    @mapped
    async def get_response(self, answer_id: str) -> StoredResponse | None:
        rows = await self._rows(
            "SELECT answer_id, previous_id, request, outcome FROM responses WHERE answer_id = ?",
            (answer_id,),
        )
        if not rows:
            return None
        answer, previous, request, outcome = rows[0]
        return StoredResponse(
            answer,
            orjson.loads(request),
            previous,
            orjson.loads(outcome) if outcome is not None else None,
        )

    @mapped
    async def streaming_answers(
        self,
        created_before: float,
        after: tuple[float, str] | None = None,
        limit: int = 100,
    ) -> list[StoredMessage]:
        at, last = after or (-1.0, "")
        rows = await self._rows(
            f"SELECT {MESSAGE_SELECT} FROM messages WHERE status = 'streaming'"
            " AND created_at < ? AND (created_at > ? OR (created_at = ? AND id > ?))"
            " ORDER BY created_at, id LIMIT ?",
            (created_before, at, at, last, limit),
        )
        return [_message(row) for row in rows]

    # -- what the processes of a deployment share --------------------------------------------

    @mapped
    async def lease_worker(self, token: str, ttl: float, workers: int) -> int:
        async with self._transaction() as db:
            now = time.time()
            rows = await db.execute_fetchall("SELECT n FROM workers WHERE expires_at > ?", (now,))
            held = {row[0] for row in rows}
            free = [n for n in range(workers) if n not in held]
            if not free:
                raise unavailable(RuntimeError(f"all {workers} worker numbers are leased"))
            worker = random.choice(free)
            await db.execute(
                "INSERT INTO workers (n, token, expires_at) VALUES (?, ?, ?)"
                " ON CONFLICT (n) DO UPDATE SET token = excluded.token,"
                " expires_at = excluded.expires_at",
                (worker, token, now + ttl),
            )
            return worker

    @mapped
    async def renew_worker(self, worker: int, token: str, ttl: float) -> bool:
        count = await self._write(
            "UPDATE workers SET expires_at = ? WHERE n = ? AND token = ?",
            (time.time() + ttl, worker, token),
        )
        return count == 1

    @mapped
    async def release_worker(self, worker: int, token: str) -> None:
        await self._write("DELETE FROM workers WHERE n = ? AND token = ?", (worker, token))

    @mapped
    async def secret(self, name: str) -> str:
        async with self._transaction() as db:
            await db.execute(
                "INSERT OR IGNORE INTO secrets (name, value) VALUES (?, ?)",
                (name, random_secrets.token_hex(32)),
            )
            rows = await db.execute_fetchall("SELECT value FROM secrets WHERE name = ?", (name,))
            return str(list(rows)[0][0])

    # -- uploaded files -------------------------------------------------------------------

    @mapped
    async def add_file(self, record: FileRecord, indexer: str = "") -> None:
        await self._write(
            f"INSERT INTO files ({FILE_COLUMNS}, indexer) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (*file_params(record), indexer or None),
        )

    @mapped
    async def fail_orphaned_files(self, error: str, created_before: float) -> int:
        return await self._write(
            "UPDATE files SET status = 'failed', error = ? WHERE status = 'indexing'"
            " AND created_at < ? AND (indexer IS NULL OR indexer NOT IN"
            " (SELECT token FROM workers WHERE expires_at > ?))",
            (error, created_before, time.time()),
        )

    @mapped
    async def finish_file(self, record: FileRecord, chunks: list[StoredChunk]) -> None:
        async with self._transaction() as db:
            await db.execute(
                "UPDATE files SET status = ?, pages = ?, chunks = ?, error = ? WHERE id = ?",
                (record.status, record.pages, record.chunks, record.error, record.id),
            )
            await db.executemany(
                "INSERT INTO file_chunks (file_id, n, page, text, vector) VALUES (?, ?, ?, ?, ?)",
                [(record.id, c.n, c.page, c.text, c.vector) for c in chunks],
            )

    @mapped
    async def get_file(self, file_id: str) -> FileRecord | None:
        rows = await self._rows(f"SELECT {FILE_COLUMNS} FROM files WHERE id = ?", (file_id,))
        return file_from_row(rows[0]) if rows else None

    @mapped
    async def list_files(self, user_id: str) -> list[FileRecord]:
        rows = await self._rows(
            f"SELECT {FILE_COLUMNS} FROM files WHERE user_id = ? ORDER BY created_at DESC, id",
            (user_id,),
        )
        return [file_from_row(row) for row in rows]

    @mapped
    async def delete_file(self, file_id: str) -> bool:
        async with self._transaction() as db:
            await db.execute("DELETE FROM chat_files WHERE file_id = ?", (file_id,))
            await db.execute("DELETE FROM file_chunks WHERE file_id = ?", (file_id,))
            cursor = await db.execute("DELETE FROM files WHERE id = ?", (file_id,))
            return cursor.rowcount == 1

    @mapped
    async def file_chunks(self, file_id: str) -> list[StoredChunk]:
        rows = await self._rows(
            "SELECT n, page, text, vector FROM file_chunks WHERE file_id = ? ORDER BY n",
            (file_id,),
        )
        return [StoredChunk(*row) for row in rows]

    @mapped
    async def attach_files(self, chat_id: str, file_ids: list[str]) -> None:
        now = time.time()
        async with self._transaction() as db:
            await db.executemany(
                "INSERT OR IGNORE INTO chat_files (chat_id, file_id, attached_at) VALUES (?, ?, ?)",
                [(chat_id, file_id, now) for file_id in file_ids],
            )

    @mapped
    async def chat_files(self, chat_ids: list[str]) -> dict[str, list[FileRecord]]:
        if not chat_ids:
            return {}
        marks = ", ".join("?" * len(chat_ids))
        columns = ", ".join(f"f.{c.strip()}" for c in FILE_COLUMNS.split(","))
        rows = await self._rows(
            f"SELECT cf.chat_id, {columns} FROM chat_files cf JOIN files f ON f.id = cf.file_id"
            f" WHERE cf.chat_id IN ({marks}) ORDER BY cf.attached_at, f.id",
            tuple(chat_ids),
        )
        out: dict[str, list[FileRecord]] = {}
        for row in rows:
            out.setdefault(row[0], []).append(file_from_row(row[1:]))
        return out

    # -- token usage ----------------------------------------------------------------------

    @mapped
    async def usage(self, user_id: str, since: float = 0.0) -> list[Usage]:
        rows = await self._rows(
            "SELECT m.model, count(*), sum(m.prompt_tokens), sum(m.completion_tokens),"
            " sum(coalesce(m.reasoning_tokens, 0)), max(coalesce(m.usage_estimated, 0))"
            " FROM messages m JOIN chats c ON c.id = m.chat_id"
            " WHERE c.user_id = ? AND m.role = 'assistant' AND m.model IS NOT NULL"
            " AND m.created_at >= ? GROUP BY m.model ORDER BY m.model",
            (user_id, since),
        )
        return [Usage(r[0], r[2], r[3], r[4], bool(r[5]), r[1]) for r in rows]

    @mapped
    async def tokens_on(self, day: int, user_id: str) -> int:
        rows = await self._rows(
            "SELECT tokens FROM tokens_by_day WHERE user_id = ? AND day = ?", (user_id, day)
        )
        return int(rows[0][0]) if rows else 0

    @mapped
    async def tokens_by_user(self, day: int) -> dict[str, int]:
        rows = await self._rows(
            "SELECT user_id, tokens FROM tokens_by_day WHERE day = ? AND tokens > 0", (day,)
        )
        return {str(r[0]): int(r[1]) for r in rows}

    # -- accounts ---------------------------------------------------------------------------

    @mapped
    async def add_account(
        self, account: Account, *, admin_if_none: bool = False, invite: str | None = None
    ) -> Account:
        async with self._transaction() as db:
            rows = await db.execute_fetchall("SELECT 1 FROM accounts WHERE role = 'admin' LIMIT 1")
            has_admin = bool(list(rows))
            if admin_if_none and not has_admin:
                account = replace(account, role="admin")
            try:
                await db.execute(
                    f"INSERT INTO accounts ({ACCOUNT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    account_params(account),
                )
            except sqlite3.IntegrityError as exc:
                raise taken("this email or identity") from exc
            if invite is not None and has_admin:
                cursor = await db.execute(
                    "UPDATE invites SET used_by = ?, used_at = ? WHERE code_hash = ?"
                    " AND used_by IS NULL AND expires_at > ?",
                    (account.id, account.created_at, invite, time.time()),
                )
                if cursor.rowcount != 1:
                    raise bad_invite()
            return account

    @mapped
    async def get_account(self, account_id: str) -> Account | None:
        return await self._account("id = ?", (account_id,))

    @mapped
    async def account_by_email(self, email: str) -> Account | None:
        return await self._account("email = ?", (email,))

    @mapped
    async def account_by_subject(self, issuer: str, subject: str) -> Account | None:
        return await self._account("issuer = ? AND subject = ?", (issuer, subject))

    async def _account(self, where: str, params: tuple[Any, ...]) -> Account | None:
        rows = await self._rows(f"SELECT {ACCOUNT_COLUMNS} FROM accounts WHERE {where}", params)
        return account_from_row(rows[0]) if rows else None

    @mapped
    async def list_accounts(self, limit: int = 1000) -> list[Account]:
        rows = await self._rows(
            f"SELECT {ACCOUNT_COLUMNS} FROM accounts ORDER BY created_at, id LIMIT ?", (limit,)
        )
        return [account_from_row(row) for row in rows]

    @mapped
    async def has_admin(self) -> bool:
        return bool(await self._rows("SELECT 1 FROM accounts WHERE role = 'admin' LIMIT 1", ()))

    @mapped
    async def update_account(self, account_id: str, change: AccountChange) -> Account | None:
        sets, params = account_change_sql(change, "?")
        async with self._transaction() as db:
            if sets:
                cursor = await db.execute(
                    f"UPDATE accounts SET {', '.join(sets)} WHERE id = ?", (*params, account_id)
                )
                if cursor.rowcount != 1:
                    return None
                rows = await db.execute_fetchall(
                    "SELECT count(*) FROM accounts WHERE role = 'admin' AND disabled = 0"
                )
                if list(rows)[0][0] == 0:
                    raise no_admin_left()
            if change.disabled:
                await db.execute("DELETE FROM sessions WHERE account_id = ?", (account_id,))
            rows = await db.execute_fetchall(
                f"SELECT {ACCOUNT_COLUMNS} FROM accounts WHERE id = ?", (account_id,)
            )
            found = list(rows)
            return account_from_row(found[0]) if found else None

    # -- sessions and API keys --------------------------------------------------------------

    @mapped
    async def add_session(self, token_hash: str, account_id: str, expires_at: float) -> None:
        now = time.time()
        async with self._transaction() as db:
            await db.execute("DELETE FROM sessions WHERE expires_at <= ?", (now,))
            await db.execute(
                "INSERT INTO sessions (token_hash, account_id, created_at, expires_at)"
                " VALUES (?, ?, ?, ?)",
                (token_hash, account_id, now, expires_at),
            )

    @mapped
    async def session_account(self, token_hash: str) -> Account | None:
        columns = ", ".join(f"a.{c.strip()}" for c in ACCOUNT_COLUMNS.split(","))
        rows = await self._rows(
            f"SELECT {columns} FROM sessions s JOIN accounts a ON a.id = s.account_id"
            " WHERE s.token_hash = ? AND s.expires_at > ?",
            (token_hash, time.time()),
        )
        return account_from_row(rows[0]) if rows else None

    @mapped
    async def delete_session(self, token_hash: str) -> bool:
        return await self._write("DELETE FROM sessions WHERE token_hash = ?", (token_hash,)) == 1

    @mapped
    async def add_api_key(self, key: ApiKey, key_hash: str) -> None:
        await self._write(
            f"INSERT INTO api_keys ({API_KEY_COLUMNS}, key_hash) VALUES (?, ?, ?, ?, ?, ?)",
            (key.id, key.user_id, key.name, key.prefix, key.created_at, key_hash),
        )

    @mapped
    async def api_key_account(self, key_hash: str) -> Account | None:
        columns = ", ".join(f"a.{c.strip()}" for c in ACCOUNT_COLUMNS.split(","))
        rows = await self._rows(
            f"SELECT {columns} FROM api_keys k JOIN accounts a ON a.id = k.account_id"
            " WHERE k.key_hash = ?",
            (key_hash,),
        )
        return account_from_row(rows[0]) if rows else None

    @mapped
    async def list_api_keys(self, account_id: str) -> list[ApiKey]:
        rows = await self._rows(
            f"SELECT {API_KEY_COLUMNS} FROM api_keys WHERE account_id = ? ORDER BY created_at, id",
            (account_id,),
        )
        return [api_key_from_row(row) for row in rows]

    @mapped
    async def revoke_api_key(self, account_id: str, key_id: str) -> bool:
        count = await self._write(
            "DELETE FROM api_keys WHERE id = ? AND account_id = ?", (key_id, account_id)
        )
        return count == 1

    @mapped
    async def add_invite(self, code_hash: str, created_by: str, expires_at: float) -> None:
        await self._write(
            "INSERT INTO invites (code_hash, created_by, created_at, expires_at) VALUES (?, ?, ?, ?)",
            (code_hash, created_by, time.time(), expires_at),
        )

    @mapped
    async def invite_usable(self, code_hash: str) -> bool:
        rows = await self._rows(
            "SELECT 1 FROM invites WHERE code_hash = ? AND used_by IS NULL AND expires_at > ?",
            (code_hash, time.time()),
        )
        return bool(rows)

    # -- knowledge collections ------------------------------------------------------------

    @mapped
    async def add_collection(self, record: CollectionRecord) -> None:
        async with self._transaction() as db:
            await db.execute(
                f"INSERT INTO collections ({COLLECTION_COLUMNS}) VALUES (?, ?, ?, ?, ?)",
                (
                    record.id,
                    record.owner,
                    record.name,
                    record.description,
                    record.created_at,
                ),
            )
            await self._write_shares(db, record)

    async def _write_shares(self, db: aiosqlite.Connection, record: CollectionRecord) -> None:
        await db.executemany(
            "INSERT INTO collection_shares (collection_id, user_id) VALUES (?, ?)",
            [(record.id, user) for user in record.shared],
        )
        await db.executemany(
            "INSERT INTO collection_group_shares (collection_id, group_id) VALUES (?, ?)",
            [(record.id, group) for group in record.groups],
        )

    async def _with_shares(self, rows: list[Any]) -> list[CollectionRecord]:
        if not rows:
            return []
        ids = tuple(row[0] for row in rows)
        marks = ", ".join("?" * len(ids))
        shares: dict[str, list[str]] = {}
        groups: dict[str, list[str]] = {}
        for sql, into in ((SQL_SHARES, shares), (SQL_GROUP_SHARES, groups)):
            ordered = sql.replace("= ANY_OF", f"IN ({marks})") + " ORDER BY 2"
            for collection_id, who in await self._rows(ordered, ids):
                into.setdefault(collection_id, []).append(who)
        return [collection_from_row(r, shares.get(r[0], ()), groups.get(r[0], ())) for r in rows]

    @mapped
    async def get_collection(self, collection_id: str) -> CollectionRecord | None:
        found = await self._with_shares(await self._rows(SQL_GET_COLLECTION, (collection_id,)))
        return found[0] if found else None

    @mapped
    async def list_collections(self, user_id: str) -> list[CollectionRecord]:
        rows = await self._rows(SQL_LIST_COLLECTIONS, (user_id, user_id, user_id))
        return await self._with_shares(rows)

    @mapped
    async def update_collection(self, record: CollectionRecord) -> None:
        async with self._transaction() as db:
            await db.execute(
                "UPDATE collections SET name = ?, description = ? WHERE id = ?",
                (record.name, record.description, record.id),
            )
            for table in ("collection_shares", "collection_group_shares"):
                await db.execute(f"DELETE FROM {table} WHERE collection_id = ?", (record.id,))
            await self._write_shares(db, record)

    @mapped
    async def delete_collection(self, collection_id: str) -> bool:
        async with self._transaction() as db:
            for table in ("collection_documents", "collection_shares", "collection_group_shares"):
                await db.execute(f"DELETE FROM {table} WHERE collection_id = ?", (collection_id,))
            cursor = await db.execute("DELETE FROM collections WHERE id = ?", (collection_id,))
            return cursor.rowcount == 1

    @mapped
    async def add_documents(
        self,
        records: Sequence[DocumentRecord],
        indexer: str = "",
        max_documents: int | None = None,
    ) -> list[DocumentRecord]:
        if not records:
            return []
        collection_id = records[0].collection_id
        async with self._transaction() as db:  # BEGIN IMMEDIATE: one writer at a time
            async with db.execute("SELECT 1 FROM collections WHERE id = ?", (collection_id,)) as c:
                if await c.fetchone() is None:
                    raise NotFound("no such collection")
            async with db.execute(SQL_COUNT_DOCUMENTS, (collection_id,)) as c:
                row = await c.fetchone()
            stored = limit_documents(records, int(row[0]) if row else 0, max_documents)
            await db.executemany(
                SQL_ADD_DOCUMENT, [(*document_params(d), indexer or None) for d in stored]
            )
        return stored

    @mapped
    async def fail_orphaned_documents(
        self, error: str, created_before: float
    ) -> list[tuple[str, str]]:
        async with self._transaction() as db:
            sql = SQL_SWEEP_DOCUMENTS.replace("NOW", "?")
            async with db.execute(sql, (error, created_before, time.time())) as cursor:
                return [(row[0], row[1]) for row in await cursor.fetchall()]

    @mapped
    async def ready_documents(self, document_ids: Sequence[str]) -> set[str]:
        ids = tuple(dict.fromkeys(document_ids))
        if not ids:
            return set()
        rows = await self._rows(
            f"SELECT id FROM collection_documents WHERE id IN ({', '.join('?' * len(ids))})"
            " AND status = 'ready'",
            ids,
        )
        return {row[0] for row in rows}

    @mapped
    async def finish_document(self, record: DocumentRecord) -> None:
        await self._write(SQL_FINISH_DOCUMENT, finish_document_params(record))

    @mapped
    async def get_document(self, document_id: str) -> DocumentRecord | None:
        rows = await self._rows(SQL_GET_DOCUMENT, (document_id,))
        return document_from_row(rows[0]) if rows else None

    @mapped
    async def list_documents(
        self, collection_id: str, import_id: str | None = None
    ) -> list[DocumentRecord]:
        if import_id is None:
            rows = await self._rows(SQL_LIST_DOCUMENTS, (collection_id,))
        else:
            rows = await self._rows(SQL_IMPORT_DOCUMENTS, (collection_id, import_id))
        return [document_from_row(row) for row in rows]

    @mapped
    async def import_progress(
        self, collection_id: str, import_id: str
    ) -> tuple[int, int, list[DocumentRecord]]:
        counts = await self._rows(SQL_IMPORT_COUNTS, (collection_id, import_id))
        total, done = (int(counts[0][0]), int(counts[0][1])) if counts else (0, 0)
        if not total:
            return 0, 0, []
        failed = await self._rows(SQL_IMPORT_FAILED, (collection_id, import_id))
        return total, done, [document_from_row(row) for row in failed]

    @mapped
    async def delete_document(self, document_id: str) -> bool:
        count = await self._write("DELETE FROM collection_documents WHERE id = ?", (document_id,))
        return count == 1

    # -- groups -------------------------------------------------------------------------------

    @mapped
    async def add_group(self, record: GroupRecord) -> None:
        async with self._transaction() as db:
            await db.execute(
                f"INSERT INTO user_groups ({GROUP_COLUMNS}) VALUES (?, ?, ?)",
                (record.id, record.name, record.created_at),
            )
            await db.executemany(
                "INSERT INTO user_group_members (group_id, user_id) VALUES (?, ?)",
                [(record.id, user) for user in record.members],
            )

    async def _with_members(self, rows: list[Any]) -> list[GroupRecord]:
        if not rows:
            return []
        ids = tuple(row[0] for row in rows)
        members: dict[str, list[str]] = {}
        for group_id, user in await self._rows(
            "SELECT group_id, user_id FROM user_group_members"
            f" WHERE group_id IN ({', '.join('?' * len(ids))}) ORDER BY user_id",
            ids,
        ):
            members.setdefault(group_id, []).append(user)
        return [GroupRecord(r[0], r[1], r[2], tuple(members.get(r[0], ()))) for r in rows]

    @mapped
    async def get_group(self, group_id: str) -> GroupRecord | None:
        rows = await self._rows(
            f"SELECT {GROUP_COLUMNS} FROM user_groups WHERE id = ?", (group_id,)
        )
        found = await self._with_members(rows)
        return found[0] if found else None

    @mapped
    async def list_groups(self, member: str | None = None) -> list[GroupRecord]:
        if member is None:
            rows = await self._rows(f"SELECT {GROUP_COLUMNS} FROM user_groups ORDER BY name", ())
        else:
            rows = await self._rows(
                f"SELECT {GROUP_COLUMNS} FROM user_groups WHERE id IN"
                " (SELECT group_id FROM user_group_members WHERE user_id = ?) ORDER BY name",
                (member,),
            )
        return await self._with_members(rows)

    @mapped
    async def update_group(self, record: GroupRecord) -> bool:
        async with self._transaction() as db:
            cursor = await db.execute(
                "UPDATE user_groups SET name = ? WHERE id = ?", (record.name, record.id)
            )
            if cursor.rowcount != 1:
                return False
            await db.execute("DELETE FROM user_group_members WHERE group_id = ?", (record.id,))
            await db.executemany(
                "INSERT INTO user_group_members (group_id, user_id) VALUES (?, ?)",
                [(record.id, user) for user in record.members],
            )
            return True

    @mapped
    async def delete_group(self, group_id: str) -> bool:
        async with self._transaction() as db:
            for table in ("user_group_members", "collection_group_shares"):
                await db.execute(f"DELETE FROM {table} WHERE group_id = ?", (group_id,))
            cursor = await db.execute("DELETE FROM user_groups WHERE id = ?", (group_id,))
            return cursor.rowcount == 1


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


_INSERT_MESSAGE = f"INSERT INTO messages ({MESSAGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"


def _params(message: StoredMessage) -> tuple[Any, ...]:
    return message_params(message, orjson.dumps(message.sources).decode())


def _message(row: Any) -> StoredMessage:
    steps, error = (orjson.loads(value) if value else None for value in (row[10], row[11]))
    return message_from_row(row, orjson.loads(row[6]), steps, error)


def _json(value: Any) -> str | None:
    return None if value is None else orjson.dumps(value).decode()
