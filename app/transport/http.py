"""What every HTTP endpoint shares: body limits, the error body, the caller's identity."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..auth import Auth
from ..errors import AppError, BadRequest, Unauthorized, UnknownModel
from ..identity import User
from ..identity.resolver import SAFE_METHODS, Identity
from ..ids import is_number, parse_id
from ..protocol import ChatRequest, error_body, loads

log = logging.getLogger("app.http")

#: the user of a request without auth and without a `userId`
ANONYMOUS = "0"
#: where the request's authenticated `User` is kept in the ASGI scope (and its id under
#: "user_id")
USER = "searchchat.user"
#: how much of an over-large body is read and dropped before the 413
DRAIN_BYTES = 64 * 1024 * 1024
DRAIN_SECONDS = 10.0
#: the most files one multipart upload may carry
MAX_FILES_PER_UPLOAD = 10

Endpoint = Callable[[Request], Awaitable[Response]]


def error_response(exc: AppError, **extra: Any) -> JSONResponse:
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    return JSONResponse(error_body(exc, **extra), status_code=exc.status, headers=headers)


#: our error keys → OpenAI's error type and code
ERROR_TYPES = {
    "BAD_REQUEST": ("invalid_request_error", None),
    "UNAUTHORIZED": ("invalid_request_error", "invalid_api_key"),
    "FORBIDDEN": ("permission_error", None),
    "NOT_FOUND": ("invalid_request_error", None),
    "RATE_LIMITED": ("rate_limit_error", "rate_limit_exceeded"),
    "CONFIG_ERROR": ("server_error", "not_configured"),
    "CHAT_ERROR": ("api_error", "upstream_unreachable"),
    "STREAM_ERROR": ("api_error", "upstream_error"),
    "SEARCH_ERROR": ("api_error", "search_error"),
    "INTERNAL": ("server_error", None),
}


def openai_error(exc: AppError) -> JSONResponse:
    """An error in OpenAI's shape, with its HTTP status (and `Retry-After`)."""
    kind, code = ERROR_TYPES.get(exc.key, ("server_error", None))
    if isinstance(exc, UnknownModel):
        code = "model_not_found"
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    body = {"error": {"message": exc.message, "type": kind, "code": code}}
    return JSONResponse(body, status_code=exc.status, headers=headers)


def answering_errors(
    render: Callable[[AppError], Response],
) -> Callable[[Endpoint], Endpoint]:
    """A decorator that turns an error raised before a response starts into the body
    `render` makes of it: an `AppError` as it says, anything else (a bug) as 500
    `INTERNAL`, logged."""

    def decorate(endpoint: Endpoint) -> Endpoint:
        @functools.wraps(endpoint)
        async def wrapper(request: Request) -> Response:
            try:
                return await endpoint(request)
            except AppError as exc:
                request.app.state.metrics.errors.labels(exc.key).inc()
                return render(exc)
            except Exception:
                log.exception("%s %s failed", request.method, request.url.path)
                request.app.state.metrics.errors.labels("INTERNAL").inc()
                return render(AppError("internal error"))

        return wrapper

    return decorate


#: the chat API's JSON error bodies (PROTOCOL §1)
json_errors = answering_errors(error_response)
#: OpenAI's error shape, for the `/v1` API (PROTOCOL §10)
openai_errors = answering_errors(openai_error)


async def read_json(
    request: Request, max_bytes: int, *, setting: str = "limits.max_body_bytes"
) -> Any:
    """The decoded JSON body; 413 `BAD_REQUEST` past `max_bytes` (naming the `setting`
    that says so, if any), 400 when not JSON.

    An over-large body is read to its end (up to `DRAIN_BYTES`, `DRAIN_SECONDS`) and
    dropped before the 413 goes out: a server that answers and closes while the
    client still sends makes the kernel reset the connection, and many clients
    then report a broken connection instead of the 413."""
    declared = request.headers.get("content-length")
    too_large = declared is not None and is_number(declared) and int(declared) > max_bytes
    chunks, size = [], 0
    try:
        async with asyncio.timeout(DRAIN_SECONDS if too_large else None):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    too_large = True
                if too_large:
                    if size > DRAIN_BYTES:
                        break
                    continue
                chunks.append(chunk)
    except ClientDisconnect as exc:
        raise BadRequest("the client went away while sending the body") from exc
    except TimeoutError:
        pass  # a slow over-large body: answer now
    if too_large:
        named = f" (the server's {setting})" if setting else ""
        raise BadRequest(f"body is larger than {max_bytes} bytes{named}", status=413)
    if not size:
        raise BadRequest("body is empty: send the request as JSON")
    return loads(b"".join(chunks))


async def read_object(request: Request, *, optional: bool = False) -> dict[str, Any]:
    """The JSON object of a request's body, within `limits.max_body_bytes` (400 for
    another JSON value; see `read_json`); with `optional`, {} for a request that sends
    no body."""
    length = request.headers.get("content-length")
    if optional and length in (None, "0") and "transfer-encoding" not in request.headers:
        return {}
    body = await read_json(request, request.app.state.settings.limits.max_body_bytes)
    if not isinstance(body, dict):
        raise BadRequest("request must be a JSON object")
    return body


