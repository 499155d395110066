"""Sign-in with a real OpenID Connect provider (npm's oidc-provider on loopback): the
authorization code flow with PKCE, state and nonce, the account matched by issuer +
`sub` and made on first sign-in when sign-up allows; refused flows land on the sign-in
page saying why."""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Iterator
from urllib.parse import parse_qs, unquote, urlsplit

import httpx
import orjson
import pytest
from joserfc import jwt
from joserfc.jwk import OctKey

from tests.client import sse_chat
from tests.identity import browser, question, sign_up
from tests.oidc_provider import (
    CLIENT_ID,
    LOGIN,
    NAME,
    PASSWORD,
    SUB,
    OidcProvider,
    server_with_oidc,
)
from tests.servers import ServerThread

pytestmark = pytest.mark.anyio


@pytest.fixture
def signup_rule() -> str:
    return "open"


@pytest.fixture
def oidc_server(settings, signup_rule) -> Iterator[tuple[ServerThread, OidcProvider]]:
    with server_with_oidc(settings, signup=signup_rule) as running:
        yield running


async def at_provider(http: httpx.AsyncClient, authorize: str, login: str = LOGIN) -> str:
    """Sign in at the provider as a person would (its login form), and return where it
    sends the browser back to (our callback, with the code and state)."""
    response = await http.get(authorize)
    while response.is_redirect:
        location = str(response.next_request.url) if response.next_request else ""
        if "/api/auth/oidc/callback" in location:
            return location
        response = await http.get(location)
    assert "Test identity provider" in response.text, response.text[:500]
    form_url = str(response.url)
    response = await http.post(form_url, data={"login": login, "password": PASSWORD})
    while response.is_redirect:
        location = str(response.next_request.url) if response.next_request else ""
        if "/api/auth/oidc/callback" in location:
            return location
        response = await http.get(location)
    raise AssertionError(
        f"the provider did not send us back: {response.status_code} {response.text[:300]}"
    )


def flow_of(cookie: str) -> dict:
    body = cookie.split(".")[0]
    return orjson.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))


async def begin(http: httpx.AsyncClient, next_path: str = "/after") -> str:
    started = await http.get("/api/auth/oidc/login", params={"next": next_path})
    assert started.status_code == 302
    return started.headers["location"]


async def test_sign_in_with_the_provider_makes_the_account_once(oidc_server, fake_model):
    server, provider = oidc_server
    async with browser(server.url) as http:
        me = (await http.get("/api/auth/me")).json()
        assert me["authMethods"] == ["password", "oidc"]
        assert me["oidc"] == {"name": "Test IdP", "login": "/api/auth/oidc/login"}
        authorize = await begin(http)
        query = parse_qs(urlsplit(authorize).query)
        assert authorize.startswith(provider.issuer)
        assert query["response_type"] == ["code"] and query["client_id"] == [CLIENT_ID]
        assert query["code_challenge_method"] == ["S256"]
        assert set(query["scope"][0].split()) == {"openid", "email", "profile"}
        flow = flow_of(http.cookies["sc_oidc"])
        challenge = base64.urlsafe_b64encode(
            hashlib.sha256(flow["verifier"].encode()).digest()
        ).rstrip(b"=")
        assert query["code_challenge"] == [challenge.decode()]
        assert query["state"] == [flow["state"]] and query["nonce"] == [flow["nonce"]]
        callback = await at_provider(http, authorize)
        back = await http.get(callback)
        assert back.status_code == 302 and back.headers["location"] == "/after"
        assert "sc_session" in http.cookies
        me = (await http.get("/api/auth/me")).json()["user"]
        assert me["name"] == NAME and me["role"] == "admin"  # the first account
        events = await sse_chat(http, question("signed in through the provider"))
        assert events[-1].data["status"] == "completed"
        # the same code once more is refused (by the provider, and so by us)
        replay = await http.get(callback)
        assert replay.status_code == 302 and "signin-error" in replay.headers["location"]
        # signing in again is the same account
        await http.post("/api/auth/logout")
        callback = await at_provider(http, await begin(http))
        await http.get(callback)
        again = (await http.get("/api/auth/me")).json()["user"]
        assert again["id"] == me["id"]


