"""The OpenAI-compatible API (PROTOCOL §10): `GET /v1/models`, `POST /v1/chat/completions`.

Any OpenAI client can use the search chat as a model: one model id per focus
mode (and `<focusMode>:<optimizationMode>` for the web modes), the last user
message the question, earlier ones the history, system messages extra
instructions. It goes through the same chat service as `/api/chat/sse`: a
completion is a generation, relayed through one more encoder (`OpenAIEncoder`,
`chat.completion.chunk` lines). Sources come as Perplexity returns them:
`citations` (URLs, `[N]` → `citations[N-1]`) and `search_results`; Perplexity's
search parameters (`search_domain_filter`, `search_recency_filter`, …) become the
chat request's `search` controls (`search_parameters`, shared with `/v1/responses`).

Unlike the chat protocol, a client that goes away stops the generation (the
upstream model request is closed), as OpenAI clients expect.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..chat.modes import MODES, ResearchSources
from ..chat.service import ChatService
from ..citations import fit_sources, perplexity_sources
from ..config import Settings
from ..errors import AppError, BadRequest, UnknownModel
from ..events import FOCUS_MODES, Event, Handle
from ..ids import parse_id
from ..protocol import (
    OPTIMIZATION_MODES,
    ChatRequest,
    Encoder,
    Events,
    parse_collections,
    parse_search,
)
from .http import (
    ERROR_TYPES,
    client_identity,
    count_request,
    openai_error,
    openai_errors,
    rate_key,
    read_json,
    restricted,
)
from .streaming import StreamResponse

CREATED = int(time.time())
T = TypeVar("T")


def model_ids() -> list[str]:
    """Every focus mode, and `<mode>:<optimization>` for the modes that search the web."""
    ids = []
    for name, mode in MODES.items():
        ids.append(name)
        if mode.sources is not None:
            ids.extend(f"{name}:{optimization}" for optimization in OPTIMIZATION_MODES)
    return ids


async def models(request: Request) -> Response:
    """The focus modes, then each mode with every model the caller may choose
    (`webSearch@openrouter/deepseek/deepseek-r1`)."""
    service: ChatService = request.app.state.service
    chosen = [
        (f"{mode}@{provider.id}/{model.id}", provider.id)
        for provider in service.models.visible(restricted=restricted(request))
        for model in provider.models
        for mode in MODES
    ]
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": CREATED, "owned_by": owner}
                for name, owner in [*((n, "searchchat") for n in model_ids()), *chosen]
            ],
        }
    )


@openai_errors
async def chat_completions(request: Request) -> Response:
    settings: Settings = request.app.state.settings
    body = await read_json(request, settings.limits.max_body_bytes)
    chat_request = parse_completion(body, settings)
    claimed = body.get("user") if isinstance(body.get("user"), str) else None
    chat_request = replace(
        chat_request,
        user_id=api_user(request, claimed),
        cap_key=rate_key(request),
        host=request.headers.get("host", ""),
        restricted=restricted(request),
    )
    await count_request(request)
    service: ChatService = request.app.state.service
    handle = await service.start(chat_request)
    model = str(body["model"])
    stream = body.get("stream") is True
    options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    if stream:
        encoder = OpenAIEncoder(
            model,
            handle,
            include_usage=bool(options.get("include_usage")),
            max_event_bytes=settings.stream.max_event_bytes,
        )
        return event_stream(
            request, service.relay(handle, encoder), "openai", lambda: service.stop_here(handle)
        )
    return await _whole(request, service, handle, model)


def event_stream(
    request: Request,
    chunks: AsyncIterator[bytes],
    label: str,
    on_disconnect: Callable[[], None] | None,
) -> Response:
    """A `/v1` event stream: `chunks` as they come, `: keep-alive` while idle, a stuck
    client let go, `on_disconnect` called when the client goes away."""
    settings: Settings = request.app.state.settings
    return StreamResponse(
        chunks,
        media_type="text/event-stream; charset=utf-8",
        ping=b": keep-alive\n\n",
        ping_interval=settings.server.keepalive_seconds,
        send_timeout=settings.stream.client_timeout_seconds,
        on_disconnect=on_disconnect,
        connections=request.app.state.metrics.connections_active.labels(label),
        group=request.app.state.streams,
    )


def api_user(request: Request, claimed: str | None) -> str:
    """Whom a completion is for. OpenAI's `user` is a free end-user label its clients
    are encouraged to send: with auth on the key decides (the label is not a claim),
    with auth off a label that is an id names the user, as `userId` does."""
    if request.scope.get("user_id") is not None:
        return client_identity(request, None)
    try:
        return client_identity(request, claimed)
    except BadRequest:
        return client_identity(request, None)


def parse_model(body: Any) -> tuple[str, str, dict[str, Any]]:
    """The focus and optimization modes a request's `model` names, and the chat
    request's fields it and `collections` set (`collection:<id>`: that collection
    alone, no web). `BadRequest`, or `NotFound` for a model that is not one of
    `model_ids()`."""
    if not isinstance(body, dict):
        raise BadRequest("the request must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required: one of GET /v1/models")
    model, chosen = chosen_model(model)
    focus, _, optimization = model.partition(":")
    collections = parse_collections(body.get("collections"))
    copilot = True
    if focus == "collection":  # `collection:<id>`: that collection alone, no web
        collections = (*collections, parse_id(optimization, "model's collection id"))
        focus, optimization, copilot = "webSearch", "", False
    elif model not in model_ids() or focus not in FOCUS_MODES:
        raise UnknownModel(f"the model {model!r} does not exist: see GET /v1/models")
    fields = {
        "collections": tuple(dict.fromkeys(collections)),
        "copilot_enabled": copilot,
        **chosen,
    }
    return focus, optimization, fields


def chosen_model(model: str) -> tuple[str, dict[str, Any]]:
    """`<focusMode>[:<optimizationMode>]@<provider>/<model>` as the mode's name and the
    chat request's `provider` and `model` (PROTOCOL §13); `@<provider>/<model>` alone
    is plain chat (deepSeek). A name without `@` is the mode's alone."""
    mode, at, rest = model.partition("@")
    if not at:
        return model, {}
    provider, _, name = rest.partition("/")
    if not provider or not name:
        raise UnknownModel(f"the model {model!r} does not exist: see GET /v1/models")
    return mode or "deepSeek", {"provider": provider, "model": name}


