"""A lean streaming HTTP response: chunks as they come, keep-alive pings, a stuck
client let go, and a callback when the client goes away.

One timer per connection does both the pings and the send timeout (not a
cancel scope per write): it wakes every `ping_interval` seconds, sends `ping`
when nothing else went out since, and closes a connection whose current write
has waited longer than `send_timeout`. A second task listens for the client's
`http.disconnect`, so a client that goes is noticed at once, even while the
stream is idle (`on_disconnect` is how the OpenAI-compatible API stops its
generation). Responses made with a `group` are in it while they run, so that a
server shutting down can `end` the ones still open.

A response may be given a function that makes its chunks from a `write`: a way to
write a chunk straight to the server's transport at once, or to be told it cannot
(`serving.BODY_CHUNKS`: flow control paused it, a write is under way, the client
went), for a source that writes what it can itself and yields the rest.

The start and the end go through the middleware; the chunks in between go to
the server's own `send` when the app left it in the scope (`SERVER_SEND`): the
middleware only look at the start, and four wrappers per chunk are a fair part
of what a token costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..chores import cancel_and_wait
from ..serving import BODY_CHUNKS, WriteBody

log = logging.getLogger("app.stream")

#: where the app keeps the server's `send` in the scope
SERVER_SEND = "app.server_send"
#: how long a response waits for its writer and chunks to stop once it ends
STOP_SECONDS = 3.0


class Gauge(Protocol):
    def inc(self) -> None: ...

    def dec(self) -> None: ...


class StreamResponse(Response):
    """Status 200 with `media_type`, then the chunks (see the module docstring)."""

    def __init__(
        self,
        chunks: AsyncIterator[bytes] | Callable[[WriteBody], AsyncIterator[bytes]],
        *,
        media_type: str,
        headers: Mapping[str, str] | None = None,
        ping: bytes | None = None,
        ping_interval: float = 15.0,
        send_timeout: float | None = None,
        on_disconnect: Callable[[], None] | None = None,
        connections: Gauge | None = None,
        group: set[StreamResponse] | None = None,
    ) -> None:
        self._source = chunks
        self.chunks: AsyncIterator[bytes] = chunks if not callable(chunks) else _none()
        self._write_body: WriteBody | None = None
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", media_type.encode()),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items()),
        ]
        self.ping = ping
        self.ping_interval = ping_interval
        self.send_timeout = send_timeout
        self.on_disconnect = on_disconnect
        self.connections = connections
        self.group = group
        self._writer: asyncio.Task[None] | None = None
        self._ended = False
        self._last_write = 0.0
        self._writing_since: float | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.connections is not None:
            self.connections.inc()
        if self.group is not None:
            self.group.add(self)
        try:
            if callable(self._source):
                found = scope.get("extensions", {}).get(BODY_CHUNKS)
                self._write_body = found["write"] if found else None
                self.chunks = self._source(self.write_now)
            await self._respond(receive, send, scope.get(SERVER_SEND, send))
        finally:
            if self.connections is not None:
                self.connections.dec()
            if self.group is not None:
                self.group.discard(self)

    def end(self) -> None:
        """End the response now, cleanly (the server is shutting down)."""
        self._ended = True
        if self._writer is not None:
            self._writer.cancel()

    async def _respond(self, receive: Receive, send: Send, send_chunk: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        self._last_write = time.monotonic()
        writer = self._writer = asyncio.create_task(self._write(send_chunk))
        watchers = [
            asyncio.create_task(self._listen(receive)),
            asyncio.create_task(self._tick(send_chunk)),
        ]
        try:
            await asyncio.wait([writer, *watchers], return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait([writer, *watchers], timeout=STOP_SECONDS)
            with contextlib.suppress(AttributeError, RuntimeError, TimeoutError):
                async with asyncio.timeout(STOP_SECONDS):
                    await self.chunks.aclose()  # type: ignore[attr-defined]
        if self._ended or (not writer.cancelled() and writer.exception() is None):
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        elif self.on_disconnect is not None:
            self.on_disconnect()

    def write_now(self, chunk: bytes) -> bool:
        """Write `chunk` at once, in order after every chunk before it; or nothing and
        False when it cannot go now (a write or ping is under way, flow control, the
        client gone, the response ended)."""
        write = self._write_body
        if write is None or self._writing_since is not None or self._ended or not write(chunk):
            return False
        self._last_write = time.monotonic()
        return True

    async def _write(self, send: Send) -> None:
        clock = time.monotonic
        async for chunk in self.chunks:
            self._writing_since = clock()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self._last_write, self._writing_since = self._writing_since, None

    async def _listen(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def _tick(self, send: Send) -> None:
        """Pings while idle; gives up on a client whose write is stuck. Returns (ends
        the response) only for a stuck client."""
        interval = self.ping_interval
        if self.send_timeout is not None:
            interval = min(interval, max(self.send_timeout / 2, 0.5))
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            if (
                self.send_timeout is not None
                and self._writing_since is not None
                and now - self._writing_since > self.send_timeout
            ):
                log.info("letting go of a client that stopped reading")
                return
            if self.ping is not None and self._writing_since is None:
                if now - self._last_write >= self.ping_interval:
                    self._writing_since = now
                    await send({"type": "http.response.body", "body": self.ping, "more_body": True})
                    self._writing_since = None
                    self._last_write = time.monotonic()


async def _none() -> AsyncIterator[bytes]:
    return
    yield
