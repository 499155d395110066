"""`/mcp`: the search as tools of the Model Context Protocol (PROTOCOL §14, server).

Streamable HTTP through the official `mcp` SDK, which parses and answers the
JSON-RPC (`initialize`, `tools/list`, `tools/call`, `ping`, the revisions it
serves). It is one more transport over the chat service: `ask` and
`deep_research` start a generation with a `ChatRequest` and follow its log as
every transport does; each `progress` event becomes `notifications/progress`
(the event's `seq` is the progress number), the answer the tool's result.

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
from mcp.server.streamable_http import EventCallback, EventStore, StreamableHTTPServerTransport
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.exceptions import MCPError
from mcp.shared.jsonrpc_dispatcher import JSONRPCDispatcher, progress_token_from_params
from mcp.shared.transport_context import TransportContext
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from ..chat.service import ChatService
from ..config import Settings, auth_mode
from ..errors import AppError, BadRequest, Unauthorized
from ..events import FOCUS_MODES, Event, Handle
from ..identity.resolver import SAFE_METHODS
from ..protocol import (
    OPTIMIZATION_MODES,
    ChatRequest,
    Encoder,
    Events,
    parse_collections,
    parse_id,
    parse_search,
    parse_sources,
)
from ..search.base import SearchResult
from .collections import passage
from .http import client_identity, count_request, rate_key, read_json, set_user
from .mcp_sessions import Call, Sessions, open_sessions
from .openai import real_sources
from .streaming import StreamResponse

log = logging.getLogger("app.mcp")

SESSION_HEADER = "mcp-session-id"
VERSION_HEADER = "mcp-protocol-version"
#: where a request's event store is in the ASGI scope (for its tool calls)
EVENTS = "searchchat.mcp.events"
#: the request headers a browser's MCP client sends, and the response headers it reads
HEADERS = (SESSION_HEADER, VERSION_HEADER)
EXPOSED_HEADERS = (SESSION_HEADER,)
#: the revisions that took JSON-RPC batches (2025-06-18 removed them)
BATCH_REVISIONS = ("2024-11-05", "2025-03-26")
MAX_SEARCH_RESULTS = 20
MAX_COLLECTION_RESULTS = 50

PARSE_ERROR, INVALID_REQUEST, INVALID_PARAMS = -32700, -32600, -32602


# -- the tools ---------------------------------------------------------------------------------

_QUESTION = {"type": "string", "description": "the question, in plain words"}
_COLLECTIONS = {
    "type": "array",
    "items": {"type": "string"},
    "description": "ids of knowledge collections to search beside the web",
}
_MODEL = {"type": "string", "description": "provider/model; the default model when absent"}

TOOLS = {
    "web_search": types.Tool(
        name="web_search",
        description="Search the web: titles, links and snippets of the best pages.",
        input_schema={
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "max_results": {"type": "integer", "minimum": 1, "maximum": MAX_SEARCH_RESULTS},
                "domains": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "only these domains; a leading '-' excludes one",
                },
                "recency": {"type": "string", "enum": ["hour", "day", "week", "month", "year"]},
            },
            "required": ["query"],
        },
    ),
    "ask": types.Tool(
        name="ask",
        description=(
            "Answer a question from a web search, with [N] citations of numbered sources."
            " Saved as a chat: pass its chatId as chat_id to ask a follow-up."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "question": _QUESTION,
                "focus_mode": {"type": "string", "default": "webSearch"},
                "optimization_mode": {"type": "string", "enum": list(OPTIMIZATION_MODES)},
                "chat_id": {"type": "string", "description": "continue this chat"},
                "sources": {
                    "type": "array",
                    "items": {
                        "type": "string",
                        "enum": ["web", "academic", "discussions", "files"],
                    },
                },
                "collections": _COLLECTIONS,
                "model": _MODEL,
            },
            "required": ["question"],
        },
    ),
    "deep_research": types.Tool(
        name="deep_research",
        description=(
            "Research a question in depth (many searches and pages, minutes): a report with"
            " [N] citations. Progress is reported step by step."
        ),
        input_schema={
            "type": "object",
            "properties": {"question": _QUESTION, "collections": _COLLECTIONS, "model": _MODEL},
            "required": ["question"],
        },
    ),
    "search_collection": types.Tool(
        name="search_collection",
        description="Search one of your knowledge collections: its best passages.",
        input_schema={
            "type": "object",
            "properties": {
                "collection_id": {"type": "string"},
                "query": {"type": "string"},
                "limit": {"type": "integer", "minimum": 1, "maximum": MAX_COLLECTION_RESULTS},
            },
            "required": ["collection_id", "query"],
        },
    ),
}


def invalid(message: str) -> MCPError:
    return MCPError(INVALID_PARAMS, message)


def _text(args: dict[str, Any], name: str) -> str:
    value = args.get(name)
    if not isinstance(value, str) or not value.strip():
        raise invalid(f"{name} must be a non-empty string")
    return value


def _optional(args: dict[str, Any], name: str) -> str | None:
    return None if args.get(name) is None else _text(args, name)


def _count(args: dict[str, Any], name: str, default: int, most: int) -> int:
    value = args.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
        raise invalid(f"{name} must be a whole number from 1 to {most}")
    return value


def _caller(ctx: Any) -> Request:
    request = ctx.request
    if not isinstance(request, Request):  # pragma: no cover - the SDK always sets it over HTTP
        raise MCPError(INVALID_REQUEST, "this server serves MCP over HTTP only")
    return request


async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
    """The tools; `search_collection` only for a caller who can read a collection."""
    request = _caller(ctx)
    tools = [TOOLS[name] for name in ("web_search", "ask", "deep_research")]
    knowledge = request.app.state.collections
    if knowledge is not None and await knowledge.listed(client_identity(request, None)):
        tools.append(TOOLS["search_collection"])
    return types.ListToolsResult(tools=tools)


async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
    """Runs a tool. Bad arguments and unknown tools are JSON-RPC errors (-32602); what
    goes wrong while the tool runs (a refused question, a failed answer) is a result
    with `isError`, which the model can read."""
    request = _caller(ctx)
    args = dict(params.arguments or {})
    try:
        if params.name == "web_search":
            return await web_search(request, args)
        if params.name == "search_collection":
            return await search_collection(request, args)
        if params.name in ("ask", "deep_research"):
            return await answer(ctx, request, params.name, args)
    except BadRequest as exc:
        raise invalid(exc.message) from exc
    except AppError as exc:
        return failed(f"{exc.key}: {exc.message}")
    raise invalid(f"unknown tool {params.name!r}: see tools/list")


def failed(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)


async def web_search(request: Request, args: dict[str, Any]) -> types.CallToolResult:
    query = _text(args, "query")
    limit = _count(args, "max_results", 8, MAX_SEARCH_RESULTS)
    filters = parse_search(
        {"domains": args.get("domains"), "recency": args.get("recency")}, "arguments"
    )
    await count_request(request)
    service: ChatService = request.app.state.service
    found = await service.search.provider.search(query, limit, filters=filters)
    found = service.search.keep_to(_Silent(), found, filters)[:limit]
    results = [_result(r) for r in found]
    text = "\n\n".join(
        f"[{n}] {r['title']}\n{r['url']}\n{r['snippet']}" for n, r in enumerate(results, 1)
    )
    return types.CallToolResult(
        content=[types.TextContent(text=text or "no results")],
        structured_content={"results": results},
    )


class _Silent:
    """Where a search's notes go when nobody reads them (`WebSearch.keep_to`)."""

    def emit(self, type: str, **data: object) -> object:
        return None


