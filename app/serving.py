"""How uvicorn serves the app: its options, and an HTTP protocol that defends itself.

uvicorn's httptools protocol bounds neither a request's headers nor how long a
client may take to send them or its body, nor how many connections one address
holds. `BoundedHeaders` is that protocol with those bounds, for a server with
nothing in front of it (nginx's `large_client_header_buffers`,
`client_header_timeout`, `client_body_timeout` and `limit_conn` do the same in
front):

* a request's line and headers past `max_header_bytes` (uvicorn's
  `h11_max_incomplete_event_size` option): 431, and the connection is closed;
* a connection that has not sent a whole request line and headers
  `header_timeout` seconds after it opened (or after its first byte, for the next
  request of a kept-alive one): 408, closed — this also bounds a WebSocket's
  handshake;
* a request body that stops arriving for `body_timeout` seconds (while the server
  reads it): 408 (as nginx's `client_body_timeout` answers) when no response has
  begun, and the connection is closed;
* more than `max_connections_per_address` connections open from one client address
  (the proxies of `trusted_proxies` excepted: every client comes through them): 503,
  closed. The count is this worker process's: with several workers, an address may
  hold that many in each;
* a request the parser cannot read (`400 Invalid HTTP request` in uvicorn's plain
  text): the same 400 as JSON in the protocol's shape;
* a WebSocket handshake with a line the `websockets` library will not read (over
  8 KiB): 431, closed (uvicorn would keep it open, and silent).

uvicorn takes a protocol class in its `http` option, and one in its `ws` option:
`BoundedWebSocket` is uvicorn's Sans-I/O WebSocket protocol that gives back its
connection's place in the count when it ends (an upgraded connection is no longer
the HTTP protocol's, whose `connection_lost` never runs for it). So this replaces
nothing of uvicorn's. The bounds are a server's settings, which the protocols read
from uvicorn's config (`config.server_limits`, set by `uvicorn_config`; defaults
without it), beside the count (`config.open_connections`): the config reaches every
worker process, each with a copy of its own, a class made at run time could not.
"""

from __future__ import annotations

import asyncio
import ipaddress
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import SecurityError
from websockets.http11 import Request
from websockets.protocol import State

from .config import ServerSettings, Settings

TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
)
TOO_LARGE_BODY = (
    b'{"type":"error","key":"BAD_REQUEST","data":"the request\'s headers are too large"}'
)
TOO_SLOW = (
    b"HTTP/1.1 408 Request Timeout\r\n"
    b"content-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
)
TOO_SLOW_BODY = b'{"type":"error","key":"BAD_REQUEST","data":"the request did not arrive in time"}'
TOO_MANY = (
    b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 5\r\n"
    b"content-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
)
TOO_MANY_BODY = (
    b'{"type":"error","key":"RATE_LIMITED","data":"too many connections from this address"}'
)
UNREADABLE = (
    b"HTTP/1.1 400 Bad Request\r\n"
    b"content-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
)
UNREADABLE_BODY = b'{"type":"error","key":"BAD_REQUEST","data":"invalid HTTP request"}'

#: the scope extension by which a WebSocket's app writes text frames at once (its
#: `write` is `BoundedWebSocket.write_texts`)
TEXT_FRAMES = "app.websocket.text_frames"
#: what `write_texts` is to the app
WriteTexts = Callable[[Sequence[bytes]], bool]

#: the scope extension by which an HTTP app writes a chunk of its response's body at
#: once (its `write` is made by `body_writer`)
BODY_CHUNKS = "app.http.body_chunks"
#: what that `write` is to the app
WriteBody = Callable[[bytes], bool]

#: the attributes of uvicorn's config that hold the server's settings, and the count
#: of its open connections by address
LIMITS = "server_limits"
OPEN = "open_connections"


class HeadersTooLarge(Exception):
    """Raised inside the parser: stops it on this request."""


