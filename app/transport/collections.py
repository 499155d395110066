"""The knowledge collections endpoints (PROTOCOL §12). The user of a request is
`client_identity`'s (§7): with auth off the `userId` of the query or the JSON body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..collections.service import CollectionService
from ..errors import AppError, BadRequest
from ..files.service import clean_name
from ..protocol import error_body, parse_id
from .http import client_identity, count_request, json_errors, read_json

PROGRESS_POLL_SECONDS = 0.25
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
    body = await read_json(request, request.app.state.settings.limits.max_body_bytes)
    if not isinstance(body, dict):
        raise BadRequest("request must be a JSON object")
    return body


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
    202 `{"import": {"id", "documents"}, "documents": [...], "failed": [...]}`."""
    service = _service(request)
    collection_id = _id(request)
    if "multipart/form-data" in request.headers.get("content-type", ""):
        from ..api import read_form

        limit = service.settings.max_import_bytes
        form = await read_form(request, limit, max_files=service.settings.max_import_files)
        try:
            parts = [p for p in form.getlist("files") if isinstance(p, UploadFile)]
            claimed = form.get("userId") or request.query_params.get("userId")
            user_id = client_identity(request, claimed if isinstance(claimed, str) else None)
            await count_request(request)
            files = [(clean_name(p.filename or "file"), await p.read()) for p in parts]
        finally:
            await form.close()
        import_id, records = await service.import_files(user_id, collection_id, files)
    else:
        body = await _body(request)
        await count_request(request)
        import_id, records = await service.import_urls(
            _user(request, body), collection_id, body.get("urls")
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
    """`{"done", "total", "failed"}`; with `?stream=true` SSE `progress` events, one per
    change, until the import has ended (the last one has `done == total`)."""
    service, user_id, collection_id = _service(request), _user(request), _id(request)
    import_id = parse_id(request.path_params["import_id"], "importId")
    first = await service.progress(user_id, collection_id, import_id)
    if request.query_params.get("stream", "").lower() not in ("true", "1", "yes"):
        return JSONResponse(first.to_json())

    async def events() -> AsyncIterator[bytes]:
        last: dict[str, Any] | None = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PROGRESS_MAX_SECONDS
        progress = first
        while True:
            now = progress.to_json()
            if now != last:
                yield b"event: progress\ndata: " + orjson.dumps(now) + b"\n\n"
                last = now
            if progress.done >= progress.total or loop.time() > deadline:
                return
            await asyncio.sleep(PROGRESS_POLL_SECONDS)
            try:
                progress = await service.progress(user_id, collection_id, import_id)
            except AppError as exc:
                yield b"event: error\ndata: " + orjson.dumps(error_body(exc)) + b"\n\n"
                return

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
    return JSONResponse(
        {
            "results": [
                {
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
                for r in found
            ]
        }
    )
