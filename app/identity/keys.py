"""What the server fetches from identity providers: their discovery documents and
their signing keys (JWKS), cached.

`Jwks.key(kid)` answers from the cache; a `kid` it does not know (the provider
rotated its keys) fetches the set again, but at most `REFETCH_BURST` times per
`REFETCH_WINDOW` seconds, so tokens with made-up `kid`s cannot make the server hammer
the provider. Every fetch has a deadline; a provider that cannot be reached is
`Unauthorized` for the token (the server cannot check it), never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from joserfc.errors import JoseError
from joserfc.jwk import KeySet

from ..errors import Unauthorized, Unavailable

log = logging.getLogger("app.identity")

FETCH_SECONDS = 10.0
#: a key set or discovery document older than this is fetched again when next used
MAX_AGE_SECONDS = 3600.0
REFETCH_BURST = 5
REFETCH_WINDOW = 60.0


class Discovery:
    """An issuer's OpenID Connect discovery document (`/.well-known/openid-configuration`),
    cached for `MAX_AGE_SECONDS`."""

    def __init__(self, issuer: str, http: httpx.AsyncClient) -> None:
        self.issuer = issuer.rstrip("/")
        self.http = http
        self._document: dict[str, Any] | None = None
        self._fetched = 0.0
        self._lock = asyncio.Lock()

    async def document(self) -> dict[str, Any]:
        """The document; `Unauthorized` when it cannot be had or names another issuer."""
        async with self._lock:
            if self._document is None or time.monotonic() - self._fetched > MAX_AGE_SECONDS:
                url = self.issuer + "/.well-known/openid-configuration"
                document = await fetch_json(self.http, url, "the identity provider's discovery")
                if str(document.get("issuer", "")).rstrip("/") != self.issuer:
                    raise Unauthorized("the identity provider's discovery names another issuer")
                self._document, self._fetched = document, time.monotonic()
            return self._document

    async def endpoint(self, name: str) -> str:
        value = (await self.document()).get(name)
        if not isinstance(value, str) or not value:
            raise Unauthorized(f"the identity provider's discovery has no {name}")
        return value


class Jwks:
    """A provider's signing keys, from a URL (given, or found by `url` at first use)."""

    def __init__(self, url: Callable[[], Awaitable[str]], http: httpx.AsyncClient) -> None:
        self._url = url
        self.http = http
        self._keys: KeySet | None = None
        self._fetched = 0.0
        self._refetches: list[float] = []
        self._lock = asyncio.Lock()
        self.fetches = 0  # how often the set was fetched (for tests and metrics)

    async def key(self, kid: str | None) -> Any:
        """The key named `kid` (the only key, when the token names none and the set has
        one). `Unauthorized` when there is none, even after fetching the set again."""
        async with self._lock:
            stale = time.monotonic() - self._fetched > MAX_AGE_SECONDS
            if self._keys is None or stale:
                await self._fetch()
            found = self._find(kid)
            if found is None and self._may_refetch():
                await self._fetch()
                found = self._find(kid)
        if found is None:
            raise Unauthorized(
                f"the token's signing key ({kid or 'no kid'}) is not one of the issuer's keys"
            )
        return found

    def _find(self, kid: str | None) -> Any:
        keys = self._keys.keys if self._keys is not None else []
        if kid is None:
            return keys[0] if len(keys) == 1 else None
        return next((k for k in keys if k.kid == kid), None)

    def _may_refetch(self) -> bool:
        now = time.monotonic()
        self._refetches = [t for t in self._refetches if now - t < REFETCH_WINDOW]
        if len(self._refetches) >= REFETCH_BURST:
            return False
        self._refetches.append(now)
        return True

    async def _fetch(self) -> None:
        url = await self._url()
        document = await fetch_json(self.http, url, "the issuer's keys")
        try:
            # only signing keys: a set may hold encryption keys as well
            usable = [k for k in document.get("keys", []) if k.get("use", "sig") == "sig"]
            self._keys = KeySet.import_key_set({"keys": usable})
        except (JoseError, ValueError, TypeError, AttributeError) as exc:
            raise Unauthorized("the issuer's keys (JWKS) cannot be read") from exc
        self._fetched = time.monotonic()
        self.fetches += 1


async def fetch_json(http: httpx.AsyncClient, url: str, what: str) -> dict[str, Any]:
    """A JSON object from `url`; `Unauthorized` naming `what` when it cannot be had
    (the details go to the log, without the URL's query)."""
    try:
        response = await http.get(url, timeout=FETCH_SECONDS)
        response.raise_for_status()
        document = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        log.warning("cannot fetch %s: %r", what, type(exc).__name__)
        raise Unavailable(f"{what} cannot be fetched right now; try again shortly") from exc
    if not isinstance(document, dict):
        raise Unauthorized(f"{what} is not a JSON object")
    return document
