"""The OpenAI-compatible API (PROTOCOL §10): `GET /v1/models`, `POST /v1/chat/completions`.

Any OpenAI client can use the search chat as a model: one model id per focus
mode (and `<focusMode>:<optimizationMode>` for the web modes), the last user
message the question, earlier ones the history, system messages extra
instructions. It goes through the same chat service as `/api/chat/sse`: a
completion is a generation, relayed through one more encoder (`OpenAIEncoder`,
`chat.completion.chunk` lines). Sources come as Perplexity returns them:
`citations` (URLs, `[N]` → `citations[N-1]`) and `search_results`.

Unlike the chat protocol, a client that goes away stops the generation (the
upstream model request is closed), as OpenAI clients expect.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..chat.modes import MODES
from ..chat.service import ChatService
from ..config import Settings
from ..errors import AppError, BadRequest, NotFound
from ..events import FOCUS_MODES, Event, Handle
from ..protocol import (
    OPTIMIZATION_MODES,
    ChatRequest,
    Encoder,
    Events,
    parse_collections,
    parse_id,
)
from .http import ERROR_TYPES, client_identity, count_request, openai_error, rate_key, read_json
from .streaming import StreamResponse

CREATED = int(time.time())


def model_ids() -> list[str]:
    """Every focus mode, and `<mode>:<optimization>` for the modes that search the web."""
    ids = []
    for name, mode in MODES.items():
        ids.append(name)
        if mode.sources is not None and not mode.sources.reads_files:
            ids.extend(f"{name}:{optimization}" for optimization in OPTIMIZATION_MODES)
    return ids


async def models(request: Request) -> Response:
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": CREATED, "owned_by": "searchchat"}
                for name in model_ids()
            ],
        }
    )


async def chat_completions(request: Request) -> Response:
    try:
        return await _chat_completions(request)
    except AppError as exc:
        request.app.state.metrics.errors.labels(exc.key).inc()
        return openai_error(exc)


async def _chat_completions(request: Request) -> Response:
    settings: Settings = request.app.state.settings
    body = await read_json(request, settings.limits.max_body_bytes)
    chat_request = parse_completion(body, settings)
    claimed = body.get("user") if isinstance(body.get("user"), str) else None
    chat_request = replace(
        chat_request,
        user_id=_user(request, claimed),
        cap_key=rate_key(request),
        host=request.headers.get("host", ""),
    )
    await count_request(request)
    service: ChatService = request.app.state.service
    handle = await service.start(chat_request)
    model = str(body["model"])
    stream = body.get("stream") is True
    options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    if stream:
        encoder = OpenAIEncoder(model, handle, include_usage=bool(options.get("include_usage")))
        chunks: AsyncIterator[bytes] = service.relay(handle, encoder)
        return StreamResponse(
            chunks,
            media_type="text/event-stream; charset=utf-8",
            ping=b": keep-alive\n\n",
            ping_interval=settings.server.keepalive_seconds,
            send_timeout=settings.stream.client_timeout_seconds,
            on_disconnect=lambda: service.stop_here(handle),
            connections=request.app.state.metrics.connections_active.labels("openai"),
            group=request.app.state.streams,
        )
    return await _whole(request, service, handle, model)


def _user(request: Request, claimed: str | None) -> str:
    """Whom a completion is for. OpenAI's `user` is a free end-user label its clients
    are encouraged to send: with auth on the key decides (the label is not a claim),
    with auth off a label that is an id names the user, as `userId` does."""
    if request.scope.get("user_id") is not None:
        return client_identity(request, None)
    try:
        return client_identity(request, claimed)
    except BadRequest:
        return client_identity(request, None)


def parse_completion(body: Any, settings: Settings) -> ChatRequest:
    """An OpenAI chat completion request as a chat request. `BadRequest`, or
    `NotFound` for a model that is not one of `model_ids()`."""
    if not isinstance(body, dict):
        raise BadRequest("the request must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required: one of GET /v1/models")
    focus, _, optimization = model.partition(":")
    collections = parse_collections(body.get("collections"))
    copilot = True
    if focus == "collection":  # `collection:<id>`: that collection alone, no web
        collections = (*collections, parse_id(optimization, "model's collection id"))
        focus, optimization, copilot = "webSearch", "", False
    elif model not in model_ids() or focus not in FOCUS_MODES:
        raise NotFound(f"the model {model!r} does not exist: see GET /v1/models")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    limits = settings.limits
    turns: list[tuple[str, str]] = []
    instructions: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}] must be an object")
        role, text = message.get("role"), _text(message.get("content"), i)
        if role in ("system", "developer"):
            instructions.append(text)
        elif role in ("user", "assistant"):
            if len(text) > limits.max_content_chars:
                raise BadRequest(
                    f"messages[{i}] is longer than {limits.max_content_chars} characters"
                )
            turns.append((role, text))
        elif role not in ("tool", "function"):
            raise BadRequest(f"messages[{i}].role must be system, developer, user or assistant")
    last_user = max((i for i, (role, _) in enumerate(turns) if role == "user"), default=None)
    if last_user is None or not turns[last_user][1].strip():
        raise BadRequest("messages must end with a user message that has content")
    history = turns[:last_user][-limits.max_history_messages :]
    return ChatRequest(
        user_id="0",
        content=turns[last_user][1],
        focus_mode=focus,
        copilot_enabled=copilot,
        optimization_mode=optimization or "speed",
        history=tuple(history),
        collections=tuple(dict.fromkeys(collections)),
        instructions="\n\n".join(t for t in instructions if t.strip())[: limits.max_content_chars],
        transport="openai",
    )


def _text(content: Any, index: int) -> str:
    """A message's content: a string, or OpenAI's list of parts (the text ones)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
    raise BadRequest(f"messages[{index}].content must be a string or a list of parts")


