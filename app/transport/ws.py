"""WebSocket: `/api/chat/ws` (and `/`). One socket may run several chats at once.

Frames in: chat requests (`type: message`), `cancel`, `resume`, `ping`.
Frames out: one event per text frame, with `eventId`, plus `signal`, `pong`,
`cancelled` and `error` frames. A bad frame is answered with an `error`
frame and the socket stays open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import orjson
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..chores import cancel_and_wait
from ..errors import AppError, BadRequest, RateLimited
from ..events import Event, Handle
from ..ids import parse_id
from ..protocol import (
    Encoder,
    TokenJson,
    error_body,
    loads,
    parse_chat_request,
    parse_control,
    render,
    render_start,
)
from ..serving import TEXT_FRAMES, WriteTexts
from .http import client_identity, count_request, count_resume, request_user, set_user
from .perplexica import picked_model
from .streaming import SERVER_SEND

log = logging.getLogger("app.ws")


class WsEncoder(Encoder[list[bytes]]):
    """Events as WebSocket text frames (one per event, its UTF-8 JSON) with `eventId`;
    an upstream keep-alive becomes a `keep-alive` frame."""

    name = "ws"

    def __init__(self, fmt: str) -> None:
        self.format = fmt
        self._tokens = TokenJson(event_id=True) if fmt == "default" else None

    def preamble(self, handle: Handle) -> list[bytes] | None:
        start = render_start(handle, self.format)
        return None if start is None else [orjson.dumps(start)]

    def encode(self, events: Sequence[Event]) -> list[bytes] | None:
        frames: list[bytes] = []
        fmt, tokens = self.format, self._tokens
        for event in events:
            if tokens is not None and event.seq:
                token = tokens.of(event)
                if token is not None:  # a piece of the answer: made around its text
                    frames.append(token)
                    continue
            frame = render(event, fmt)
            if frame is None:
                continue
            if event.seq:
                frame["eventId"] = event.event_id
            frames.append(orjson.dumps(frame))
        return frames or None


class SocketWriter:
    """Serialises writes of the relays sharing one socket. A write that waits more
    than `timeout` (a client that stopped reading) fails with `WebSocketDisconnect`
    (1008) and the socket is closed: one watch per socket (`watch`) looks for it,
    not a timer per write.

    A write that nothing holds up — no other write waiting, the server's WebSocket
    protocol able to take the frames at once (`serving.TEXT_FRAMES`: open, not
    paused by flow control, no compression) — is done there and then, with no
    wait, no lock and no ASGI message: what a token costs on this socket. Any other
    goes through the server's `send` under the lock, in order behind the ones
    before it."""

    def __init__(self, websocket: WebSocket, timeout: float) -> None:
        self.websocket = websocket
        self.timeout = timeout
        self.lock = asyncio.Lock()
        # frames go to the server's own send (the socket is accepted, and no
        # middleware looks at frames): four wrappers and a state check less each
        self._send = websocket.scope.get(SERVER_SEND, websocket.send)
        frames = websocket.scope.get("extensions", {}).get(TEXT_FRAMES)
        self._write_now: WriteTexts | None = frames["write"] if frames else None
        self._writing: asyncio.Task[Any] | None = None
        self._writing_since: float | None = None
        self._stuck = False

    async def send(self, frames: Sequence[bytes]) -> None:
        """Write `frames` (each one message of UTF-8 text), in order after every
        write before it. Raises `WebSocketDisconnect` for a socket stuck or gone.
        Cancelling is safe: a frame is written whole or not at all."""
        if self.write_now(frames):
            return
        send = self._send
        async with self.lock:
            if self._stuck:
                raise WebSocketDisconnect(1008)
            self._writing = asyncio.current_task()
            self._writing_since = time.monotonic()
            try:
                for frame in frames:
                    await send({"type": "websocket.send", "text": frame.decode()})
            except asyncio.CancelledError:
                # cancelled by `watch` alone: the write is stuck, not the task
                if self._stuck and self._writing is not None and not self._writing.uncancel():
                    raise WebSocketDisconnect(1008) from None
                raise
            finally:
                self._writing_since = None

    def write_now(self, frames: Sequence[bytes]) -> bool:
        """Write `frames` now, if nothing holds them up; else nothing, and False."""
        write = self._write_now
        return write is not None and not self._stuck and not self.lock.locked() and write(frames)

    async def send_json(self, frame: dict[str, Any]) -> None:
        await self.send([orjson.dumps(frame)])

    async def watch(self) -> None:
        """Until the socket ends: every half `timeout`, let go of a write that has
        waited longer than `timeout`, and close the socket."""
        while True:
            await asyncio.sleep(max(self.timeout / 2, 0.5))
            since, writing = self._writing_since, self._writing
            if since is None or writing is None or time.monotonic() - since <= self.timeout:
                continue
            log.info("closing a websocket that stopped reading")
            self._stuck = True
            writing.cancel()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):  # the close frame may be stuck as well
                    await self.websocket.close(1008)
            return


class Session:
    """One WebSocket connection: its writer and the relays it runs — one per answer
    followed: a second resume of an answer replaces its relay, so one socket can never
    multiply the work per token."""

    def __init__(self, websocket: WebSocket) -> None:
        app = websocket.app
        self.websocket = websocket
        self.service = app.state.service
        self.settings = app.state.settings
        self.metrics = app.state.metrics
        self.writer = SocketWriter(websocket, self.settings.stream.client_timeout_seconds)
        self.relays: dict[str, asyncio.Task[None]] = {}  # answer id → its relay
        self._rate = self.settings.limits.ws_messages_per_second
        self._allowance = self._rate
        self._checked = time.monotonic()

    async def follow(self, handle: Handle, fmt: str, after_seq: int = 0) -> None:
        """Relay an answer's events after `after_seq` to this socket (in place of any
        relay of the same answer it had)."""
        answer_id = handle.answer_id
        previous = self.relays.pop(answer_id, None)
        if previous is not None:
            await cancel_and_wait([previous], timeout=5.0)
        task = asyncio.create_task(self._relay(handle, WsEncoder(fmt), after_seq))
        self.relays[answer_id] = task
        task.add_done_callback(lambda done: self._relay_ended(answer_id, done))

    def _relay_ended(self, answer_id: str, task: asyncio.Task[None]) -> None:
        if self.relays.get(answer_id) is task:
            del self.relays[answer_id]

    async def _relay(self, handle: Handle, encoder: WsEncoder, after_seq: int) -> None:
        try:
            relay = self.service.relay(handle, encoder, after_seq, self.writer.write_now)
            async for frames in relay:
                await self.writer.send(frames)
        except (WebSocketDisconnect, OSError, RuntimeError):
            pass  # the socket went away; the generation goes on and stays resumable

    async def run(self) -> None:
        watch = asyncio.create_task(self.writer.watch())
        try:
            await self._serve()
        finally:
            await cancel_and_wait([watch])

    async def _serve(self) -> None:
        await self.writer.send_json({"type": "signal", "data": "open"})
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            chat_id = None
            try:
                body = self._decode(message)
                if isinstance(body, dict):
                    chat_id = _chat_id_of(body)
                await self.handle(body)
            except AppError as exc:
                self.metrics.errors.labels(exc.key).inc()
                extra: dict[str, Any] = {"chatId": chat_id} if chat_id else {}
                if exc.retry_after is not None:  # what HTTP says in Retry-After
                    extra["retryAfter"] = exc.retry_after
                await self.writer.send_json(error_body(exc, **extra))
            except (WebSocketDisconnect, OSError):
                raise
            except Exception:  # a bug: say so on this frame, keep the socket
                log.exception("websocket frame failed")
                self.metrics.errors.labels("INTERNAL").inc()
                error = AppError("internal error")
                await self.writer.send_json(
                    error_body(error, **({"chatId": chat_id} if chat_id else {}))
                )

    def _throttle(self) -> None:
        """A token bucket of `limits.ws_messages_per_second` frames (bursts up to one second's)."""
        if self._rate <= 0:
            return
        now = time.monotonic()
        self._allowance = min(self._rate, self._allowance + (now - self._checked) * self._rate)
        self._checked = now
        if self._allowance < 1:
            raise RateLimited(
                f"more than {self._rate:g} messages a second on this socket", retry_after=1
            )
        self._allowance -= 1

    def _decode(self, message: Mapping[str, Any]) -> Any:
        self._throttle()
        text = message.get("text")
        if text is None:
            raise BadRequest("binary frames are not accepted: send JSON as text")
        limit = self.settings.limits.max_body_bytes
        if len(text) > limit:
            raise BadRequest(f"frame is larger than {limit} bytes")
        return loads(text)

    async def still_signed_in(self) -> None:
        """With accounts, a socket's credential is checked again for every frame that
        acts (message, cancel, resume): a signed-out session, a revoked key, a disabled
        account or an expired JWT ends the socket (an error frame, then 4401) on its
        next frame, as it would end the next HTTP request."""
        identity = self.websocket.app.state.identity
        if identity.mode != "accounts":
            return
        try:
            user = await identity.authenticate(self.websocket, token_param=True)
        except AppError as exc:
            if exc.status != 401:
                raise
            await self.writer.send_json(error_body(exc))
            await self.websocket.close(4401)
            raise WebSocketDisconnect(4401) from exc
        set_user(self.websocket.scope, user)

    async def handle(self, body: Any) -> None:
        """One frame from the client; raises `AppError` for an error frame."""
        kind = body.get("type", "message") if isinstance(body, dict) else None
        service, websocket = self.service, self.websocket
        if kind in ("message", "cancel", "resume"):
            await self.still_signed_in()
        if kind == "message":
            request = parse_chat_request(
                body,
                max_content_chars=self.settings.limits.max_content_chars,
                max_history_messages=self.settings.limits.max_history_messages,
                format_override=websocket.query_params.get("format") or None,
                host=websocket.headers.get("host", ""),
                transport="ws",
            )
            request = request_user(websocket, request, body)
            query = websocket.query_params
            picked = picked_model(
                service.models,
                query.get("chatModel"),
                query.get("chatModelProvider"),
                restricted=request.restricted,
            )
            if picked is not None and request.provider is None and request.model is None:
                request = replace(request, provider=picked[0], model=picked[1])
            await count_request(websocket)
            handle = await service.start(request)
            await self.follow(handle, request.format)
        elif kind == "cancel":
            control = parse_control(body)
            if control.chat_id is None:
                raise BadRequest("cancel needs chatId")
            handle = await service.cancel(
                control.chat_id, client_identity(websocket, control.user_id)
            )
            frame = {
                "type": "cancelled",
                "chatId": handle.chat_id,
                "messageId": handle.answer_id,
                "cancelled": True,
            }
            await self.writer.send_json(frame)
        elif kind == "resume":
            control = parse_control(body)
            await count_resume(websocket)
            handle, seq = await service.find_resumable(
                control.chat_id, client_identity(websocket, control.user_id), control.last_event_id
            )
            await self.follow(handle, control.format, seq)
        elif kind == "ping":
            await self.writer.send_json({"type": "pong"})
        else:
            raise BadRequest("type must be one of message, cancel, resume, ping")

    async def close(self, code: int, wait: float) -> None:
        """Let the relays deliver what they have (up to `wait` seconds), then close."""
        if self.relays:
            await asyncio.wait(list(self.relays.values()), timeout=wait)
        await cancel_and_wait(list(self.relays.values()))
        with contextlib.suppress(RuntimeError, OSError, WebSocketDisconnect):
            await self.websocket.close(code)


async def endpoint(websocket: WebSocket) -> None:
    await websocket.accept()
    identity = websocket.app.state.identity
    try:
        user = await identity.authenticate(websocket, token_param=True)
        if user is not None and user.by_cookie:  # a socket opened by another site's page
            identity.check_origin(websocket)
        set_user(websocket.scope, user)
    except AppError as exc:
        await websocket.send_text(orjson.dumps(error_body(exc)).decode())
        await websocket.close({401: 4401, 403: 4403}.get(exc.status, 1013))
        return
    session = Session(websocket)
    sessions: set[Session] = websocket.app.state.sessions
    connections = session.metrics.connections_active.labels("ws")
    sessions.add(session)
    connections.inc()
    try:
        await session.run()
    except WebSocketDisconnect:
        pass
    finally:
        connections.dec()
        sessions.discard(session)
        await cancel_and_wait(list(session.relays.values()))


def _chat_id_of(body: dict[str, Any]) -> str | None:
    message = body.get("message")
    value = message.get("chatId") if isinstance(message, dict) else body.get("chatId")
    try:
        return parse_id(value, "chatId")
    except BadRequest:
        return None
