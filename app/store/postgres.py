"""PostgreSQL store, through an asyncpg pool.

The schema is created and upgraded by numbered migrations recorded in
`schema_migrations`; they run on start inside one transaction holding an
advisory lock, so several workers starting at once apply each migration once.
Worker leases use the database's clock, so hosts whose clocks differ agree.
"""

from __future__ import annotations

import secrets as random_secrets
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import asyncpg
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

LOCK_ID = 7_138_337_258  # pg_advisory_xact_lock key of the migrations
#: pg_advisory_xact_lock key of changes that must see every admin (the first account,
#: the last enabled admin), so two at once cannot both decide on what they saw
ADMINS_LOCK_ID = 7_138_337_259
NOW = "extract(epoch from clock_timestamp())"

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
    # 2: opaque text ids (existing integer ids become their decimal text), the
    # answers a sweeper looks for, worker leases and shared secrets
    """
    ALTER TABLE messages DROP CONSTRAINT messages_chat_id_fkey;
    ALTER TABLE chats
        ALTER COLUMN id TYPE TEXT USING id::text,
        ALTER COLUMN user_id TYPE TEXT USING user_id::text;
    ALTER TABLE messages
        ALTER COLUMN id TYPE TEXT USING id::text,
        ALTER COLUMN chat_id TYPE TEXT USING chat_id::text,
        ALTER COLUMN reply_to TYPE TEXT USING reply_to::text;
    ALTER TABLE messages ADD CONSTRAINT messages_chat_id_fkey
        FOREIGN KEY (chat_id) REFERENCES chats (id) ON DELETE CASCADE;
    CREATE INDEX messages_streaming ON messages (created_at) WHERE status = 'streaming';
    CREATE TABLE workers (
        n INTEGER PRIMARY KEY,
        token TEXT NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL
    );
    CREATE TABLE secrets (name TEXT PRIMARY KEY, value TEXT NOT NULL);
    """,
    # 3: uploaded files, their chunks (text, page, embedding) and the chats they are in
    """
    CREATE TABLE files (
        id TEXT PRIMARY KEY,
        user_id TEXT NOT NULL,
        name TEXT NOT NULL,
        kind TEXT NOT NULL,
        size BIGINT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
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
        vector BYTEA,
        PRIMARY KEY (file_id, n)
    );
    CREATE TABLE chat_files (
        chat_id TEXT NOT NULL REFERENCES chats (id) ON DELETE CASCADE,
        file_id TEXT NOT NULL REFERENCES files (id) ON DELETE CASCADE,
        attached_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (chat_id, file_id)
    );
    CREATE INDEX chat_files_by_file ON chat_files (file_id);
    """,
    # 4: what each answer cost, in tokens
    """
    ALTER TABLE messages
        ADD COLUMN model TEXT,
        ADD COLUMN prompt_tokens INTEGER,
        ADD COLUMN completion_tokens INTEGER,
        ADD COLUMN reasoning_tokens INTEGER,
        ADD COLUMN usage_estimated BOOLEAN;
    """,
    # 5: an answer's progress lines and, when it failed, its error
    """
    ALTER TABLE messages ADD COLUMN steps JSONB, ADD COLUMN error JSONB;
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
        disabled BOOLEAN NOT NULL DEFAULT false,
        tokens_per_day BIGINT,
        issuer TEXT,
        subject TEXT,
        created_at DOUBLE PRECISION NOT NULL,
        UNIQUE (issuer, subject)
    );
    CREATE TABLE sessions (
        token_hash TEXT PRIMARY KEY,
        account_id TEXT NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
        created_at DOUBLE PRECISION NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL
    );
    CREATE INDEX sessions_by_account ON sessions (account_id);
    CREATE INDEX sessions_by_expiry ON sessions (expires_at);
    CREATE TABLE api_keys (
        id TEXT PRIMARY KEY,
        account_id TEXT NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
        name TEXT NOT NULL,
        prefix TEXT NOT NULL,
        key_hash TEXT NOT NULL UNIQUE,
        created_at DOUBLE PRECISION NOT NULL
    );
    CREATE INDEX api_keys_by_account ON api_keys (account_id, created_at);
    CREATE TABLE invites (
        code_hash TEXT PRIMARY KEY,
        created_by TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL,
        used_by TEXT,
        used_at DOUBLE PRECISION
    );
    """,
    # 8: knowledge collections (their passages are in the collections engine)
    """
    CREATE TABLE collections (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        name TEXT NOT NULL,
        description TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL
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
        size BIGINT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
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
        tokens BIGINT NOT NULL,
        PRIMARY KEY (user_id, day)
    );
    INSERT INTO tokens_by_day (user_id, day, tokens)
        SELECT c.user_id, floor(m.created_at / 86400)::integer,
               sum(coalesce(m.prompt_tokens, 0) + coalesce(m.completion_tokens, 0))
        FROM messages m JOIN chats c ON c.id = m.chat_id
        WHERE m.role = 'assistant' AND m.model IS NOT NULL
        GROUP BY 1, 2;
    """,
    # 10: what a Responses API answer keeps beside it: its request's echo, the answer it
    # continued, and what its stream showed beyond the text
    """
    CREATE TABLE responses (
        answer_id TEXT PRIMARY KEY REFERENCES messages (id) ON DELETE CASCADE,
        previous_id TEXT,
        request JSONB NOT NULL,
        outcome JSONB
    );
    """,
    # 11: groups of accounts, made by the admin; a collection shared with a group is
    # readable by its members
    """
    CREATE TABLE user_groups (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        created_at DOUBLE PRECISION NOT NULL
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
    ALTER TABLE messages ADD COLUMN truncated BOOLEAN;
    """,
)


