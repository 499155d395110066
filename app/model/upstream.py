"""A small streaming HTTP/1.1 client for the one hot call: the model's streamed
`POST /chat/completions`, read straight off an `asyncio.Protocol` with httptools
(the parser uvicorn uses). Everything else goes through the `openai` SDK.

At a model's pace every token is one read of the model's socket; through the
SDK and aiohttp each read cost a timer rescheduled, a stream reader fed and
woken, and a few layers of iterators — more than the rest of a token's path.
Here a read is one parser feed and, when the reader waits, one future set.

What it keeps of the SDK's path (`LLMClient` uses it only for direct connections:
with a proxy configured for the model's URL, the SDK reads the stream as before):

* the SDK's headers (its auth, user agent) and its errors: a non-2xx answer is
  read and raised as the SDK raises it (`openai.APIStatusError` subclasses, from
  `make_status_error`), but a redirect raises `Redirected` (for the SDK to follow,
  as it did); a connection that cannot be made raises
  `openai.APIConnectionError` (`openai.APITimeoutError` when out of time) with
  the OS's error as its cause; no answer within `read_timeout` before the
  headers raises `openai.APITimeoutError`, and after them, while the body is
  read, `TimeoutError`; a connection lost mid-body raises `ConnectionResetError`;
* TLS for `https://` (the SDK's HTTP client's context: certificates from the
  environment as it takes them);
* keep-alive: a connection whose response was read to its end goes back to the
  pool (at most `max_idle`, for `keepalive_seconds`); one closed by the server
  while idle is retried once on a new connection, before any byte came back;
* cancel: `aclose()` of a response not read to its end closes its connection, so
  the model sees the client go and stops.

The read timeout costs nothing per read: one timer per connection looks, every
quarter of `read_timeout`, whether anything came since it last looked.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import httptools
import httpx2
import openai

from ..config import LLMSettings

#: a connection stops reading past this many unread bytes (the reader catches up)
HIGH_WATER = 1 << 16
#: requests that may be waiting for a connection or reading a response at once
MAX_CONNECTIONS = 1000
#: how long a finished response's connection waits for the end of its message
LINGER_SECONDS = 1.0


class Redirected(Exception):
    """The server answered with a redirect (to `args[0]`): not followed here."""


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: one request at a time, its response parsed as it
    comes; the reader waits on `wait()`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = self.complete = self.keep_alive = False
        self.body: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.error: BaseException | None = None
        self.received = 0  # reads, for the read timeout's watch and the idle retry
        self.idle_since = 0.0
        #: called (soon) when the response has come to its end
        self.on_complete: Callable[[], None] | None = None
        #: takes the body as it is read, in the read's callback, instead of `body`
        self.consumer: Callable[[bytes], None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.lost = loop.create_future()  # done once the connection is gone
        self._delimited = False  # by a length or chunks (else by the connection's end)

    # -- the protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received += 1
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(ConnectionResetError(f"the model's answer could not be parsed: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.lost.done():
            self.lost.set_result(None)
        if self.headers_done and not self.complete and not self._delimited and exc is None:
            self.complete = True  # a body delimited by the connection's end
            self._wake()
        elif not self.complete:
            self.fail(exc or ConnectionResetError("the model closed the connection"))

    def pause_writing(self) -> None:  # the request is small: nothing to hold back
        pass

    def resume_writing(self) -> None:
        pass

    # -- the parser's callbacks --------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        lowered = name.lower()
        if lowered == b"content-length" or (
            lowered == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self._delimited = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        consumer = self.consumer
        if consumer is not None:
            try:
                consumer(body)
            except Exception as exc:  # the reader's own error: it ends the response
                self.consumer = None
                self.fail(exc)
            return
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # (the parser forgets it after)
        if self.on_complete is not None:
            self.loop.call_soon(self.on_complete)  # once the parser is done with this read
            self.on_complete = None
        self._wake()

    # -- for the response --------------------------------------------------------------

    async def wait(self) -> None:
        """Until more of the response came, or it ended or failed (cancelling is safe)."""
        waiter = self._waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def take(self) -> bytes:
        """The body bytes come so far (and reading resumed if it was held back)."""
        body = self.body
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def reset(self) -> None:
        """Ready for the next request on this connection."""
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers = []
        self.headers_done = self.complete = self.keep_alive = self._delimited = False
        self.body.clear()
        self.buffered = 0
        self.error = None
        self.on_complete = None

    @property
    def reusable(self) -> bool:
        return (
            self.complete
            and self.error is None
            and self.transport is not None
            and not self.transport.is_closing()
            and self.keep_alive
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if self.transport is not None:
            self.transport.abort()
            self.transport = None
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class StreamedResponse:
    """A 2xx response whose body is being read: `async for data in response` gives
    its bytes as they come (decoded when gzip- or deflate-encoded); `aclose()`
    releases the connection: back to the pool when the body was read to its end, or
    (after `finish()`) when the little left of it comes soon; else it is closed, so
    the server sees the client go. Cancelling a read is safe."""

    def __init__(self, client: StreamingClient, connection: Connection) -> None:
        self._client = client
        self._connection = connection
        self.status_code = connection.status
        self.headers = httpx2.Headers(connection.headers)
        encoding = self.headers.get("content-encoding", "identity").lower()
        self._decoder = (
            zlib.decompressobj(zlib.MAX_WBITS | 16 if encoding == "gzip" else zlib.MAX_WBITS)
            if encoding in ("gzip", "deflate")
            else None
        )
        self._closed = self._finished = False
        self._watch = client.watch(connection, before_headers=False)

    def __aiter__(self) -> StreamedResponse:
        return self

    async def __anext__(self) -> bytes:
        connection = self._connection
        while not connection.body:
            if connection.error is not None:
                raise connection.error
            if connection.complete:
                raise StopAsyncIteration
            await connection.wait()
        data = connection.take()
        return data if self._decoder is None else self._decoder.decompress(data)

    async def aread(self) -> bytes:
        return b"".join([data async for data in self])

    async def pump(self, consume: Callable[[bytes], bool]) -> None:
        """Hand the body to `consume` as it is read — in the callback that read it from
        the socket, so no task is woken per read — until `consume` says it has what
        it wanted (`finish()` is then implied) or the body ends. Raises as iterating
        does, and what `consume` raises. Cancelling is safe: nothing is handed on
        once it is."""
        connection = self._connection
        decoder = self._decoder
        wanted = False

        def take(data: bytes) -> None:
            nonlocal wanted
            if wanted:
                return  # the rest of the message after what was wanted
            if decoder is not None:
                data = decoder.decompress(data)
            if consume(data):
                wanted = True
                connection._wake()

        if connection.body:  # what came with the headers
            take(connection.take())
        connection.consumer = take
        try:
            while not wanted:
                if connection.error is not None:
                    raise connection.error
                if connection.complete:
                    return
                await connection.wait()
        finally:
            connection.consumer = None
        self.finish()

    def finish(self) -> None:
        """The reader has what it wanted (an SSE stream's `[DONE]`): what is left is
        the message's end, and `aclose()` keeps the connection for it."""
        self._finished = True

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._watch.cancel()
        self._client.release(self._connection, linger=self._finished)


class StreamingClient:
    """Streamed POSTs to one origin (`base_url`'s scheme, host and port) over
    keep-alive connections; see the module docstring. Close with `aclose()`."""

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str],
        make_status_error: Callable[[httpx2.Response], openai.APIStatusError],
        connect_timeout: float,
        read_timeout: float,
        pool_timeout: float,
        ssl_context: ssl.SSLContext | None = None,
        max_idle: int = 100,
        keepalive_seconds: float = 5.0,
    ) -> None:
        parts = urlsplit(base_url)
        self.base_url = base_url.rstrip("/")
        self.secure = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.secure else 80)
        self.prefix = parts.path.rstrip("/")
        host_header = parts.netloc.rsplit("@", 1)[-1]
        self._head = (
            "".join(f"{name}: {value}\r\n" for name, value in headers.items())
            + f"host: {host_header}\r\naccept-encoding: identity\r\n"
        ).encode("latin-1")
        self.make_status_error = make_status_error
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.pool_timeout = pool_timeout
        self.ssl_context = (ssl_context or ssl.create_default_context()) if self.secure else None
        self.max_idle = max_idle
        self.keepalive_seconds = keepalive_seconds
        self._idle: list[Connection] = []  # oldest first
        self._expiry: asyncio.TimerHandle | None = None
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        self._busy: set[Connection] = set()
        self._lingering: set[Connection] = set()

    async def post(self, path: str, body: bytes) -> StreamedResponse:
        """POST `body` (JSON) to `path` under the base URL; the response once its
        headers came, its body unread. A non-2xx answer is read and raised as the
        SDK raises it. The caller closes the response."""
        request = self._request(path, body)
        try:
            async with asyncio.timeout(self.pool_timeout):
                await self._slots.acquire()
        except TimeoutError as exc:
            raise openai.APITimeoutError(request=self._httpx_request(path)) from exc
        try:
            connection = await self._send(path, request)
        except BaseException:
            self._slots.release()
            raise
        self._busy.add(connection)
        response = StreamedResponse(self, connection)
        if 200 <= connection.status < 300:
            return response
        if 300 <= connection.status < 400 and "location" in response.headers:
            await response.aclose()
            raise Redirected(response.headers["location"])
        try:
            async with asyncio.timeout(self.read_timeout):
                content = await response.aread()
        except (TimeoutError, OSError):
            content = b""
        finally:
            await response.aclose()
        raise self.make_status_error(
            httpx2.Response(
                response.status_code,
                headers=response.headers,
                content=content,
                request=self._httpx_request(path),
            )
        )

    def release(self, connection: Connection, *, linger: bool = False) -> None:
        """A response is done with its connection: pooled when it can serve another;
        with `linger`, also when its end comes within `LINGER_SECONDS`."""
        if connection in self._busy:
            self._busy.discard(connection)
            self._slots.release()
        if connection.reusable:
            self._pool(connection)
        elif linger and connection.error is None and connection.transport is not None:
            self._lingering.add(connection)

            def ended() -> None:
                timer.cancel()
                self._lingering.discard(connection)
                if connection.reusable:
                    self._pool(connection)
                else:
                    connection.close()

            def late() -> None:
                self._lingering.discard(connection)
                connection.on_complete = None
                connection.close()

            timer = connection.loop.call_later(LINGER_SECONDS, late)
            connection.on_complete = ended
        else:
            connection.close()

    def _pool(self, connection: Connection) -> None:
        if len(self._idle) >= self.max_idle:
            connection.close()
            return
        connection.reset()
        connection.idle_since = time.monotonic()
        self._idle.append(connection)
        if self._expiry is None:
            self._expiry = connection.loop.call_later(self.keepalive_seconds, self._expire)

    def _expire(self) -> None:
        """Close the pooled connections idle for `keepalive_seconds` (a pool that had
        many streams at once would otherwise keep their sockets until it is used as
        much again); look again while any is left."""
        self._expiry = None
        now = time.monotonic()
        kept = []
        for connection in self._idle:
            if now - connection.idle_since >= self.keepalive_seconds:
                connection.close()
            else:
                kept.append(connection)
        self._idle[:] = kept
        if kept:
            wait = kept[0].idle_since + self.keepalive_seconds - now
            self._expiry = asyncio.get_running_loop().call_later(max(wait, 0.05), self._expire)

    def watch(self, connection: Connection, *, before_headers: bool) -> _Cancel:
        """The read timeout of `connection` (see the module docstring): on expiry it
        fails with `TimeoutError`. Cancel the handle when done."""
        timeout = self.read_timeout
        step = max(timeout / 4, 0.01)
        loop = connection.loop
        seen = [connection.received, loop.time()]  # reads, when they last changed
        handle: list[asyncio.TimerHandle] = []

        def look() -> None:
            now = loop.time()
            if connection.received != seen[0] or connection.paused:  # paused: the reader's
                seen[0], seen[1] = connection.received, now  # to catch up, not the model
            elif now - seen[1] >= timeout and not connection.complete:
                what = "headers" if before_headers else "more of the stream"
                connection.fail(TimeoutError(f"no {what} from the model in {timeout:g} s"))
                return
            handle[0] = loop.call_at(now + step, look)

        handle.append(loop.call_at(loop.time() + step, look))
        return _Cancel(handle)

    async def aclose(self) -> None:
        """Close every connection, and wait (a moment at most) until they are gone."""
        connections = [*self._idle, *self._busy, *self._lingering]
        self._idle.clear()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        for connection in connections:
            connection.close()
        if connections:
            await asyncio.wait([c.lost for c in connections], timeout=1.0)

    def _request(self, path: str, body: bytes) -> bytes:
        return b"POST %s HTTP/1.1\r\n%scontent-length: %d\r\n\r\n%s" % (
            (self.prefix + path).encode(),
            self._head,
            len(body),
            body,
        )

    def _httpx_request(self, path: str) -> httpx2.Request:
        return httpx2.Request("POST", self.base_url + path)

    async def _send(self, path: str, request: bytes) -> Connection:
        """Write the request on a pooled connection or a new one; the connection once
        the response's headers came."""
        while True:
            connection = self._pooled()
            if connection is None:
                break
            reads = connection.received
            try:
                return await self._exchange(connection, path, request)
            except openai.APITimeoutError:
                raise
            except openai.APIConnectionError:
                # closed by the server while idle (before anything came back): the
                # request never reached it, so a new connection may take it
                if connection.received != reads:
                    raise
        return await self._exchange(await self._connect(path), path, request)

    async def _exchange(self, connection: Connection, path: str, request: bytes) -> Connection:
        watch = self.watch(connection, before_headers=True)
        try:
            if connection.transport is None:
                raise ConnectionResetError("the pooled connection was closed")
            connection.transport.write(request)
            while not connection.headers_done:
                if connection.error is not None:
                    raise connection.error
                await connection.wait()
        except TimeoutError as exc:
            connection.close()
            raise openai.APITimeoutError(request=self._httpx_request(path)) from exc
        except OSError as exc:  # the connection went before the headers came
            connection.close()
            raise openai.APIConnectionError(request=self._httpx_request(path)) from exc
        except BaseException:
            connection.close()
            raise
        finally:
            watch.cancel()
        return connection

    def _pooled(self) -> Connection | None:
        now = time.monotonic()
        loop = asyncio.get_running_loop()
        while self._idle:
            connection = self._idle.pop()
            transport = connection.transport
            if (
                connection.loop is loop
                and transport is not None
                and not transport.is_closing()
                and now - connection.idle_since < self.keepalive_seconds
            ):
                return connection
            connection.close()
        return None

    async def _connect(self, path: str) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: Connection(loop),
                    self.host,
                    self.port,
                    ssl=self.ssl_context,
                    server_hostname=self.host if self.secure else None,
                )
        except TimeoutError as exc:
            raise openai.APITimeoutError(request=self._httpx_request(path)) from exc
        except OSError as exc:  # refused, unresolvable, TLS (ssl.SSLError is an OSError)
            raise openai.APIConnectionError(request=self._httpx_request(path)) from exc
        return connection