def parse_completion(body: Any, settings: Settings) -> ChatRequest:
    """An OpenAI chat completion request as a chat request. `BadRequest`, or
    `NotFound` for a model that is not one of `model_ids()`."""
    focus, optimization, fields = parse_model(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    return conversation(messages, "messages", focus, optimization, settings, body, fields)


def conversation(
    messages: list[Any],
    name: str,
    focus: str,
    optimization: str,
    settings: Settings,
    body: dict[str, Any],
    fields: dict[str, Any],
    *,
    instructions: str = "",
) -> ChatRequest:
    """OpenAI's messages (`{role, content}`, content a string or a list of text parts)
    as a chat request with `fields` (what the model named): the last user message the
    question, the user and assistant ones before it the history, system and developer
    ones extra instructions; Perplexity's search parameters of `body` as its `search`
    controls. `BadRequest` names the message (`name[i]`)."""
    limits = settings.limits
    turns: list[tuple[str, str]] = []
    extra: list[str] = [instructions]
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"{name}[{i}] must be an object")
        role, text = message.get("role", "user"), _text(message.get("content"), f"{name}[{i}]")
        if role in ("system", "developer"):
            extra.append(text)
        elif role in ("user", "assistant"):
            if len(text) > limits.max_content_chars:
                raise BadRequest(
                    f"{name}[{i}] is longer than {limits.max_content_chars} characters"
                )
            turns.append((role, text))
        elif role not in ("tool", "function"):
            raise BadRequest(f"{name}[{i}].role must be system, developer, user or assistant")
    last_user = max((i for i, (role, _) in enumerate(turns) if role == "user"), default=None)
    if last_user is None or not turns[last_user][1].strip():
        raise BadRequest(f"{name} must end with a user message that has content")
    history = turns[:last_user][-limits.max_history_messages :]
    request = ChatRequest(
        user_id="0",
        content=turns[last_user][1],
        focus_mode=focus,
        optimization_mode=optimization or "speed",
        history=tuple(history),
        instructions="\n\n".join(t for t in extra if t.strip())[: limits.max_content_chars],
        transport="openai",
    )
    return replace(request, **{**fields, **search_parameters(body, focus)})


#: the text parts of a message's content, in either API
TEXT_PARTS = ("text", "input_text", "output_text")