#: how asyncpg's errors read: the database cannot be reached or used now (connection
#: trouble; refusing writes after a failover; out of resources; shutting down; a
#: statement timeout; a deadlock or serialization failure, which a retry resolves), a
#: broken constraint, a value it cannot keep (a NUL in text, say); anything else is a bug
def _misused(exc: BaseException) -> bool:
    """An `InterfaceError` that is a mistake of ours, not a connection that went:
    a query given the wrong number of arguments, a setting the driver refuses."""
    if isinstance(exc, asyncpg.exceptions._base.ClientConfigurationError):
        return True
    return type(exc) is asyncpg.InterfaceError and "argument" in str(exc)


ERRORS = DriverErrors(
    unavailable=(
        OSError,
        TimeoutError,
        asyncpg.PostgresConnectionError,
        asyncpg.InterfaceError,
        asyncpg.exceptions.InsufficientResourcesError,
        asyncpg.exceptions.OperatorInterventionError,
        asyncpg.exceptions.ReadOnlySQLTransactionError,
        asyncpg.exceptions.TransactionRollbackError,
        asyncpg.exceptions.PostgresSystemError,
        # "cannot switch to state N; another operation is in progress": a pooled
        # connection whose session the server ended under a statement, before
        # asyncpg saw it close (a restart, a failover, pg_terminate_backend)
        asyncpg.exceptions.InternalClientError,
    ),
    conflict=(asyncpg.IntegrityConstraintViolationError,),
    # class 22 from the server, and a value asyncpg itself cannot send as its type
    data=(asyncpg.DataError, asyncpg.exceptions._base.DataError),
    every=(asyncpg.PostgresError,),
    outage=lambda exc: not _misused(exc),
)
COMMAND_SECONDS = 10.0

mapped = mapping_errors(ERRORS)


