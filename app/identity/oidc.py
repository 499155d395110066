"""Sign-in with an OpenID Connect provider (PROTOCOL §7, `auth.oidc.*`), through
authlib's OAuth 2.0 client: the authorization code flow with PKCE (S256), `state`
and `nonce`.

`begin` makes the provider's authorization URL and the flow's cookie: state, nonce,
PKCE verifier, where to go after and the invite code the sign-in came with, signed
(HMAC-SHA256 with a secret the deployment keeps in its store) and valid for
`FLOW_SECONDS` — so the callback may land on any process, and a callback without the
browser's own cookie (a link someone else started) fails. `finish` checks the state, trades the code (and the verifier)
for tokens, and checks the ID token: its signature against the provider's keys, `iss`,
`aud`, `azp`, `exp`/`iat` (60 s skew) and the `nonce`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx
import httpx2
import orjson
from authlib.integrations.base_client import OAuthError
from authlib.integrations.httpx_client import AsyncOAuth2Client
from authlib.oidc.core import CodeIDToken
from joserfc import jwt
from joserfc.errors import ClaimError, JoseError

from ..config import OidcSettings
from ..errors import Unauthorized
from .jwt import ASYMMETRIC, KEY_ALGORITHMS, LEEWAY_SECONDS
from .keys import FETCH_SECONDS, Discovery, Jwks

#: how long a sign-in may take at the provider
FLOW_SECONDS = 600
FLOW_COOKIE = "sc_oidc"


class OidcSignIn:
    def __init__(self, settings: OidcSettings, http: httpx.AsyncClient, key: bytes) -> None:
        """`key` signs the flow cookies (the same on every process of a deployment)."""
        self.settings = settings
        self._key = key
        self.issuer = settings.issuer.rstrip("/")
        self.discovery = Discovery(self.issuer, http)
        self.jwks = Jwks(lambda: self.discovery.endpoint("jwks_uri"), http)

    @property
    def name(self) -> str:
        """What the sign-in button names: `auth.oidc.name`, else the issuer's host."""
        return self.settings.name or urlsplit(self.issuer).hostname or "your identity provider"

    def _client(self, redirect_uri: str) -> AsyncOAuth2Client:
        return AsyncOAuth2Client(
            client_id=self.settings.client_id,
            client_secret=self.settings.client_secret or None,
            token_endpoint_auth_method=(
                "client_secret_basic" if self.settings.client_secret else "none"
            ),
            scope=" ".join(self.settings.scopes),
            redirect_uri=redirect_uri,
            code_challenge_method="S256",
            timeout=FETCH_SECONDS,
        )

    async def begin(
        self, redirect_uri: str, next_path: str, invite: str | None = None
    ) -> tuple[str, str]:
        """The provider's authorization URL and the flow cookie's value (which carries
        `invite`, a code to spend if the sign-in makes an account)."""
        endpoint = await self.discovery.endpoint("authorization_endpoint")
        flow = {
            "state": secrets.token_urlsafe(32),
            "nonce": secrets.token_urlsafe(32),
            "verifier": secrets.token_urlsafe(48),
            "next": next_path,
            "invite": invite,
            "exp": time.time() + FLOW_SECONDS,
        }
        async with self._client(redirect_uri) as client:
            url, _ = client.create_authorization_url(
                endpoint, state=flow["state"], nonce=flow["nonce"], code_verifier=flow["verifier"]
            )
        return url, _sign(self._key, flow)

    async def finish(
        self, params: Mapping[str, str], cookie: str | None, redirect_uri: str
    ) -> tuple[dict[str, Any], str, str | None]:
        """The verified claims of the signed-in user (the ID token's, with the userinfo
        endpoint's for what it lacks), where to go next and the invite code the sign-in
        was started with. `Unauthorized` saying what failed."""
        flow = _unsign(self._key, cookie)
        if params.get("error"):
            raise Unauthorized(f"the identity provider did not sign you in ({params['error']})")
        given = str(params.get("state", "")).encode()
        if not hmac.compare_digest(given, str(flow["state"]).encode()):
            raise Unauthorized("the sign-in's state does not match: start the sign-in again")
        code = params.get("code")
        if not code:
            raise Unauthorized("the identity provider sent no code")
        token_endpoint = await self.discovery.endpoint("token_endpoint")
        async with self._client(redirect_uri) as client:
            try:
                token = await client.fetch_token(
                    token_endpoint,
                    grant_type="authorization_code",
                    code=code,
                    code_verifier=flow["verifier"],
                )
            except (OAuthError, httpx2.HTTPError, ValueError) as exc:
                raise Unauthorized("the identity provider did not accept the sign-in") from exc
            claims = await self._id_token(token, str(flow["nonce"]))
            if not claims.get("email") or not claims.get("name"):
                claims = {**(await self._userinfo(client, claims["sub"])), **claims}
        invite = flow.get("invite")
        return claims, str(flow["next"]), invite if isinstance(invite, str) else None

    async def _id_token(self, token: Mapping[str, Any], nonce: str) -> dict[str, Any]:
        id_token = token.get("id_token")
        if not isinstance(id_token, str):
            raise Unauthorized("the identity provider sent no ID token")
        try:
            header = orjson.loads(_b64decode(id_token.split(".")[0]))
            alg = header.get("alg")
            if alg not in ASYMMETRIC:
                raise Unauthorized(f"ID tokens signed with {alg} are not accepted")
            key = await self.jwks.key(header.get("kid"))
            if alg not in KEY_ALGORITHMS.get(key.key_type, frozenset()):
                raise Unauthorized("the ID token's algorithm does not fit its key")
            decoded = jwt.decode(id_token, key, algorithms=[alg])
            claims = CodeIDToken(
                decoded.claims,
                decoded.header,
                options={
                    "iss": {"essential": True, "values": [self.issuer, self.issuer + "/"]},
                    "aud": {"essential": True, "value": self.settings.client_id},
                },
                params={
                    "nonce": nonce,
                    "client_id": self.settings.client_id,
                    "access_token": token.get("access_token"),
                },
            )
            claims.validate(leeway=LEEWAY_SECONDS)
        except ClaimError as exc:
            raise Unauthorized(f"the ID token's {exc.claim!r} is not valid") from exc
        except (JoseError, ValueError, IndexError, AttributeError) as exc:
            raise Unauthorized("the ID token is not valid") from exc
        return dict(claims)

    async def _userinfo(self, client: AsyncOAuth2Client, subject: str) -> dict[str, Any]:
        """The userinfo endpoint's claims when they are about the same `sub`; nothing
        when there is no endpoint or it fails (the ID token is enough to sign in)."""
        endpoint = (await self.discovery.document()).get("userinfo_endpoint")
        if not isinstance(endpoint, str):
            return {}
        try:
            response = await client.get(endpoint)
            response.raise_for_status()
            info = response.json()
        except (OAuthError, httpx2.HTTPError, ValueError):
            return {}
        if not isinstance(info, dict) or info.get("sub") != subject:
            return {}
        return info


def _b64decode(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def _sign(key: bytes, flow: dict[str, Any]) -> str:
    body = base64.urlsafe_b64encode(orjson.dumps(flow)).decode().rstrip("=")
    mac = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    return f"{body}.{mac}"


def _unsign(key: bytes, cookie: str | None) -> dict[str, Any]:
    again = Unauthorized("the sign-in took too long or was started elsewhere: start it again")
    body, _, mac = (cookie or "").partition(".")
    expected = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    if not body or not hmac.compare_digest(mac.encode(), expected.encode()):
        raise again
    try:
        flow = orjson.loads(_b64decode(body))
    except ValueError as exc:
        raise again from exc
    if not isinstance(flow, dict) or float(flow.get("exp", 0)) < time.time():
        raise again
    return flow