class Trusted:
    """Client addresses whose connections are not counted (reverse proxies), read as
    uvicorn reads its `forwarded_allow_ips` (so both agree on who is a proxy):
    addresses, networks (`10.0.0.0/8`), `*` alone for any, and other names (a Unix
    socket's) as they are."""

    def __init__(self, entries: Iterable[str]) -> None:
        listed = [e.strip() for e in entries]
        self.anyone = listed == ["*"]
        self.addresses: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self.names: set[str] = set()
        for entry in listed:
            if "/" in entry:
                try:
                    self.networks.append(ipaddress.ip_network(entry))
                except ValueError:
                    self.names.add(entry)
            elif entry:
                try:
                    self.addresses.add(ipaddress.ip_address(entry))
                except ValueError:
                    self.names.add(entry)

    def __contains__(self, host: str) -> bool:
        if self.anyone or host in self.names:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return address in self.addresses or any(address in net for net in self.networks)


class OpenConnections:
    """The connections one server has open, by client address, and its cap on them.
    One per server (on uvicorn's config, copied into each worker process): nothing of
    it is shared between servers or processes."""

    def __init__(self, limits: ServerSettings) -> None:
        self.cap = limits.max_connections_per_address
        self.trusted = Trusted(limits.trusted_proxies)
        self._by_host: dict[str, set[asyncio.BaseTransport]] = {}

    def admit(self, host: str, transport: asyncio.BaseTransport) -> bool:
        """Count a new connection from `host`; False (and not counted) past the cap."""
        if not host or not self.cap or host in self.trusted:
            return True
        open_now = self._by_host.get(host)
        if open_now is None:
            open_now = self._by_host[host] = set()
        elif len(open_now) >= self.cap:
            # a transport is given back when its protocol hears that it closed; one
            # that is closing already does not count
            open_now.difference_update([t for t in open_now if t.is_closing()])
            if len(open_now) >= self.cap:
                return False
        open_now.add(transport)
        return True

    def release(self, host: str, transport: asyncio.BaseTransport) -> None:
        """A connection has ended (nothing when it was not counted)."""
        open_now = self._by_host.get(host)
        if open_now is not None:
            open_now.discard(transport)
            if not open_now:
                del self._by_host[host]

    def count(self, host: str) -> int:
        return len(self._by_host.get(host, ()))

    def hosts(self) -> int:
        """How many addresses have a connection counted."""
        return len(self._by_host)


def open_connections(config: Config) -> OpenConnections:
    """The count of `config`'s server (made with it by `uvicorn_config`; for a config
    made elsewhere, at its first connection)."""
    found: OpenConnections | None = getattr(config, OPEN, None)
    if found is None:
        found = OpenConnections(getattr(config, LIMITS, None) or ServerSettings())
        setattr(config, OPEN, found)
    return found


def _host(client: tuple[str, int] | None) -> str:
    return client[0] if client else ""


