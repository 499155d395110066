"""Webhooks as Standard Webhooks sends them (standardwebhooks.com): an outbox in the
store, sent by a chore of every process.

A webhook is a JSON POST with `webhook-id` (the same on every attempt, so a
receiver can drop a repeat), `webhook-timestamp` (Unix seconds, of this attempt)
and `webhook-signature: v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">`,
keyed with the bytes of the secret (`whsec_<base64>`). A delivery that fails (no
answer within `schedules.webhook_timeout_seconds`, or anything but a 2xx) is
tried again after a growing pause, for a day; it is kept in the store meanwhile,
so a restart drops none. Redirects are not followed, and every connection goes
through the reader's `GuardedBackend`: the host is resolved, and unless
`schedules.webhook_allow_private_networks` a loopback, private or link-local
address is refused when connecting (a refusal is final: trying again is no use).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from urllib.parse import urlsplit

import httpx

from .config import SchedulesSettings
from .errors import BadRequest
from .search.reader import GuardedBackend, GuardedTransport, address_allowed
from .store import Store
from .store.records import Delivery

log = logging.getLogger("app.webhooks")

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 24
#: the pauses after the 1st, 2nd, … failed attempt (Standard Webhooks' suggestion),
#: the last one repeated until the delivery is a day old
BACKOFF_SECONDS = (5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0)
RETRY_FOR_SECONDS = 86400.0
MAX_URL_CHARS = 2000
#: deliveries one process sends at once
BATCH = 20


def new_secret() -> str:
    """A signing secret as Standard Webhooks writes one: `whsec_<base64 of 24 bytes>`."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def sign(secret: str, message_id: str, timestamp: int, body: str) -> str:
    """The `webhook-signature` header of a body."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    signed = f"{message_id}.{timestamp}.{body}".encode()
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def check_url(url: object, allow_private: bool) -> str:
    """A webhook URL a schedule may keep: http(s) with a host — and, unless private
    networks are allowed, not an address literal or name that is plainly loopback,
    private or link-local (names are checked again, resolved, at every connection).
    `BadRequest` naming the field otherwise."""
    if not isinstance(url, str) or not url or len(url) > MAX_URL_CHARS:
        raise BadRequest(
            f"webhook.url must be an http(s) URL of at most {MAX_URL_CHARS} characters"
        )
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises for a port that is not a number
    except ValueError as exc:
        raise BadRequest(f"webhook.url {url!r} is not a URL") from exc
    if parts.scheme not in ("http", "https") or not host:
        raise BadRequest(f"webhook.url {url!r} must be an http or https URL with a host")
    if parts.username or parts.password:
        raise BadRequest("webhook.url must not carry a user or password")
    if allow_private:
        return url
    if host == "localhost" or host.endswith(".localhost"):
        raise BadRequest(f"webhook.url {url!r} names a loopback host")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return url
    if not address_allowed(ip):
        raise BadRequest(f"webhook.url {url!r} is a private, loopback or link-local address")
    return url


class Webhooks:
    """Sends the outbox's due deliveries (`deliver_due`), each from one process.
    `clock` says when a delivery is due (tests drive it); the signature's timestamp
    is the wall clock, which receivers compare theirs with."""

    def __init__(
        self,
        settings: SchedulesSettings,
        store: Store,
        *,
        owner: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.store = store
        self.owner = owner
        self.clock = clock
        backend = GuardedBackend(allow_private=settings.webhook_allow_private_networks)
        self.http = httpx.AsyncClient(
            transport=GuardedTransport(backend),
            follow_redirects=False,
            timeout=settings.webhook_timeout_seconds,
            headers={"User-Agent": "searchchat-webhooks/0.1"},
        )

    def delivery(self, message_id: str, url: str, secret: str, body: str) -> Delivery:
        """A new delivery of `body`, due now, tried for a day."""
        now = self.clock()
        return Delivery(message_id, url, secret, body, now, now + RETRY_FOR_SECONDS)

    async def deliver_due(self) -> int:
        """Send the deliveries that are due (those another process sends are left to
        it); returns how many were sent. Each attempt's outcome is saved."""
        lease = self.settings.webhook_timeout_seconds * 3 + 5
        due = await self.store.claim_deliveries(self.clock(), self.owner, lease, BATCH)
        if due:
            ended = await asyncio.gather(*(self.send(delivery) for delivery in due))
            for delivery in ended:
                await self.store.end_delivery(delivery, self.owner)
        return len(due)

    async def send(self, delivery: Delivery) -> Delivery:
        """One attempt: the delivery as it is afterwards (delivered, due again later,
        or failed for good)."""
        timestamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "webhook-id": delivery.id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(delivery.secret, delivery.id, timestamp, delivery.body),
        }
        attempts = delivery.attempts + 1
        final = False
        try:
            response = await self.http.post(
                delivery.url, content=delivery.body.encode(), headers=headers
            )
            await response.aclose()
            if 200 <= response.status_code < 300:
                return replace(delivery, attempts=attempts, status="delivered", error=None)
            error = f"the receiver answered {response.status_code}"
        except httpx.HTTPError as exc:
            # our own refusal says why (and is final); anything else only its kind:
            # httpx's messages may carry the URL
            said = str(exc)
            final = said.startswith("refused")
            error = said if final else f"not delivered: {type(exc).__name__}"
        pause = BACKOFF_SECONDS[min(attempts, len(BACKOFF_SECONDS)) - 1]
        next_at = self.clock() + pause
        if final or next_at > delivery.expires_at:
            log.warning("webhook %s given up after %d attempts: %s", delivery.id, attempts, error)
            return replace(delivery, attempts=attempts, status="failed", error=error)
        return replace(delivery, attempts=attempts, next_at=next_at, error=error)

    async def aclose(self) -> None:
        await self.http.aclose()
