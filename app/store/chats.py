"""Chats, their messages and the Responses API's answers: the tables and their SQL."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import groupby
from operator import itemgetter
from typing import Any

from .records import Chat, Checkpoint, Saved, StoredMessage, StoredResponse, StreamingAnswer
from .sql import Connection, Database, mapped, not_yours, taken

CHAT_COLUMNS = "id, user_id, title, focus_mode, created_at"
MESSAGE_COLUMNS = (
    "id, chat_id, role, content, reasoning, rewritten, sources, status, reply_to, created_at"
)
#: what is read of a message: the inserted columns, then what its end saved
MESSAGE_SELECT = MESSAGE_COLUMNS + ", steps, error, model, truncated"
#: `MESSAGE_SELECT` of `messages m`, then the text and reasoning of a running answer's
#: parts, a row each (`_folded`): one statement reads a message and its parts alike
FOLDED_SELECT = ", ".join(f"m.{c.strip()}" for c in MESSAGE_SELECT.split(","))
FOLDED_SELECT += ", p.content, p.reasoning FROM {messages} m LEFT JOIN answer_parts p"
FOLDED_SELECT += " ON m.status = 'streaming' AND p.answer_id = m.id"
PARTS_ORDER = "p.content_from, p.reasoning_from"
INSERT_MESSAGE = f"INSERT INTO messages ({MESSAGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"

#: the columns of a message but its ids, as SQLite's first table has them: the rebuild
#: that gives it text ids (migration 2) keeps them as they were
SQLITE_MESSAGE_FIELDS = """\
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        reasoning TEXT NOT NULL DEFAULT '',
        rewritten TEXT,
        sources TEXT NOT NULL DEFAULT '[]',
        status TEXT NOT NULL,"""

#: the schema's changes, by migration number (the two first differ by dialect: SQLite
#: rebuilds its tables where PostgreSQL alters a column's type)
MIGRATIONS: dict[int, str | dict[str, str]] = {
    1: {
        "sqlite": f"""
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
{SQLITE_MESSAGE_FIELDS}
        reply_to INTEGER,
        created_at REAL NOT NULL
    );
    CREATE INDEX IF NOT EXISTS messages_by_chat ON messages (chat_id, created_at, id);
    """,
        "postgresql": """
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
    },
    # 2: opaque text ids (existing integer ids become their decimal text), the
    # answers a sweeper looks for
    2: {
        "sqlite": f"""
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
{SQLITE_MESSAGE_FIELDS}
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
    """,
        "postgresql": """
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
    """,
    },
    # 4: what each answer cost, in tokens
    4: """
    ALTER TABLE messages ADD COLUMN model TEXT;
    ALTER TABLE messages ADD COLUMN prompt_tokens INTEGER;
    ALTER TABLE messages ADD COLUMN completion_tokens INTEGER;
    ALTER TABLE messages ADD COLUMN reasoning_tokens INTEGER;
    ALTER TABLE messages ADD COLUMN usage_estimated {bool};
    """,
    # 5: an answer's progress lines and, when it failed, its error (JSON)
    5: """
    ALTER TABLE messages ADD COLUMN steps {json};
    ALTER TABLE messages ADD COLUMN error {json};
    """,
    # 10: what a Responses API answer keeps beside it: its request's echo, the answer it
    # continued, and what its stream showed beyond the text (JSON)
    10: """
    CREATE TABLE responses (
        answer_id TEXT PRIMARY KEY REFERENCES messages (id) ON DELETE CASCADE,
        previous_id TEXT,
        request {json} NOT NULL,
        outcome {json}
    );
    """,
    # 13: an answer cut at the model's output cap (llm.max_output_tokens)
    13: """
    ALTER TABLE messages ADD COLUMN truncated {bool};
    """,
    # 15: what the checkpoints of a running answer added, a row each (its text goes
    # after the message's own and the parts before it, in the order of where each
    # starts), folded into the message when the answer ends
    15: """
    CREATE TABLE answer_parts (
        answer_id TEXT NOT NULL REFERENCES messages (id) ON DELETE CASCADE,
        content_from {bigint} NOT NULL,
        reasoning_from {bigint} NOT NULL,
        content TEXT NOT NULL,
        reasoning TEXT NOT NULL,
        PRIMARY KEY (answer_id, content_from, reasoning_from)
    );
    """,
}


