"""Page readers: turn a result's URL into its main text.

* `JinaReader` asks a Jina-style reader service (`GET {base_url}/<url>`), which
  fetches the page and answers Markdown.
* `BuiltinReader` fetches the page itself and extracts the main text with
  selectolax. Every TCP connection it opens — the first and each redirect hop —
  goes through `GuardedBackend`, which resolves the host, refuses loopback,
  private, link-local, metadata and other non-public addresses (unless
  allowed), and connects to the address it checked, so a DNS answer cannot
  change between the check and the connection.

`read` raises `SearchError` for anything that keeps the page from being read;
callers keep the snippet then.
"""

from __future__ import annotations

import abc
import asyncio
import ipaddress
import socket
import typing

import httpcore
import httpx

from ..config import ReaderSettings
from ..errors import SearchError
from ..extract import extract_main_text

MAX_PAGE_BYTES = 2_000_000
MAX_TEXT_CHARS = 20_000
TEXT_TYPES = ("text/html", "application/xhtml+xml", "text/plain", "text/markdown")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# not covered by ipaddress' is_private on every Python: shared (CGNAT) space
_EXTRA_BLOCKED = (ipaddress.ip_network("100.64.0.0/10"),)


class Reader(abc.ABC):
    @abc.abstractmethod
    async def read(self, url: str) -> str: ...

    async def aclose(self) -> None:  # noqa: B027 - nothing to close by default
        """Release connections."""


class JinaReader(Reader):
    def __init__(self, http: httpx.AsyncClient, settings: ReaderSettings) -> None:
        self.http = http
        self.settings = settings

    async def read(self, url: str) -> str:
        headers = {"Accept": "text/plain"}
        if self.settings.api_key:
            headers["Authorization"] = f"Bearer {self.settings.api_key}"
        try:
            response = await self.http.get(
                f"{self.settings.base_url.rstrip('/')}/{url}",
                headers=headers,
                timeout=self.settings.timeout_seconds,
            )
        except httpx.HTTPError as exc:
            raise SearchError(f"the reader is unreachable ({type(exc).__name__})") from exc
        if response.status_code >= 400:
            raise SearchError(f"the reader answered {response.status_code}")
        return clip(response.text)


def address_allowed(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address, trusted: tuple[Network, ...] = ()
) -> bool:
    """Whether a page at this address may be fetched from a server-side reader."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip in net for net in trusted):
        return True
    return not (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or any(ip in net for net in _EXTRA_BLOCKED)
    )


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """Resolves, checks, then connects to the checked address (no DNS rebinding)."""

    def __init__(self, *, allow_private: bool, trusted: tuple[Network, ...] = ()) -> None:
        self.allow_private = allow_private
        self.trusted = trusted
        self.inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
        allowed = [
            ip for ip in addresses if self.allow_private or address_allowed(ip, self.trusted)
        ]
        if not allowed:
            raise httpcore.ConnectError(f"refused: {host} resolves to a non-public address")
        return await self.inner.connect_tcp(
            str(allowed[0]),
            port,
            timeout=timeout,
            local_address=local_address,
            socket_options=socket_options,
        )

    async def connect_unix_socket(
        self, *args: typing.Any, **kwargs: typing.Any
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("refused: unix sockets")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport with its connection pool built on `GuardedBackend`.

    httpx takes no network backend argument, so the pool is built here the way
    httpx builds it, with the backend added; proxies from the environment are
    ignored (a proxy would connect on our behalf, unchecked).
    """

    def __init__(self, backend: GuardedBackend) -> None:
        super().__init__(trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            max_connections=100,
            max_keepalive_connections=20,
            keepalive_expiry=5.0,
            network_backend=backend,
        )


class BuiltinReader(Reader):
    def __init__(self, settings: ReaderSettings, *, trusted: tuple[Network, ...] = ()) -> None:
        self.settings = settings
        backend = GuardedBackend(allow_private=settings.allow_private_networks, trusted=trusted)
        self.http = httpx.AsyncClient(
            transport=GuardedTransport(backend),
            follow_redirects=True,
            max_redirects=5,
            timeout=settings.timeout_seconds,
            headers={"User-Agent": "Mozilla/5.0 (compatible; searchchat-reader/0.1)"},
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def read(self, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise SearchError("refused: only http and https pages are read")
        try:
            async with self.http.stream("GET", url) as response:
                if response.status_code >= 400:
                    raise SearchError(f"the page answered {response.status_code}")
                kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
                if kind and kind not in TEXT_TYPES:
                    raise SearchError(f"the page is {kind}, not a text page")
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_PAGE_BYTES:
                        break  # enough to find the main text
                encoding = response.encoding or "utf-8"
        except httpx.HTTPError as exc:
            # our own refusal (a non-public address) says why; anything else only its
            # kind: httpx's messages may carry the URL
            said = str(exc)
            reason = said if said.startswith("refused") else type(exc).__name__
            raise SearchError(f"the page cannot be read: {reason}") from exc
        text = bytes(body).decode(encoding, errors="replace")
        if kind in ("text/plain", "text/markdown"):
            return clip(text)
        return clip(await asyncio.to_thread(extract_main_text, text))


def clip(text: str) -> str:
    return text.strip()[:MAX_TEXT_CHARS]


def open_reader(settings: ReaderSettings, http: httpx.AsyncClient) -> Reader:
    """`reader.provider`: `jina` or `builtin`; ValueError for another."""
    if settings.provider == "jina":
        return JinaReader(http, settings)
    if settings.provider == "builtin":
        return BuiltinReader(settings)
    raise ValueError(f"unsupported reader.provider {settings.provider!r}: use jina or builtin")
