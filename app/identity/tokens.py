"""Secrets the server hands out (session cookies, API keys, invite codes): random, and
stored only as their SHA-256 — they carry 256 bits, so a fast hash is enough, and a
stolen database holds nothing that signs anyone in."""

from __future__ import annotations

import hashlib
import secrets

#: what a user's own API key starts with (tells it from a JWT or a static key at once)
API_KEY_PREFIX = "sck_"


def new_token(prefix: str = "") -> str:
    """A new secret of 256 random bits, URL-safe."""
    return prefix + secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    """What the store keeps of a secret."""
    return hashlib.sha256(token.encode()).hexdigest()
