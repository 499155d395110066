"""Shared chats and exports (PROTOCOL §15): what a share link shows is a snapshot of
the chat taken when it was shared (or shared again), kept in the store and read from
it on every request — so a share taken back answers 404 on every process at once.

Only a chat's owner shares it, takes its share back, lists their shares or exports
a chat: every one of these goes through the chat service's `open_chat` (and so
`authorize`). Reading a share needs nothing but its id."""

from __future__ import annotations

import dataclasses
import secrets
import time
from dataclasses import dataclass
from typing import Any

from ..errors import BadRequest, NotFound
from ..store import Chat, FileRecord, ShareRecord, StoredMessage
from .service import ChatService

#: random bytes of a share's id (192 bits: well past guessing)
SHARE_ID_BYTES = 24
#: the longest display name a share may show
MAX_DISPLAY_NAME = 80

_MESSAGE_FIELDS = {f.name for f in dataclasses.fields(StoredMessage)}


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A chat as a share or an export shows it: the chat, its messages in order and its
    files; `shared_at` when it was taken (a live export: now), `display_name` the
    owner's name it may show (None: none)."""

    chat: Chat
    messages: list[StoredMessage]
    files: list[FileRecord]
    shared_at: float
    display_name: str | None = None


class Shares:
    """Share, unshare, list, read and export chats, over the chat service's store."""

    def __init__(self, chats: ChatService) -> None:
        self.chats = chats
        self.store = chats.store

    async def share(self, chat_id: str, user_id: str, display_name: Any = None) -> ShareRecord:
        """Share a chat as it is now, or refresh its share under the same id.
        `BadRequest` for a display name that is not a short text; NotFound / Forbidden
        as `open_chat`."""
        name = _display_name(display_name)
        chat, messages, files = await self.chats.open_chat(chat_id, user_id)
        now = time.time()
        return await self.store.put_share(
            ShareRecord(
                id=secrets.token_urlsafe(SHARE_ID_BYTES),
                chat_id=chat.id,
                user_id=chat.user_id,
                title=chat.title,
                created_at=now,
                updated_at=now,
                display_name=name,
                snapshot=_frozen(chat, messages, files),
            )
        )

    async def unshare(self, chat_id: str, user_id: str) -> None:
        """Take a chat's share back (nothing when it had none). NotFound / Forbidden."""
        await self.chats.owned_chat(chat_id, user_id)
        await self.store.delete_share(chat_id)

    async def of_user(self, user_id: str) -> list[ShareRecord]:
        """The user's shares, the latest shared first (without their snapshots)."""
        return await self.store.list_shares(user_id)

    async def shared(self, share_id: str) -> Snapshot:
        """What a share link shows. NotFound when there is no such share (any more)."""
        share = await self.store.get_share(share_id)
        if share is None or share.snapshot is None:
            raise NotFound("this chat is not shared (any more)")
        return _thawed(share)

    async def export(self, chat_id: str, user_id: str) -> Snapshot:
        """A chat as it is now, for its owner. NotFound / Forbidden."""
        chat, messages, files = await self.chats.open_chat(chat_id, user_id)
        return Snapshot(chat, messages, files, time.time())


def _display_name(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value.strip()) > MAX_DISPLAY_NAME:
        raise BadRequest(f"displayName must be a text of at most {MAX_DISPLAY_NAME} characters")
    return " ".join(value.split()) or None


def _frozen(chat: Chat, messages: list[StoredMessage], files: list[FileRecord]) -> dict[str, Any]:
    """A chat as the store keeps a snapshot of it (JSON)."""
    return {
        "chat": dataclasses.asdict(chat),
        "messages": [dataclasses.asdict(m) for m in messages],
        "files": [{"id": f.id, "name": f.name} for f in files],
    }


def _thawed(share: ShareRecord) -> Snapshot:
    """A stored snapshot back as records (fields a later server does not know left out)."""
    data = share.snapshot or {}
    chat = Chat(**data["chat"])
    messages = [
        StoredMessage(**{k: v for k, v in m.items() if k in _MESSAGE_FIELDS})
        for m in data["messages"]
    ]
    files = [
        FileRecord(id=f["id"], user_id="", name=f["name"], kind="", size=0, created_at=0.0)
        for f in data.get("files", [])
    ]
    return Snapshot(chat, messages, files, share.updated_at, share.display_name)
