"""What the Perplexica web UI asks of its backend beyond the chat protocol (PROTOCOL §9):
the models it may pick, its settings page, images and videos for an answer, the
discover page, and Perplexica's programmatic `POST /api/search`, whose NDJSON
stream is one more encoder of a generation's events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..chat.history import rewrite
from ..chat.service import ChatService
from ..config import DEFAULT_PROVIDER, Settings
from ..errors import BadRequest, Forbidden
from ..events import Event, Handle
from ..model import is_demo
from ..model.providers import ModelRegistry
from ..protocol import Encoder, Events, parse_chat_request, parse_messages
from .http import (
    count_request,
    current_user,
    json_errors,
    read_json,
    request_user,
    restricted,
)
from .streaming import StreamResponse

#: what the settings page may change: preferences the browser keeps for itself
BROWSER_PREFERENCES = frozenset(
    {
        "automaticImageSearch",
        "automaticVideoSearch",
        "chatModelProvider",
        "chatModel",
        "embeddingModelProvider",
        "embeddingModel",
    }
)
#: the keys of Perplexica's settings page that hold keys and addresses: never sent
SECRET_FIELDS = (
    "openaiApiKey",
    "ollamaApiUrl",
    "groqApiKey",
    "anthropicApiKey",
    "geminiApiKey",
    "customOpenaiApiKey",
    "customOpenaiApiUrl",
    "customOpenaiModelName",
)
NO_EMBEDDINGS = ("builtin", "bm25", "BM25 (no embeddings model: lexical ranking)")


def provider_name(base_url: str) -> str:
    """A provider's name from its address: `api.deepseek.com` → `deepseek`."""
    host = urlsplit(base_url).hostname or "local"
    parts = [p for p in host.split(".") if p not in ("api", "www")]
    if len(parts) >= 2 and not host.replace(".", "").isdigit():
        return parts[-2]
    return "local" if host in ("127.0.0.1", "localhost") else host


def chat_models(settings: Settings) -> tuple[str, dict[str, str]]:
    """The chat models clients may pick, by name → display name, and their provider."""
    llm = settings.llm
    if is_demo(llm.base_url):
        return "demo", {llm.model: "Demo model (made-up answers)"}
    models = {llm.model: llm.model}
    if llm.effective_small_model != llm.model:
        models[llm.effective_small_model] = f"{llm.effective_small_model} (small)"
    return provider_name(llm.base_url), models


def embedding_models(settings: Settings) -> tuple[str, dict[str, str]]:
    emb = settings.embeddings
    if emb.model:
        return provider_name(emb.base_url), {emb.model: emb.model}
    provider, name, display = NO_EMBEDDINGS
    return provider, {name: display}


def chat_providers(request: Request) -> dict[str, dict[str, str]]:
    """The chat models the caller may pick, by provider, name → display name: the
    default's under its provider's name, every other provider's under its id
    (PROTOCOL §13)."""
    chat_provider, chat = chat_models(request.app.state.settings)
    providers = {chat_provider: dict(chat)}
    for provider in _service(request).models.visible(restricted=restricted(request)):
        if provider.id != DEFAULT_PROVIDER:
            listed = providers.setdefault(provider.id, {})
            listed.update({m.id: m.name for m in provider.models})
    return providers


async def models(request: Request) -> Response:
    """`GET /api/models`: the models the caller may pick (never a key)."""
    embedding_provider, embedding = embedding_models(request.app.state.settings)
    return JSONResponse(
        {
            "chatModelProviders": {
                provider: {name: {"displayName": shown} for name, shown in chat.items()}
                for provider, chat in chat_providers(request).items()
            },
            "embeddingModelProviders": {
                embedding_provider: {
                    name: {"displayName": shown} for name, shown in embedding.items()
                }
            },
        }
    )


def settings_view(settings: Settings, chat: dict[str, dict[str, str]]) -> dict[str, Any]:
    """What Perplexica's settings page reads, as lists of {name, displayName}, with
    every key and address field empty; `chat`: the chat models (`chat_providers`)."""
    embedding_provider, embedding = embedding_models(settings)
    return {
        "chatModelProviders": {
            provider: [{"name": n, "displayName": d} for n, d in models.items()]
            for provider, models in chat.items()
        },
        "embeddingModelProviders": {
            embedding_provider: [{"name": n, "displayName": d} for n, d in embedding.items()]
        },
        **dict.fromkeys(SECRET_FIELDS, ""),
        "configWritable": False,
    }


@json_errors
async def save_config(request: Request) -> Response:
    """`POST /api/config`: the server's configuration is read-only (it is
    `config.toml`'s); a body that changes only what the browser keeps for itself
    (automatic image search, the model picked) is accepted and nothing is written."""
    settings: Settings = request.app.state.settings
    user = current_user(request)
    if request.app.state.identity.mode == "accounts" and (user is None or not user.is_admin):
        raise Forbidden("only an admin may change the configuration")
    body = await read_json(request, settings.limits.max_body_bytes)
    if not isinstance(body, dict):
        raise BadRequest("request must be a JSON object")
    current = settings_view(settings, chat_providers(request))
    changed = sorted(
        key
        for key, value in body.items()
        if key not in BROWSER_PREFERENCES and key in current and value != current[key]
    )
    if changed:
        raise Forbidden(
            f"configuration is read-only ({', '.join(changed)}); edit config.toml on the server"
        )
    return JSONResponse({"saved": False, "configWritable": False})


@json_errors
async def images(request: Request) -> Response:
    """`POST /api/images`: `{query, chatHistory}` → `{"images": [{img_src, url, title}]}`."""
    query = await _media_query(request)
    found = await _service(request).search.images(query)
    return JSONResponse(
        {"images": [{"img_src": i.img_src, "url": i.url, "title": i.title} for i in found]}
    )


