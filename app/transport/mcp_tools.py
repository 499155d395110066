"""The tools `/mcp` offers (PROTOCOL §14): their schemas, and the SDK's handlers that
run them over the chat service, the web search and the collections.

`ask` and `deep_research` start a generation and follow its log as every
transport does, each `progress` event a progress notification whose number is
the event's `seq`; `CallEvents` gives the call's SSE events ids made of that
number, so that a resume knows where to go on from.
"""

from __future__ import annotations

import base64
from typing import Any

import mcp_types as types
from mcp.server.streamable_http import EventCallback, EventStore
from mcp.shared.exceptions import MCPError
from mcp.shared.jsonrpc_dispatcher import progress_token_from_params
from starlette.requests import Request

from ..chat.service import ChatService
from ..citations import real_sources
from ..config import Settings
from ..errors import AppError, BadRequest
from ..events import FOCUS_MODES, Event, Handle
from ..ids import parse_id
from ..protocol import (
    OPTIMIZATION_MODES,
    ChatRequest,
    Events,
    parse_collections,
    parse_search,
    parse_sources,
)
from ..results import SearchResult
from .collections import passage
from .http import client_identity, count_request, rate_key
from .mcp_sessions import Call

SESSION_HEADER = "mcp-session-id"
#: where a request's event store is in the ASGI scope (for its tool calls)
EVENTS = "searchchat.mcp.events"
MAX_SEARCH_RESULTS = 20
MAX_COLLECTION_RESULTS = 50
INVALID_REQUEST, INVALID_PARAMS = -32600, -32602


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


def encode_stream(stream: str) -> str:
    return base64.urlsafe_b64encode(stream.encode()).decode().rstrip("=")


class CallEvents(EventStore):
    """The event ids of one POST's stream: `<stream>:<seq>`, the seq of the answer's
    last event the message carries (a progress notification's progress number; the
    result carries the last). Nothing is stored: a resume reads the answer's log."""

    def __init__(self) -> None:
        self.calls: dict[str, Answer] = {}

    async def store_event(self, stream_id: str, message: Any) -> str:
        seq = 0
        if isinstance(message, types.JSONRPCNotification) and message.params:
            progress = message.params.get("progress")  # the SDK sends it as a float
            seq = int(progress) if isinstance(progress, int | float) else 0
        elif message is not None and stream_id in self.calls:
            seq = self.calls[stream_id].seq
        return f"{encode_stream(stream_id)}:{seq}"

    async def replay_events_after(
        self, last_event_id: str, send_callback: EventCallback
    ) -> str | None:
        return None  # a resume is `McpEndpoint.resume`, on any worker
