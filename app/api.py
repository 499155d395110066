"""The plain HTTP endpoints: chats, sources, config, suggestions, cancel, health."""

from __future__ import annotations

import html
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response

from .errors import BadRequest, Forbidden, NotFound
from .protocol import FOCUS_MODES, OPTIMIZATION_MODES, parse_control, parse_id
from .transport.http import client_identity, count_request, guard, read_json

WEB_INDEX = Path(__file__).resolve().parent / "web" / "index.html"


def _service(request: Request):  # type: ignore[no-untyped-def]
    return request.app.state.service


async def _owned_chat(request: Request):  # type: ignore[no-untyped-def]
    chat_id = parse_id(request.path_params["chat_id"], "chatId")
    chat = await _service(request).store.get_chat(chat_id)
    if chat is None:
        raise NotFound("no such chat")
    user_id = client_identity(request, request.query_params.get("userId"))
    if user_id is not None and chat.user_id != user_id:
        raise Forbidden("this chat belongs to another user")
    return chat


@guard
async def list_chats(request: Request) -> Response:
    user_id = client_identity(request, request.query_params.get("userId")) or "0"
    chats = await _service(request).store.list_chats(user_id)
    return JSONResponse([chat.to_json() for chat in chats])


@guard
async def get_chat(request: Request) -> Response:
    chat = await _owned_chat(request)
    messages = await _service(request).store.list_messages(chat.id)
    return JSONResponse({"chat": chat.to_json(), "messages": [m.to_json() for m in messages]})


@guard
async def delete_chat(request: Request) -> Response:
    chat = await _owned_chat(request)
    service = _service(request)
    if await service.hub.lookup(chat.id) is not None:
        raise BadRequest("a generation is running for this chat: cancel it first")
    await service.store.delete_chat(chat.id)
    return JSONResponse({"id": chat.id, "deleted": True})


@guard
async def sources(request: Request) -> Response:
    message_id = parse_id(request.path_params["message_id"], "messageId")
    store = _service(request).store
    message = await store.get_message(message_id)
    if message is None or message.role != "user":
        raise NotFound("no such question")
    user_id = client_identity(request, request.query_params.get("userId"))
    if user_id is not None:
        chat = await store.get_chat(message.chat_id)
        if chat is None or chat.user_id != user_id:
            raise Forbidden("these sources belong to another user")
    if "text/html" in request.headers.get("accept", ""):
        items = "\n".join(
            '<li><a href="{url}" rel="noopener noreferrer">{title}</a><p>{text}</p></li>'.format(
                url=html.escape(s.get("metadata", {}).get("url", ""), quote=True),
                title=html.escape(s.get("metadata", {}).get("title", "") or "(untitled)"),
                text=html.escape((s.get("pageContent") or "")[:500]),
            )
            for s in message.sources
        )
        page = (
            "<!doctype html><meta charset=utf-8><title>Sources</title>"
            f"<h1>Sources for “{html.escape(message.rewritten or message.content)}”</h1><ol>{items}</ol>"
        )
        return HTMLResponse(page)
    return JSONResponse({"messageId": message.id, "sources": message.sources})


async def config(request: Request) -> Response:
    settings = request.app.state.settings
    return JSONResponse(
        {
            "focusModes": list(FOCUS_MODES),
            "optimizationModes": list(OPTIMIZATION_MODES),
            "formats": ["default", "simple"],
            "searchProvider": settings.search.provider,
            "readerProvider": settings.reader.provider,
            "chatModel": settings.llm.model,
            "smallModel": settings.llm.effective_small_model,
            "embeddingModel": settings.embeddings.model,
            "authRequired": bool(settings.auth.api_keys),
        }
    )


@guard
async def suggestions(request: Request) -> Response:
    settings = request.app.state.settings
    body = await read_json(request, settings.limits.max_body_bytes)
    if not isinstance(body, dict):
        raise BadRequest("request must be a JSON object")
    service = _service(request)
    if body.get("history") is not None:
        history = body["history"]
        if not isinstance(history, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
            for p in history
        ):
            raise BadRequest("history must be a list of [role, text] pairs")
        pairs = [("user" if role == "human" else "assistant", text) for role, text in history]
    elif body.get("chatId") not in (None, ""):
        chat_id = parse_id(body["chatId"], "chatId")
        chat = await service.store.get_chat(chat_id)
        if chat is None:
            raise NotFound("no such chat")
        user_id = client_identity(request, body.get("userId"))
        if user_id is not None and chat.user_id != user_id:
            raise Forbidden("this chat belongs to another user")
        pairs = await service.stored_history(chat_id)
    else:
        raise BadRequest("send chatId or history")
    if not pairs:
        raise BadRequest("there is no conversation to suggest from")
    await count_request(request)
    return JSONResponse({"suggestions": await service.suggestions(pairs)})


@guard
async def cancel(request: Request) -> Response:
    settings = request.app.state.settings
    body = await read_json(request, settings.limits.max_body_bytes)
    if not isinstance(body, dict):
        raise BadRequest("request must be a JSON object")
    control = parse_control({**body, "type": "cancel"})
    if control.chat_id is None:
        raise BadRequest("cancel needs chatId")
    try:
        handle = await _service(request).cancel(
            control.chat_id, client_identity(request, control.user_id)
        )
    except NotFound as exc:
        return JSONResponse(
            {"type": "error", "key": exc.key, "data": exc.message, "cancelled": False},
            status_code=404,
        )
    return JSONResponse(
        {"chatId": handle.chat_id, "messageId": handle.answer_id, "cancelled": True}
    )


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    service = _service(request)
    if not service.accepting:
        return JSONResponse({"status": "draining"}, status_code=503)
    failing = {}
    for name, backend in (("store", service.store), ("redis", service.hub)):
        try:
            await backend.ping()
        except Exception as exc:  # any failure means "not ready"; say which
            failing[name] = f"{type(exc).__name__}: {exc}"
    if failing:
        return JSONResponse({"status": "unavailable", "failing": failing}, status_code=503)
    return JSONResponse({"status": "ready"})


async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.metrics.render()
    return Response(body, media_type=content_type)


async def web_client(request: Request) -> Response:
    """The browser client (static files under /static)."""
    return FileResponse(WEB_INDEX, headers={"Cache-Control": "no-cache"})