@json_errors
async def videos(request: Request) -> Response:
    """`POST /api/videos` → `{"videos": [{img_src, url, title, iframe_src}]}`."""
    query = await _media_query(request)
    found = await _service(request).search.videos(query)
    return JSONResponse(
        {
            "videos": [
                {"img_src": v.img_src, "url": v.url, "title": v.title, "iframe_src": v.iframe_src}
                for v in found
            ]
        }
    )


async def _media_query(request: Request) -> str:
    """The search query of an image or video request: the question, made standalone
    with the conversation before it (as a chat question is)."""
    settings: Settings = request.app.state.settings
    body = await read_json(request, settings.limits.max_body_bytes)
    if not isinstance(body, dict) or not isinstance(body.get("query"), str):
        raise BadRequest("send {query, chatHistory}")
    query = str(body["query"]).strip()[: settings.limits.max_content_chars]
    if not query:
        raise BadRequest("query must not be empty")
    history = parse_messages(
        body.get("chatHistory") or [],
        settings.limits.max_history_messages,
        settings.limits.max_content_chars,
    )
    await count_request(request)
    if history:
        service = _service(request)
        rewritten = await rewrite(service.llm, service.prompts, query, history)
        return rewritten or query
    return query


async def discover(request: Request) -> Response:
    """`GET /api/discover` → `{"blogs": [{title, content, url, thumbnail}]}`: recent
    news from the search provider (cached); empty, never an error, without any."""
    items = await _service(request).search.discover()
    return JSONResponse(
        {
            "blogs": [
                {"title": i.title, "content": i.content, "url": i.url, "thumbnail": i.thumbnail}
                for i in items
            ]
        }
    )


class NdjsonEncoder(Encoder[bytes]):
    """Perplexica's `/api/search` stream: one JSON object a line — `init`, `sources`,
    `response` chunks, then `done` (or `error`)."""

    name = "ndjson"

    def preamble(self, handle: Handle) -> bytes:
        return b'{"type":"init","data":"Stream connected"}\n'

    def encode(self, events: Sequence[Event]) -> bytes | None:
        lines = []
        for event in events:
            kind, data = event.type, event.data
            line: dict[str, Any]
            if kind == "sources":
                line = {"type": "sources", "data": _without_link(data.get("data", []))}
            elif kind == "message" and data.get("data"):
                line = {"type": "response", "data": data["data"]}
            elif kind == "messageEnd":
                line = {"type": "done"}
            elif kind == "error":
                line = {"type": "error", "data": data.get("data", ""), "key": data.get("key")}
            else:
                continue
            lines.append(orjson.dumps(line) + b"\n")
        return b"".join(lines) or None


@json_errors
async def search(request: Request) -> Response:
    """`POST /api/search`, Perplexica's programmatic API: `{query, focusMode,
    optimizationMode, history, stream, systemInstructions}` → `{message, sources}`,
    or with `stream: true` an NDJSON stream."""
    settings: Settings = request.app.state.settings
    body = await read_json(request, settings.limits.max_body_bytes)
    if not isinstance(body, dict):
        raise BadRequest("request must be a JSON object")
    chat_body = {
        "message": {"content": body.get("query")},
        "focusMode": body.get("focusMode", "webSearch"),
        "optimizationMode": body.get("optimizationMode", "speed"),
        "history": body.get("history"),
        "systemInstructions": body.get("systemInstructions") or "",
        "userId": body.get("userId"),
    }
    if not isinstance(body.get("query"), str):
        raise BadRequest("query must be a non-empty string")
    chat_request = parse_chat_request(
        chat_body,
        max_content_chars=settings.limits.max_content_chars,
        max_history_messages=settings.limits.max_history_messages,
        host=request.headers.get("host", ""),
        transport="perplexica",
    )
    chat_request = request_user(request, chat_request, chat_body)
    await count_request(request)
    service = _service(request)
    handle = await service.start(chat_request)
    if body.get("stream"):
        stream: AsyncIterator[bytes] = service.relay(handle, NdjsonEncoder())
        return StreamResponse(
            stream,
            media_type="application/x-ndjson",
            send_timeout=settings.stream.client_timeout_seconds,
            connections=request.app.state.metrics.connections_active.labels("perplexica"),
            group=request.app.state.streams,
        )
    return await _whole_answer(service, handle)


async def _whole_answer(service: ChatService, handle: Handle) -> Response:
    message: list[str] = []
    sources: list[Any] = []
    async for events in service.relay(handle, Events()):
        for event in events:
            if event.type == "message":
                message.append(event.data.get("data", ""))
            elif event.type == "sources":
                sources = _without_link(event.data.get("data", []))
            elif event.type == "error":
                return JSONResponse(
                    {"type": "error", "key": event.data.get("key"), "data": event.data.get("data")},
                    status_code=502,
                )
    return JSONResponse({"message": "".join(message), "sources": sources})


def _without_link(sources: list[Any]) -> list[Any]:
    """The sources without the closing "All Sources" link (Perplexica's API has none)."""
    return [s for s in sources if s.get("metadata", {}).get("title") != "All Sources"]


def _service(request: Request) -> ChatService:
    service: ChatService = request.app.state.service
    return service


def picked_model(
    registry: ModelRegistry, name: str | None, provider: str | None, *, restricted: bool
) -> tuple[str | None, str] | None:
    """A chat model a client names (the Perplexica UI's `chatModel` and
    `chatModelProvider`), if it is one of the configured ones: (None, name) for the
    default's, (provider, name) for another's; None otherwise (the default answers)."""
    if not name:
        return None
    found = registry.find(name, provider, restricted=restricted)
    if found is None:
        return None
    pid, model = found
    return (None if pid == DEFAULT_PROVIDER else pid), model
