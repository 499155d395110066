"""The store's records the transports show (chats, messages, files) and `iso`, the
form of their times on the wire: named here, in the service layer, so that no
transport imports the store."""

from __future__ import annotations

from ..store import Chat, FileRecord, StoredMessage
from ..store.base import iso

__all__ = ["Chat", "FileRecord", "StoredMessage", "iso"]