# -- streaming --------------------------------------------------------------------------------


class OpenAIEncoder(Encoder[bytes]):
    """A generation's events as `chat.completion.chunk` lines, then `data: [DONE]`.

    Each chunk is built from two byte strings made once (before and after the
    delta), so a token costs one small `orjson.dumps` of its text; the citations,
    once known, are in those byte strings too (Perplexity sends them on every
    chunk)."""

    name = "openai"

    def __init__(self, model: str, handle: Handle, *, include_usage: bool) -> None:
        self.include_usage = include_usage
        self._id = f"chatcmpl-{handle.answer_id}"
        self._model = model
        self._sources: dict[str, Any] = {}
        self._head, self._tail = self._frame()

    def _body(self, choices: list[Any], **extra: Any) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self._model,
            **self._sources,
            **extra,
            "choices": choices,
        }

    def _frame(self) -> tuple[bytes, bytes]:
        """The bytes before and after a delta's object in a chunk line."""
        marker = "\x00DELTA\x00"
        chunk = self._body([{"index": 0, "delta": marker, "finish_reason": None}])
        head, tail = orjson.dumps(chunk).split(orjson.dumps(marker))
        return b"data: " + head, tail + b"\n\n"

    def _line(self, body: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def _chunk(self, delta: dict[str, Any]) -> bytes:
        return self._head + orjson.dumps(delta) + self._tail

    def preamble(self, handle: Handle) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def encode(self, events: Sequence[Event]) -> bytes | None:
        out = []
        for event in events:
            kind, data = event.type, event.data
            if kind == "message":
                if data.get("data"):
                    out.append(self._chunk({"content": data["data"]}))
            elif kind == "reasoning":
                out.append(self._chunk({"reasoning_content": data.get("data", "")}))
            elif kind == "progress" and "step" in data:  # shown as thinking, a line a step
                out.append(self._chunk({"reasoning_content": data.get("data", "") + "\n"}))
            elif kind == "sources":
                self._sources = perplexity_sources(data.get("data", []))
                self._head, self._tail = self._frame()
            elif kind == "keep-alive":
                out.append(b": keep-alive\n\n")
            elif kind == "messageEnd":
                out.append(self._end(data))
            elif kind == "error":
                kind_, code = ERROR_TYPES.get(data.get("key", ""), ("api_error", None))
                error = {"message": data.get("data", ""), "type": kind_, "code": code}
                out.append(self._line({"error": error}))
        return b"".join(out) or None

    def _end(self, data: dict[str, Any]) -> bytes:
        lines = [self._line(self._body([{"index": 0, "delta": {}, "finish_reason": "stop"}]))]
        if self.include_usage:
            lines.append(self._line(self._body([], usage=openai_usage(data.get("usage")))))
        lines.append(b"data: [DONE]\n\n")
        return b"".join(lines)


def perplexity_sources(sources: list[Any]) -> dict[str, Any]:
    """`citations` (URLs in order, so `[N]` is `citations[N-1]`) and `search_results`,
    as Perplexity's API returns them; the "All Sources" link is not a source."""
    real = [s for s in sources if s.get("metadata", {}).get("title") != "All Sources"]
    return {
        "citations": [s.get("metadata", {}).get("url", "") for s in real],
        "search_results": [
            {
                "title": s.get("metadata", {}).get("title", ""),
                "url": s.get("metadata", {}).get("url", ""),
                "snippet": s.get("pageContent", ""),
            }
            for s in real
        ],
    }


def openai_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    return {
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
        "total_tokens": usage.get("total_tokens", 0),
        "completion_tokens_details": {"reasoning_tokens": usage.get("reasoning_tokens", 0)},
    }


# -- one whole completion -------------------------------------------------------------------


async def _whole(request: Request, service: ChatService, handle: Handle, model: str) -> Response:
    """Wait for the whole answer; a client that goes away meanwhile stops it."""
    collect = asyncio.create_task(_collect(service, handle))
    watch = asyncio.create_task(_gone(request))
    try:
        await asyncio.wait([collect, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():
            service.stop_here(handle)
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    answer = await collect
    if answer["error"] is not None:
        key, message = answer["error"]
        return openai_error(_app_error(key, message))
    reply: dict[str, Any] = {"role": "assistant", "content": answer["content"]}
    if answer["reasoning"]:
        reply["reasoning_content"] = answer["reasoning"]
    return JSONResponse(
        {
            "id": f"chatcmpl-{handle.answer_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": reply, "finish_reason": "stop"}],
            "usage": openai_usage(answer["usage"]),
            **answer["sources"],
        }
    )


async def _collect(service: ChatService, handle: Handle) -> dict[str, Any]:
    content: list[str] = []
    reasoning: list[str] = []
    answer: dict[str, Any] = {"sources": {}, "usage": None, "error": None}
    async for events in service.relay(handle, Events()):
        for event in events:
            if event.type == "message":
                content.append(event.data.get("data", ""))
            elif event.type == "reasoning":
                reasoning.append(event.data.get("data", ""))
            elif event.type == "sources":
                answer["sources"] = perplexity_sources(event.data.get("data", []))
            elif event.type == "messageEnd":
                answer["usage"] = event.data.get("usage")
            elif event.type == "error":
                answer["error"] = (event.data.get("key", "INTERNAL"), event.data.get("data", ""))
    answer["content"] = "".join(content)
    answer["reasoning"] = "".join(reasoning)
    return answer


async def _gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _app_error(key: str, message: str) -> AppError:
    error = AppError(message, status=502 if key in ("CHAT_ERROR", "STREAM_ERROR") else 500)
    error.key = key
    return error
