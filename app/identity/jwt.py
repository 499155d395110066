"""Bearer JWTs from an app's own identity provider (PROTOCOL §7, `auth.jwt.*`).

A token is checked, in order: three parts (a JWS; encrypted tokens are refused);
its header's `alg` — `none` is refused, and an HMAC algorithm only with
`auth.jwt.secret` (HS256), never against the issuer's public keys, so an RS256 public
key used as an HS256 secret gets nowhere; its key (by `kid`, from the issuer's
JWKS, fetched again for a `kid` not seen yet, see `keys.Jwks`), which must be of the
algorithm's type; the signature; then `exp` (required), `nbf` and `iat` with
`LEEWAY_SECONDS` of clock skew, `iss` (when `auth.jwt.issuer` is set) and `aud`
(when `auth.jwt.audience` is set; it must be with the issuer's keys) and `sub`
(required). Each refusal is `Unauthorized` saying which check failed, never which
key or secret was tried. The user is the `sub` within a namespace the server chose,
never the unchecked `iss` (see `BearerJwt.namespace`).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import httpx
import orjson
from joserfc import jwt
from joserfc.errors import (
    BadSignatureError,
    ExpiredTokenError,
    InvalidClaimError,
    JoseError,
    MissingClaimError,
)
from joserfc.jwk import OctKey

from ..config import JwtSettings
from ..errors import Unauthorized
from .keys import Discovery, Jwks

LEEWAY_SECONDS = 60
#: the algorithms a key of each type may verify (a key never verifies another type's)
KEY_ALGORITHMS = {
    "RSA": frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512"}),
    "EC": frozenset({"ES256", "ES384", "ES512"}),
    "OKP": frozenset({"EdDSA", "Ed25519"}),
}
ASYMMETRIC = frozenset().union(*KEY_ALGORITHMS.values())


def looks_like_jwt(token: str) -> bool:
    """Three non-empty base64url parts, the first a JSON header: what no API key is."""
    parts = token.split(".")
    return len(parts) == 3 and parts[0].startswith("eyJ") and all(parts[:2])


class BearerJwt:
    def __init__(self, settings: JwtSettings, http: httpx.AsyncClient) -> None:
        self.issuer = settings.issuer.rstrip("/")
        self.audience = settings.audience
        self._secret = OctKey.import_key(settings.secret) if settings.secret else None
        self.jwks: Jwks | None = None
        self.jwks_url = settings.jwks_url
        if settings.jwks_url:
            url = settings.jwks_url

            async def given() -> str:
                return url

            self.jwks = Jwks(given, http)
        elif self.issuer:
            discovery = Discovery(self.issuer, http)

            async def discovered() -> str:
                return await discovery.endpoint("jwks_uri")

            self.jwks = Jwks(discovered, http)

    async def verify(self, token: str) -> tuple[dict[str, Any], str]:
        """The token's claims once every check passed, and the namespace its `sub` is a
        user of (see `namespace`); `Unauthorized` saying which check failed
        (`Unavailable` when the issuer's keys cannot be had)."""
        header = _header(token)
        alg = header.get("alg")
        if not isinstance(alg, str) or not alg or alg.lower() == "none":
            raise Unauthorized("unsigned tokens (alg: none) are refused")
        key: Any
        if alg.upper().startswith("HS"):
            if self._secret is None or alg != "HS256":
                raise Unauthorized(
                    f"{alg} tokens are refused: this server checks tokens with the issuer's"
                    " public keys (an HMAC secret is never one of those)"
                    if self._secret is None
                    else f"{alg} tokens are refused: only HS256 with the shared secret"
                )
            key = self._secret
        elif alg in ASYMMETRIC:
            if self.jwks is None:
                raise Unauthorized(f"{alg} tokens are refused: this server checks HS256 tokens")
            kid = header.get("kid")
            key = await self.jwks.key(kid if isinstance(kid, str) else None)
            if alg not in KEY_ALGORITHMS.get(key.key_type, frozenset()):
                raise Unauthorized(f"the token's algorithm {alg} does not fit its signing key")
        else:
            raise Unauthorized(f"tokens signed with {alg} are not accepted")
        try:
            decoded = jwt.decode(token, key, algorithms=[alg])
        except BadSignatureError as exc:
            raise Unauthorized("the token's signature is not valid") from exc
        except (JoseError, ValueError) as exc:
            raise Unauthorized("the token cannot be read") from exc
        claims = decoded.claims
        self._check_claims(claims)
        return claims, self.namespace(by_secret=key is self._secret)

    def namespace(self, *, by_secret: bool) -> str:
        """Whose `sub` a verified token names — what its accounts are filed under (with
        the `sub`). With `auth.jwt.issuer` it is that issuer (the `iss` claim was checked
        to be it), the same accounts an OIDC sign-in at that issuer makes. Otherwise
        the token's own `iss` proves nothing — whoever holds the keys writes any — so
        the accounts are filed under the keys that checked it: `jwt:hs256` for the
        shared secret, `jwt:<jwks_url>` for the key set. A token can then never reach an
        account another issuer vouched for (an OIDC admin's, say)."""
        if self.issuer:
            return self.issuer
        return "jwt:hs256" if by_secret else f"jwt:{self.jwks_url}"

    def _check_claims(self, claims: dict[str, Any]) -> None:
        options: dict[str, Any] = {"exp": {"essential": True}, "sub": {"essential": True}}
        if self.issuer:
            options["iss"] = {"essential": True, "values": [self.issuer, self.issuer + "/"]}
        if self.audience:
            options["aud"] = {"essential": True, "value": self.audience}
        registry = jwt.JWTClaimsRegistry(leeway=LEEWAY_SECONDS, **options)
        try:
            registry.validate(claims)
        except ExpiredTokenError as exc:
            raise Unauthorized("the token has expired") from exc
        except MissingClaimError as exc:
            raise Unauthorized(f"the token has no {exc.claim!r} claim") from exc
        except InvalidClaimError as exc:
            raise Unauthorized(_claim_problem(exc, self.issuer, self.audience)) from exc


def _header(token: str) -> dict[str, Any]:
    parts = token.split(".")
    if len(parts) != 3:
        raise Unauthorized(
            "encrypted tokens (JWE) are not accepted" if len(parts) == 5 else "not a JWT"
        )
    try:
        raw = base64.urlsafe_b64decode(parts[0] + "=" * (-len(parts[0]) % 4))
        header = orjson.loads(raw)
    except (binascii.Error, ValueError) as exc:
        raise Unauthorized("the token's header cannot be read") from exc
    if not isinstance(header, dict):
        raise Unauthorized("the token's header cannot be read")
    return header


def _claim_problem(exc: InvalidClaimError, issuer: str, audience: str) -> str:
    problems = {
        "aud": f"the token is not meant for this server (its audience is not {audience!r})",
        "iss": f"the token's issuer is not {issuer!r}",
        "nbf": "the token is not valid yet (nbf)",
        "iat": "the token was issued in the future (iat)",
    }
    return problems.get(exc.claim, f"the token's {exc.claim!r} claim is not valid")
