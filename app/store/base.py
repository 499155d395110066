"""The store interface: chats and their messages.

Ids are decimal strings at this interface (64-bit integers underneath).
`created_at` is Unix seconds (float). Messages of a chat are ordered by
`created_at`, then id (snowflake ids grow with time).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class Chat:
    id: str
    user_id: str
    title: str
    focus_mode: str
    created_at: float

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "userId": self.user_id,
            "title": self.title,
            "focusMode": self.focus_mode,
            "createdAt": iso(self.created_at),
        }


@dataclass(frozen=True, slots=True)
class StoredMessage:
    id: str
    chat_id: str
    role: str  # "user" | "assistant"
    content: str
    created_at: float
    status: str = "completed"  # answers: completed | cancelled | failed | streaming
    reasoning: str = ""
    rewritten: str | None = None
    sources: list[dict[str, Any]] = field(default_factory=list)
    reply_to: str | None = None  # an answer's question

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "chatId": self.chat_id,
            "role": self.role,
            "content": self.content,
            "sources": self.sources,
            "status": self.status,
            "createdAt": iso(self.created_at),
        }
        if self.role == "assistant":
            out["reasoning"] = self.reasoning
            out["questionMessageId"] = self.reply_to
        elif self.rewritten is not None:
            out["rewritten"] = self.rewritten
        return out


#: the column order both backends select in, so one mapping serves both
CHAT_COLUMNS = "id, user_id, title, focus_mode, created_at"
MESSAGE_COLUMNS = (
    "id, chat_id, role, content, reasoning, rewritten, sources, status, reply_to, created_at"
)


def chat_from_row(row: Any) -> Chat:
    """A row of `CHAT_COLUMNS` (tuple or record) as a `Chat`."""
    return Chat(
        id=str(row[0]), user_id=str(row[1]), title=row[2], focus_mode=row[3], created_at=row[4]
    )


def message_from_row(row: Any, sources: list[dict[str, Any]]) -> StoredMessage:
    """A row of `MESSAGE_COLUMNS` as a `StoredMessage`, with its sources already decoded."""
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
    )


def message_params(message: StoredMessage, sources: Any) -> tuple[Any, ...]:
    """The values of `MESSAGE_COLUMNS` for an insert, with the sources already encoded."""
    return (
        int(message.id),
        int(message.chat_id),
        message.role,
        message.content,
        message.reasoning,
        message.rewritten,
        sources,
        message.status,
        int(message.reply_to) if message.reply_to else None,
        message.created_at,
    )


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Store(abc.ABC):
    """Chats and messages. Missing rows are `None`/`False`, never exceptions; a
    backend that cannot be reached raises its driver's error (OSError and the like)."""

    async def open(self) -> None:  # noqa: B027 - optional for backends without setup
        """Connect and create or upgrade the schema."""

    async def close(self) -> None:  # noqa: B027
        """Release connections. Safe to call twice."""

    @abc.abstractmethod
    async def ping(self) -> None:
        """Raise if the backend cannot answer."""

    @abc.abstractmethod
    async def create_chat(self, chat: Chat) -> bool:
        """Insert a chat; False when the id exists already."""

    @abc.abstractmethod
    async def get_chat(self, chat_id: str) -> Chat | None: ...

    @abc.abstractmethod
    async def set_title(self, chat_id: str, title: str) -> None: ...

    @abc.abstractmethod
    async def list_chats(self, user_id: str, limit: int = 100) -> list[Chat]:
        """The user's chats, newest first."""

    @abc.abstractmethod
    async def delete_chat(self, chat_id: str) -> bool:
        """Delete a chat and its messages; False when there was none."""

    @abc.abstractmethod
    async def add_messages(self, messages: list[StoredMessage]) -> None:
        """Insert several messages in one round trip; ids that exist are left alone."""

    @abc.abstractmethod
    async def finish_message(
        self, message_id: str, *, content: str, reasoning: str, status: str
    ) -> None:
        """Set an answer's final content, reasoning and status."""

    @abc.abstractmethod
    async def set_sources(self, message_id: str, sources: list[dict[str, Any]]) -> None: ...

    @abc.abstractmethod
    async def get_message(self, message_id: str) -> StoredMessage | None: ...

    @abc.abstractmethod
    async def list_messages(self, chat_id: str) -> list[StoredMessage]:
        """A chat's messages in order."""

    async def __aenter__(self) -> Store:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
