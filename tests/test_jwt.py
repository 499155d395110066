"""Bearer JWTs from an app's own identity provider (PROTOCOL §7): keys made here (RS256,
ES256, HS256), the issuer's discovery document and JWKS served on loopback; each bad
token refused with 401 and a message saying why, the right one accepted on SSE,
WebSocket and /v1."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from httpx_ws import WebSocketDisconnect, aconnect_ws
from joserfc import jwt
from joserfc.jwk import ECKey, OctKey, RSAKey
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from app.identity import keys
from app.main import create_app
from app.store import Account, open_store
from tests.client import sse_chat
from tests.identity import browser, question, sign_up
from tests.servers import ServerThread, serve

pytestmark = pytest.mark.anyio

AUDIENCE = "searchchat-api"


class Issuer:
    """An identity provider's public side: discovery and JWKS, with keys to rotate."""

    def __init__(self) -> None:
        self.rsa = RSAKey.generate_key(2048, parameters={"kid": "rsa-1", "use": "sig"})
        self.ec = ECKey.generate_key("P-256", parameters={"kid": "ec-1", "use": "sig"})
        self.published = [self.rsa, self.ec]
        self.jwks_hits = 0
        self.jwks_answered = 0  # JWKS requests answered, after their delay
        self.url = ""
        self.down = False  # answers 503 to everything
        self.delay = 0.0  # seconds the JWKS takes

    def app(self) -> Starlette:
        async def discovery(request: Request) -> JSONResponse:
            if self.down:
                return JSONResponse({}, status_code=503)
            return JSONResponse({"issuer": self.url, "jwks_uri": self.url + "/jwks"})

        async def jwks(request: Request) -> JSONResponse:
            self.jwks_hits += 1
            await asyncio.sleep(self.delay)
            self.jwks_answered += 1
            if self.down:
                return JSONResponse({}, status_code=503)
            return JSONResponse({"keys": [k.as_dict(private=False) for k in self.published]})

        return Starlette(
            routes=[
                Route("/.well-known/openid-configuration", discovery),
                Route("/jwks", jwks),
            ]
        )

    def token(self, key: Any = None, alg: str = "RS256", **claims: Any) -> str:
        key = key or self.rsa
        now = int(time.time())
        body = {"iss": self.url, "aud": AUDIENCE, "sub": "user-1", "iat": now, "exp": now + 600}
        body.update(claims)
        body = {k: v for k, v in body.items() if v is not None}
        return jwt.encode({"alg": alg, "kid": key.kid}, body, key, algorithms=[alg])


@pytest.fixture(scope="module")
def issuer() -> Iterator[Issuer]:
    provider = Issuer()
    with serve(provider.app()) as running:
        provider.url = running.url
        yield provider


@pytest.fixture
def jwt_server(settings, issuer) -> Iterator[ServerThread]:
    issuer.published = [issuer.rsa, issuer.ec]
    issuer.down, issuer.delay = False, 0.0
    configured = settings.replace(
        auth={"mode": "accounts", "jwt": {"issuer": issuer.url, "audience": AUDIENCE}}
    )
    with serve(create_app(configured)) as server:
        yield server


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def unsigned(claims: dict[str, Any]) -> str:
    header = b64(orjson.dumps({"alg": "none", "typ": "JWT"}))
    return f"{header}.{b64(orjson.dumps(claims))}."


def hs256_with(secret: bytes, claims: dict[str, Any], kid: str | None = None) -> str:
    """An HS256 token signed by hand with any bytes as the secret (what an attacker
    does with a public key)."""
    header = {"alg": "HS256", "typ": "JWT", **({"kid": kid} if kid else {})}
    signing_input = f"{b64(orjson.dumps(header))}.{b64(orjson.dumps(claims))}"
    mac = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64(mac)}"


async def refused(server: ServerThread, token: str) -> str:
    """The 401's message for a token on /api, having checked /v1 refuses it too."""
    headers = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=server.url, timeout=10, headers=headers) as http:
        response = await http.get("/api/chats")
        assert response.status_code == 401, response.text
        assert response.json()["key"] == "UNAUTHORIZED"
        v1 = await http.get("/v1/models")
        assert v1.status_code == 401 and v1.json()["error"]["type"] == "invalid_request_error"
        message: str = response.json()["data"]
        return message