class PostgresStore(Store):
    def __init__(
        self, url: str, *, min_size: int = 1, max_size: int = 10, statement_cache_size: int = 100
    ) -> None:
        self.url = url
        self.min_size = min_size
        self.max_size = max_size
        self.statement_cache_size = statement_cache_size
        self._pool: asyncpg.Pool | None = None

    async def open(self) -> None:
        self._pool = await asyncpg.create_pool(
            self.url,
            min_size=self.min_size,
            max_size=self.max_size,
            init=_init_connection,
            reset=_nothing_to_reset,
            command_timeout=COMMAND_SECONDS,
            statement_cache_size=self.statement_cache_size,
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

    @mapped
    async def ping(self) -> None:
        """Raise unless the database answers and takes writes (a replica promoted
        back to read-only, say, answers but does not)."""
        writable = await self.pool.fetchval(
            "SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'"
        )
        if not writable:
            raise unavailable(RuntimeError("the database is read-only"))

    # -- chats --------------------------------------------------------------------------

    @mapped
    async def get_chat(self, chat_id: str) -> Chat | None:
        row = await self.pool.fetchrow(f"SELECT {CHAT_COLUMNS} FROM chats WHERE id = $1", chat_id)
        return chat_from_row(row) if row else None

    @mapped
    async def set_title(self, chat_id: str, title: str) -> None:
        await self.pool.execute("UPDATE chats SET title = $1 WHERE id = $2", title, chat_id)

    @mapped
    async def list_chats(self, user_id: str, limit: int = 100) -> list[Chat]:
        rows = await self.pool.fetch(
            f"SELECT {CHAT_COLUMNS} FROM chats WHERE user_id = $1"
            " ORDER BY created_at DESC, id DESC LIMIT $2",
            user_id,
            limit,
        )
        return [chat_from_row(row) for row in rows]

    @mapped
    async def delete_chat(self, chat_id: str) -> bool:
        # messages go with it (ON DELETE CASCADE)
        status = await self.pool.execute("DELETE FROM chats WHERE id = $1", chat_id)
        return _one_row(status)

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
        async with self.pool.acquire() as conn, conn.transaction():
            status = await conn.execute(
                "INSERT INTO chats (id, user_id, title, focus_mode, created_at)"
                " VALUES ($1, $2, $3, $4, $5) ON CONFLICT (id) DO NOTHING",
                chat.id,
                chat.user_id,
                chat.title,
                chat.focus_mode,
                chat.created_at,
            )
            if not _one_row(status):
                owner = await conn.fetchval("SELECT user_id FROM chats WHERE id = $1", chat.id)
                if owner != chat.user_id:
                    raise not_yours()
            try:
                if regenerate:
                    await conn.execute(
                        "DELETE FROM messages WHERE chat_id = $1 AND (created_at, id) > ($2, $3)",
                        question.chat_id,
                        question.created_at,
                        question.id,
                    )
                    await conn.execute(
                        "UPDATE messages SET content = $1, rewritten = NULL, sources = '[]'"
                        " WHERE id = $2",
                        question.content,
                        question.id,
                    )
                    await conn.execute(_INSERT_MESSAGE, *_params(answer))
                else:
                    await conn.executemany(_INSERT_MESSAGE, [_params(question), _params(answer)])
            except asyncpg.UniqueViolationError as exc:
                raise taken("message.messageId") from exc
            if files:
                await conn.executemany(
                    "INSERT INTO chat_files (chat_id, file_id, attached_at)"
                    " VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
                    [(chat.id, file_id, question.created_at) for file_id in files],
                )
            return _one_row(status)

    @mapped
    async def set_sources(self, message_id: str, sources: list[dict[str, Any]]) -> None:
        await self.pool.execute(
            "UPDATE messages SET sources = $1 WHERE id = $2", sources, message_id
        )

    @mapped
    async def finish_answer(
        self, answer_id: str, saved: Saved, *, only_streaming: bool = False
    ) -> bool:
        async with self.pool.acquire() as conn, conn.transaction():
            result = await conn.execute(
                "UPDATE messages SET content = $1, reasoning = $2, status = $3, steps = $4,"
                " error = $5, truncated = $6 WHERE id = $7"
                + (" AND status = 'streaming'" if only_streaming else ""),
                saved.content,
                saved.reasoning,
                saved.status,
                saved.steps,
                saved.error,
                saved.truncated,
                answer_id,
            )
            changed = _one_row(result)
            if changed and saved.usage is not None:
                u = saved.usage
                # what this save adds to the user's day (nothing when saved before)
                await conn.execute(
                    "INSERT INTO tokens_by_day (user_id, day, tokens)"
                    " SELECT c.user_id, floor(m.created_at / 86400)::integer,"
                    " greatest($1 - coalesce(m.prompt_tokens + m.completion_tokens, 0), 0)"
                    " FROM messages m JOIN chats c ON c.id = m.chat_id WHERE m.id = $2"
                    " ON CONFLICT (user_id, day) DO UPDATE"
                    " SET tokens = tokens_by_day.tokens + excluded.tokens",
                    u.total_tokens,
                    answer_id,
                )
                await conn.execute(
                    "UPDATE messages SET model = $1, prompt_tokens = $2, completion_tokens = $3,"
                    " reasoning_tokens = $4, usage_estimated = $5 WHERE id = $6",
                    u.model,
                    u.prompt_tokens,
                    u.completion_tokens,
                    u.reasoning_tokens,
                    u.estimated,
                    answer_id,
                )
            if changed and saved.question_id is not None and saved.rewritten is not None:
                await conn.execute(
                    "UPDATE messages SET rewritten = $1 WHERE id = $2",
                    saved.rewritten,
                    saved.question_id,
                )
            if changed and saved.question_id is not None and saved.sources is not None:
                await conn.execute(
                    "UPDATE messages SET sources = $1 WHERE id = $2",
                    saved.sources,
                    saved.question_id,
                )
            return changed

    @mapped
    async def checkpoint_answers(self, progress: Sequence[Checkpoint]) -> None:
        await self.pool.executemany(
            "UPDATE messages SET content = $2, reasoning = $3, steps = $4 WHERE id = $1"
            " AND status = 'streaming'",
            [(c.answer_id, c.content, c.reasoning, c.steps) for c in progress],
        )

    @mapped
    async def get_message(self, message_id: str) -> StoredMessage | None:
        row = await self.pool.fetchrow(
            f"SELECT {MESSAGE_SELECT} FROM messages WHERE id = $1", message_id
        )
        return _message(row) if row else None

    @mapped
    async def list_messages(self, chat_id: str) -> list[StoredMessage]:
        rows = await self.pool.fetch(
            f"SELECT {MESSAGE_SELECT} FROM messages WHERE chat_id = $1 ORDER BY created_at, id",
            chat_id,
        )
        return [_message(row) for row in rows]

    @mapped
    async def delete_turn(self, answer_id: str) -> bool:
        async with self.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(
                "DELETE FROM messages WHERE id = $1 AND role = 'assistant'"
                " RETURNING chat_id, reply_to",
                answer_id,
            )
            if row is None:
                return False
            chat_id, question_id = row
            if question_id is not None:
                await conn.execute("DELETE FROM messages WHERE id = $1", question_id)
            # the chat's files go with it (ON DELETE CASCADE)
            await conn.execute(
                "DELETE FROM chats WHERE id = $1"
                " AND NOT EXISTS (SELECT 1 FROM messages WHERE chat_id = $1)",
                chat_id,
            )
            return True

    @mapped
    async def add_response(self, response: StoredResponse) -> None:
        await self.pool.execute(
            "INSERT INTO responses (answer_id, previous_id, request, outcome)"
            " VALUES ($1, $2, $3, $4)",
            response.answer_id,
            response.previous,
            response.request,
            response.outcome,
        )

    @mapped
    async def end_response(self, answer_id: str, outcome: list[dict[str, Any]]) -> None:
        await self.pool.execute(
            "UPDATE responses SET outcome = $1 WHERE answer_id = $2", outcome, answer_id
        )

    @mapped
    async def get_response(self, answer_id: str) -> StoredResponse | None:
        row = await self.pool.fetchrow(
            "SELECT answer_id, previous_id, request, outcome FROM responses WHERE answer_id = $1",
            answer_id,
        )
        return StoredResponse(row[0], row[2], row[1], row[3]) if row else None

    @mapped
    async def streaming_answers(
        self,
        created_before: float,
        after: tuple[float, str] | None = None,
        limit: int = 100,
    ) -> list[StoredMessage]:
        at, last = after or (-1.0, "")
        rows = await self.pool.fetch(
            f"SELECT {MESSAGE_SELECT} FROM messages WHERE status = 'streaming'"
            " AND created_at < $1 AND (created_at, id) > ($2, $3)"
            " ORDER BY created_at, id LIMIT $4",
            created_before,
            at,
            last,
            limit,
        )
        return [_message(row) for row in rows]

    # -- what the processes of a deployment share --------------------------------------------

    @mapped
    async def lease_worker(self, token: str, ttl: float, workers: int) -> int:
        # a free number at random (not the lowest), so that starts racing for one
        # rarely meet; the upsert takes it only if it is still free
        for _attempt in range(8):
            worker: int | None = await self.pool.fetchval(
                f"SELECT n FROM generate_series(0, $1 - 1) AS n WHERE n NOT IN"
                f" (SELECT n FROM workers WHERE expires_at > {NOW}) ORDER BY random() LIMIT 1",
                workers,
            )
            if worker is None:
                break
            leased = await self.pool.fetchval(
                f"INSERT INTO workers (n, token, expires_at) VALUES ($1, $2, {NOW} + $3)"
                " ON CONFLICT (n) DO UPDATE SET token = excluded.token,"
                f" expires_at = excluded.expires_at WHERE workers.expires_at <= {NOW}"
                " RETURNING n",
                worker,
                token,
                ttl,
            )
            if leased is not None:
                return worker
        raise unavailable(RuntimeError(f"no free worker number of {workers}"))

    @mapped
    async def renew_worker(self, worker: int, token: str, ttl: float) -> bool:
        status = await self.pool.execute(
            f"UPDATE workers SET expires_at = {NOW} + $1 WHERE n = $2 AND token = $3",
            ttl,
            worker,
            token,
        )
        return _one_row(status)

    @mapped
    async def release_worker(self, worker: int, token: str) -> None:
        await self.pool.execute("DELETE FROM workers WHERE n = $1 AND token = $2", worker, token)

    @mapped
    async def secret(self, name: str) -> str:
        await self.pool.execute(
            "INSERT INTO secrets (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
            name,
            random_secrets.token_hex(32),
        )
        value: str = await self.pool.fetchval("SELECT value FROM secrets WHERE name = $1", name)
        return value

    # -- uploaded files -------------------------------------------------------------------

    @mapped
    async def add_file(self, record: FileRecord, indexer: str = "") -> None:
        await self.pool.execute(
            f"INSERT INTO files ({FILE_COLUMNS}, indexer)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
            *file_params(record),
            indexer or None,
        )

    @mapped
    async def fail_orphaned_files(self, error: str, created_before: float) -> int:
        status = await self.pool.execute(
            "UPDATE files SET status = 'failed', error = $1 WHERE status = 'indexing'"
            " AND created_at < $2 AND (indexer IS NULL OR indexer NOT IN"
            f" (SELECT token FROM workers WHERE expires_at > {NOW}))",
            error,
            created_before,
        )
        return int(status.rsplit(" ", 1)[-1])

    @mapped
    async def finish_file(self, record: FileRecord, chunks: list[StoredChunk]) -> None:
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(
                "UPDATE files SET status = $1, pages = $2, chunks = $3, error = $4 WHERE id = $5",
                record.status,
                record.pages,
                record.chunks,
                record.error,
                record.id,
            )
            if chunks:
                await conn.copy_records_to_table(
                    "file_chunks",
                    records=[(record.id, c.n, c.page, c.text, c.vector) for c in chunks],
                    columns=["file_id", "n", "page", "text", "vector"],
                )

    @mapped
    async def get_file(self, file_id: str) -> FileRecord | None:
        row = await self.pool.fetchrow(f"SELECT {FILE_COLUMNS} FROM files WHERE id = $1", file_id)
        return file_from_row(tuple(row)) if row else None

    @mapped
    async def list_files(self, user_id: str) -> list[FileRecord]:
        rows = await self.pool.fetch(
            f"SELECT {FILE_COLUMNS} FROM files WHERE user_id = $1 ORDER BY created_at DESC, id",
            user_id,
        )
        return [file_from_row(tuple(row)) for row in rows]

    @mapped
    async def delete_file(self, file_id: str) -> bool:
        # chunks and chat attachments go with it (ON DELETE CASCADE)
        status = await self.pool.execute("DELETE FROM files WHERE id = $1", file_id)
        return _one_row(status)

    @mapped
    async def file_chunks(self, file_id: str) -> list[StoredChunk]:
        rows = await self.pool.fetch(
            "SELECT n, page, text, vector FROM file_chunks WHERE file_id = $1 ORDER BY n",
            file_id,
        )
        return [StoredChunk(*row) for row in rows]

    @mapped
    async def attach_files(self, chat_id: str, file_ids: list[str]) -> None:
        await self.pool.executemany(
            "INSERT INTO chat_files (chat_id, file_id, attached_at)"
            f" VALUES ($1, $2, {NOW}) ON CONFLICT DO NOTHING",
            [(chat_id, file_id) for file_id in file_ids],
        )

    @mapped
    async def chat_files(self, chat_ids: list[str]) -> dict[str, list[FileRecord]]:
        if not chat_ids:
            return {}
        columns = ", ".join(f"f.{c.strip()}" for c in FILE_COLUMNS.split(","))
        rows = await self.pool.fetch(
            f"SELECT cf.chat_id, {columns} FROM chat_files cf JOIN files f ON f.id = cf.file_id"
            " WHERE cf.chat_id = ANY($1::text[]) ORDER BY cf.attached_at, f.id",
            chat_ids,
        )
        out: dict[str, list[FileRecord]] = {}
        for row in rows:
            out.setdefault(row[0], []).append(file_from_row(tuple(row)[1:]))
        return out

    # -- token usage ----------------------------------------------------------------------

    @mapped
    async def usage(self, user_id: str, since: float = 0.0) -> list[Usage]:
        rows = await self.pool.fetch(
            "SELECT m.model, count(*), sum(m.prompt_tokens), sum(m.completion_tokens),"
            " sum(coalesce(m.reasoning_tokens, 0)), bool_or(coalesce(m.usage_estimated, false))"
            " FROM messages m JOIN chats c ON c.id = m.chat_id"
            " WHERE c.user_id = $1 AND m.role = 'assistant' AND m.model IS NOT NULL"
            " AND m.created_at >= $2 GROUP BY m.model ORDER BY m.model",
            user_id,
            since,
        )
        return [Usage(r[0], int(r[2]), int(r[3]), int(r[4]), bool(r[5]), int(r[1])) for r in rows]

    @mapped
    async def tokens_on(self, day: int, user_id: str) -> int:
        tokens = await self.pool.fetchval(
            "SELECT tokens FROM tokens_by_day WHERE user_id = $1 AND day = $2", user_id, day
        )
        return int(tokens or 0)

    @mapped
    async def tokens_by_user(self, day: int) -> dict[str, int]:
        rows = await self.pool.fetch(
            "SELECT user_id, tokens FROM tokens_by_day WHERE day = $1 AND tokens > 0", day
        )
        return {str(r[0]): int(r[1]) for r in rows}

    # -- accounts ---------------------------------------------------------------------------

    @mapped
    async def add_account(
        self, account: Account, *, admin_if_none: bool = False, invite: str | None = None
    ) -> Account:
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", ADMINS_LOCK_ID)
            has_admin = bool(
                await conn.fetchval("SELECT exists(SELECT 1 FROM accounts WHERE role = 'admin')")
            )
            if admin_if_none and not has_admin:
                account = replace(account, role="admin")
            try:
                await conn.execute(
                    f"INSERT INTO accounts ({ACCOUNT_COLUMNS})"
                    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                    *account_params(account),
                )
            except asyncpg.UniqueViolationError as exc:
                raise taken("this email or identity") from exc
            if invite is not None and has_admin:
                status = await conn.execute(
                    "UPDATE invites SET used_by = $1, used_at = $2 WHERE code_hash = $3"
                    f" AND used_by IS NULL AND expires_at > {NOW}",
                    account.id,
                    account.created_at,
                    invite,
                )
                if not _one_row(status):
                    raise bad_invite()
            return account

    @mapped
    async def get_account(self, account_id: str) -> Account | None:
        return await self._account("id = $1", account_id)

    @mapped
    async def account_by_email(self, email: str) -> Account | None:
        return await self._account("email = $1", email)

    @mapped
    async def account_by_subject(self, issuer: str, subject: str) -> Account | None:
        return await self._account("issuer = $1 AND subject = $2", issuer, subject)

    async def _account(self, where: str, *params: Any) -> Account | None:
        row = await self.pool.fetchrow(
            f"SELECT {ACCOUNT_COLUMNS} FROM accounts WHERE {where}", *params
        )
        return account_from_row(row) if row else None

    @mapped
    async def list_accounts(self, limit: int = 1000) -> list[Account]:
        rows = await self.pool.fetch(
            f"SELECT {ACCOUNT_COLUMNS} FROM accounts ORDER BY created_at, id LIMIT $1", limit
        )
        return [account_from_row(row) for row in rows]

    @mapped
    async def has_admin(self) -> bool:
        return bool(
            await self.pool.fetchval("SELECT exists(SELECT 1 FROM accounts WHERE role = 'admin')")
        )

    @mapped
    async def update_account(self, account_id: str, change: AccountChange) -> Account | None:
        sets, params = account_change_sql(change, "$")
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", ADMINS_LOCK_ID)
            if sets:
                status = await conn.execute(
                    f"UPDATE accounts SET {', '.join(sets)} WHERE id = ${len(params) + 1}",
                    *params,
                    account_id,
                )
                if not _one_row(status):
                    return None
                admins = await conn.fetchval(
                    "SELECT count(*) FROM accounts WHERE role = 'admin' AND NOT disabled"
                )
                if admins == 0:
                    raise no_admin_left()
            if change.disabled:
                await conn.execute("DELETE FROM sessions WHERE account_id = $1", account_id)
            row = await conn.fetchrow(
                f"SELECT {ACCOUNT_COLUMNS} FROM accounts WHERE id = $1", account_id
            )
            return account_from_row(row) if row else None

    # -- sessions and API keys --------------------------------------------------------------

    @mapped
    async def add_session(self, token_hash: str, account_id: str, expires_at: float) -> None:
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(f"DELETE FROM sessions WHERE expires_at <= {NOW}")
            await conn.execute(
                "INSERT INTO sessions (token_hash, account_id, created_at, expires_at)"
                f" VALUES ($1, $2, {NOW}, $3)",
                token_hash,
                account_id,
                expires_at,
            )

    @mapped
    async def session_account(self, token_hash: str) -> Account | None:
        columns = ", ".join(f"a.{c.strip()}" for c in ACCOUNT_COLUMNS.split(","))
        row = await self.pool.fetchrow(
            f"SELECT {columns} FROM sessions s JOIN accounts a ON a.id = s.account_id"
            f" WHERE s.token_hash = $1 AND s.expires_at > {NOW}",
            token_hash,
        )
        return account_from_row(row) if row else None

    @mapped
    async def delete_session(self, token_hash: str) -> bool:
        return _one_row(
            await self.pool.execute("DELETE FROM sessions WHERE token_hash = $1", token_hash)
        )

    @mapped
    async def add_api_key(self, key: ApiKey, key_hash: str) -> None:
        await self.pool.execute(
            f"INSERT INTO api_keys ({API_KEY_COLUMNS}, key_hash) VALUES ($1, $2, $3, $4, $5, $6)",
            key.id,
            key.user_id,
            key.name,
            key.prefix,
            key.created_at,
            key_hash,
        )

    @mapped
    async def api_key_account(self, key_hash: str) -> Account | None:
        columns = ", ".join(f"a.{c.strip()}" for c in ACCOUNT_COLUMNS.split(","))
        row = await self.pool.fetchrow(
            f"SELECT {columns} FROM api_keys k JOIN accounts a ON a.id = k.account_id"
            " WHERE k.key_hash = $1",
            key_hash,
        )
        return account_from_row(row) if row else None

    @mapped
    async def list_api_keys(self, account_id: str) -> list[ApiKey]:
        rows = await self.pool.fetch(
            f"SELECT {API_KEY_COLUMNS} FROM api_keys WHERE account_id = $1 ORDER BY created_at, id",
            account_id,
        )
        return [api_key_from_row(row) for row in rows]

    @mapped
    async def revoke_api_key(self, account_id: str, key_id: str) -> bool:
        status = await self.pool.execute(
            "DELETE FROM api_keys WHERE id = $1 AND account_id = $2", key_id, account_id
        )
        return _one_row(status)

    @mapped
    async def add_invite(self, code_hash: str, created_by: str, expires_at: float) -> None:
        await self.pool.execute(
            "INSERT INTO invites (code_hash, created_by, created_at, expires_at)"
            f" VALUES ($1, $2, {NOW}, $3)",
            code_hash,
            created_by,
            expires_at,
        )

    @mapped
    async def invite_usable(self, code_hash: str) -> bool:
        found = await self.pool.fetchval(
            "SELECT 1 FROM invites WHERE code_hash = $1 AND used_by IS NULL"
            f" AND expires_at > {NOW}",
            code_hash,
        )
        return found is not None

    # -- knowledge collections ------------------------------------------------------------

    @mapped
    async def add_collection(self, record: CollectionRecord) -> None:
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(
                f"INSERT INTO collections ({COLLECTION_COLUMNS}) VALUES ($1, $2, $3, $4, $5)",
                record.id,
                record.owner,
                record.name,
                record.description,
                record.created_at,
            )
            await _write_shares(conn, record)

    async def _with_shares(self, rows: list[Any]) -> list[CollectionRecord]:
        if not rows:
            return []
        ids = [row[0] for row in rows]
        shares: dict[str, list[str]] = {}
        groups: dict[str, list[str]] = {}
        for sql, into in ((SQL_SHARES, shares), (SQL_GROUP_SHARES, groups)):
            ordered = numbered(sql.replace("= ANY_OF", "= ANY(?::text[])")) + " ORDER BY 2"
            for collection_id, who in await self.pool.fetch(ordered, ids):
                into.setdefault(collection_id, []).append(who)
        return [
            collection_from_row(tuple(r), shares.get(r[0], ()), groups.get(r[0], ())) for r in rows
        ]

    @mapped
    async def get_collection(self, collection_id: str) -> CollectionRecord | None:
        rows = await self.pool.fetch(numbered(SQL_GET_COLLECTION), collection_id)
        found = await self._with_shares(rows)
        return found[0] if found else None

    @mapped
    async def list_collections(self, user_id: str) -> list[CollectionRecord]:
        rows = await self.pool.fetch(numbered(SQL_LIST_COLLECTIONS), user_id, user_id, user_id)
        return await self._with_shares(rows)

    @mapped
    async def update_collection(self, record: CollectionRecord) -> None:
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(
                "UPDATE collections SET name = $1, description = $2 WHERE id = $3",
                record.name,
                record.description,
                record.id,
            )
            for table in ("collection_shares", "collection_group_shares"):
                await conn.execute(f"DELETE FROM {table} WHERE collection_id = $1", record.id)
            await _write_shares(conn, record)

    @mapped
    async def delete_collection(self, collection_id: str) -> bool:
        # shares and documents go with it (ON DELETE CASCADE)
        status = await self.pool.execute("DELETE FROM collections WHERE id = $1", collection_id)
        return _one_row(status)

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
        async with self.pool.acquire() as conn, conn.transaction():
            # the collection's row locked: concurrent imports into it count in turn
            found = await conn.fetchval(
                "SELECT 1 FROM collections WHERE id = $1 FOR UPDATE", collection_id
            )
            if found is None:
                raise NotFound("no such collection")
            counted = await conn.fetchval(numbered(SQL_COUNT_DOCUMENTS), collection_id)
            stored = limit_documents(records, int(counted or 0), max_documents)
            await conn.executemany(
                numbered(SQL_ADD_DOCUMENT),
                [(*document_params(d), indexer or None) for d in stored],
            )
        return stored

    @mapped
    async def fail_orphaned_documents(
        self, error: str, created_before: float
    ) -> list[tuple[str, str]]:
        rows = await self.pool.fetch(
            numbered(SQL_SWEEP_DOCUMENTS.replace("NOW", NOW)), error, created_before
        )
        return [(row[0], row[1]) for row in rows]

    @mapped
    async def ready_documents(self, document_ids: Sequence[str]) -> set[str]:
        if not document_ids:
            return set()
        rows = await self.pool.fetch(
            "SELECT id FROM collection_documents WHERE id = ANY($1::text[]) AND status = 'ready'",
            list(dict.fromkeys(document_ids)),
        )
        return {row[0] for row in rows}

    @mapped
    async def finish_document(self, record: DocumentRecord) -> None:
        await self.pool.execute(numbered(SQL_FINISH_DOCUMENT), *finish_document_params(record))

    @mapped
    async def get_document(self, document_id: str) -> DocumentRecord | None:
        row = await self.pool.fetchrow(numbered(SQL_GET_DOCUMENT), document_id)
        return document_from_row(tuple(row)) if row else None

    @mapped
    async def list_documents(
        self, collection_id: str, import_id: str | None = None
    ) -> list[DocumentRecord]:
        if import_id is None:
            rows = await self.pool.fetch(numbered(SQL_LIST_DOCUMENTS), collection_id)
        else:
            rows = await self.pool.fetch(numbered(SQL_IMPORT_DOCUMENTS), collection_id, import_id)
        return [document_from_row(tuple(row)) for row in rows]

    @mapped
    async def import_progress(
        self, collection_id: str, import_id: str
    ) -> tuple[int, int, list[DocumentRecord]]:
        counts = await self.pool.fetchrow(numbered(SQL_IMPORT_COUNTS), collection_id, import_id)
        total, done = (int(counts[0]), int(counts[1])) if counts else (0, 0)
        if not total:
            return 0, 0, []
        failed = await self.pool.fetch(numbered(SQL_IMPORT_FAILED), collection_id, import_id)
        return total, done, [document_from_row(tuple(row)) for row in failed]

    @mapped
    async def delete_document(self, document_id: str) -> bool:
        status = await self.pool.execute(
            "DELETE FROM collection_documents WHERE id = $1", document_id
        )
        return _one_row(status)

    # -- groups -------------------------------------------------------------------------------

    @mapped
    async def add_group(self, record: GroupRecord) -> None:
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(
                f"INSERT INTO user_groups ({GROUP_COLUMNS}) VALUES ($1, $2, $3)",
                record.id,
                record.name,
                record.created_at,
            )
            await conn.executemany(
                "INSERT INTO user_group_members (group_id, user_id) VALUES ($1, $2)",
                [(record.id, user) for user in record.members],
            )

    async def _with_members(self, rows: list[Any]) -> list[GroupRecord]:
        if not rows:
            return []
        members: dict[str, list[str]] = {}
        for group_id, user in await self.pool.fetch(
            "SELECT group_id, user_id FROM user_group_members WHERE group_id = ANY($1::text[])"
            " ORDER BY user_id",
            [row[0] for row in rows],
        ):
            members.setdefault(group_id, []).append(user)
        return [GroupRecord(r[0], r[1], r[2], tuple(members.get(r[0], ()))) for r in rows]

    @mapped
    async def get_group(self, group_id: str) -> GroupRecord | None:
        rows = await self.pool.fetch(
            f"SELECT {GROUP_COLUMNS} FROM user_groups WHERE id = $1", group_id
        )
        found = await self._with_members(list(rows))
        return found[0] if found else None

    @mapped
    async def list_groups(self, member: str | None = None) -> list[GroupRecord]:
        if member is None:
            rows = await self.pool.fetch(f"SELECT {GROUP_COLUMNS} FROM user_groups ORDER BY name")
        else:
            rows = await self.pool.fetch(
                f"SELECT {GROUP_COLUMNS} FROM user_groups WHERE id IN"
                " (SELECT group_id FROM user_group_members WHERE user_id = $1) ORDER BY name",
                member,
            )
        return await self._with_members(list(rows))

    @mapped
    async def update_group(self, record: GroupRecord) -> bool:
        async with self.pool.acquire() as conn, conn.transaction():
            status = await conn.execute(
                "UPDATE user_groups SET name = $1 WHERE id = $2", record.name, record.id
            )
            if not _one_row(status):
                return False
            await conn.execute("DELETE FROM user_group_members WHERE group_id = $1", record.id)
            await conn.executemany(
                "INSERT INTO user_group_members (group_id, user_id) VALUES ($1, $2)",
                [(record.id, user) for user in record.members],
            )
            return True

    @mapped
    async def delete_group(self, group_id: str) -> bool:
        # members and the collections' shares with it go with it (ON DELETE CASCADE)
        status = await self.pool.execute("DELETE FROM user_groups WHERE id = $1", group_id)
        return _one_row(status)


async def _write_shares(conn: asyncpg.Connection, record: CollectionRecord) -> None:
    await conn.executemany(
        "INSERT INTO collection_shares (collection_id, user_id) VALUES ($1, $2)",
        [(record.id, user) for user in record.shared],
    )
    await conn.executemany(
        "INSERT INTO collection_group_shares (collection_id, group_id) VALUES ($1, $2)",
        [(record.id, group) for group in record.groups],
    )


_INSERT_MESSAGE = (
    f"INSERT INTO messages ({MESSAGE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"
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


async def _nothing_to_reset(conn: asyncpg.Connection) -> None:
    """A connection goes back to the pool as it is: this store leaves no session state
    on one (no SET, LISTEN, cursors or session advisory locks; transactions always
    end), and asyncpg's default reset costs a round trip per query."""


def _params(message: StoredMessage) -> tuple[Any, ...]:
    return message_params(message, message.sources)


def _message(row: Any) -> StoredMessage:
    return message_from_row(row, row[6], row[10], row[11])


def _one_row(status: str) -> bool:
    """Whether a command tag (`INSERT 0 1`, `DELETE 1`) says one row."""
    return status.endswith(" 1")


def numbered(sql: str) -> str:
    """`?` placeholders as PostgreSQL's `$1`, `$2`, … (the shared queries use `?`)."""
    parts = sql.split("?")
    return parts[0] + "".join(f"${n}{part}" for n, part in enumerate(parts[1:], start=1))
