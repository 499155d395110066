"""Server-Sent Events: `POST /api/chat/sse` and `GET /api/chat/sse/resume`.

Each event goes out as `id: <answerMessageId>:<seq>\\ndata: <json>\\n\\n`; a
`: ping` comment every `server.keepalive_seconds` keeps proxies from closing
an idle stream. The request is validated before the response starts, so a
refusal is an HTTP status with a JSON error body.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from prometheus_client import Counter
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import Response

from ..protocol import Event, parse_chat_request, parse_id, render, render_simple_start
from ..streams import Handle
from .emitter import Emitter
from .http import bind_user, client_identity, count_request, guard, read_json

PING = b": ping\n\n"


def encode(event: Event, fmt: str) -> bytes:
    """One event as SSE bytes (a keep-alive becomes a ping comment)."""
    if not event.seq:
        return PING
    body = render(event, fmt)
    if body is None:
        return b""
    return b"id: %s:%d\ndata: %s\n\n" % (event.message_id.encode(), event.seq, orjson.dumps(body))


class SseEmitter(Emitter):
    """Renders events as SSE bytes. Unlike a WebSocket, an SSE response pulls: its body
    iterates `stream()`, which follows the generation's log and yields one chunk per
    batch of events — no queue between the log and the socket, so a client that falls
    behind gets everything that piled up in one write, and its buffer is the log."""

    def __init__(self, fmt: str, sent: Counter | None = None) -> None:
        super().__init__(fmt)
        self._sent = sent
        self._chunks: list[bytes] = []

    async def open(self, handle: Handle) -> None:
        if self.format == "simple":
            start = render_simple_start(handle.chat_id, handle.answer_id, handle.question)
            self._chunks.append(b"data: %s\n\n" % orjson.dumps(start))

    async def emit(self, events: Sequence[Event]) -> None:
        fmt = self.format
        self._chunks.append(b"".join([encode(event, fmt) for event in events]))
        if self._sent is not None:
            self._sent.inc(len(events))

    def take(self) -> bytes:
        chunk = b"".join(self._chunks)
        self._chunks.clear()
        return chunk

    async def stream(self, service: Any, handle: Handle, after_seq: int) -> AsyncIterator[bytes]:
        await self.open(handle)
        async for batch in service.follow(handle, after_seq):
            await self.emit(batch)
            chunk = self.take()
            if chunk:
                yield chunk


def stream_response(request: Request, handle: Handle, fmt: str, after_seq: int = 0) -> Response:
    service = request.app.state.service
    settings = request.app.state.settings
    metrics = request.app.state.metrics
    emitter = SseEmitter(fmt, metrics.events_sent.labels("sse"))
    connections = metrics.connections_active.labels("sse")

    async def body() -> AsyncIterator[bytes]:
        connections.inc()
        try:
            async for chunk in emitter.stream(service, handle, after_seq):
                yield chunk
        finally:
            connections.dec()

    return EventSourceResponse(
        body(),
        headers={"Cache-Control": "no-cache"},
        ping=settings.server.keepalive_seconds,
        ping_message_factory=lambda: ServerSentEvent(comment="ping", sep="\n"),
        sep="\n",
        # a client that stops reading is let go; the generation goes on, resumable
        send_timeout=settings.stream.client_timeout_seconds,
    )


@guard
async def chat(request: Request) -> Response:
    settings = request.app.state.settings
    body = await read_json(request, settings.limits.max_body_bytes)
    chat_request = parse_chat_request(
        body,
        max_content_chars=settings.limits.max_content_chars,
        max_history_messages=settings.limits.max_history_messages,
        format_override=request.query_params.get("format") or None,
        host=request.headers.get("host", ""),
        transport="sse",
    )
    chat_request = bind_user(request, chat_request, body)
    await count_request(request)
    handle = await request.app.state.service.start(chat_request)
    return stream_response(request, handle, chat_request.format)


@guard
async def resume(request: Request) -> Response:
    params = request.query_params
    chat_id = params.get("chatId")
    user_id = client_identity(request, params.get("userId"))
    last = request.headers.get("last-event-id") or params.get("lastEventId")
    fmt = params.get("format") or "default"
    if fmt not in ("default", "simple"):
        fmt = "default"
    handle, seq = await request.app.state.service.find_resumable(
        parse_id(chat_id, "chatId") if chat_id else None, user_id, last
    )
    return stream_response(request, handle, fmt, seq)
