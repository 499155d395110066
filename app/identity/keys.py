"""What the server fetches from identity providers: their discovery documents and
their signing keys (JWKS), cached.

Both are fetched at first use and again once older than `MAX_AGE_SECONDS`. A refresh
that fails (the provider is away, or answers nonsense) keeps the last known document
or keys in use, logged, and is tried again `RETRY_SECONDS` later: a provider that
is down for a while does not turn every token away. Only with nothing fetched yet
is a provider that cannot be reached `Unavailable` (503) for the token.

`Jwks.key(kid)` answers from the cache; a `kid` it does not know (the provider
rotated its keys) fetches the set again, but at most `REFETCH_BURST` times per
`REFETCH_WINDOW` seconds, so tokens with made-up `kid`s cannot make the server hammer
the provider. No lock is held across a fetch: one fetch runs at a time and callers
that need it wait for that one (`Flight`), while callers the cache can answer go on
at once. Every fetch has a deadline (`FETCH_SECONDS`), never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from joserfc.errors import JoseError
from joserfc.jwk import KeySet

from ..errors import AppError, Unauthorized, Unavailable

log = logging.getLogger("app.identity")

FETCH_SECONDS = 10.0
#: a key set or discovery document older than this is fetched again when next used
MAX_AGE_SECONDS = 3600.0
#: after a refresh failed, the last known one is used this long before the next try
RETRY_SECONDS = 60.0
REFETCH_BURST = 5
REFETCH_WINDOW = 60.0


class Flight:
    """One fetch at a time: a caller that needs it while it runs waits for that same
    fetch (and gets its error), instead of queueing on a lock held across the network."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def run(self, fetch: Callable[[], Awaitable[None]]) -> None:
        task = self._task
        if task is None or task.done():
            task = self._task = asyncio.ensure_future(fetch())
            task.add_done_callback(_retrieved)
        # a caller that gives up (cancelled) does not cancel the others' fetch
        await asyncio.shield(task)


def _retrieved(task: asyncio.Task[None]) -> None:
    """Mark a fetch's error seen (its callers got it; with none left, nobody needs it)."""
    if not task.cancelled():
        task.exception()


class _Refreshed:
    """When something cached was fetched, and when fetching it again last failed."""

    def __init__(self) -> None:
        self.fetched = -math.inf
        self.failed = -math.inf

    def due(self) -> bool:
        now = time.monotonic()
        return now - self.fetched > MAX_AGE_SECONDS and now - self.failed > RETRY_SECONDS


class Discovery:
    """An issuer's OpenID Connect discovery document (`/.well-known/openid-configuration`),
    cached for `MAX_AGE_SECONDS` (and kept past that while the issuer cannot be reached)."""

    def __init__(self, issuer: str, http: httpx.AsyncClient) -> None:
        self.issuer = issuer.rstrip("/")
        self.http = http
        self._document: dict[str, Any] | None = None
        self._times = _Refreshed()
        self._flight = Flight()

    async def document(self) -> dict[str, Any]:
        """The document; `Unavailable` when it cannot be had and none was before,
        `Unauthorized` when it names another issuer."""
        if self._document is None:
            await self._flight.run(self._fetch)
        elif self._times.due() and not self._flight.running:
            await _keeping_last(self._flight.run(self._fetch), "discovery document")
        assert self._document is not None
        return self._document

    async def _fetch(self) -> None:
        url = self.issuer + "/.well-known/openid-configuration"
        try:
            document = await fetch_json(self.http, url, "the identity provider's discovery")
            if str(document.get("issuer", "")).rstrip("/") != self.issuer:
                raise Unauthorized("the identity provider's discovery names another issuer")
        except AppError:
            self._times.failed = time.monotonic()
            raise
        self._document, self._times.fetched = document, time.monotonic()

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
        self._times = _Refreshed()
        self._refetches: list[float] = []
        self._flight = Flight()
        self.fetches = 0  # how often the set was fetched (for tests and metrics)

    async def key(self, kid: str | None) -> Any:
        """The key named `kid` (the only key, when the token names none and the set has
        one). `Unauthorized` when there is none, even after fetching the set again;
        `Unavailable` when the set is needed from a provider that cannot be reached."""
        refreshed: bool | None = None  # None: the cache answers as it is
        if self._keys is None:
            await self._flight.run(self._fetch)
            refreshed = True
        elif self._times.due() and not self._flight.running:
            refreshed = await _keeping_last(self._flight.run(self._fetch), "signing keys")
        found = self._find(kid)
        if found is None and refreshed is False:
            # a key the provider may have added, and it cannot be asked right now
            raise Unavailable("the issuer's keys cannot be fetched right now; try again shortly")
        if found is None and refreshed is None and self._may_refetch():
            await self._flight.run(self._fetch)  # a new kid: the provider rotated its keys
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
        try:
            url = await self._url()
            document = await fetch_json(self.http, url, "the issuer's keys")
            try:
                # only signing keys: a set may hold encryption keys as well
                usable = [k for k in document.get("keys", []) if k.get("use", "sig") == "sig"]
                keys = KeySet.import_key_set({"keys": usable})
            except (JoseError, ValueError, TypeError, AttributeError) as exc:
                raise Unauthorized("the issuer's keys (JWKS) cannot be read") from exc
        except AppError:
            self._times.failed = time.monotonic()
            raise
        self._keys, self._times.fetched = keys, time.monotonic()
        self.fetches += 1


async def _keeping_last(refresh: Awaitable[None], what: str) -> bool:
    """Refresh something cached; when that fails, keep the last known (logged).
    Returns whether it was refreshed."""
    try:
        await refresh
    except AppError as exc:
        log.warning(
            "cannot refresh the identity provider's %s (%s): using the last known for %.0f s",
            what,
            exc.message,
            RETRY_SECONDS,
        )
        return False
    return True


async def fetch_json(http: httpx.AsyncClient, url: str, what: str) -> dict[str, Any]:
    """A JSON object from `url`; `Unavailable` naming `what` when it cannot be had (the
    details go to the log, without the URL), `Unauthorized` when it is not an object."""
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
