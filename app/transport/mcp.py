"""`/mcp`: the search as tools of the Model Context Protocol (PROTOCOL §14, server).

Streamable HTTP through the official `mcp` SDK, which parses and answers the
JSON-RPC (`initialize`, `tools/list`, `tools/call`, `ping`, the revisions it
serves). It is one more transport over the chat service: `ask` and
`deep_research` start a generation with a `ChatRequest` and follow its log as
every transport does; each `progress` event becomes `notifications/progress`
(the event's `seq` is the progress number), the answer the tool's result (the
tools are `mcp_tools`; this module is the endpoint, its sessions and resume).

Sessions across workers. The SDK's own sessions live in one process (a task and
memory streams per session), so a second worker behind a load balancer without
sticky sessions would answer 404 to half of a session's requests. Here the SDK
runs without sessions of its own — a fresh transport per request, nothing of a
session kept on any worker — and this module gives the handshake revisions
(2025-06-18, 2025-11-25: `initialize`) their `Mcp-Session-Id`: a random token
whose owner is kept in Redis when `redis.url` is set (else in this process),
forgotten after `IDLE_SECONDS` idle. A running call is kept there under
(session, JSON-RPC id) too, so that `notifications/cancelled` cancels its
generation and `GET /mcp` with `Last-Event-ID` resumes its stream from the
answer's log (PROTOCOL §5), on any worker. An idle session costs a Redis key
and no worker memory. Under the stateless revision (2026-07-28) the SDK serves
each request alone, and a closed stream is the cancel.

Event ids of a call's stream are `<stream>:<seq>`: the stream (the JSON-RPC id,
base64url) and the last answer event sent (0 before any).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import mcp_types as types
import orjson
from mcp.server.connection import Connection
from mcp.server.lowlevel.server import Server
from mcp.server.runner import serve_connection
from mcp.server.streamable_http import StreamableHTTPServerTransport
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.jsonrpc_dispatcher import JSONRPCDispatcher
from mcp.shared.transport_context import TransportContext
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from ..chat.service import ChatService
from ..config import Settings, auth_mode
from ..errors import AppError, BadRequest, Unauthorized
from ..events import Event, Handle
from ..identity.resolver import SAFE_METHODS
from ..protocol import Encoder
from .http import client_identity, read_json, set_user
from .mcp_sessions import Call, Sessions, open_sessions
from .mcp_tools import (
    EVENTS,
    INVALID_REQUEST,
    SESSION_HEADER,
    Answer,
    CallEvents,
    call_tool,
    encode_stream,
    list_tools,
)
from .streaming import StreamResponse

log = logging.getLogger("app.mcp")

VERSION_HEADER = "mcp-protocol-version"
#: the request headers a browser's MCP client sends, and the response headers it reads
HEADERS = (SESSION_HEADER, VERSION_HEADER)
EXPOSED_HEADERS = (SESSION_HEADER,)
#: the revisions that took JSON-RPC batches (2025-06-18 removed them)
BATCH_REVISIONS = ("2024-11-05", "2025-03-26")

PARSE_ERROR = -32700


# -- event ids and resume -------------------------------------------------------------------


def decode_event_id(value: str) -> tuple[str, int]:
    """`<stream>:<seq>` → (the stream as encoded, seq); `BadRequest` otherwise."""
    stream, sep, seq = value.rpartition(":")
    if not sep or not seq.isascii() or not seq.isdigit() or len(seq) > 12 or not stream:
        raise BadRequest("Last-Event-ID is not an event id of this server")
    try:
        base64.urlsafe_b64decode(stream + "=" * (-len(stream) % 4))
    except (binascii.Error, ValueError) as exc:
        raise BadRequest("Last-Event-ID is not an event id of this server") from exc
    return stream, int(seq)


class ResumeEncoder(Encoder[bytes]):
    """A resumed call's stream: the progress notifications after `after`, then the
    result (as SSE events with their ids). The whole log is read, so the result
    holds the whole answer."""

    name = "mcp"

    def __init__(self, handle: Handle, call: Call, stream: str, after: int) -> None:
        self.call = call
        self.stream = stream
        self.after = after
        self.read = Answer(handle)

    def _event(self, seq: int, message: dict[str, Any]) -> bytes:
        return b"id: %s:%d\nevent: message\ndata: %s\n\n" % (
            self.stream.encode(),
            seq,
            orjson.dumps(message),
        )

    def encode(self, events: Sequence[Event]) -> bytes | None:
        out = []
        for event in events:
            note = self.read.feed(event)
            if note is not None and self.call.token is not None and event.seq > self.after:
                params = {
                    "progressToken": self.call.token,
                    "progress": float(event.seq),  # as the SDK sends it
                    "message": note,
                }
                message = {"jsonrpc": "2.0", "method": "notifications/progress", "params": params}
                out.append(self._event(event.seq, message))
            if event.terminal:
                result = self.read.result().model_dump(
                    by_alias=True, exclude_none=True, mode="json"
                )
                result.pop("resultType", None)
                out.append(
                    self._event(
                        self.read.seq, {"jsonrpc": "2.0", "id": self.call.id, "result": result}
                    )
                )
        return b"".join(out) or None


# -- the endpoint ---------------------------------------------------------------------------


def error_body(code: int, message: str, request_id: Any = None) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}


def rpc_error(code: int, message: str, status: int, **headers: str) -> Response:
    return JSONResponse(error_body(code, message), status_code=status, headers=headers or None)


class McpEndpoint:
    """`/mcp` for one app: the SDK's server, this module's sessions, the task group its
    requests' servers run in."""

    def __init__(self, settings: Settings, sessions: Sessions, service: ChatService) -> None:
        self.settings = settings
        self.sessions = sessions
        self.service = service
        self.server: Server[Any] = Server(
            "searchchat",
            version="1",
            instructions="Web search and cited answers; deep_research reports its progress.",
            on_list_tools=list_tools,
            on_call_tool=call_tool,
        )
        # the stateless revision, served by the SDK as it is
        self.modern = StreamableHTTPSessionManager(self.server, stateless=True)
        self._tasks: anyio.abc.TaskGroup | None = None

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[McpEndpoint]:
        async with self.modern.run(), anyio.create_task_group() as tasks:
            self._tasks = tasks
            try:
                yield self
            finally:
                self._tasks = None
                tasks.cancel_scope.cancel()

    # -- requests ---

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            await self._authenticate(request)
        except AppError as exc:
            headers = {}
            if isinstance(exc, Unauthorized):
                headers["WWW-Authenticate"] = (
                    f'Bearer resource_metadata="{resource_url(request, "/.well-known/oauth-protected-resource/mcp")}"'
                )
            await rpc_error(INVALID_REQUEST, exc.message, exc.status, **headers)(
                scope, receive, send
            )
            return
        version = request.headers.get(VERSION_HEADER)
        if request.method == "GET":
            response = await self.resume(request)
        elif request.method == "DELETE":
            response = await self.delete(request)
        elif request.method == "POST":
            await self.post(request, version, scope, send)
            return
        else:
            response = rpc_error(
                INVALID_REQUEST, "method not allowed", 405, Allow="GET, POST, DELETE"
            )
        await response(scope, receive, send)

    async def _authenticate(self, request: Request) -> None:
        if auth_mode(self.settings.auth) == "off":
            return
        identity = request.app.state.identity
        user = await identity.authenticate(request)
        set_user(request.scope, user)
        if user is not None and user.by_cookie and request.method not in SAFE_METHODS:
            identity.check_origin(request)  # another site's page must not call tools

    async def post(self, request: Request, version: str | None, scope: Scope, send: Send) -> None:
        try:
            body = await read_json(request, self.settings.limits.max_body_bytes)
        except BadRequest as exc:
            code = INVALID_REQUEST if exc.status == 413 else PARSE_ERROR
            await rpc_error(code, exc.message, exc.status)(scope, _nothing, send)
            return
        raw = orjson.dumps(body)
        replay = _replaying(raw, request.receive)
        if version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS:
            await self.modern.handle_request(scope, replay, send)
            return
        if isinstance(body, list):
            await batch_refused(body, version)(scope, replay, send)
            return
        if not isinstance(body, dict):
            await rpc_error(INVALID_REQUEST, "a JSON-RPC message is a JSON object", 400)(
                scope, replay, send
            )
            return
        user = client_identity(request, None)
        session = request.headers.get(SESSION_HEADER)
        if body.get("method") == "initialize" and session is None:
            session = await self.sessions.open(user)
            send = _with_header(send, SESSION_HEADER, session)
        elif session is not None:
            if await self.sessions.owner(session) != user:
                await rpc_error(INVALID_REQUEST, "session not found", 404)(scope, replay, send)
                return
            if body.get("method") == "notifications/cancelled":
                await self.cancel(session, user, body.get("params"))
                await Response(status_code=202)(scope, replay, send)
                return
        await self.serve(scope, replay, send, version)

    async def serve(self, scope: Scope, receive: Receive, send: Send, version: str | None) -> None:
        """One request through a transport of its own (as the SDK's stateless mode),
        whose SSE events carry ids (`CallEvents`)."""
        assert self._tasks is not None
        events = CallEvents()
        scope[EVENTS] = events
        transport = StreamableHTTPServerTransport(
            mcp_session_id=None, is_json_response_enabled=False, event_store=events
        )

        async def run(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
            async with transport.connect() as (read, write):
                task_status.started()
                dispatcher: JSONRPCDispatcher[TransportContext] = JSONRPCDispatcher(
                    read,
                    write,
                    inline_methods=frozenset({"initialize"}),
                    transport_builder=lambda _: TransportContext(
                        kind="streamable-http", can_send_request=False
                    ),
                )
                connection = Connection.from_envelope(
                    version or types.DEFAULT_NEGOTIATED_VERSION, None, None
                )
                try:
                    await serve_connection(
                        self.server, dispatcher, connection=connection, lifespan_state={}
                    )
                except Exception:
                    log.exception("an MCP request failed")

        try:
            await self._tasks.start(run)
            await transport.handle_request(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await transport.terminate()

    async def cancel(self, session: str, user: str, params: Any) -> None:
        """`notifications/cancelled`: the call's generation stops, wherever it runs."""
        if not isinstance(params, dict) or not isinstance(params.get("requestId"), str | int):
            return
        call = await self.sessions.call(session, encode_stream(str(params["requestId"])))
        if call is None:
            return
        with contextlib.suppress(AppError):
            await self.service.cancel(call.chat_id, user)

    async def resume(self, request: Request) -> Response:
        """`GET /mcp` with `Last-Event-ID`: a call's stream from after that event, read
        from the answer's log, on any worker. Without one: 405 (no stream of
        server-initiated messages is offered)."""
        last = request.headers.get("last-event-id")
        session = request.headers.get(SESSION_HEADER)
        if not last:
            return rpc_error(INVALID_REQUEST, "GET needs Last-Event-ID", 405, Allow="POST, DELETE")
        user = client_identity(request, None)
        if session is None or await self.sessions.owner(session) != user:
            return rpc_error(INVALID_REQUEST, "session not found", 404)
        try:
            stream, seq = decode_event_id(last)
            call = await self.sessions.call(session, stream)
            if call is None:
                return rpc_error(INVALID_REQUEST, "no call to resume for this event id", 404)
            handle, _ = await self.service.find_resumable(call.chat_id, user, f"{call.answer_id}:0")
        except AppError as exc:
            return rpc_error(INVALID_REQUEST, exc.message, exc.status)
        encoder = ResumeEncoder(handle, call, stream, seq)
        return StreamResponse(
            self.service.relay(handle, encoder),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", SESSION_HEADER: session},
            ping=b": ping\n\n",
            ping_interval=self.settings.server.keepalive_seconds,
            send_timeout=self.settings.stream.client_timeout_seconds,
            group=request.app.state.streams,
        )

    async def delete(self, request: Request) -> Response:
        session = request.headers.get(SESSION_HEADER)
        if session is None:
            return rpc_error(INVALID_REQUEST, "DELETE needs Mcp-Session-Id", 400)
        if await self.sessions.owner(session) != client_identity(request, None):
            return rpc_error(INVALID_REQUEST, "session not found", 404)
        await self.sessions.close(session)
        return Response(status_code=200)


def batch_refused(body: list[Any], version: str | None) -> Response:
    """A JSON-RPC batch: the revisions that had them get an error per request (this
    server takes one message per POST); from 2025-06-18 on, batches are not JSON-RPC
    of MCP at all."""
    if version in BATCH_REVISIONS and body:
        errors = [
            error_body(INVALID_REQUEST, "send one message per POST", item.get("id"))
            for item in body
            if isinstance(item, dict) and "id" in item
        ]
        return JSONResponse(errors, status_code=400)
    return rpc_error(
        INVALID_REQUEST, "JSON-RPC batches are not supported (removed in 2025-06-18)", 400
    )


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives `body` (already read from `receive`) once, then what
    `receive` says (the client's going)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _nothing() -> Message:
    return {"type": "http.disconnect"}


def _with_header(send: Send, name: str, value: str) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            headers.append((name.encode(), value.encode()))
            message = {**message, "headers": headers}
        await send(message)

    return sending


# -- protected-resource metadata (RFC 9728) ---------------------------------------------------


def resource_url(request: Request, path: str) -> str:
    settings: Settings = request.app.state.settings
    base = settings.server.public_url.rstrip("/")
    if not base:
        base = f"{request.url.scheme}://{request.headers.get('host', request.url.netloc)}"
    return base + path


async def resource_metadata(request: Request) -> Response:
    """The protected-resource metadata of `/mcp` (RFC 9728): the resource, the
    authorization server that issues its tokens when one is configured, how a token
    is sent."""
    settings: Settings = request.app.state.settings
    issuer = settings.auth.oidc.issuer or settings.auth.jwt.issuer
    return JSONResponse(
        {
            "resource": resource_url(request, "/mcp"),
            "authorization_servers": [issuer] if issuer else [],
            "bearer_methods_supported": ["header"],
        }
    )


@contextlib.asynccontextmanager
async def open_endpoint(
    settings: Settings, service: ChatService, redis: Any
) -> AsyncIterator[McpEndpoint]:
    """`/mcp`'s endpoint running, its sessions in Redis when there is one."""
    sessions = open_sessions(redis, keep_seconds=settings.stream.replay_ttl_seconds)
    endpoint = McpEndpoint(settings, sessions, service)
    async with endpoint.run():
        yield endpoint


class Mcp:
    """The ASGI app at `/mcp`: the app's running `McpEndpoint`."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await scope["app"].state.mcp(scope, receive, send)
