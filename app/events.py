"""The types every layer shares: a generation's events, its handle, and the names the
protocol gives to event types, statuses and focus modes.

A leaf: it imports nothing of this package, so the protocol, the stream hubs and
the chat service all import it and never each other for these.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Final, Literal, get_args

#: every event type a generation writes (PROTOCOL §3); `keep-alive` is never numbered
EventType = Literal[
    "rewrited",
    "sources",
    "progress",
    "message",
    "reasoning",
    "keep-alive",
    "messageEnd",
    "error",
]
#: how an answer ended (`messageEnd.status`), or that it still runs (`streaming`)
AnswerStatus = Literal["completed", "cancelled", "failed", "streaming"]
#: PROTOCOL §1 `focusMode`
FocusModeName = Literal[
    "webSearch",
    "translator",
    "deepSeek",
    "mathAssistant",
    "writingAssistant",
    "deepResearch",
    "academicSearch",
    "youtubeSearch",
    "redditSearch",
    "wolframAlphaSearch",
]
EVENT_TYPES: Final[tuple[str, ...]] = get_args(EventType)
FOCUS_MODES: Final[tuple[str, ...]] = get_args(FocusModeName)
TERMINAL: Final = frozenset({"messageEnd", "error"})


@dataclass(slots=True)
class Event:
    """One event of a generation. `seq` 0 means unnumbered (keep-alive). Treated as
    immutable, not frozen: one is made per token, and a frozen dataclass takes three
    times as long to make."""

    type: str
    chat_id: str
    message_id: str
    data: dict[str, Any] = field(default_factory=dict)
    seq: int = 0
    ts: float = field(default_factory=time.time)

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL

    @property
    def event_id(self) -> str:
        """`<answerMessageId>:<seq>` (numbered events only carry one on the wire)."""
        return f"{self.message_id}:{self.seq}"


@dataclass(frozen=True, slots=True)
class Handle:
    """What the registry knows of a running generation."""

    chat_id: str
    answer_id: str
    question_id: str
    user_id: str
    question: str
