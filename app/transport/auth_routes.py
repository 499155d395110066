"""The accounts endpoints (PROTOCOL §7): sign-up, sign-in, sign-out, `me`, OIDC sign-in,
a user's API keys, and the admin's.

The session is the cookie `sc_session` (HttpOnly, `SameSite=Lax`, `Secure` when the
request came over https). `AuthMiddleware` has already put the request's `User` in
the scope (or none, on `/api/auth/*`) and refused cookie-authenticated writes from
another origin.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from ..chat.records import iso
from ..errors import AppError, BadRequest, Forbidden, NotFound, Unauthorized
from ..identity import User
from ..identity.accounts import Account, Accounts
from ..identity.oidc import FLOW_COOKIE, FLOW_SECONDS, OidcSignIn
from ..identity.quota import Quota
from ..identity.resolver import SESSION_COOKIE, Identity
from ..ids import parse_id
from .http import current_user, error_response, json_errors, read_json
from .usage import usage_json

CALLBACK = "/api/auth/oidc/callback"
#: longer than any invite code the server makes
MAX_INVITE = 200


def _identity(request: Request) -> Identity:
    identity: Identity = request.app.state.identity
    return identity


def _accounts(request: Request) -> Accounts:
    accounts = _identity(request).accounts
    if accounts is None:
        raise NotFound('accounts are off on this server (auth.mode is not "accounts")')
    return accounts


def _signed_in(request: Request) -> User:
    _accounts(request)
    user = current_user(request)
    if user is None:
        raise Unauthorized("sign in first")
    return user


def _admin(request: Request) -> User:
    user = _signed_in(request)
    if not user.is_admin:
        raise Forbidden("only an admin may do this")
    return user


def _https(request: Request) -> bool:
    public = request.app.state.settings.server.public_url
    return request.url.scheme == "https" or str(public).startswith("https://")


def _base(request: Request) -> str:
    """The server's address as browsers reach it (`server.public_url`, else the request's)."""
    public = request.app.state.settings.server.public_url
    return str(public).rstrip("/") if public else str(request.base_url).rstrip("/")


def _with_session(request: Request, response: Response, token: str) -> Response:
    days = request.app.state.settings.auth.session_days
    response.set_cookie(
        SESSION_COOKIE,
        token,
        max_age=int(days * 86400),
        path="/",
        httponly=True,
        samesite="lax",
        secure=_https(request),
    )
    return response


def account_json(account: Account) -> dict[str, Any]:
    return {"id": account.id, "email": account.email, "name": account.name, "role": account.role}


async def _body(request: Request) -> dict[str, Any]:
    body = await read_json(request, request.app.state.settings.limits.max_body_bytes)
    if not isinstance(body, dict):
        raise BadRequest("request must be a JSON object")
    return body


# -- signing in and out -----------------------------------------------------------------------


def _address(request: Request) -> str:
    """The client's address, as sign-in and sign-up throttles count it (behind a trusted
    proxy, the server already took it from `X-Forwarded-For`)."""
    return request.client.host if request.client else "unknown"


@json_errors
async def signup(request: Request) -> Response:
    """`POST /api/auth/signup {"email","password","name"?,"invite"?}` → 201 `{"user"}`
    and a session cookie."""
    accounts = _accounts(request)
    body = await _body(request)
    account, token = await accounts.sign_up(
        body.get("email"),
        body.get("password"),
        body.get("name"),
        body.get("invite"),
        address=_address(request),
    )
    response = JSONResponse({"user": account_json(account)}, status_code=201)
    return _with_session(request, response, token)


@json_errors
async def login(request: Request) -> Response:
    """`POST /api/auth/login {"email","password"}` → `{"user"}` and a session cookie;
    401 when wrong, 429 once throttled."""
    accounts = _accounts(request)
    body = await _body(request)
    account, token = await accounts.sign_in(
        body.get("email"), body.get("password"), _address(request)
    )
    return _with_session(request, JSONResponse({"user": account_json(account)}), token)


@json_errors
async def logout(request: Request) -> Response:
    """`POST /api/auth/logout` → 204: the session is deleted from the store, so it ends
    on every process at once."""
    accounts = _accounts(request)
    token = request.cookies.get(SESSION_COOKIE)
    if token:
        await accounts.sign_out(token)
    response = Response(status_code=204)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="lax")
    return response


def _sign_in_options(identity: Identity) -> dict[str, Any]:
    out: dict[str, Any] = {"authMethods": identity.methods, "authMode": identity.mode}
    if identity.mode == "accounts":
        out["signup"] = identity.settings.auth.signup
        if identity.oidc is not None:
            out["oidc"] = {"name": identity.oidc.name, "login": "/api/auth/oidc/login"}
    return out


@json_errors
async def me(request: Request) -> Response:
    """`GET /api/auth/me` → `{"user", "authMethods"}`, or 401 (which says how to sign
    in: `authMethods`, `signup`, `oidc`). With auth off `user` is null: requests name
    their user."""
    identity = _identity(request)
    if not identity.enabled:
        return JSONResponse({"user": None, **_sign_in_options(identity)})
    user = current_user(request)
    if user is None:
        return error_response(Unauthorized("not signed in"), **_sign_in_options(identity))
    return JSONResponse({"user": user.to_json(), "via": user.method, **_sign_in_options(identity)})


# -- OpenID Connect -------------------------------------------------------------------------


def _oidc(request: Request) -> OidcSignIn:
    oidc = _identity(request).oidc
    if oidc is None:
        raise NotFound("sign-in with an identity provider is not configured (auth.oidc)")
    return oidc


def _next(value: str | None) -> str:
    """Where to go after signing in: a path on this server, never another site."""
    if not value or not value.startswith("/") or value.startswith(("//", "/\\")):
        return "/"
    return value


async def oidc_login(request: Request) -> Response:
    """`GET /api/auth/oidc/login?next=&invite=` → to the identity provider (a browser
    follows a link here: a failure goes back to the sign-in page, saying why). An
    `invite` code rides along in the signed flow cookie and is spent if the sign-in
    makes an account (`auth.signup = "invite"`)."""
    try:
        _accounts(request)
        invite = request.query_params.get("invite") or None
        if invite is not None and len(invite) > MAX_INVITE:
            raise BadRequest("this invite code is not valid")
        url, flow = await _oidc(request).begin(
            _base(request) + CALLBACK, _next(request.query_params.get("next")), invite
        )
    except AppError as exc:
        return _refused(exc)
    response = RedirectResponse(url, status_code=302)
    response.set_cookie(
        FLOW_COOKIE,
        flow,
        max_age=FLOW_SECONDS,
        path="/api/auth/oidc",
        httponly=True,
        samesite="lax",
        secure=_https(request),
    )
    return response


def _refused(exc: AppError) -> Response:
    return RedirectResponse("/signin#signin-error=" + quote(exc.message), status_code=302)


async def oidc_callback(request: Request) -> Response:
    """`GET /api/auth/oidc/callback`: back from the identity provider. Signed in: to
    `next` with the session cookie. Refused: to the web client's sign-in page, saying
    why (in the fragment, which no server logs): `/signin`, the web client's page whatever
    else serves `/`."""
    try:
        oidc, accounts = _oidc(request), _accounts(request)
        claims, next_path, invite = await oidc.finish(
            request.query_params, request.cookies.get(FLOW_COOKIE), _base(request) + CALLBACK
        )
        _, token = await accounts.for_oidc(claims, invite)
    except AppError as exc:
        response: Response = _refused(exc)
    else:
        response = _with_session(request, RedirectResponse(next_path, status_code=302), token)
    response.delete_cookie(FLOW_COOKIE, path="/api/auth/oidc", httponly=True, samesite="lax")
    return response


# -- a user's API keys --------------------------------------------------------------------------


@json_errors
async def list_keys(request: Request) -> Response:
    user = _signed_in(request)
    keys = await _accounts(request).list_keys(user)
    return JSONResponse({"keys": [k.to_json() for k in keys]})


@json_errors
async def create_key(request: Request) -> Response:
    """`POST /api/keys {"name"}` → 201 `{"id","name","key","createdAt"}`: the key this
    once (only its hash is kept)."""
    user = _signed_in(request)
    body = await _body(request)
    key, secret = await _accounts(request).create_key(user, body.get("name"))
    return JSONResponse({**key.to_json(), "key": secret}, status_code=201)


@json_errors
async def revoke_key(request: Request) -> Response:
    user = _signed_in(request)
    key_id = parse_id(request.path_params["key_id"], "key id")
    await _accounts(request).revoke_key(user, key_id)
    return JSONResponse({"id": key_id, "revoked": True})


# -- admin --------------------------------------------------------------------------------------


def _admin_json(account: Account, quota: Quota, used: int) -> dict[str, Any]:
    limit = account.tokens_per_day if account.tokens_per_day is not None else quota.default
    return {**account.to_json(), "quota": limit, "tokensToday": used}


@json_errors
async def admin_users(request: Request) -> Response:
    """`GET /api/admin/users` → every account with its quota and its tokens today."""
    _admin(request)
    quota: Quota = request.app.state.quota
    used = await quota.used_today_by_user()
    users = await _accounts(request).list_users()
    return JSONResponse(
        {
            "users": [_admin_json(a, quota, used.get(a.id, 0)) for a in users],
            "tokensPerDay": quota.default,
            "signup": request.app.state.settings.auth.signup,
        }
    )


@json_errors
async def admin_change_user(request: Request) -> Response:
    """`PATCH /api/admin/users/{id} {"disabled"?, "role"?, "tokensPerDay"?}`."""
    _admin(request)
    user_id = parse_id(request.path_params["user_id"], "user id")
    account = await _accounts(request).change_user(user_id, await _body(request))
    quota: Quota = request.app.state.quota
    return JSONResponse({"user": _admin_json(account, quota, await quota.used_today(account.id))})


@json_errors
async def admin_user_usage(request: Request) -> Response:
    """`GET /api/admin/users/{id}/usage?since=`: as `/api/usage`, for any user."""
    _admin(request)
    user_id = parse_id(request.path_params["user_id"], "user id")
    return JSONResponse(await usage_json(request, user_id))


@json_errors
async def admin_invite(request: Request) -> Response:
    """`POST /api/admin/invites {"days"?}` → 201 `{"invite", "expiresAt"}`: a code one
    sign-up may spend (`auth.signup = "invite"`)."""
    admin = _admin(request)
    body = await _body(request) if request.headers.get("content-length") not in (None, "0") else {}
    code, expires = await _accounts(request).invite(admin, body.get("days"))
    return JSONResponse({"invite": code, "expiresAt": iso(expires)}, status_code=201)
