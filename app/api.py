"""The plain HTTP endpoints: chats, sources, config, suggestions, cancel, health."""

from __future__ import annotations

import html
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response

from .chat.service import ChatService
from .errors import BadRequest, NotFound
from .protocol import (
    FOCUS_MODES,
    FORMATS,
    OPTIMIZATION_MODES,
    parse_control,
    parse_history,
    parse_id,
)
from .store import StoredMessage
from .transport.http import (
    ANONYMOUS,
    client_identity,
    count_request,
    error_response,
    json_errors,
    read_json,
)

WEB_INDEX = Path(__file__).resolve().parent / "web" / "index.html"

#: on every HTML page the server makes: no inline script, no framing, no sniffing
HTML_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline';"
        " img-src 'self' https: http: data:; connect-src 'self'; frame-src https:;"
        " object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


def _service(request: Request) -> ChatService:
    service: ChatService = request.app.state.service
    return service


def _user(request: Request) -> str:
    return client_identity(request, request.query_params.get("userId"))


@json_errors
async def list_chats(request: Request) -> Response:
    limit = request.query_params.get("limit", "100")
    if not limit.isdigit() or not 1 <= int(limit) <= 1000:
        raise BadRequest("limit must be a number from 1 to 1000")
    chats = await _service(request).list_chats(_user(request), int(limit))
    return JSONResponse({"chats": [chat.to_json() for chat in chats]})


@json_errors
async def get_chat(request: Request) -> Response:
    chat_id = parse_id(request.path_params["chat_id"], "chatId")
    chat, messages = await _service(request).open_chat(chat_id, _user(request))
    return JSONResponse({"chat": chat.to_json(), "messages": [m.to_json() for m in messages]})


@json_errors
async def delete_chat(request: Request) -> Response:
    chat_id = parse_id(request.path_params["chat_id"], "chatId")
    await _service(request).delete_chat(chat_id, _user(request))
    return JSONResponse({"id": chat_id, "deleted": True})


@json_errors
async def sources(request: Request) -> Response:
    message_id = parse_id(request.path_params["message_id"], "messageId")
    sig = request.query_params.get("sig") or None
    user = ANONYMOUS if sig else _user(request)
    message = await _service(request).question_sources(message_id, user, sig)
    if "text/html" in request.headers.get("accept", ""):
        return HTMLResponse(sources_page(message), headers=HTML_HEADERS)
    return JSONResponse({"messageId": message.id, "sources": message.sources})


def sources_page(message: StoredMessage) -> str:
    """The sources as a plain HTML list. Only http(s) addresses become links: a result
    can carry any URL (`javascript:…`), and this page is on the server's origin."""
    items = []
    for source in message.sources:
        meta = source.get("metadata", {})
        url, title = str(meta.get("url", "")), str(meta.get("title", "") or "(untitled)")
        text = html.escape(str(source.get("pageContent") or "")[:500])
        if safe_url(url):
            link = f'<a href="{html.escape(url, quote=True)}" rel="noopener noreferrer">'
            items.append(f"<li>{link}{html.escape(title)}</a><p>{text}</p></li>")
        else:
            items.append(f"<li>{html.escape(title)}<p>{text}</p></li>")
    question = html.escape(message.rewritten or message.content)
    return (
        "<!doctype html><meta charset=utf-8><title>Sources</title>"
        f"<h1>Sources for “{question}”</h1><ol>{''.join(items)}</ol>"
    )


def safe_url(url: str) -> bool:
    """An absolute http(s) URL, after the clean-up a browser does (it drops tabs and
    newlines inside a scheme: `java\tscript:`)."""
    cleaned = "".join(ch for ch in url if ch not in "\t\n\r").strip().lower()
    return cleaned.startswith(("http://", "https://"))


async def config(request: Request) -> Response:
    settings = request.app.state.settings
    return JSONResponse(
        {
            "focusModes": list(FOCUS_MODES),
            "optimizationModes": list(OPTIMIZATION_MODES),
            "formats": list(FORMATS),
            "searchProvider": settings.search.provider,
            "readerProvider": settings.reader.provider,
            "chatModel": settings.llm.model,
            "smallModel": settings.llm.effective_small_model,
            "embeddingModel": settings.embeddings.model,
            "authRequired": bool(settings.auth.api_keys),
        }
    )


@json_errors
async def suggestions(request: Request) -> Response:
    settings = request.app.state.settings
    body = await read_json(request, settings.limits.max_body_bytes)
    if not isinstance(body, dict):
        raise BadRequest("request must be a JSON object")
    history = parse_history(
        body.get("history"),
        settings.limits.max_history_messages,
        settings.limits.max_content_chars,
    )
    chat_id = body.get("chatId")
    if history is None and chat_id in (None, ""):
        raise BadRequest("send chatId or history")
    user_id = client_identity(request, body.get("userId"))
    service = _service(request)
    if history is None:
        history = tuple(await service.chat_history(parse_id(chat_id, "chatId"), user_id))
    if not history:
        raise BadRequest("there is no conversation to suggest from")
    await count_request(request)
    return JSONResponse({"suggestions": await service.suggestions(history)})


@json_errors
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
        return error_response(exc, cancelled=False)
    return JSONResponse(
        {"chatId": handle.chat_id, "messageId": handle.answer_id, "cancelled": True}
    )


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    service = _service(request)
    if not service.accepting:
        return JSONResponse({"status": "draining"}, status_code=503)
    failing = await service.health()
    if failing:
        return JSONResponse({"status": "unavailable", "failing": failing}, status_code=503)
    return JSONResponse({"status": "ready"})


async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.metrics.render()
    return Response(body, media_type=content_type)


async def web_client(request: Request) -> Response:
    """The browser client (static files under /static)."""
    return FileResponse(WEB_INDEX, headers={"Cache-Control": "no-cache", **HTML_HEADERS})
