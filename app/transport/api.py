"""The plain HTTP endpoints: chats, sources, config, suggestions, cancel, health."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import orjson
from starlette.datastructures import MutableHeaders, UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..chat.records import Chat, FileRecord, StoredMessage, iso
from ..chat.service import ChatService
from ..errors import BadRequest, Forbidden, NotFound
from ..events import FOCUS_MODES
from ..extract import kind_of
from ..files.service import clean_name
from ..ids import is_number, parse_id
from ..model import is_demo
from ..model.providers import stored_choice
from ..protocol import FORMATS, OPTIMIZATION_MODES, parse_control, parse_history, parse_messages
from ..search.web import choose_provider, search_problem
from .http import (
    ANONYMOUS,
    MAX_FILES_PER_UPLOAD,
    client_identity,
    count_request,
    current_user,
    error_response,
    json_errors,
    read_form,
    read_json,
    restricted,
)
from .perplexica import chat_providers, settings_view

WEB_INDEX = Path(__file__).resolve().parent.parent / "web" / "index.html"

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
    if not is_number(limit, 4) or not 1 <= int(limit) <= 1000:
        raise BadRequest("limit must be a number from 1 to 1000")
    chats, files = await _service(request).list_chats(_user(request), int(limit))
    return JSONResponse({"chats": [chat_json(chat, files.get(chat.id, [])) for chat in chats]})


@json_errors
async def get_chat(request: Request) -> Response:
    chat_id = parse_id(request.path_params["chat_id"], "chatId")
    chat, messages, files = await _service(request).open_chat(chat_id, _user(request))
    questions = {m.id: m for m in messages if m.role == "user"}
    return JSONResponse(
        {
            "chat": chat_json(chat, files),
            "messages": [message_json(m, questions.get(m.reply_to or "")) for m in messages],
        }
    )


def chat_json(chat: Chat, files: list[FileRecord]) -> dict[str, Any]:
    """A chat as PROTOCOL §6 shows it."""
    return {
        "id": chat.id,
        "userId": chat.user_id,
        "title": chat.title,
        "focusMode": chat.focus_mode,
        "createdAt": iso(chat.created_at),
        "files": [{"fileId": f.id, "name": f.name} for f in files],
    }


def message_json(message: StoredMessage, question: StoredMessage | None) -> dict[str, Any]:
    """A message as PROTOCOL §6 shows it: an answer carries its question's sources, and
    `metadata` is a JSON string (the Perplexica UI parses it)."""
    sources = question.sources if question is not None else message.sources
    created = iso(message.created_at)
    out: dict[str, Any] = {
        "id": message.id,
        "messageId": message.id,
        "chatId": message.chat_id,
        "role": message.role,
        "content": message.content,
        "sources": sources,
        "status": message.status,
        "createdAt": created,
        "metadata": orjson.dumps(
            {"createdAt": created, "sources": sources if message.role == "assistant" else []}
            | answered_by(message)
            | ({"truncated": True} if message.truncated else {})
        ).decode(),
    }
    if message.role == "assistant":
        out["reasoning"] = message.reasoning
        out["questionMessageId"] = message.reply_to
        out["steps"] = message.steps  # its progress lines, as they came
        out["error"] = message.error  # {"key", "data"} when it failed, else null
    elif message.rewritten is not None:
        out["rewritten"] = message.rewritten
    return out


async def providers(request: Request) -> Response:
    """`GET /api/providers` (PROTOCOL §13): every model the caller may choose, by
    provider, with each provider's status. The first listing is waited for a little
    (a provider that is down refuses at once or times out alone); never a key."""
    registry = _service(request).models
    await registry.first_listing()
    return JSONResponse(registry.to_json(restricted=restricted(request)))


@json_errors
async def mcp_servers(request: Request) -> Response:
    """`GET /api/mcp/servers` (PROTOCOL §14): each configured MCP server, its status and
    its tools; for an admin, or anyone with auth off. Never a URL or a header."""
    identity = request.app.state.identity
    if identity.mode != "off":
        user = current_user(request)
        if user is None or not user.is_admin:
            raise Forbidden("only an admin may see the MCP servers")
    return JSONResponse({"servers": _service(request).mcp_servers()})


def answered_by(message: StoredMessage) -> dict[str, Any]:
    """`{"chatModel": {"provider", "model"}}` of an answer whose model is known."""
    chosen = stored_choice(message.model) if message.role == "assistant" else None
    return {"chatModel": chosen} if chosen else {}


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
    """`GET /api/config`: what clients may choose (never a key), with what the
    Perplexica UI's settings page reads."""
    settings = request.app.state.settings
    return JSONResponse(
        {
            **settings_view(settings, chat_providers(request)),
            "focusModes": list(FOCUS_MODES),
            "optimizationModes": list(OPTIMIZATION_MODES),
            "formats": list(FORMATS),
            "searchProvider": choose_provider(settings).name,
            "searchProblem": search_problem(settings) or request.app.state.service.search_problem,
            "readerProvider": settings.reader.provider,
            "chatModel": settings.llm.model,
            "smallModel": settings.llm.effective_small_model,
            "embeddingModel": settings.embeddings.model,
            "authRequired": request.app.state.identity.enabled,
            "authMode": request.app.state.identity.mode,
            "demo": is_demo(settings.llm.base_url),
            "modelProblem": request.app.state.service.model_problem,
            # the source picker's MCP servers: names only (`sources: ["mcp:<name>"]`)
            "mcpServers": [
                {"name": s["name"], "default": s["default"]}
                for s in request.app.state.service.mcp_servers()
            ],
        }
    )