class _Cancel:
    """Cancels the current timer of a rescheduling watch."""

    __slots__ = ("_handle",)

    def __init__(self, handle: list[asyncio.TimerHandle]) -> None:
        self._handle = handle

    def cancel(self) -> None:
        self._handle[0].cancel()


def usable_for(client: openai.AsyncOpenAI, base_url: str) -> bool:
    """Whether the SDK's HTTP client would reach `base_url` directly (no proxy from
    the environment or its settings): only then does `StreamingClient` stand in."""
    http: Any = getattr(client, "_client", None)
    pick = getattr(http, "_transport_for_url", None)
    if pick is None:
        return False
    try:
        return bool(pick(httpx2.URL(base_url)) is http._transport)
    except (AttributeError, httpx2.InvalidURL):
        return False


def streaming_client(client: openai.AsyncOpenAI, settings: LLMSettings) -> StreamingClient:
    """The reader of the answer's stream, with the SDK's headers (its auth included),
    its errors, its TLS context and the model's timeouts."""
    headers = {
        name: value
        for name, value in {**client.default_headers, **client.auth_headers}.items()
        if isinstance(value, str)
    }
    return StreamingClient(
        settings.base_url,
        headers=headers,
        make_status_error=client._make_status_error_from_response,
        connect_timeout=settings.connect_timeout_seconds,
        read_timeout=settings.read_timeout_seconds,
        pool_timeout=settings.timeout_seconds,
        ssl_context=httpx2.create_ssl_context(trust_env=True),
    )