class BoundedHeaders(HttpToolsProtocol):
    """HttpToolsProtocol with bounded headers, deadlines for a request's arrival and a
    cap on connections per address (see the module docstring).

    Two counts bound the headers: what the parser has handed over (URL, names,
    values), which stops a request whose headers arrive whole at once; and the
    bytes received while the headers are not complete, which stops one endless
    header the parser would keep buffering."""

    def __init__(self, config: Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        limits: ServerSettings = getattr(config, LIMITS, None) or ServerSettings()
        self.header_timeout = limits.header_timeout_seconds
        self.body_timeout = limits.body_timeout_seconds
        self.open_connections = open_connections(config)
        self._counted = False
        self.max_header_bytes = config.h11_max_incomplete_event_size or 16384
        self._in_body = False
        self._too_large = False
        self._parsed = 0
        self._received = 0
        self._messages = 0
        self._deadline: asyncio.TimerHandle | None = None

    # -- connections per address, and the first request's deadline -------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.open_connections.admit(_host(self.client), transport):
            transport.write(TOO_MANY % (len(TOO_MANY_BODY), TOO_MANY_BODY))
            transport.close()
            return
        self._counted = True
        self._arm(self.header_timeout, self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._counted:
            self._counted = False
            self.open_connections.release(_host(self.client), self.transport)
        super().connection_lost(exc)

    def _arm(self, seconds: float, late: Any) -> None:
        self._disarm()
        if seconds > 0:
            self._deadline = self.loop.call_later(seconds, late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.write(TOO_SLOW % (len(TOO_SLOW_BODY), TOO_SLOW_BODY))
            self.transport.close()

    def _body_late(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or not self._in_body:
            return
        if self.flow is not None and self.flow.read_paused:
            # the server is not reading it yet: the client is not the slow one
            self._arm(self.body_timeout, self._body_late)
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            # the app, still reading, sees the client gone: what it answers is dropped
            cycle.disconnected = True
            cycle.message_event.set()
            self.transport.write(TOO_SLOW % (len(TOO_SLOW_BODY), TOO_SLOW_BODY))
        self.transport.close()

    # -- the parser's callbacks ----------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        messages = self._messages
        if not self._in_body and self._deadline is None and not self._parsed:
            # the next request of a kept-alive connection starts: its headers' deadline
            self._arm(self.header_timeout, self._headers_late)
        super().data_received(data)
        if self._in_body and self._messages == messages and not self.transport.is_closing():
            self._arm(self.body_timeout, self._body_late)  # body bytes came: a new deadline
        if self._in_body or self._messages != messages or self.transport.is_closing():
            return
        # all of this chunk was request line and headers (the parser has kept it)
        self._received += len(data)
        if self._received > self.max_header_bytes:
            self._too_large = True
            self.send_400_response("")

    def _count(self, size: int) -> None:
        self._parsed += size
        if self._parsed > self.max_header_bytes:
            self._too_large = True
            raise HeadersTooLarge

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def send_400_response(self, msg: str) -> None:
        if self._too_large:
            self.transport.write(TOO_LARGE % (len(TOO_LARGE_BODY), TOO_LARGE_BODY))
        else:  # what the parser refused, in the protocol's shape
            self.transport.write(UNREADABLE % (len(UNREADABLE_BODY), UNREADABLE_BODY))
        self.transport.close()

    def on_headers_complete(self) -> None:
        self._in_body = True
        self._disarm()
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not before:  # a request for the app (no upgrade)
            cycle.scope.setdefault("extensions", {})[BODY_CHUNKS] = {"write": body_writer(cycle)}
        if not self.transport.is_closing():
            self._arm(self.body_timeout, self._body_late)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()
        self._in_body = False
        self._parsed = self._received = 0
        self._messages += 1

    def handle_websocket_upgrade(self) -> None:
        self._disarm()  # the WebSocket protocol takes the connection from here
        super().handle_websocket_upgrade()
        if self._counted and not isinstance(self.transport.get_protocol(), BoundedWebSocket):
            # a WebSocket protocol that will not give its place back when it ends:
            # the connection is not counted from here rather than counted for ever
            self.open_connections.release(_host(self.client), self.transport)
        # from here the connection's end is the WebSocket protocol's to tell
        self._counted = False


class BoundedWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's Sans-I/O WebSocket protocol, giving back its connection's place in
    its address's count (`OpenConnections`) when the connection ends; and answering
    a handshake the `websockets` library refuses (a request line or header longer than
    its 8 KiB, which the HTTP protocol's bound lets through): uvicorn would leave that
    connection open and silent for as long as the client holds it."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.handshake_exc is not None and not self.handshake_complete:
            self.handle_handshake_exception()  # a uvicorn that leaves it unanswered

    def handle_handshake_exception(self) -> None:
        """The refusal in JSON, in place of the plain text `websockets` queued (a
        uvicorn that answers a refused handshake itself calls this)."""
        refused = self.conn.handshake_exc
        self.conn.data_to_send()  # its plain-text refusal: ours is JSON
        self.handshake_complete = self.close_sent = True
        if isinstance(refused, SecurityError):  # a line, or the headers, too long
            self.transport.write(TOO_LARGE % (len(TOO_LARGE_BODY), TOO_LARGE_BODY))
        else:
            self.transport.write(UNREADABLE % (len(UNREADABLE_BODY), UNREADABLE_BODY))
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        open_connections(self.config).release(_host(self.client), self.transport)
        super().connection_lost(exc)

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)  # none for a refused handshake
        if scope is not None:
            scope["extensions"][TEXT_FRAMES] = {"write": self.write_texts}

    def write_texts(self, frames: Sequence[bytes]) -> bool:
        """Write `frames` (each a whole message of UTF-8 text) as text frames, in one
        write, now; or nothing and False when the socket cannot take them at once —
        not open (not accepted yet, closing, gone), paused by flow control (the
        transport's buffer is full: `send` waits for it), or with an extension
        (permessage-deflate) that must encode each frame. Then `send` them, which
        waits and raises as ASGI says. What it writes is what `send` would: a
        server's frames are not masked, and an unfragmented text frame is its header
        and its bytes."""
        if (
            self.close_sent
            or self.disconnected
            or not self.handshake_complete
            or self.initial_response is not None
            or not self.writable.is_set()
            or self.conn.state is not State.OPEN
            or self.conn.extensions
            or self.conn.expect_continuation_frame
            or self.transport.is_closing()
        ):
            return False
        if len(frames) == 1:
            frame = frames[0]
            self.transport.write(_text_head(len(frame)) + frame)
        else:
            self.transport.write(b"".join([_text_head(len(f)) + f for f in frames]))
        return True


def body_writer(cycle: RequestResponseCycle) -> WriteBody:
    """`write(body)`: a chunk of the response's body, written now, as `send` would
    write it (`http.response.body` with more to come); or nothing and False when it
    cannot go at once — the response not started (or ended), not chunked (HTTP/1.0,
    a length given, HEAD), the client gone, or the transport paused by flow control
    (its buffer is full: `send` waits for it). Then `send` it. The app sees to it that
    no `send` of the body is under way meanwhile (it would go out after this)."""

    def write(body: bytes) -> bool:
        if (
            cycle.disconnected
            or not cycle.response_started
            or cycle.response_complete
            or not cycle.chunked_encoding
            or cycle.flow.write_paused
            or cycle.transport.is_closing()
        ):
            return False
        if body:
            cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    return write


def _text_head(length: int) -> bytes:
    """The header of an unmasked, final text frame of `length` bytes (RFC 6455 §5.2)."""
    if length < 126:
        return bytes((0x81, length))
    if length < 65536:
        return struct.pack("!BBH", 0x81, 126, length)
    return struct.pack("!BBQ", 0x81, 127, length)


def uvicorn_config(app: Any, settings: Settings, **overrides: Any) -> Config:
    """uvicorn's config for `app` (an app, or an import string) with `uvicorn_options`,
    carrying the server's settings and its count of connections for `BoundedHeaders`."""
    config = Config(app, **{**uvicorn_options(settings), **overrides})
    setattr(config, LIMITS, settings.server)
    setattr(config, OPEN, OpenConnections(settings.server))
    return config


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The options `python -m app` runs uvicorn with."""
    server = settings.server
    return {
        "host": server.host,
        "port": server.port,
        "http": BoundedHeaders,
        "h11_max_incomplete_event_size": server.max_header_bytes,
        "ws": BoundedWebSocket,
        # a start-up that fails (a refused middleware, a store that cannot be
        # opened) stops the server, whatever the app's lifespan looks like
        "lifespan": "on",
        "log_config": None,
        "access_log": False,
        "proxy_headers": True,
        # the client address is the rightmost X-Forwarded-For entry that is not one
        # of these proxies; from anyone else the header is ignored
        "forwarded_allow_ips": ",".join(server.trusted_proxies),
        # the app drains on SIGTERM before uvicorn starts closing connections;
        # this only bounds what is left after that
        "timeout_graceful_shutdown": 5,
    }
