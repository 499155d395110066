"""A message stream in the simplified format, for server-side code and scripts.

In the spirit of the simplified-format document: `send_start`, `send_info`,
`send_answer`, `send_complete` and `send_error` append messages that are read
back as dicts of `type`, `content`, `timestamp` and `metadata`. It is built on
the server's own events — each `send_*` records the default-format event
(`progress`, `message`, `messageEnd`, `error`) in a generation log, and the
dicts are that log rendered by the simple renderer — so what a script
produces here is exactly what a client of the server would receive.

    stream = MessageStream(question="write a report on Milvus")
    stream.send_start()
    stream.send_info("iteration 1: searching related documents...")
    stream.send_answer("Milvus is a vector database ...")
    stream.send_complete()
    for message in stream.get_messages_as_dicts():
        print(message["type"], message["content"])
"""

from __future__ import annotations

from typing import Any

from .events import Event, Handle
from .protocol import render_default, render_simple, render_simple_start
from .streams import GenerationLog, LogWriter


class MessageStream:
    def __init__(self, *, chat_id: str = "0", message_id: str = "0", question: str = "") -> None:
        self.handle = Handle(
            chat_id=chat_id,
            answer_id=message_id,
            question_id="0",
            user_id="0",
            question=question,
        )
        self.log = GenerationLog(self.handle)
        self._out = LogWriter(self.log)
        self._start: dict[str, Any] | None = None

    def send_start(self, content: str | None = None) -> None:
        """Open the stream (`start`); the content defaults to "processing query: <question>"."""
        start = render_simple_start(
            self.handle.chat_id, self.handle.answer_id, self.handle.question
        )
        if content is not None:
            start["content"] = content
        self._start = start

    def send_info(self, content: str, kind: str = "progress") -> None:
        """A step, status or iteration note (`info`); `kind` is `progress` or `reasoning`."""
        if kind not in ("progress", "reasoning"):
            raise ValueError("kind must be 'progress' or 'reasoning'")
        self._out.emit(kind, data=content)

    def send_answer(self, content: str) -> None:
        """A piece of the answer (`answer`); the pieces concatenate to the answer."""
        self._out.emit("message", data=content)

    def send_complete(self, status: str = "completed") -> None:
        """The end (`complete`), `completed` or `cancelled`."""
        self._out.emit("messageEnd", status=status)

    def send_error(self, content: str, key: str = "INTERNAL") -> None:
        """A terminal error (`error`) with a key from the protocol."""
        self._out.emit("error", key=key, data=content)

    @property
    def events(self) -> list[Event]:
        return list(self.log.events)

    def get_messages_as_dicts(self) -> list[dict[str, Any]]:
        """Every message so far in the simplified format, `start` first."""
        messages = [self._start] if self._start else []
        messages.extend(m for m in (render_simple(e) for e in self.log.events) if m is not None)
        return messages

    def get_events_as_dicts(self) -> list[dict[str, Any]]:
        """The same messages in the default format (as SSE `data:` carries them)."""
        return [render_default(e) for e in self.log.events]