def _result(r: SearchResult) -> dict[str, Any]:
    result = {"title": r.title, "url": r.url, "snippet": r.snippet}
    if r.date:
        result["date"] = r.date[:10]
    return result


async def search_collection(request: Request, args: dict[str, Any]) -> types.CallToolResult:
    collection_id = parse_id(args.get("collection_id"), "collection_id")
    query = _text(args, "query")
    limit = _count(args, "limit", 10, MAX_COLLECTION_RESULTS)
    knowledge = request.app.state.collections
    record = await knowledge.readable(client_identity(request, None), collection_id)
    await count_request(request)
    found = await knowledge.searcher([record], limit)(query)
    results = [passage(r) for r in found]
    text = "\n\n".join(f"[{n}] {r.title}\n{r.snippet}" for n, r in enumerate(found, 1))
    return types.CallToolResult(
        content=[types.TextContent(text=text or "no passages")],
        structured_content={"results": results},
    )


def ask_request(request: Request, tool: str, args: dict[str, Any]) -> ChatRequest:
    """The chat request an `ask` or `deep_research` call makes. `BadRequest`, or an
    `MCPError` for arguments of the wrong shape."""
    settings: Settings = request.app.state.settings
    question = _text(args, "question")
    if len(question) > settings.limits.max_content_chars:
        raise invalid(f"question is longer than {settings.limits.max_content_chars} characters")
    model = _optional(args, "model")
    if model is not None and model not in (settings.llm.model, f"default/{settings.llm.model}"):
        raise invalid(
            f"model {model!r} does not exist: the models are default/{settings.llm.model}"
        )
    focus, optimization = "deepResearch", "speed"
    chat_id = None
    sources: tuple[str, ...] = ()
    if tool == "ask":
        focus = _optional(args, "focus_mode") or "webSearch"
        optimization = _optional(args, "optimization_mode") or "speed"
        if optimization not in OPTIMIZATION_MODES:
            raise invalid(f"optimization_mode must be one of {', '.join(OPTIMIZATION_MODES)}")
        if args.get("chat_id") is not None:
            chat_id = parse_id(args["chat_id"], "chat_id")
        sources = parse_sources(args.get("sources"))
    if focus not in FOCUS_MODES:
        raise invalid(f"focus_mode must be one of {', '.join(FOCUS_MODES)}")
    return ChatRequest(
        user_id=client_identity(request, None),
        content=question,
        chat_id=chat_id,
        focus_mode=focus,
        optimization_mode=optimization,
        collections=parse_collections(args.get("collections")),
        sources=sources,
        host=request.headers.get("host", ""),
        transport="mcp",
        cap_key=rate_key(request),
    )