def chat_from_row(row: Any) -> Chat:
    """A row of `CHAT_COLUMNS` (tuple or record) as a `Chat`."""
    return Chat(
        id=str(row[0]), user_id=str(row[1]), title=row[2], focus_mode=row[3], created_at=row[4]
    )


async def insert_chat(tx: Connection, chat: Chat) -> bool:
    """Insert `chat`'s row, unless a chat of its id is there; whether it was inserted."""
    inserted = await tx.execute(
        "INSERT INTO chats (id, user_id, title, focus_mode, created_at)"
        " VALUES (?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
        chat.id,
        chat.user_id,
        chat.title,
        chat.focus_mode,
        chat.created_at,
    )
    return inserted == 1


def message_from_row(
    row: Any,
    sources: list[dict[str, Any]],
    steps: list[str] | None = None,
    error: dict[str, str] | None = None,
) -> StoredMessage:
    """A row of `MESSAGE_SELECT` as a `StoredMessage`, with its JSON already decoded."""
    return StoredMessage(
        id=str(row[0]),
        chat_id=str(row[1]),
        role=row[2],
        content=row[3],
        reasoning=row[4],
        rewritten=row[5],
        sources=sources,
        status=row[7],
        reply_to=str(row[8]) if row[8] is not None else None,
        created_at=row[9],
        steps=steps or [],
        error=error,
        model=row[12] if len(row) > 12 else None,
        truncated=bool(row[13]) if len(row) > 13 else False,
    )


def message_params(message: StoredMessage, sources: Any) -> tuple[Any, ...]:
    """The values of `MESSAGE_COLUMNS` for an insert, with the sources already encoded."""
    return (
        message.id,
        message.chat_id,
        message.role,
        message.content,
        message.reasoning,
        message.rewritten,
        sources,
        message.status,
        message.reply_to,
        message.created_at,
    )


