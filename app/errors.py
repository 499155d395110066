"""Errors a client can see, each with a key from docs/protocol.md.

    AppError                      (key INTERNAL, HTTP 500)
    ├── BadRequest                BAD_REQUEST, 400 (413 for an over-large body)
    │   └── Conflict              BAD_REQUEST, 409: the chat is busy, or an id is taken
    ├── Unauthorized              UNAUTHORIZED, 401
    ├── Forbidden                 FORBIDDEN, 403
    ├── NotFound                  NOT_FOUND, 404
    │   └── UnknownModel          NOT_FOUND, 404: a `/v1` model that does not exist
    ├── RateLimited               RATE_LIMITED, 429 (carries retry_after)
    ├── ConfigError               CONFIG_ERROR: no model configured
    ├── ModelError                CHAT_ERROR: the model cannot be reached
    │   └── StreamError           STREAM_ERROR: non-2xx, broken or malformed stream
    ├── SearchError               SEARCH_ERROR: a search provider failed
    └── Unavailable               INTERNAL, 503: the store or Redis cannot be reached

Foreign errors (httpx, openai, drivers) are mapped at the boundary with
`raise ... from exc`; nothing else reaches a client.
"""

from __future__ import annotations


class AppError(Exception):
    key = "INTERNAL"
    status = 500
    #: seconds a client should wait before trying again (sent as `Retry-After`)
    retry_after: int | None = None

    def __init__(
        self, message: str, *, status: int | None = None, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if retry_after is not None:
            self.retry_after = retry_after


class BadRequest(AppError):
    key = "BAD_REQUEST"
    status = 400


class Conflict(BadRequest):
    status = 409


class Unauthorized(AppError):
    key = "UNAUTHORIZED"
    status = 401


class Forbidden(AppError):
    key = "FORBIDDEN"
    status = 403


class NotFound(AppError):
    key = "NOT_FOUND"
    status = 404


class UnknownModel(NotFound):
    """A `/v1` request's model is none of `GET /v1/models` (OpenAI's code for it is
    `model_not_found`; a missing response or chat has none)."""


class RateLimited(AppError):
    key = "RATE_LIMITED"
    status = 429

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message, retry_after=retry_after)


class ConfigError(AppError):
    key = "CONFIG_ERROR"


class ModelError(AppError):
    key = "CHAT_ERROR"
    status = 502


class StreamError(ModelError):
    key = "STREAM_ERROR"


class SearchError(AppError):
    key = "SEARCH_ERROR"
    status = 502


class Unavailable(AppError):
    status = 503
