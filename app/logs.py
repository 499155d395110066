"""Structured logs: one JSON object per line, and one access line per request.

Query strings are never logged (a WebSocket `?token=` would be a secret), nor
are headers or bodies.
"""

from __future__ import annotations

import logging
import sys
import time
from datetime import UTC, datetime
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_log = logging.getLogger("app.access")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def configure(level: str = "INFO") -> None:
    """JSON lines on stderr for the app's and uvicorn's loggers (uvicorn's own access
    log is replaced by `AccessLog`, which leaves out query strings)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True
    quiet_third_parties()


def quiet_third_parties() -> None:
    """HTTP clients log every request with its URL at INFO (a search key and the
    user's question in a query string; OIDC and JWKS requests go through them too),
    aiosqlite every statement with its values at DEBUG: they log warnings only, and
    what fails is logged by the app, in words."""
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)


#: third-party loggers that would log each outbound request, its URL included, or each
#: statement with its values
QUIET = (
    "httpx",
    "httpx2",
    "httpcore",
    "openai",
    "aiohttp",
    "primp",
    "ddgs",
    "hpack",
    "authlib",
    "aiosqlite",  # every statement with its values, at DEBUG
)


class AccessLog:
    """ASGI middleware: one line per HTTP request or WebSocket session, when it ends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status: list[int] = [0]

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "websocket.close":
                status[0] = message.get("code", 1000)
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            access_log.info(
                "request",
                extra={
                    "fields": {
                        "method": scope.get("method", "WS"),
                        "path": scope.get("path", ""),
                        "status": status[0],
                        "durationMs": round((time.monotonic() - started) * 1000, 1),
                        "client": (scope.get("client") or ("", 0))[0],
                    }
                },
            )
