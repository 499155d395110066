"""WebSocket: `/api/chat/ws` (and `/`). One socket may run several chats at once.

Frames in: chat requests (`type: message`), `cancel`, `resume`, `ping`.
Frames out: one event per text frame, with `eventId`, plus `signal`, `pong`,
`cancelled` and `error` frames. A bad frame is answered with an `error`
frame and the socket stays open.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import orjson
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..errors import AppError, BadRequest
from ..protocol import (
    Event,
    error_body,
    loads,
    parse_chat_request,
    parse_control,
    render,
    render_simple_start,
)
from ..streams import Handle
from .emitter import Emitter

log = logging.getLogger("app.ws")


class SocketWriter:
    """Serialises writes of the relays sharing one socket."""

    def __init__(self, websocket: WebSocket) -> None:
        self.websocket = websocket
        self.lock = asyncio.Lock()

    async def send(self, frames: Sequence[dict[str, Any]]) -> None:
        async with self.lock:
            for frame in frames:
                await self.websocket.send_text(orjson.dumps(frame).decode())


class WebSocketEmitter(Emitter):
    def __init__(self, writer: SocketWriter, fmt: str) -> None:
        super().__init__(fmt)
        self.writer = writer

    async def open(self, handle: Handle) -> None:
        if self.format == "simple":
            await self.writer.send(
                [render_simple_start(handle.chat_id, handle.answer_id, handle.question)]
            )

    async def emit(self, events: Sequence[Event]) -> None:
        frames = []
        fmt = self.format
        for event in events:
            frame = render(event, fmt)
            if frame is None:
                continue
            if event.seq:
                frame["eventId"] = f"{event.message_id}:{event.seq}"
            frames.append(frame)
        if frames:
            await self.writer.send(frames)


async def endpoint(websocket: WebSocket) -> None:
    service = websocket.app.state.service
    settings = websocket.app.state.settings
    await websocket.accept()
    writer = SocketWriter(websocket)
    relays: set[asyncio.Task[None]] = set()

    def follow(handle: Handle, fmt: str, after_seq: int = 0) -> None:
        task = asyncio.create_task(
            _relay(service, handle, WebSocketEmitter(writer, fmt), after_seq)
        )
        relays.add(task)
        task.add_done_callback(relays.discard)

    try:
        await writer.send([{"type": "signal", "data": "open"}])
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            chat_id = None
            try:
                text = message.get("text")
                if text is None:
                    raise BadRequest("binary frames are not accepted: send JSON as text")
                if len(text) > settings.limits.max_body_bytes:
                    raise BadRequest(f"frame is larger than {settings.limits.max_body_bytes} bytes")
                body = loads(text)
                if isinstance(body, dict):
                    chat_id = _chat_id_of(body)
                kind = body.get("type", "message") if isinstance(body, dict) else None
                if kind == "message":
                    request = parse_chat_request(
                        body,
                        max_content_chars=settings.limits.max_content_chars,
                        max_history_messages=settings.limits.max_history_messages,
                        format_override=websocket.query_params.get("format") or None,
                        host=websocket.headers.get("host", ""),
                    )
                    handle = await service.start(request)
                    follow(handle, request.format)
                elif kind == "cancel":
                    control = parse_control(body)
                    if control.chat_id is None:
                        raise BadRequest("cancel needs chatId")
                    handle = await service.cancel(control.chat_id, control.user_id)
                    await writer.send(
                        [
                            {
                                "type": "cancelled",
                                "chatId": handle.chat_id,
                                "messageId": handle.answer_id,
                                "cancelled": True,
                            }
                        ]
                    )
                elif kind == "resume":
                    control = parse_control(body)
                    handle, seq = await service.find_resumable(
                        control.chat_id, control.user_id, control.last_event_id
                    )
                    follow(handle, control.format, seq)
                elif kind == "ping":
                    await writer.send([{"type": "pong"}])
                else:
                    raise BadRequest("type must be one of message, cancel, resume, ping")
            except AppError as exc:
                extra = {"chatId": chat_id} if chat_id else {}
                await writer.send([error_body(exc, **extra)])
    except WebSocketDisconnect:
        pass
    finally:
        for task in relays:
            task.cancel()


async def _relay(service: Any, handle: Handle, emitter: WebSocketEmitter, after_seq: int) -> None:
    try:
        await service.relay(handle, emitter, after_seq)
    except (WebSocketDisconnect, OSError, RuntimeError):
        # the socket went away; the generation goes on and stays resumable
        pass


def _chat_id_of(body: dict[str, Any]) -> str | None:
    message = body.get("message")
    value = message.get("chatId") if isinstance(message, dict) else body.get("chatId")
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and value.isdigit():
        return value
    return None