async def test_a_callback_that_is_not_this_browsers_flow_is_refused(oidc_server):
    server, _ = oidc_server
    async with browser(server.url) as http:
        callback = await at_provider(http, await begin(http))
        parts = urlsplit(callback)
        code = parse_qs(parts.query)["code"][0]
        # a state that is not the flow's
        forged = await http.get(
            "/api/auth/oidc/callback", params={"code": code, "state": "not-the-state"}
        )
        assert forged.status_code == 302
        assert "state" in unquote(forged.headers["location"].split("signin-error=")[1])
        # a link someone else started: no flow cookie in this browser
        async with browser(server.url) as victim:
            lured = await victim.get(callback)
            assert "signin-error" in lured.headers["location"]
            assert "sc_session" not in victim.cookies
        # the provider's refusal
        async with browser(server.url) as other:
            await begin(other)
            denied = await other.get(
                "/api/auth/oidc/callback",
                params={
                    "error": "access_denied",
                    "state": flow_of(other.cookies["sc_oidc"])["state"],
                },
            )
            assert "access_denied" in unquote(denied.headers["location"])
        # next is a path on this server, never another site
        elsewhere = await http.get("/api/auth/oidc/login", params={"next": "//evil.example/x"})
        assert flow_of(elsewhere.cookies["sc_oidc"])["next"] == "/"


@pytest.mark.parametrize("signup_rule", ["closed"])
async def test_with_sign_up_closed_an_unknown_identity_is_not_let_in(oidc_server, signup_rule):
    server, _ = oidc_server
    async with browser(server.url) as admin:
        await sign_up(admin, "admin@example.test")  # the first account: the admin
    async with browser(server.url) as http:
        callback = await at_provider(http, await begin(http))
        refused = await http.get(callback)
        assert "sign-up is closed" in unquote(refused.headers["location"])
        assert (await http.get("/api/auth/me")).status_code == 401


@pytest.mark.parametrize("signup_rule", ["invite"])
async def test_an_invite_code_lets_a_new_identity_in(oidc_server, signup_rule):
    server, _ = oidc_server
    async with browser(server.url) as admin:
        await sign_up(admin, "admin@example.test")
        code = (await admin.post("/api/admin/invites", json={})).json()["invite"]
    async with browser(server.url) as http:
        # without a code: refused, saying why
        refused = await http.get(await at_provider(http, await begin(http)))
        assert "by invitation" in unquote(refused.headers["location"])
        # with one, carried through the provider in the signed flow cookie
        started = await http.get("/api/auth/oidc/login", params={"next": "/", "invite": code})
        assert flow_of(http.cookies["sc_oidc"])["invite"] == code
        back = await http.get(await at_provider(http, started.headers["location"]))
        assert back.status_code == 302 and back.headers["location"] == "/"
        me = (await http.get("/api/auth/me")).json()["user"]
        assert me["name"] == NAME and me["role"] == "user"
    async with browser(server.url) as other:  # the code is spent
        again = await other.post(
            "/api/auth/signup",
            json={"email": "b@example.test", "password": "a long passphrase", "invite": code},
        )
        assert again.status_code == 403


async def test_an_app_token_cannot_act_as_the_providers_admin(settings):
    """An HS256 secret (no `auth.jwt.issuer`) vouches for its own users only: a token
    that names the provider as `iss` and the admin's `sub` is another, new user."""
    secret = "an app's shared secret of thirty-two bytes"
    with server_with_oidc(settings, jwt={"secret": secret}) as (server, provider):
        async with browser(server.url) as http:
            await http.get(await at_provider(http, await begin(http)))
            admin = (await http.get("/api/auth/me")).json()["user"]
            assert admin["role"] == "admin"  # the first account, made through the provider
        now = int(time.time())
        claims = {"iss": provider.issuer, "sub": SUB, "exp": now + 600}
        token = jwt.encode(
            {"alg": "HS256"}, claims, OctKey.import_key(secret), algorithms=["HS256"]
        )
        headers = {"authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=server.url, timeout=10, headers=headers) as app:
            me = (await app.get("/api/auth/me")).json()["user"]
            assert me["id"] != admin["id"] and me["role"] == "user"
            assert (await app.get("/api/admin/users")).status_code == 403
