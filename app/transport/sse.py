"""Server-Sent Events: `POST /api/chat/sse` and `GET /api/chat/sse/resume`.

Each event goes out as `id: <answerMessageId>:<seq>\\ndata: <json>\\n\\n`; a
`: ping` comment every `server.keepalive_seconds` keeps proxies from closing
an idle stream. The request is validated before the response starts, so a
refusal is an HTTP status with a JSON error body.

No block reaches a client's message handler without `data`: clients written like
`@microsoft/fetch-event-source` hand every blank-line-ended block to user code, so
`retry:` rides in the first event's block and a ping is a comment line that no
blank line follows (a comment line inside a block is ignored by every parser).
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson
from starlette.requests import Request
from starlette.responses import Response

from ..events import Event, Handle
from ..ids import parse_id
from ..protocol import FORMATS, Encoder, TokenJson, parse_chat_request, render, render_start
from .http import (
    client_identity,
    count_request,
    count_resume,
    json_errors,
    read_json,
    request_user,
)
from .streaming import StreamResponse

PING = b": ping\n"


class SseEncoder(Encoder[bytes]):
    """Events as SSE bytes, one chunk per batch; an upstream keep-alive becomes a
    ping comment. The first event's block carries `retry:` (how long a browser's
    EventSource waits before it reconnects), on a resume too."""

    name = "sse"

    def __init__(self, fmt: str, retry_ms: int = 2000) -> None:
        self.format = fmt
        self._retry: bytes | None = b"retry: %d\n" % retry_ms  # until the first event
        self._tokens = TokenJson() if fmt == "default" else None

    def preamble(self, handle: Handle) -> bytes | None:
        start = render_start(handle, self.format)
        if start is None:
            return None
        retry, self._retry = self._retry or b"", None
        return retry + b"data: %s\n\n" % orjson.dumps(start)

    def encode(self, events: Sequence[Event]) -> bytes | None:
        if self._retry is not None:
            return self._first(events)
        if len(events) == 1:  # at a model's pace, the usual batch
            return self._one(events[0]) or None
        return b"".join([self._one(event) for event in events]) or None

    def _first(self, events: Sequence[Event]) -> bytes | None:
        """The batch with `retry:` put into its first event's block, if it has one."""
        blocks = [self._one(event) for event in events]
        for i, block in enumerate(blocks):
            if block.startswith(b"id: "):
                blocks[i] = (self._retry or b"") + block
                self._retry = None
                break
        return b"".join(blocks) or None

    def _one(self, event: Event) -> bytes:
        if not event.seq:
            return PING
        if self._tokens is not None:
            token = self._tokens.of(event)
            if token is not None:  # a piece of the answer: its bytes made around the text
                return b"id: %s:%d\ndata: %s\n\n" % (event.message_id.encode(), event.seq, token)
        body = render(event, self.format)
        if body is None:
            return b""
        return b"id: %s\ndata: %s\n\n" % (event.event_id.encode(), orjson.dumps(body))


def stream_response(request: Request, handle: Handle, fmt: str, after_seq: int = 0) -> Response:
    """The generation's events from `after_seq` as an SSE response. A client that
    stops reading is let go; the generation goes on, resumable."""
    state = request.app.state
    encoder = SseEncoder(fmt, state.settings.stream.retry_ms)
    return StreamResponse(
        lambda write: state.service.relay(handle, encoder, after_seq, write),
        connections=state.metrics.connections_active.labels("sse"),
        group=state.streams,
        media_type="text/event-stream; charset=utf-8",
        ping=PING,
        ping_interval=state.settings.server.keepalive_seconds,
        send_timeout=state.settings.stream.client_timeout_seconds,
    )


@json_errors
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
    chat_request = request_user(request, chat_request, body)
    await count_request(request)
    handle = await request.app.state.service.start(chat_request)
    return stream_response(request, handle, chat_request.format)


@json_errors
async def resume(request: Request) -> Response:
    params = request.query_params
    chat_id = params.get("chatId")
    user_id = client_identity(request, params.get("userId"))
    last = request.headers.get("last-event-id") or params.get("lastEventId")
    fmt = params.get("format") or "default"
    if fmt not in FORMATS:
        fmt = "default"
    await count_resume(request)
    service = request.app.state.service
    handle, seq = await service.find_resumable(
        parse_id(chat_id, "chatId") if chat_id else None, user_id, last
    )
    if seq and await service.ended_by(handle, seq):
        # nothing more will come: 204 tells a browser's EventSource not to reconnect
        return Response(status_code=204, headers={"cache-control": "no-cache"})
    return stream_response(request, handle, fmt, seq)
