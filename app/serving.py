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
  reads it): closed;
* more than `max_per_address` connections open from one client address (proxies
  in `trusted` excepted: every client comes through them): 503, closed.

uvicorn takes a protocol class in its `http` option, so this replaces nothing of
uvicorn's. The bounds are a server's settings, which the protocol reads from
uvicorn's config (`config.server_limits`, set by `uvicorn_config`; defaults
without it): the config reaches every worker process, a class made at run time
could not.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

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


class HeadersTooLarge(Exception):
    """Raised inside the parser: stops it on this request."""


class BoundedHeaders(HttpToolsProtocol):
    """HttpToolsProtocol with bounded headers, deadlines for a request's arrival and a
    cap on connections per address (see the module docstring).

    Two counts bound the headers: what the parser has handed over (URL, names,
    values), which stops a request whose headers arrive whole at once; and the
    bytes received while the headers are not complete, which stops one endless
    header the parser would keep buffering."""

    #: the connections open now, by client address (of this process)
    _open: ClassVar[dict[str, set[asyncio.BaseTransport]]] = {}

    def __init__(self, config: Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        limits: ServerSettings = getattr(config, LIMITS, None) or ServerSettings()
        self.header_timeout = limits.header_timeout_seconds
        self.body_timeout = limits.body_timeout_seconds
        self.max_per_address = limits.max_connections_per_address
        self.trusted = frozenset(limits.trusted_proxies)
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
        host = self.client[0] if self.client else ""
        if host and self.max_per_address and host not in self.trusted:
            open_now = {t for t in self._open.get(host, ()) if not t.is_closing()}
            if len(open_now) >= self.max_per_address:
                transport.write(TOO_MANY % (len(TOO_MANY_BODY), TOO_MANY_BODY))
                transport.close()
                return
            open_now.add(transport)
            self._open[host] = open_now
        self._arm(self.header_timeout, self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        host = self.client[0] if self.client else ""
        open_now = self._open.get(host)
        if open_now is not None:
            open_now.discard(self.transport)
            if not open_now:
                del self._open[host]
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
        if not self._too_large:
            super().send_400_response(msg)
            return
        self.transport.write(TOO_LARGE % (len(TOO_LARGE_BODY), TOO_LARGE_BODY))
        self.transport.close()

    def on_headers_complete(self) -> None:
        self._in_body = True
        self._disarm()
        super().on_headers_complete()
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


#: the attribute of uvicorn's config that holds the server's settings
LIMITS = "server_limits"


def uvicorn_config(app: Any, settings: Settings, **overrides: Any) -> Config:
    """uvicorn's config for `app` (an app, or an import string) with `uvicorn_options`,
    carrying the server's settings for `BoundedHeaders`."""
    config = Config(app, **{**uvicorn_options(settings), **overrides})
    setattr(config, LIMITS, settings.server)
    return config


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The options `python -m app` runs uvicorn with."""
    server = settings.server
    return {
        "host": server.host,
        "port": server.port,
        "http": BoundedHeaders,
        "h11_max_incomplete_event_size": server.max_header_bytes,
        "ws": "websockets-sansio",
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
