"""Share links and exports (PROTOCOL §15): `/api/chats/{id}/share`, `/api/shares`,
`/api/chats/{id}/export` for a chat's owner, and `/s/{shareId}` for anyone with the
link (no sign-in: the auth middleware guards only the API's prefixes)."""

from __future__ import annotations

import re
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from ..chat.records import iso
from ..chat.shares import Shares
from ..errors import BadRequest, NotFound
from ..ids import parse_id
from .http import client_identity, error_response, json_errors, read_object
from .share_page import PAGE_HEADERS, share_markdown, share_page, snapshot_json

#: an id `secrets.token_urlsafe` makes, and nothing else
SHARE_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")
#: what a file name keeps of a title (ASCII; the rest goes in `filename*`)
UNSAFE_NAME = re.compile(r"[^A-Za-z0-9 ._-]+")
EXPORTS = ("md", "json", "html")
MARKDOWN = "text/markdown; charset=utf-8"
MAX_FILE_NAME = 80


def _shares(request: Request) -> Shares:
    """The shares, or NotFound (as an unknown route) with `share.enabled` off."""
    if not request.app.state.settings.share.enabled:
        raise NotFound("no such route")
    shares: Shares = request.app.state.shares
    return shares


def share_url(request: Request, share_id: str) -> str:
    """`<public_url>/s/<shareId>`: `server.public_url`, else the request's own origin."""
    base = request.app.state.settings.server.public_url.rstrip("/")
    if not base:
        base = f"{request.url.scheme}://{request.url.netloc}"
    return f"{base}/s/{share_id}"


@json_errors
async def share(request: Request) -> Response:
    """`POST /api/chats/{id}/share` `{"displayName"?}` → 201 `{"shareId", "url"}`."""
    shares = _shares(request)
    chat_id = parse_id(request.path_params["chat_id"], "chatId")
    body = await read_object(request, optional=True)
    user = client_identity(request, body.get("userId"))
    record = await shares.share(chat_id, user, body.get("displayName"))
    return JSONResponse(
        {"shareId": record.id, "url": share_url(request, record.id)}, status_code=201
    )


@json_errors
async def unshare(request: Request) -> Response:
    """`DELETE /api/chats/{id}/share` → 204; the link is gone everywhere."""
    shares = _shares(request)
    chat_id = parse_id(request.path_params["chat_id"], "chatId")
    await shares.unshare(chat_id, client_identity(request, request.query_params.get("userId")))
    return Response(status_code=204)


@json_errors
async def list_shares(request: Request) -> Response:
    """`GET /api/shares` → the user's shared chats."""
    shares = _shares(request)
    user = client_identity(request, request.query_params.get("userId"))
    return JSONResponse(
        {
            "shares": [
                {
                    "shareId": s.id,
                    "chatId": s.chat_id,
                    "title": s.title,
                    "url": share_url(request, s.id),
                    "createdAt": iso(s.created_at),
                    "updatedAt": iso(s.updated_at),
                }
                for s in await shares.of_user(user)
            ]
        }
    )


async def shared(request: Request) -> Response:
    """`GET /s/{shareId}` (the page; JSON when asked for), `/s/{shareId}.json`,
    `/s/{shareId}.md`. No sign-in: the id is the capability."""
    share_id, dot, ext = request.path_params["share_id"].partition(".")
    if not dot and "application/json" in request.headers.get("accept", ""):
        ext = "json"
    try:
        if not SHARE_ID.fullmatch(share_id) or ext not in ("", "json", "md"):
            raise NotFound("this chat is not shared (any more)")
        snapshot = await _shares(request).shared(share_id)
    except NotFound as exc:
        if ext:
            return error_response(exc)
        return HTMLResponse(GONE_PAGE, status_code=404, headers=_page_headers(request))
    if ext == "json":
        return JSONResponse(snapshot_json(snapshot), headers=_page_headers(request))
    if ext == "md":
        return PlainTextResponse(
            share_markdown(snapshot),
            media_type=MARKDOWN,
            headers=_page_headers(request),
        )
    page = share_page(
        snapshot,
        url=share_url(request, share_id),
        indexable=request.app.state.settings.share.indexable,
    )
    return HTMLResponse(page, headers=_page_headers(request))


GONE_PAGE = (
    '<!doctype html><html lang="en"><meta charset="utf-8"><title>Not shared</title>'
    "<p>This chat is not shared (any more).</p></html>"
)


def _page_headers(request: Request) -> dict[str, str]:
    headers = {**PAGE_HEADERS, "Cache-Control": "no-store"}
    if not request.app.state.settings.share.indexable:
        headers["X-Robots-Tag"] = "noindex"
    return headers


@json_errors
async def export(request: Request) -> Response:
    """`GET /api/chats/{id}/export?format=md|json|html` → the chat as an attachment."""
    fmt = request.query_params.get("format", "md")
    if fmt not in EXPORTS:
        raise BadRequest("format must be md, json or html")
    chat_id = parse_id(request.path_params["chat_id"], "chatId")
    user = client_identity(request, request.query_params.get("userId"))
    snapshot = await request.app.state.shares.export(chat_id, user)
    headers = {**PAGE_HEADERS, "Content-Disposition": attachment(snapshot.chat.title, fmt)}
    if fmt == "json":
        return JSONResponse(snapshot_json(snapshot, owner=True), headers=headers)
    if fmt == "md":
        return Response(share_markdown(snapshot), media_type=MARKDOWN, headers=headers)
    return HTMLResponse(share_page(snapshot), headers=headers)


def attachment(title: str, ext: str) -> str:
    """A `Content-Disposition` naming the file after the title: an ASCII `filename`
    (what cannot be said in it replaced) and RFC 5987's `filename*` with the title as
    it is (less what a file name cannot hold)."""
    plain = " ".join(title.split())
    ascii_name = UNSAFE_NAME.sub("_", plain).strip(" ._")[:MAX_FILE_NAME].strip() or "chat"
    full = re.sub(r'[\x00-\x1f\x7f/\\:*?"<>|]+', "_", plain).strip(" .")[:MAX_FILE_NAME] or "chat"
    value = f'attachment; filename="{ascii_name}.{ext}"'
    if full != ascii_name:
        value += f"; filename*=UTF-8''{quote(full + '.' + ext, safe='')}"
    return value
