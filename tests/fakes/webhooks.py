"""A webhook receiver (real HTTP, on loopback): it keeps every POST it gets, and
answers each with the next status of `statuses` (200 once they are used up)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    status: int

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class WebhookReceiver:
    statuses: list[int] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    #: status to redirect to (a 307 with this Location), for the tests of redirects
    redirect_to: str | None = None

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self.receive, methods=["POST"])])

    async def receive(self, request: Request) -> Response:
        body = await request.body()
        status = self.statuses.pop(0) if self.statuses else 200
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.received.append(Received(request.url.path, headers, body, status))
        if self.redirect_to is not None:
            return Response(status_code=307, headers={"location": self.redirect_to})
        return Response(b"{}", status_code=status, media_type="application/json")

    def delivered(self) -> list[Received]:
        return [r for r in self.received if 200 <= r.status < 300 and self.redirect_to is None]

    async def wait(self, count: int, timeout: float = 20.0) -> list[Received]:
        """Until `count` requests came (it serves on a thread of its own, so this polls);
        AssertionError after `timeout`."""
        for _ in range(int(timeout / 0.02)):
            if len(self.received) >= count:
                return list(self.received)
            await asyncio.sleep(0.02)
        raise AssertionError(f"{len(self.received)} webhooks came, not {count}")