def _text(content: Any, name: str) -> str:
    """A message's content: a string, or a list of parts (the text ones; images and
    files are left out)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict)
            and part.get("type") in TEXT_PARTS
            and isinstance(part.get("text"), str)
        )
    raise BadRequest(f"{name}.content must be a string or a list of parts")


def search_parameters(body: dict[str, Any], focus: str) -> dict[str, Any]:
    """Perplexity's search parameters (PROTOCOL §10) as the chat request's fields:
    `search_domain_filter`, `search_recency_filter`, `search_after_date_filter`,
    `search_before_date_filter`, `web_search_options.search_context_size` → `search`;
    `search_mode: academic` → the academicSearch mode; `disable_search` → no web
    search; `return_images`, `return_related_questions`. The Responses API's
    `tools: [{"type": "web_search", "filters": {...}}]` give the same names (and
    OpenAI's `allowed_domains`, `search_context_size`). `BadRequest` names the field."""
    params = dict(body)
    tools = body.get("tools")
    for tool in tools if isinstance(tools, list) else []:
        if isinstance(tool, dict) and str(tool.get("type", "")).startswith("web_search"):
            filters = tool.get("filters")
            filters = filters if isinstance(filters, dict) else {}
            params.update({k: v for k, v in filters.items() if k.startswith("search_")})
            if "allowed_domains" in filters:
                params["search_domain_filter"] = filters["allowed_domains"]
            if "search_context_size" in tool:
                params["web_search_options"] = {"search_context_size": tool["search_context_size"]}
    options = params.get("web_search_options")
    options = options if isinstance(options, dict) else {}
    fields: dict[str, Any] = {}
    search = parse_search(
        {
            "domains": params.get("search_domain_filter"),
            "recency": params.get("search_recency_filter"),
            "after": params.get("search_after_date_filter"),
            "before": params.get("search_before_date_filter"),
            "contextSize": options.get("search_context_size"),
        },
        "search parameters: search",
    )
    if search is not None:
        fields["search"] = search
    mode = params.get("search_mode")
    if mode not in (None, "web", "academic"):
        raise BadRequest("search_mode must be web or academic")
    if mode == "academic":
        fields.update(academic(focus))
    for name, field in (
        ("disable_search", None),
        ("return_images", "images"),
        ("return_related_questions", "related"),
    ):
        value = params.get(name)
        if value is None:  # null is absent, as for stream and store
            value = False
        if not isinstance(value, bool):
            raise BadRequest(f"{name} must be true or false")
        if field is not None:
            fields[field] = value
        elif value:
            if isinstance(MODES[focus].sources, ResearchSources):
                raise BadRequest(f"{focus} always searches: disable_search needs another model")
            fields["copilot_enabled"] = False
    return fields


def academic(focus: str) -> dict[str, Any]:
    """`search_mode: academic` as the chat request's fields: webSearch becomes the
    academicSearch mode, deepResearch keeps to scholarly sources (`sources`), and
    academicSearch is so already; `BadRequest` for a mode kept to other sources or one
    that does not search."""
    if focus == "webSearch":
        return {"focus_mode": "academicSearch"}
    if focus == "deepResearch":
        return {"sources": ("academic",)}
    if focus == "academicSearch":
        return {}
    what = "does not search" if MODES[focus].sources is None else "searches other sources"
    raise BadRequest(f"search_mode academic: the model {focus!r} {what}")


# -- streaming --------------------------------------------------------------------------------


class OpenAIEncoder(Encoder[bytes]):
    """A generation's events as `chat.completion.chunk` lines, then `data: [DONE]`.

    Each chunk is built from two byte strings made once (before and after the
    delta), so a token costs one small `orjson.dumps` of its text; the citations,
    once known, are in those byte strings too (Perplexity sends them on every
    chunk): cut to fit half of `max_event_bytes`, so that a chunk with a piece of
    text (at most the other half) stays under it."""

    name = "openai"

    def __init__(
        self,
        model: str,
        handle: Handle,
        *,
        include_usage: bool,
        max_event_bytes: int = 262144,
    ) -> None:
        self.include_usage = include_usage
        self._room = max_event_bytes // 2
        self._id = f"chatcmpl-{handle.answer_id}"
        self._model = model
        self._sources: dict[str, Any] = {}
        self._searches = 0
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
                self._searches += searched(data)
                out.append(self._chunk({"reasoning_content": data.get("data", "") + "\n"}))
            elif kind == "sources":
                self._sources = perplexity_sources(data.get("data", []))
                self._head, self._tail = self._frame()
                if len(self._head) + len(self._tail) > self._room:
                    self._sources = fit_sources(self._sources, self._room - 512)
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
        finish = finish_reason(data)
        last = self._body([{"index": 0, "delta": {}, "finish_reason": finish}], **asked_for(data))
        lines = [self._line(last)]
        if self.include_usage:
            usage = openai_usage(data.get("usage"), self._searches)
            lines.append(self._line(self._body([], usage=usage)))
        lines.append(b"data: [DONE]\n\n")
        return b"".join(lines)


def searched(progress: dict[str, Any]) -> int:
    """1 when a `progress` event starts a web search (its `step`), else 0."""
    step = progress.get("step")
    return int(
        isinstance(step, dict) and step.get("kind") == "search" and step.get("status") == "running"
    )


def noted(progress: dict[str, Any]) -> bool:
    """Whether a `progress` event is a note of what a search could not do (a filter its
    provider cannot apply, PROTOCOL §10), which every answer shows."""
    step = progress.get("step")
    return isinstance(step, dict) and bool(step.get("note"))


def finish_reason(end: dict[str, Any]) -> str:
    """OpenAI's `finish_reason` for a `messageEnd`: "length" for an answer cut at
    `llm.max_output_tokens`, else "stop"."""
    return "length" if end.get("truncated") else "stop"


def asked_for(end: dict[str, Any]) -> dict[str, Any]:
    """What a `messageEnd` carries because the request asked for it: `images` and
    `related_questions`, as Perplexity names them."""
    fields: dict[str, Any] = {}
    if "images" in end:
        fields["images"] = end["images"]
    if "relatedQuestions" in end:
        fields["related_questions"] = end["relatedQuestions"]
    return fields


def openai_usage(usage: dict[str, Any] | None, searches: int = 0) -> dict[str, Any]:
    usage = usage or {}
    return {
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
        "total_tokens": usage.get("total_tokens", 0),
        "completion_tokens_details": {"reasoning_tokens": usage.get("reasoning_tokens", 0)},
        "num_search_queries": searches,
    }


# -- one whole completion -------------------------------------------------------------------


async def while_connected(
    request: Request, service: ChatService, handle: Handle, reader: Coroutine[Any, Any, T]
) -> T:
    """Run `reader` (which follows the whole generation) to its end; a client that
    goes away meanwhile stops the generation, and `reader` then ends with it."""
    collect = asyncio.create_task(reader)
    watch = asyncio.create_task(gone(request))
    try:
        await asyncio.wait([collect, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():
            service.stop_here(handle)
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    return await collect


async def _whole(request: Request, service: ChatService, handle: Handle, model: str) -> Response:
    """Wait for the whole answer; a client that goes away meanwhile stops it."""
    answer = await while_connected(request, service, handle, _collect(service, handle))
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
            "choices": [
                {"index": 0, "message": reply, "finish_reason": finish_reason(answer["end"])}
            ],
            "usage": openai_usage(answer["usage"], answer["searches"]),
            **answer["sources"],
            **asked_for(answer["end"]),
        }
    )


async def _collect(service: ChatService, handle: Handle) -> dict[str, Any]:
    content: list[str] = []
    reasoning: list[str] = []
    answer: dict[str, Any] = {"sources": {}, "usage": None, "error": None, "end": {}}
    answer["searches"] = 0
    async for events in service.relay(handle, Events()):
        for event in events:
            if event.type == "message":
                content.append(event.data.get("data", ""))
            elif event.type == "reasoning":
                reasoning.append(event.data.get("data", ""))
            elif event.type == "sources":
                answer["sources"] = perplexity_sources(event.data.get("data", []))
            elif event.type == "progress":
                answer["searches"] += searched(event.data)
                if noted(event.data):  # what a search could not do is never dropped
                    reasoning.append(event.data.get("data", "") + "\n")
            elif event.type == "messageEnd":
                answer["usage"] = event.data.get("usage")
                answer["end"] = event.data
            elif event.type == "error":
                answer["error"] = (event.data.get("key", "INTERNAL"), event.data.get("data", ""))
    answer["content"] = "".join(content)
    answer["reasoning"] = "".join(reasoning)
    return answer


async def gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _app_error(key: str, message: str) -> AppError:
    error = AppError(message, status=502 if key in ("CHAT_ERROR", "STREAM_ERROR") else 500)
    error.key = key
    return error