async def read_form(
    request: Request, limit: int, max_files: int = MAX_FILES_PER_UPLOAD
) -> FormData:
    """A multipart body of at most `limit` bytes and `max_files` files (413 past the
    size, read to its end first)."""
    declared = request.headers.get("content-length")
    if declared is not None and is_number(declared) and int(declared) > limit:
        await read_json(request, limit, setting="")  # reads it to its end, then says 413
    size = 0

    async def bounded() -> AsyncGenerator[bytes, None]:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(f"upload is larger than {limit} bytes", status=413)
            yield chunk

    if "multipart/form-data" not in request.headers.get("content-type", ""):
        raise BadRequest("send the files as multipart/form-data", status=415)
    try:
        parser = MultiPartParser(request.headers, bounded(), max_files=max_files, max_fields=20)
        return await parser.parse()
    except MultiPartException as exc:
        raise BadRequest(f"the upload is not valid multipart: {exc.message}") from exc


def current_user(request: HTTPConnection) -> User | None:
    """The request's authenticated user (None with auth off)."""
    user: User | None = request.scope.get(USER)
    return user


def set_user(scope: Scope, user: User | None) -> None:
    if user is not None:
        scope[USER] = user
        scope["user_id"] = user.id


def client_identity(request: HTTPConnection, claimed: Any) -> str:
    """The user a request acts as (PROTOCOL §7): the API key's user when auth is on (a
    different `claimed` id is Forbidden); with auth off the id the request names,
    and `"0"` when it names none — never "anyone"."""
    claimed_id = None if claimed in (None, "") else parse_id(claimed, "userId")
    return Auth.resolve(request.scope.get("user_id"), claimed_id) or ANONYMOUS


def request_user(request: HTTPConnection, chat_request: ChatRequest, body: Any) -> ChatRequest:
    """A chat request acting as its caller (see `client_identity`), counted by the
    concurrency cap under `rate_key`."""
    claimed = body.get("userId") if isinstance(body, dict) else None
    return replace(
        chat_request,
        user_id=client_identity(request, claimed),
        cap_key=rate_key(request),
        restricted=restricted(request),
    )


def restricted(request: HTTPConnection) -> bool:
    """Whether the caller may not use the providers kept for admins: with accounts,
    anyone but an admin."""
    if request.app.state.identity.mode != "accounts":
        return False
    user = current_user(request)
    return user is None or not user.is_admin


def rate_key(request: HTTPConnection) -> str:
    """Whom rate limits and the concurrency cap count: the key's user when auth is on,
    else the client address (a claimed `userId` proves nothing). Behind a trusted
    proxy (`server.trusted_proxies`), the server already took the address from the
    rightmost `X-Forwarded-For` entry."""
    user = request.scope.get("user_id")
    if user is not None:
        return f"user:{user}"
    return f"ip:{request.client.host if request.client else 'unknown'}"


async def count_request(request: HTTPConnection) -> None:
    """One request that starts model work: `RateLimited` past `limits.requests_per_minute`,
    or once an authenticated user's answers used their daily token quota (before any
    model is asked)."""
    await request.app.state.limiter.hit(rate_key(request))
    user = current_user(request)
    if user is not None:
        await request.app.state.quota.check(user)


async def count_resume(request: HTTPConnection) -> None:
    """One resume: counted by the same limit as the requests that start model work
    (each resume is one more relay of every event of an answer)."""
    await request.app.state.limiter.hit(rate_key(request))


class AuthMiddleware:
    """With auth on, `/api/*`, `/v1/*` and `/sources/*` need a valid credential (401
    otherwise): the request's `User` is put in the scope (`USER`, and its id as
    `user_id`). A signed sources link (`/sources/{id}?sig=…`) is its own capability and
    needs none, and so does a share link (`/s/{shareId}`, outside these prefixes: its
    id is the capability). With accounts, `/api/auth/*` (sign-up, sign-in, `me`, OIDC)
    answers without a user too, and a write signed in by the session cookie — or any write to
    `/api/auth/*` — must come from the server's own origin (403 otherwise). WebSockets
    authenticate in their endpoint, where a refusal can be an error frame."""

    PROTECTED = ("/api/", "/v1/", "/sources/")
    SIGN_IN = "/api/auth/"

    def __init__(self, app: ASGIApp, mode: str) -> None:
        self.app = app
        self.mode = mode

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.mode != "off"
            and scope["type"] == "http"
            and scope["method"] != "OPTIONS"
            and scope["path"].startswith(self.PROTECTED)
        ):
            request = Request(scope)
            sources = scope["path"].startswith("/sources/")
            if sources and request.query_params.get("sig"):
                await self.app(scope, receive, send)
                return
            identity: Identity = scope["app"].state.identity
            signing_in = self.mode == "accounts" and scope["path"].startswith(self.SIGN_IN)
            try:
                try:
                    user = await identity.authenticate(request, token_param=sources)
                except Unauthorized:
                    if not signing_in:
                        raise
                    user = None  # signing in, or asking how to
                set_user(scope, user)
                if scope["method"] not in SAFE_METHODS and (
                    signing_in or (user is not None and user.by_cookie)
                ):
                    identity.check_origin(request, sign_in=signing_in)
            except AppError as exc:
                # each API answers in its own shape: OpenAI's under /v1/
                render = openai_error if scope["path"].startswith("/v1/") else error_response
                await render(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)