async def test_the_right_token_is_accepted_on_sse_websocket_and_v1(jwt_server, issuer, fake_model):
    token = issuer.token(sub="app-user-7")
    bearer = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=jwt_server.url, timeout=10, headers=bearer) as http:
        events = await sse_chat(http, question("over sse", chatId="j1"))
        assert events[-1].data["status"] == "completed"
        me = (await http.get("/api/auth/me")).json()
        assert me["user"]["name"] == "jwt:app-user-7" and me["via"] == "jwt"
        completion = await http.post(
            "/v1/chat/completions",
            json={"model": "deepSeek", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert completion.status_code == 200
        assert completion.json()["choices"][0]["message"]["content"]
        for url, headers in (
            (jwt_server.ws_url + "/api/chat/ws", bearer),
            (jwt_server.ws_url + f"/?token={token}", {}),
        ):
            async with aconnect_ws(url, http, headers=headers) as ws:
                assert orjson.loads(await ws.receive_text())["type"] == "signal"
                chat_id = uuid.uuid4().hex[:12]
                await ws.send_text(orjson.dumps(question("over ws", chatId=chat_id)).decode())
                frame = orjson.loads(await ws.receive_text())
                while frame["type"] not in ("messageEnd", "error"):
                    frame = orjson.loads(await ws.receive_text())
                assert frame["status"] == "completed"
        chats = (await http.get("/api/chats")).json()["chats"]
        assert len(chats) == 4  # one account for the sub, whatever the transport
    # the same sub with another token is the same user; an email names a new one
    again = {
        "authorization": f"Bearer {issuer.token(sub='app-user-7', key=issuer.ec, alg='ES256')}"
    }
    async with httpx.AsyncClient(base_url=jwt_server.url, timeout=10, headers=again) as http:
        assert len((await http.get("/api/chats")).json()["chats"]) == 4
    named = {"authorization": f"Bearer {issuer.token(sub='u-8', email='eve@example.test')}"}
    async with httpx.AsyncClient(base_url=jwt_server.url, timeout=10, headers=named) as http:
        me = (await http.get("/api/auth/me")).json()
        assert me["user"]["name"] == "eve@example.test" and me["user"]["role"] == "user"
        assert (await http.get("/api/chats")).json()["chats"] == []


async def test_each_bad_token_is_refused_saying_why(jwt_server, issuer):
    now = int(time.time())
    assert "expired" in await refused(jwt_server, issuer.token(exp=now - 120))
    assert "audience" in await refused(jwt_server, issuer.token(aud="another-app"))
    assert "issuer" in await refused(jwt_server, issuer.token(iss="https://evil.example"))
    assert "not valid yet" in await refused(jwt_server, issuer.token(nbf=now + 600))
    assert "'sub'" in await refused(jwt_server, issuer.token(sub=None))
    assert "'exp'" in await refused(jwt_server, issuer.token(exp=None))
    claims = {"iss": issuer.url, "aud": AUDIENCE, "sub": "user-1", "exp": now + 600}
    assert "alg: none" in await refused(jwt_server, unsigned(claims))
    # the issuer's RS256 public key, as published, used as an HS256 secret
    public_pem = issuer.rsa.as_pem(private=False)
    confused = hs256_with(public_pem, claims, kid="rsa-1")
    assert "HS256 tokens are refused" in await refused(jwt_server, confused)
    # a signature of another key under the issuer's kid
    impostor = RSAKey.generate_key(2048, parameters={"kid": "rsa-1"})
    assert "signature" in await refused(jwt_server, issuer.token(key=impostor))
    # a key of one type named for an algorithm of another
    mixed = jwt.encode({"alg": "RS256", "kid": "ec-1"}, claims, issuer.rsa, algorithms=["RS256"])
    assert "does not fit" in await refused(jwt_server, mixed)
    head, body, signature = issuer.token().split(".")
    tampered = b64(orjson.dumps({**claims, "sub": "admin"}))
    assert "signature" in await refused(jwt_server, f"{head}.{tampered}.{signature}")
    assert "not valid" in await refused(jwt_server, "eyJhbGciOiJSUzI1NiJ9.e30.sig.x.y")


async def test_clock_skew_of_a_minute_is_allowed(jwt_server, issuer):
    now = int(time.time())
    for token in (issuer.token(exp=now - 30), issuer.token(nbf=now + 30, iat=now + 30)):
        async with httpx.AsyncClient(
            base_url=jwt_server.url, timeout=10, headers={"authorization": f"Bearer {token}"}
        ) as http:
            assert (await http.get("/api/chats")).status_code == 200


async def test_keys_rotate_and_unknown_kids_do_not_hammer_the_issuer(jwt_server, issuer):
    async with httpx.AsyncClient(base_url=jwt_server.url, timeout=10) as http:

        async def status(token: str) -> int:
            response = await http.get("/api/chats", headers={"authorization": f"Bearer {token}"})
            return response.status_code

        assert await status(issuer.token()) == 200
        fetched = issuer.jwks_hits
        assert await status(issuer.token()) == 200
        assert issuer.jwks_hits == fetched  # cached
        # the issuer rotates: a new kid is fetched at once, the retired one is refused
        rotated = RSAKey.generate_key(2048, parameters={"kid": "rsa-2", "use": "sig"})
        issuer.published = [rotated, issuer.ec]
        assert await status(issuer.token(key=rotated)) == 200
        assert issuer.jwks_hits == fetched + 1
        assert await status(issuer.token()) == 401
        # made-up kids: a few fetches, then the cache answers
        before = issuer.jwks_hits
        for n in range(12):
            stray = RSAKey.generate_key(2048, parameters={"kid": f"stray-{n}"})
            assert await status(issuer.token(key=stray)) == 401
        assert issuer.jwks_hits - before <= 5
        issuer.published = [issuer.rsa, issuer.ec]


async def test_known_keys_outlive_an_unreachable_issuer(jwt_server, issuer, monkeypatch):
    async with httpx.AsyncClient(base_url=jwt_server.url, timeout=30) as http:

        async def status(token: str) -> int:
            response = await http.get("/api/chats", headers={"authorization": f"Bearer {token}"})
            return response.status_code

        assert await status(issuer.token()) == 200
        monkeypatch.setattr(keys, "MAX_AGE_SECONDS", 0.2)
        await asyncio.sleep(0.3)
        issuer.down = True
        try:
            hits = issuer.jwks_hits
            # the keys are old and cannot be fetched again: the last known ones go on
            assert await status(issuer.token()) == 200
            assert await status(issuer.token(key=issuer.ec, alg="ES256")) == 200
            assert issuer.jwks_hits - hits <= 1  # and the issuer is not asked on each token
            # a kid not seen yet cannot be checked while the issuer is away: try again later
            stray = RSAKey.generate_key(2048, parameters={"kid": "not-yet-seen"})
            assert await status(issuer.token(key=stray)) == 503
        finally:
            issuer.down = False


async def test_a_slow_key_fetch_holds_up_only_the_tokens_that_need_it(jwt_server, issuer):
    async with httpx.AsyncClient(base_url=jwt_server.url, timeout=30) as http:

        async def timed(token: str) -> tuple[int, float]:
            started = time.monotonic()
            response = await http.get("/api/chats", headers={"authorization": f"Bearer {token}"})
            return response.status_code, time.monotonic() - started

        assert (await timed(issuer.token()))[0] == 200
        issuer.delay = 3.0
        try:
            stray = RSAKey.generate_key(2048, parameters={"kid": "made-up"})
            answered = issuer.jwks_answered
            unknown = asyncio.ensure_future(timed(issuer.token(key=stray)))
            await asyncio.sleep(0.3)  # its fetch of the keys is under way
            status, took = await timed(issuer.token())
            assert status == 200 and took < 1.5  # the cached key answers, without waiting
            assert not unknown.done() and issuer.jwks_answered == answered  # still fetching
            status, _ = await unknown
            assert status == 401 and issuer.jwks_answered == answered + 1  # once it answered
        finally:
            issuer.delay = 0.0


async def test_another_issuers_admin_cannot_be_taken_over_with_its_sub(settings, issuer):
    """Without `auth.jwt.issuer` the token's `iss` is not checked: its accounts are filed
    under the keys that checked it, never under an `iss` it may make up."""
    oidc_issuer, admin_sub = "https://idp.example", "the-admins-sub"
    async with open_store(settings.store.url) as store:
        await store.add_account(
            Account(
                "9001",
                "OIDC admin",
                role="admin",
                issuer=oidc_issuer,
                subject=admin_sub,
                created_at=time.time(),
            )
        )
    secret = "a shared secret of at least thirty-two bytes"
    configured = settings.replace(
        auth={
            "mode": "accounts",
            "jwt": {"secret": secret, "jwks_url": issuer.url + "/jwks", "audience": AUDIENCE},
        }
    )
    now = int(time.time())
    claims = {"iss": oidc_issuer, "sub": admin_sub, "aud": AUDIENCE, "exp": now + 600}
    by_keys = issuer.token(iss=oidc_issuer, sub=admin_sub)
    by_secret = jwt.encode(
        {"alg": "HS256"}, claims, OctKey.import_key(secret), algorithms=["HS256"]
    )
    with serve(create_app(configured)) as server:
        seen = set()
        for token in (by_keys, by_secret):
            headers = {"authorization": f"Bearer {token}"}
            async with httpx.AsyncClient(base_url=server.url, timeout=10, headers=headers) as http:
                me = (await http.get("/api/auth/me")).json()["user"]
                assert me["id"] != "9001" and me["role"] == "user"
                assert (await http.get("/api/admin/users")).status_code == 403
                seen.add(me["id"])
        assert len(seen) == 2  # the secret's users and the key set's are not each other


async def test_a_disabled_app_user_is_refused(jwt_server, issuer):
    async with browser(jwt_server.url) as admin:
        await sign_up(admin, "admin@example.test")
        token = issuer.token(sub="to-disable")
        bearer = {"authorization": f"Bearer {token}"}
        me = (await admin.get("/api/auth/me", headers=bearer)).json()["user"]
        changed = await admin.patch(f"/api/admin/users/{me['id']}", json={"disabled": True})
        assert changed.status_code == 200
        assert "disabled" in await refused(jwt_server, token)


async def test_an_hs256_secret_and_a_jwks_url(settings, issuer, fake_model):
    secret = "a shared secret of at least thirty-two bytes"
    configured = settings.replace(
        auth={
            "mode": "accounts",
            "jwt": {"secret": secret, "jwks_url": issuer.url + "/jwks", "audience": AUDIENCE},
        }
    )
    with serve(create_app(configured)) as server:
        now = int(time.time())
        claims = {"sub": "hs-user", "aud": AUDIENCE, "exp": now + 600}
        good = jwt.encode({"alg": "HS256"}, claims, OctKey.import_key(secret), algorithms=["HS256"])
        async with httpx.AsyncClient(
            base_url=server.url, timeout=10, headers={"authorization": f"Bearer {good}"}
        ) as http:
            events = await sse_chat(http, question("hello"))
            assert events[-1].data["status"] == "completed"
        assert "signature" in await refused(server, hs256_with(b"another secret entirely!", claims))
        assert "only HS256" in await refused(
            server,
            jwt.encode({"alg": "HS512"}, claims, OctKey.import_key(secret), algorithms=["HS512"]),
        )
        # keys from jwks_url (no issuer configured: iss is not checked, aud is)
        async with httpx.AsyncClient(
            base_url=server.url,
            timeout=10,
            headers={"authorization": f"Bearer {issuer.token(iss='anyone')}"},
        ) as http:
            assert (await http.get("/api/chats")).status_code == 200
        assert "audience" in await refused(server, issuer.token(aud="x"))


async def test_an_expired_token_ends_an_open_socket_on_its_next_frame(settings, issuer, fake_model):
    configured = settings.replace(
        auth={"mode": "accounts", "jwt": {"issuer": issuer.url, "audience": AUDIENCE}}
    )
    with serve(create_app(configured)) as server:
        # valid now (with the minute of skew), expired two seconds from now
        token = issuer.token(exp=int(time.time()) - 58)
        async with (
            httpx.AsyncClient(timeout=10) as http,
            aconnect_ws(server.ws_url + f"/api/chat/ws?token={token}", http) as ws,
        ):
            assert orjson.loads(await ws.receive_text())["type"] == "signal"
            await ws.send_text('{"type": "ping"}')
            assert orjson.loads(await ws.receive_text())["type"] == "pong"
            await asyncio.sleep(3)
            await ws.send_text(orjson.dumps(question("still me?")).decode())
            frame = orjson.loads(await ws.receive_text())
            assert frame["key"] == "UNAUTHORIZED" and "expired" in frame["data"]
            with pytest.raises(WebSocketDisconnect) as closed:
                await ws.receive_text()
            assert closed.value.code == 4401