@json_errors
async def suggestions(request: Request) -> Response:
    settings = request.app.state.settings
    body = await read_json(request, settings.limits.max_body_bytes)
    if not isinstance(body, dict):
        raise BadRequest("request must be a JSON object")
    limits = settings.limits
    history = parse_history(
        body.get("history"), limits.max_history_messages, limits.max_content_chars
    )
    if history is None and body.get("chatHistory") is not None:  # the Perplexica UI's
        history = parse_messages(
            body["chatHistory"], limits.max_history_messages, limits.max_content_chars
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
    chosen = suggesting_model(request, body.get("chatModel"))
    return JSONResponse({"suggestions": await service.suggestions(history, chosen)})


def suggesting_model(request: Request, value: Any) -> tuple[str, str] | None:
    """The model whose provider suggests (`chatModel`, as an answer names it, or as the
    Perplexica UI does with its provider's name); None (the default's) when it names
    none the caller may use."""
    if not isinstance(value, dict) or not isinstance(value.get("model"), str):
        return None
    provider = value.get("provider")
    return _service(request).models.find(
        value["model"],
        provider if isinstance(provider, str) else None,
        restricted=restricted(request),
    )


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
    ready: dict[str, object] = {"status": "ready"}
    warnings = {"model": service.model_problem, "search": service.search_problem}
    if any(warnings.values()):  # ready all the same: either may come back
        ready["warnings"] = {name: text for name, text in warnings.items() if text}
    return JSONResponse(ready)


async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.metrics.render()
    return Response(body, media_type=content_type)


class HtmlHeaders:
    """ASGI wrapper (for the static files) that puts `HTML_HEADERS` on HTML responses."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if headers.get("content-type", "").startswith("text/html"):
                    headers.update(HTML_HEADERS)
            await send(message)

        await self.app(scope, receive, sending)


async def web_client(request: Request) -> Response:
    """The browser client (static files under /static)."""
    return FileResponse(WEB_INDEX, headers={"Cache-Control": "no-cache", **HTML_HEADERS})


# -- uploads ------------------------------------------------------------------------------


@json_errors
async def upload(request: Request) -> Response:
    """`POST /api/uploads` (multipart `files`, one part per file): each file read,
    chunked and indexed, owned by the uploader → `{"files": [{fileName,
    fileExtension, fileId, …}]}`. A file it will not take is a 4xx naming it, and
    nothing of that request is kept. `?wait=false` answers 202 at once (`status:
    indexing`); poll `GET /api/uploads/{fileId}`."""
    settings = request.app.state.settings
    limit = settings.uploads.max_file_bytes * MAX_FILES_PER_UPLOAD
    form = await read_form(request, limit)
    try:
        parts = [p for p in form.getlist("files") if isinstance(p, UploadFile)]
        if not parts:
            raise BadRequest("send the files as multipart form parts named 'files'")
        if len(parts) > MAX_FILES_PER_UPLOAD:
            raise BadRequest(f"at most {MAX_FILES_PER_UPLOAD} files per upload")
        claimed = form.get("userId") or request.query_params.get("userId")
        user_id = client_identity(request, claimed if isinstance(claimed, str) else None)
        await count_request(request)
        files = [(clean_name(p.filename or "file"), await p.read()) for p in parts]
    finally:
        await form.close()
    service = _service(request)
    for name, data in files:  # refuse the whole upload before storing any of it
        kind_of(name)
        if len(data) > settings.uploads.max_file_bytes:
            raise BadRequest(
                f"{name!r} is larger than {settings.uploads.max_file_bytes} bytes", status=413
            )
    wait = request.query_params.get("wait", "true").lower() not in ("false", "0", "no")
    if wait:
        records = [await service.files.upload(user_id, name, data) for name, data in files]
    else:
        records = [await service.files.upload_later(user_id, name, data) for name, data in files]
    return JSONResponse(
        {
            "files": [
                {
                    "fileName": r.name,
                    "fileExtension": r.extension,
                    "fileId": r.id,
                    **r.to_json(),
                }
                for r in records
            ]
        },
        status_code=200 if wait else 202,
    )


@json_errors
async def list_uploads(request: Request) -> Response:
    files = await _service(request).files.list_files(_user(request))
    return JSONResponse({"files": [f.to_json() for f in files]})


@json_errors
async def get_upload(request: Request) -> Response:
    file_id = parse_id(request.path_params["file_id"], "fileId")
    record = await _service(request).files.owned(_user(request), file_id)
    return JSONResponse(record.to_json())


@json_errors
async def delete_upload(request: Request) -> Response:
    file_id = parse_id(request.path_params["file_id"], "fileId")
    await _service(request).files.delete(_user(request), file_id)
    return JSONResponse({"fileId": file_id, "deleted": True})
