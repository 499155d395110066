"""What every HTTP endpoint shares: body limits, the error body, the caller's identity."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..auth import Auth
from ..errors import AppError, BadRequest
from ..protocol import ChatRequest, error_body, loads, parse_id

log = logging.getLogger("app.http")

Endpoint = Callable[[Request], Awaitable[Response]]


def error_response(exc: AppError, **extra: Any) -> JSONResponse:
    headers = {}
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return JSONResponse(error_body(exc, **extra), status_code=exc.status, headers=headers)


def json_errors(endpoint: Endpoint) -> Endpoint:
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


def client_identity(request: HTTPConnection, claimed: Any) -> str | None:
    """The user a request acts as: the API key's user when auth is on (a different
    `claimed` id is Forbidden), else the id the request names, if any."""
    claimed_id = None if claimed in (None, "") else parse_id(claimed, "userId", allow_zero=True)
    return Auth.resolve(request.scope.get("user_id"), claimed_id)


def request_user(request: HTTPConnection, chat_request: ChatRequest, body: Any) -> ChatRequest:
    """A chat request acting as its caller (see `client_identity`)."""
    claimed = body.get("userId") if isinstance(body, dict) else None
    user = client_identity(request, claimed)
    return replace(chat_request, user_id=user) if user is not None else chat_request


def rate_key(request: HTTPConnection) -> str:
    """Whom a rate limit counts: the user when auth is on, else the client address."""
    user = request.scope.get("user_id")
    if user is not None:
        return f"user:{user}"
    return f"ip:{request.client.host if request.client else 'unknown'}"


async def count_request(request: HTTPConnection) -> None:
    """One request that starts model work; RateLimited past `limits.requests_per_minute`."""
    await request.app.state.limiter.hit(rate_key(request))


class AuthMiddleware:
    """With auth on, `/api/*` and `/sources/*` need a valid key (401 otherwise); the
    key's user is put in the scope as `user_id`. WebSockets authenticate in their
    endpoint, where a refusal can be an error frame."""

    PROTECTED = ("/api/", "/sources/")

    def __init__(self, app: ASGIApp, auth: Auth) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.auth.enabled
            and scope["type"] == "http"
            and scope["method"] != "OPTIONS"
            and scope["path"].startswith(self.PROTECTED)
        ):
            request = Request(scope)
            token = (
                request.query_params.get("token") if scope["path"].startswith("/sources/") else None
            )
            try:
                scope["user_id"] = self.auth.authenticate(
                    request.headers.get("authorization"), token
                )
            except AppError as exc:
                await error_response(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)
