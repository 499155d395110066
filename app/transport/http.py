"""What every HTTP endpoint shares: body limits, the error body, the caller's identity."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ..errors import AppError, BadRequest
from ..protocol import error_body, loads, parse_id

log = logging.getLogger("app.http")

Endpoint = Callable[[Request], Awaitable[Response]]


def error_response(exc: AppError, **extra: Any) -> JSONResponse:
    headers = {}
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return JSONResponse(error_body(exc, **extra), status_code=exc.status, headers=headers)


def guard(endpoint: Endpoint) -> Endpoint:
    """Turn an `AppError` raised before a response starts into its JSON error body."""

    @functools.wraps(endpoint)
    async def wrapper(request: Request) -> Response:
        try:
            return await endpoint(request)
        except AppError as exc:
            request.app.state.metrics.errors.labels(exc.key).inc()
            return error_response(exc)

    return wrapper


async def read_json(request: Request, max_bytes: int) -> Any:
    """The decoded JSON body; 413 `BAD_REQUEST` past `max_bytes`, 400 when not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BadRequest(f"body is larger than {max_bytes} bytes", status=413)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise BadRequest(f"body is larger than {max_bytes} bytes", status=413)
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise BadRequest("the client went away while sending the body") from exc
    if not size:
        raise BadRequest("body is empty: send the request as JSON")
    return loads(b"".join(chunks))


def client_identity(request: Request, claimed: str | None) -> str | None:
    """The caller's user id: the one the request names, if any, as a decimal id."""
    if claimed in (None, ""):
        return None
    return parse_id(claimed, "userId", allow_zero=True)
