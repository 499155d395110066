"""Who is asking (PROTOCOL §7): one `User` per request, from whatever authenticated it.

user.py       User: the leaf every layer shares
resolver.py   Identity: static keys, session cookies, per-user API keys, bearer JWTs → User
accounts.py   Accounts: sign-up, sign-in, sessions, keys, invites, admin changes
passwords.py  Argon2id, off the event loop
throttle.py   sign-in attempts per account and per address, sign-ups per address
              (Redis or memory)
jwt.py        bearer JWTs: signature, algorithm, exp/nbf/iss/aud
oidc.py       sign-in with an OpenID Connect provider (authlib, PKCE, state, nonce)
keys.py       discovery documents and JWKS, cached, fetched again on rotation
quota.py      daily token quotas
tokens.py     the secrets the server hands out, and their hashes
__main__.py   `python -m app.identity create-admin EMAIL`: the first admin, made offline
"""

from __future__ import annotations

from .user import Method, User

__all__ = ["Method", "User"]