class Answer:
    """An answer read from its events: the text, the sources, how it ended, the last
    event seen (`seq`). `feed` says what a `progress` event tells a client."""

    def __init__(self, handle: Handle) -> None:
        self.handle = handle
        self.parts: list[str] = []
        self.sources: list[dict[str, Any]] = []
        self.error: str | None = None
        self.status = "streaming"
        self.seq = 0

    def feed(self, event: Event) -> str | None:
        self.seq = event.seq or self.seq
        data = event.data
        if event.type == "message":
            self.parts.append(str(data.get("data", "")))
        elif event.type == "sources":
            self.sources = real_sources(data.get("data") or [])
        elif event.type == "messageEnd":
            self.status = str(data.get("status", "completed"))
        elif event.type == "error":
            self.status = "failed"
            self.error = f"{data.get('key', 'INTERNAL')}: {data.get('data', '')}"
        elif event.type == "progress" and event.seq:
            return str(data.get("data", ""))
        return None

    def result(self) -> types.CallToolResult:
        if self.error is not None:
            return failed(self.error)
        text = "".join(self.parts)
        listed = [
            {
                "n": n,
                "title": s.get("metadata", {}).get("title", ""),
                "url": s.get("metadata", {}).get("url", ""),
            }
            for n, s in enumerate(self.sources, 1)
        ]
        shown = text
        if listed:
            shown += "\n\nSources:\n" + "\n".join(
                f"[{s['n']}] {s['title']} {s['url']}" for s in listed
            )
        if self.status == "cancelled":
            shown += "\n\n(cancelled)"
        return types.CallToolResult(
            content=[types.TextContent(text=shown)],
            structured_content={
                "answer": text,
                "sources": listed,
                "chatId": self.handle.chat_id,
                "messageId": self.handle.answer_id,
            },
        )


async def answer(
    ctx: Any, request: Request, tool: str, args: dict[str, Any]
) -> types.CallToolResult:
    """Start the answer and follow it to its end, each `progress` step a progress
    notification. A client that goes away leaves it running under a session (it may
    resume or cancel it); without one (the stateless revision) its going is the cancel."""
    chat_request = ask_request(request, tool, args)
    await count_request(request)
    service: ChatService = request.app.state.service
    handle = await service.start(chat_request)
    stream = str(ctx.request_id)
    token = progress_token_from_params(ctx.params)
    session = request.headers.get(SESSION_HEADER)
    read = Answer(handle)
    events: CallEvents | None = request.scope.get(EVENTS)
    if events is not None:
        events.calls[stream] = read
    if session is not None:
        call = Call(ctx.request_id, token, tool, handle.chat_id, handle.answer_id)
        await request.app.state.mcp.sessions.remember(session, encode_stream(stream), call)
    ended = False
    try:
        async for batch in service.relay(handle, Events()):
            for event in batch:
                note = read.feed(event)
                if note is not None and token is not None:
                    await ctx.session.send_progress_notification(
                        token, event.seq, message=note, related_request_id=stream
                    )
        ended = True
    finally:
        if not ended and session is None:
            service.stop_here(handle)
    return read.result()


# -- event ids and resume -------------------------------------------------------------------


def encode_stream(stream: str) -> str:
    return base64.urlsafe_b64encode(stream.encode()).decode().rstrip("=")


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


class CallEvents(EventStore):
    """The event ids of one POST's stream: `<stream>:<seq>`, the seq of the answer's
    last event the message carries (a progress notification's progress number; the
    result carries the last). Nothing is stored: a resume reads the answer's log."""

    def __init__(self) -> None:
        self.calls: dict[str, Answer] = {}

    async def store_event(self, stream_id: str, message: Any) -> str:
        seq = 0
        if isinstance(message, types.JSONRPCNotification) and message.params:
            progress = message.params.get("progress")
            seq = progress if isinstance(progress, int) else 0
        elif message is not None and stream_id in self.calls:
            seq = self.calls[stream_id].seq
        return f"{encode_stream(stream_id)}:{seq}"

    async def replay_events_after(
        self, last_event_id: str, send_callback: EventCallback
    ) -> str | None:
        return None  # a resume is `McpEndpoint.resume`, on any worker


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
                params = {"progressToken": self.call.token, "progress": event.seq, "message": note}
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
