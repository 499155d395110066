"""`Identity`: whatever authenticated a request — a static key of `auth.api_keys`, a
session cookie, a user's own API key, a bearer JWT — yields one `User` (PROTOCOL §7).

`auth.mode`:

* `off`: nobody is authenticated (`None`); a request names its user.
* `keys`: `Authorization: Bearer <key>` (or `?token=` where a browser cannot set
  headers) must be one of `auth.api_keys`, exactly as before accounts existed.
* `accounts`: the static keys still work; besides them a bearer token is a user's
  API key (`sck_…`) or a JWT (with `auth.jwt.*`); without a bearer token, the
  session cookie `sc_session`. A bearer token that fails is refused, never passed
  over for the cookie.

Nothing is cached: each request looks its session, key or account up in the store,
so a sign-out, a revoked key or a disabled account holds on the next request of
every process.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.requests import HTTPConnection

from ..auth import Auth
from ..config import Settings, auth_mode
from ..errors import Forbidden, Unauthorized
from .accounts import Accounts
from .jwt import BearerJwt, looks_like_jwt
from .oidc import OidcSignIn
from .tokens import API_KEY_PREFIX
from .user import User

SESSION_COOKIE = "sc_session"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def bearer_of(authorization: str | None) -> str | None:
    """The token of `Authorization: Bearer <token>`; None for no header, another scheme
    or an empty token."""
    scheme, _, value = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


class Identity:
    def __init__(
        self,
        settings: Settings,
        *,
        accounts: Accounts | None = None,
        jwt: BearerJwt | None = None,
        oidc: OidcSignIn | None = None,
    ) -> None:
        self.settings = settings
        self.mode = auth_mode(settings.auth)
        self.static = Auth(settings.auth.api_keys)
        self.accounts = accounts
        self.jwt = jwt
        self.oidc = oidc

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def methods(self) -> list[str]:
        """How a person can sign in here (`/api/auth/me`'s `authMethods`)."""
        if self.mode != "accounts":
            return ["key"] if self.mode == "keys" else []
        return ["password"] + (["oidc"] if self.oidc is not None else [])

    async def authenticate(self, conn: HTTPConnection, *, token_param: bool = False) -> User | None:
        """The request's user; None when auth is off. `Unauthorized` without a valid
        credential (`Unavailable` when the store cannot be asked). `token_param`: a
        `?token=` counts as a bearer token (WebSocket upgrades, `/sources` links)."""
        if self.mode == "off":
            return None
        if self.mode == "keys":
            user_id = self.static.authenticate(
                conn.headers.get("authorization"),
                conn.query_params.get("token") if token_param else None,
            )
            return User(id=str(user_id), method="key")
        token = bearer_of(conn.headers.get("authorization"))
        if token is None and token_param:
            token = conn.query_params.get("token") or None
        if token is not None:
            return await self._bearer(token)
        session = conn.cookies.get(SESSION_COOKIE)
        if session and self.accounts is not None:
            return await self.accounts.by_session(session)
        raise Unauthorized("sign in first, or send Authorization: Bearer <API key or token>")

    async def _bearer(self, token: str) -> User:
        static = self.static.user_for(token)
        if static is not None:
            return User(id=static, method="key")
        if self.accounts is not None and token.startswith(API_KEY_PREFIX):
            return await self.accounts.by_api_key(token)
        if self.accounts is not None and self.jwt is not None and looks_like_jwt(token):
            claims, issuer = await self.jwt.verify(token)
            return await self.accounts.for_jwt(claims, issuer)
        raise Unauthorized("this API key or token is not valid")

    def own_origins(self, conn: HTTPConnection) -> set[str]:
        """The server's own origin: `server.public_url`'s, and the one this request
        came to (its scheme and Host)."""
        scheme = {"ws": "http", "wss": "https"}.get(conn.url.scheme, conn.url.scheme)
        own = {f"{scheme}://{conn.headers.get('host', '')}".lower()}
        if self.settings.server.public_url:
            own.add(origin_of(self.settings.server.public_url))
        return own

    def check_origin(self, conn: HTTPConnection, *, sign_in: bool = False) -> None:
        """`Forbidden` unless a cookie-authenticated write (or a WebSocket opened with
        the cookie) comes from the server's own pages, by its `Origin` or, without one,
        its `Referer` (a cross-site request cannot make either lie). `sign_in`: a
        write to `/api/auth/*`, which needs one with or without a cookie (another
        site must not sign a browser in to an account of its choosing)."""
        origin = conn.headers.get("origin")
        if origin is None and conn.headers.get("referer"):
            origin = origin_of(conn.headers["referer"])
        if not origin or origin.lower() == "null":
            raise Forbidden(
                "sign-up, sign-in and sign-out must say where they come from: send an Origin"
                " header naming this server (as browsers do), cookie or not"
                if sign_in
                else "a request signed in by cookie must say where it comes from (Origin)"
            )
        if origin.lower().rstrip("/") not in self.own_origins(conn):
            raise Forbidden("cross-site request refused: it does not come from this server's pages")


def origin_of(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()