class ChatTables:
    """The chats' part of a `Store` (see `Store` for each method's contract)."""

    db: Database

    def _message(self, row: Any) -> StoredMessage:
        unjson = self.db.dialect.unjson
        return message_from_row(row, unjson(row[6]), unjson(row[10]), unjson(row[11]))

    def _params(self, message: StoredMessage) -> tuple[Any, ...]:
        return message_params(message, self.db.dialect.json(message.sources))

    @mapped
    async def get_chat(self, chat_id: str) -> Chat | None:
        row = await self.db.fetchrow(f"SELECT {CHAT_COLUMNS} FROM chats WHERE id = ?", chat_id)
        return chat_from_row(row) if row else None

    @mapped
    async def set_title(self, chat_id: str, title: str) -> None:
        await self.db.execute("UPDATE chats SET title = ? WHERE id = ?", title, chat_id)

    @mapped
    async def list_chats(self, user_id: str, limit: int = 100) -> list[Chat]:
        rows = await self.db.fetch(
            f"SELECT {CHAT_COLUMNS} FROM chats WHERE user_id = ?"
            " ORDER BY created_at DESC, id DESC LIMIT ?",
            user_id,
            limit,
        )
        return [chat_from_row(row) for row in rows]

    @mapped
    async def delete_chat(self, chat_id: str) -> bool:
        # its messages and attached files go with it (ON DELETE CASCADE)
        return await self.db.execute("DELETE FROM chats WHERE id = ?", chat_id) == 1

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
        async with self.db.transaction() as tx:
            created = await insert_chat(tx, chat)
            if not created:
                owner = await tx.fetchval("SELECT user_id FROM chats WHERE id = ?", chat.id)
                if owner != chat.user_id:
                    raise not_yours()
            try:
                if regenerate:
                    await tx.execute(
                        "DELETE FROM messages WHERE chat_id = ? AND (created_at, id) > (?, ?)",
                        question.chat_id,
                        question.created_at,
                        question.id,
                    )
                    await tx.execute(
                        "UPDATE messages SET content = ?, rewritten = NULL, sources = '[]'"
                        " WHERE id = ?",
                        question.content,
                        question.id,
                    )
                    await tx.execute(INSERT_MESSAGE, *self._params(answer))
                else:
                    await tx.executemany(
                        INSERT_MESSAGE, [self._params(question), self._params(answer)]
                    )
            except self.db.unique_violation as exc:
                raise taken("message.messageId") from exc
            if files:
                await tx.executemany(
                    "INSERT INTO chat_files (chat_id, file_id, attached_at)"
                    " VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                    [(chat.id, file_id, question.created_at) for file_id in files],
                )
            return created

    @mapped
    async def set_sources(self, message_id: str, sources: list[dict[str, Any]]) -> None:
        await self.db.execute(
            "UPDATE messages SET sources = ? WHERE id = ?",
            self.db.dialect.json(sources),
            message_id,
        )

    @mapped
    async def finish_answer(
        self, answer_id: str, saved: Saved, *, only_streaming: bool = False
    ) -> bool:
        json = self.db.dialect.json
        async with self.db.transaction() as tx:
            changed = (
                await tx.execute(
                    "UPDATE messages SET content = ?, reasoning = ?, status = ?, steps = ?,"
                    " error = ?, truncated = ? WHERE id = ?"
                    + (" AND status = 'streaming'" if only_streaming else ""),
                    saved.content,
                    saved.reasoning,
                    saved.status,
                    json(saved.steps),
                    json(saved.error),
                    saved.truncated,
                    answer_id,
                )
                == 1
            )
            if changed:  # the answer is whole in its row now
                await tx.execute("DELETE FROM answer_parts WHERE answer_id = ?", answer_id)
            if changed and saved.usage is not None:
                u = saved.usage
                # what this save adds to the user's day (nothing when saved before)
                await tx.execute(
                    "INSERT INTO tokens_by_day (user_id, day, tokens)"
                    " SELECT c.user_id, {m_day},"
                    " {greatest}(? - coalesce(m.prompt_tokens + m.completion_tokens, 0), 0)"
                    " FROM messages m JOIN chats c ON c.id = m.chat_id WHERE m.id = ?"
                    " ON CONFLICT (user_id, day) DO UPDATE"
                    " SET tokens = tokens_by_day.tokens + excluded.tokens",
                    u.total_tokens,
                    answer_id,
                )
                await tx.execute(
                    "UPDATE messages SET model = ?, prompt_tokens = ?, completion_tokens = ?,"
                    " reasoning_tokens = ?, usage_estimated = ? WHERE id = ?",
                    u.model,
                    u.prompt_tokens,
                    u.completion_tokens,
                    u.reasoning_tokens,
                    u.estimated,
                    answer_id,
                )
            if changed and saved.question_id is not None and saved.rewritten is not None:
                await tx.execute(
                    "UPDATE messages SET rewritten = ? WHERE id = ?",
                    saved.rewritten,
                    saved.question_id,
                )
            if changed and saved.question_id is not None and saved.sources is not None:
                await tx.execute(
                    "UPDATE messages SET sources = ? WHERE id = ?",
                    json(saved.sources),
                    saved.question_id,
                )
            return changed

    @mapped
    async def checkpoint_answers(self, progress: Sequence[Checkpoint]) -> None:
        # what was added goes in a row of its own, keyed by where it starts: a row is
        # written once, not rewritten with all of the answer's text at every
        # checkpoint (so what a checkpoint costs the database does not grow with the
        # answers' length), and the same checkpoint sent again finds its part there
        # and adds nothing; an answer whose stored text is not known (`content_from`
        # -1) is sent whole, its parts dropped. A part is added only while its answer
        # runs, under the lock of the answer's row: the end's save (or a whole
        # rewrite) waits for the checkpoint, and its delete then sees the part, or
        # the checkpoint waits for it, and finds the answer ended (PostgreSQL; one
        # writer at a time in SQLite)
        json = self.db.dialect.json
        added = [c for c in progress if c.content_from >= 0 and (c.content or c.reasoning)]
        steps = [c for c in progress if c.content_from >= 0 and c.steps_changed]
        whole = [c for c in progress if c.content_from < 0]
        async with self.db.transaction() as tx:
            if added:
                await tx.executemany(
                    "INSERT INTO answer_parts"
                    " (answer_id, content_from, reasoning_from, content, reasoning)"
                    " SELECT ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM messages"
                    " WHERE id = ? AND status = 'streaming'{for_update})"
                    " ON CONFLICT DO NOTHING",
                    [
                        (
                            c.answer_id,
                            c.content_from,
                            c.reasoning_from,
                            c.content,
                            c.reasoning,
                            c.answer_id,
                        )
                        for c in added
                    ],
                )
            if steps:
                await tx.executemany(
                    "UPDATE messages SET steps = ? WHERE id = ? AND status = 'streaming'",
                    [(json(c.steps), c.answer_id) for c in steps],
                )
            if whole:
                await tx.executemany(
                    "UPDATE messages SET content = ?, reasoning = ?, steps = ? WHERE id = ?"
                    " AND status = 'streaming'",
                    [(c.content, c.reasoning, json(c.steps), c.answer_id) for c in whole],
                )
                await tx.executemany(
                    "DELETE FROM answer_parts WHERE answer_id = ?", [(c.answer_id,) for c in whole]
                )

    def _folded(self, rows: Sequence[Any]) -> list[StoredMessage]:
        """The messages of rows of `FOLDED_SELECT` (a message's rows together, its parts
        in order): a running answer with what its checkpoints added after its text."""
        messages = []
        for _, together in groupby(rows, key=itemgetter(0)):
            first, *rest = together
            message = self._message(first)
            parts = [row for row in (first, *rest) if row[-2] is not None]
            if parts:
                message = replace(
                    message,
                    content=message.content + "".join(row[-2] for row in parts),
                    reasoning=message.reasoning + "".join(row[-1] for row in parts),
                )
            messages.append(message)
        return messages

    @mapped
    async def get_message(self, message_id: str) -> StoredMessage | None:
        rows = await self.db.fetch(
            f"SELECT {FOLDED_SELECT.format(messages='messages')}"
            f" WHERE m.id = ? ORDER BY {PARTS_ORDER}",
            message_id,
        )
        return self._folded(rows)[0] if rows else None

    @mapped
    async def list_messages(self, chat_id: str) -> list[StoredMessage]:
        rows = await self.db.fetch(
            f"SELECT {FOLDED_SELECT.format(messages='messages')} WHERE m.chat_id = ?"
            f" ORDER BY m.created_at, m.id, {PARTS_ORDER}",
            chat_id,
        )
        return self._folded(rows)

    @mapped
    async def delete_turn(self, answer_id: str) -> bool:
        async with self.db.transaction() as tx:
            row = await tx.fetchrow(
                "DELETE FROM messages WHERE id = ? AND role = 'assistant'"
                " RETURNING chat_id, reply_to",
                answer_id,
            )
            if row is None:
                return False
            chat_id, question_id = row[0], row[1]
            if question_id is not None:
                await tx.execute("DELETE FROM messages WHERE id = ?", question_id)
            # the chat's files go with it (ON DELETE CASCADE)
            await tx.execute(
                "DELETE FROM chats WHERE id = ?"
                " AND NOT EXISTS (SELECT 1 FROM messages WHERE chat_id = ?)",
                chat_id,
                chat_id,
            )
            return True

    @mapped
    async def add_response(self, response: StoredResponse) -> None:
        json = self.db.dialect.json
        await self.db.execute(
            "INSERT INTO responses (answer_id, previous_id, request, outcome) VALUES (?, ?, ?, ?)",
            response.answer_id,
            response.previous,
            json(response.request),
            json(response.outcome),
        )

    @mapped
    async def end_response(self, answer_id: str, outcome: list[dict[str, Any]]) -> None:
        await self.db.execute(
            "UPDATE responses SET outcome = ? WHERE answer_id = ?",
            self.db.dialect.json(outcome),
            answer_id,
        )

    @mapped
    async def get_response(self, answer_id: str) -> StoredResponse | None:
        row = await self.db.fetchrow(
            "SELECT answer_id, previous_id, request, outcome FROM responses WHERE answer_id = ?",
            answer_id,
        )
        if row is None:
            return None
        unjson = self.db.dialect.unjson
        return StoredResponse(row[0], unjson(row[2]), row[1], unjson(row[3]))

    @mapped
    async def streaming_answers(
        self,
        created_before: float,
        after: tuple[float, str] | None = None,
        limit: int = 100,
    ) -> list[StreamingAnswer]:
        at, last = after or (-1.0, "")
        rows = await self.db.fetch(
            "SELECT id, chat_id, created_at FROM messages WHERE status = 'streaming'"
            " AND created_at < ? AND (created_at, id) > (?, ?)"
            " ORDER BY created_at, id LIMIT ?",
            created_before,
            at,
            last,
            limit,
        )
        return [StreamingAnswer(str(r[0]), str(r[1]), float(r[2])) for r in rows]
