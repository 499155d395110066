"""How uvicorn serves the app: its options, and an HTTP protocol with bounded headers.

uvicorn's httptools protocol puts no bound on the size of a request's headers
(its h11 protocol has one, `h11_max_incomplete_event_size`, but costs more CPU
per streamed write). `BoundedHeaders` is the httptools protocol honouring that
same option: it answers `431` and closes the connection once a request's
headers pass it (set from `server.max_header_bytes`; nginx's
`large_client_header_buffers` does the same in front). uvicorn takes a protocol
class in its `http` option, so this replaces nothing of uvicorn's.
"""

from __future__ import annotations

from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .config import Settings

TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
)
TOO_LARGE_BODY = (
    b'{"type":"error","key":"BAD_REQUEST","data":"the request\'s headers are too large"}'
)


class HeadersTooLarge(Exception):
    """Raised inside the parser: stops it on this request."""


class BoundedHeaders(HttpToolsProtocol):
    """HttpToolsProtocol with at most `config.h11_max_incomplete_event_size` bytes of
    request line and headers.

    Two counts: what the parser has handed over (URL, names, values), which stops a
    request whose headers arrive whole at once; and the bytes received while the
    headers are not complete, which stops one endless header the parser would
    keep buffering."""

    def __init__(self, config: Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.max_header_bytes = config.h11_max_incomplete_event_size or 16384
        self._in_body = False
        self._too_large = False
        self._parsed = 0
        self._received = 0
        self._messages = 0

    def data_received(self, data: bytes) -> None:
        messages = self._messages
        super().data_received(data)
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
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_body = False
        self._parsed = self._received = 0
        self._messages += 1


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
