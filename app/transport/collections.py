"""The knowledge collections endpoints (PROTOCOL §12), and the groups they can be
shared with. The user of a request is `client_identity`'s (§7): with auth off the
`userId` of the query or the JSON body.

Groups: `GET /api/groups` lists the caller's; the admin (`auth.mode = "accounts"`)
manages them at `GET/POST /api/admin/groups` and `PATCH/DELETE /api/admin/groups/{id}`
(`{"name", "members": [userId, …]}`). A collection's owner shares it with groups by
`PATCH {"groups": [groupId, …]}`, beside `shared` (user ids).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..collections.service import CollectionService
from ..config import auth_mode
from ..errors import AppError, BadRequest, Forbidden, Unauthorized
from ..files.service import clean_name
from ..ids import parse_id
from ..protocol import error_body
from ..results import SearchResult
from .http import (
    client_identity,
    count_request,
    current_user,
    json_errors,
    rate_key,
    read_form,
    read_object,
)

PROGRESS_MAX_SECONDS = 3600.0
MAX_SEARCH_RESULTS = 50


def _service(request: Request) -> CollectionService:
    service: CollectionService = request.app.state.collections
    return service


def _user(request: Request, body: Any = None) -> str:
    claimed = body.get("userId") if isinstance(body, dict) else None
    return client_identity(request, claimed or request.query_params.get("userId"))


def _id(request: Request) -> str:
    return parse_id(request.path_params["collection_id"], "collectionId")


async def _body(request: Request) -> dict[str, Any]:
    return await read_object(request)


@json_errors
async def create(request: Request) -> Response:
    body = await _body(request)
    record = await _service(request).create(
        _user(request, body), body.get("name"), body.get("description", "")
    )
    return JSONResponse({"collection": record.to_json()}, status_code=201)


@json_errors
async def listed(request: Request) -> Response:
    records = await _service(request).listed(_user(request))
    return JSONResponse({"collections": [r.to_json() for r in records]})


@json_errors
async def get(request: Request) -> Response:
    record = await _service(request).readable(_user(request), _id(request))
    return JSONResponse({"collection": record.to_json()})


@json_errors
async def update(request: Request) -> Response:
    body = await _body(request)
    record = await _service(request).update(_user(request, body), _id(request), body)
    return JSONResponse({"collection": record.to_json()})


@json_errors
async def delete(request: Request) -> Response:
    collection_id = _id(request)
    await _service(request).delete(_user(request), collection_id)
    return JSONResponse({"id": collection_id, "deleted": True})


@json_errors
async def add_documents(request: Request) -> Response:
    """Multipart `files` (a `.zip` opens into its folder tree), or JSON `{"urls"}` →
    202 `{"import": {"id", "documents"}, "documents": [...], "failed": [...]}`.

    Before the body is read: room for one more import (429 / 503 with Retry-After),
    and — when the user is known without the body (auth on, or `?userId=`) — that
    they own the collection. The files are spooled to disk as they arrive."""
    service = _service(request)
    collection_id = _id(request)
    async with service.importing(rate_key(request)) as slot:
        if "multipart/form-data" in request.headers.get("content-type", ""):
            if request.scope.get("user_id") is not None or "userId" in request.query_params:
                await service.owned(_user(request), collection_id)
            limit = service.settings.max_import_bytes
            form = await read_form(request, limit, max_files=service.settings.max_import_files)
            try:
                parts = [p for p in form.getlist("files") if isinstance(p, UploadFile)]
                claimed = form.get("userId") or request.query_params.get("userId")
                user_id = client_identity(request, claimed if isinstance(claimed, str) else None)
                await count_request(request)
                files = [(clean_name(p.filename or "file"), p.file) for p in parts]
                import_id, records = await service.import_files(user_id, collection_id, files, slot)
            finally:
                await form.close()
        else:
            body = await _body(request)
            await count_request(request)
            import_id, records = await service.import_urls(
                _user(request, body), collection_id, body.get("urls"), slot
            )
    failed = [r for r in records if r.status == "failed"]
    return JSONResponse(
        {
            "import": {"id": import_id, "documents": len(records)},
            "documents": [r.to_json() for r in records],
            "failed": [{"name": r.title, "error": r.error, "status": r.code} for r in failed],
        },
        status_code=202,
    )


@json_errors
async def documents(request: Request) -> Response:
    records = await _service(request).documents(_user(request), _id(request))
    return JSONResponse({"documents": [r.to_json() for r in records]})


@json_errors
async def delete_document(request: Request) -> Response:
    document_id = parse_id(request.path_params["document_id"], "documentId")
    await _service(request).delete_document(_user(request), _id(request), document_id)
    return JSONResponse({"id": document_id, "deleted": True})


@json_errors
async def import_progress(request: Request) -> Response:
    """`{"done", "total", "failed"}`; with `?stream=true` SSE: `retry:` once (in the first block), then a
    `progress` event (its `id` the documents ended) per change until the import has
    ended. A reconnect (`Last-Event-ID`, or `?lastEventId=`) at or past the end of an
    import that has ended is `204 No Content`, which stops a browser's EventSource
    (as §5's resume); one that missed the end gets it, then the stream closes."""
    service, user_id, collection_id = _service(request), _user(request), _id(request)
    import_id = parse_id(request.path_params["import_id"], "importId")
    first = await service.progress(user_id, collection_id, import_id)
    if request.query_params.get("stream", "").lower() not in ("true", "1", "yes"):
        return JSONResponse(first.to_json())
    last_id = request.headers.get("last-event-id") or request.query_params.get("lastEventId")
    if first.ended and last_id is not None and last_id.isdigit() and int(last_id) >= first.done:
        return Response(status_code=204)  # it has seen the end
    retry_ms = request.app.state.settings.stream.retry_ms

    async def events() -> AsyncIterator[bytes]:
        retry = b"retry: %d\n" % retry_ms  # in the first event's block: none without data
        try:
            async with asyncio.timeout(PROGRESS_MAX_SECONDS):
                async for progress in service.follow(user_id, collection_id, import_id):
                    retry, first = b"", retry
                    yield (
                        first
                        + b"event: progress\nid: %d\ndata: " % progress.done
                        + orjson.dumps(progress.to_json())
                        + b"\n\n"
                    )
        except TimeoutError:
            return
        except AppError as exc:
            yield b"event: error\ndata: " + orjson.dumps(error_body(exc)) + b"\n\n"

    return StreamingResponse(
        events(),
        media_type="text/event-stream; charset=utf-8",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )


@json_errors
async def search(request: Request) -> Response:
    body = await _body(request)
    query = body.get("query")
    if not isinstance(query, str) or not query.strip():
        raise BadRequest("query must be a non-empty string")
    limit = body.get("limit", 10)
    if (
        not isinstance(limit, int)
        or isinstance(limit, bool)
        or not 1 <= limit <= MAX_SEARCH_RESULTS
    ):
        raise BadRequest(f"limit must be a number from 1 to {MAX_SEARCH_RESULTS}")
    service = _service(request)
    record = await service.readable(_user(request, body), _id(request))
    await count_request(request)
    found = await service.searcher([record], limit)(query)
    return JSONResponse({"results": [passage(r) for r in found]})


def passage(r: SearchResult) -> dict[str, Any]:
    """A collection's passage as its search answers it (PROTOCOL §12)."""
    return {
        "metadata": {
            "title": r.title,
            "url": r.url,
            "collectionId": r.collection_id,
            "documentId": r.document_id,
            "page": r.page,
        },
        "pageContent": r.snippet,
        "score": r.score,
    }


# -- groups -------------------------------------------------------------------------------------


def _admin(request: Request) -> None:
    """Groups are the admin's, with accounts (`auth.mode = "accounts"`): 401 signed
    out, 403 for anyone else, and 403 without accounts (no admin to manage them)."""
    user = current_user(request)
    if auth_mode(request.app.state.settings.auth) != "accounts":
        raise Forbidden("groups need accounts (auth.mode = accounts)")
    if user is None:
        raise Unauthorized("sign in first")
    if not user.is_admin:
        raise Forbidden("only an admin may do this")


def _group_id(request: Request) -> str:
    return parse_id(request.path_params["group_id"], "groupId")


@json_errors
async def my_groups(request: Request) -> Response:
    """`GET /api/groups` → the groups the caller is in (ids to share collections with)."""
    groups = await _service(request).groups(_user(request))
    return JSONResponse({"groups": [g.to_json() for g in groups]})


@json_errors
async def admin_groups(request: Request) -> Response:
    _admin(request)
    groups = await _service(request).all_groups()
    return JSONResponse({"groups": [g.to_json() for g in groups]})


@json_errors
async def admin_create_group(request: Request) -> Response:
    _admin(request)
    body = await _body(request)
    record = await _service(request).create_group(body.get("name"), body.get("members"))
    return JSONResponse({"group": record.to_json()}, status_code=201)


@json_errors
async def admin_change_group(request: Request) -> Response:
    _admin(request)
    body = await _body(request)
    record = await _service(request).change_group(_group_id(request), body)
    return JSONResponse({"group": record.to_json()})


@json_errors
async def admin_delete_group(request: Request) -> Response:
    _admin(request)
    group_id = _group_id(request)
    await _service(request).delete_group(group_id)
    return JSONResponse({"id": group_id, "deleted": True})
