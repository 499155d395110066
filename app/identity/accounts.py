"""Accounts (PROTOCOL §7): sign-up and sign-in, sessions, a user's own API keys, the
accounts identity providers vouch for (OIDC sign-in, bearer JWTs), invites, and what
an admin changes.

Sessions and keys live in the store, as the SHA-256 of their secret, and every
request looks its credential up there: signing out, revoking a key or disabling an
account holds on the next request of every process. Who may make an account
(`auth.signup`): `open`, anyone; `invite`, whoever has an admin's invite code;
`closed`, nobody through the server. Until an admin exists the first password or
OIDC sign-up is allowed whatever the rule says, and it becomes the admin (someone has
to be able to make invites) — which is why an operator makes the admin before the
server is reachable (`python -m app.identity create-admin`). Accounts of bearer JWTs
are made on first use whatever the rule (the operator trusts their issuer by
configuring it), and are never made admin by it.
"""

from __future__ import annotations

import re
import time
from typing import Any

from ..config import AuthSettings
from ..errors import BadRequest, Conflict, Forbidden, NotFound, Unauthorized
from ..ids import Snowflake
from ..store import Account as Account
from ..store import AccountChange, ApiKey, Store
from ..store.base import bad_invite
from .passwords import MAX_LENGTH, MIN_LENGTH, Passwords
from .throttle import SignInThrottle
from .tokens import API_KEY_PREFIX, new_token, token_hash
from .user import Method, User

EMAIL = re.compile(r"^[^@\s]{1,64}@[^@\s]{1,190}$")
MAX_NAME = 100
MAX_KEYS = 100
INVITE_DAYS = 7.0


def normal_email(value: Any) -> str:
    """An email as accounts are matched by it (trimmed, lower-case); BadRequest when it
    is not one."""
    email = value.strip().lower() if isinstance(value, str) else ""
    if not EMAIL.match(email):
        raise BadRequest("email must be an email address")
    return email


def text_field(value: Any, what: str, default: str = "") -> str:
    if value is None:
        return default
    if not isinstance(value, str) or len(value.strip()) > MAX_NAME:
        raise BadRequest(f"{what} must be a string of at most {MAX_NAME} characters")
    return value.strip() or default


def user_of(account: Account, method: Method) -> User:
    """The request's `User` for an account that may act (`Unauthorized` when disabled)."""
    if account.disabled:
        raise Unauthorized("this account is disabled")
    return User(
        id=account.id,
        method=method,
        role=account.role,
        name=account.name,
        email=account.email,
        tokens_per_day=account.tokens_per_day,
    )


class Accounts:
    def __init__(
        self,
        settings: AuthSettings,
        *,
        store: Store,
        ids: Snowflake,
        throttle: SignInThrottle,
        passwords: Passwords | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.ids = ids
        self.throttle = throttle
        self.passwords = passwords or Passwords()

    # -- password accounts ----------------------------------------------------------------

    async def sign_up(
        self,
        email: Any,
        password: Any,
        name: Any = None,
        invite: Any = None,
        address: str = "unknown",
    ) -> tuple[Account, str]:
        """A new password account and its first session's token. `RateLimited` past the
        sign-ups allowed from the client's `address`, `BadRequest` for a bad email or a
        weak password, `Conflict` (409) for a taken email, `Forbidden` when the sign-up
        rule refuses (see the module docstring), `Unavailable` (503) when too many
        passwords wait to be hashed. Everything that can refuse is asked before the
        password is hashed, the one costly step."""
        await self.throttle.sign_up(address)
        who = normal_email(email)
        if not isinstance(password, str) or not MIN_LENGTH <= len(password) <= MAX_LENGTH:
            raise BadRequest(f"the password must be {MIN_LENGTH} to {MAX_LENGTH} characters long")
        await self._may_sign_up(invite)
        if await self.store.account_by_email(who) is not None:
            raise Conflict("an account with this email exists already")
        account = Account(
            id=self.ids.next_str(),
            name=text_field(name, "name", who.split("@")[0]),
            email=who,
            password_hash=await self.passwords.hash(password),
            created_at=time.time(),
        )
        # the invite is spent here, in the account's own transaction (two sign-ups
        # with one code: one account)
        made = await self.store.add_account(
            account, admin_if_none=True, invite=self._invite_hash(invite)
        )
        return made, await self.start_session(made)

    async def _may_sign_up(self, invite: Any) -> None:
        """`Forbidden` when the sign-up rule refuses a new account with `invite` (checked,
        not spent: `add_account` spends it). Until an admin exists anyone is let in."""
        rule = self.settings.signup
        if rule == "open" or not await self.store.has_admin():
            return
        if rule == "closed":
            raise Forbidden("sign-up is closed on this server: ask its admin for an account")
        if invite is not None and not isinstance(invite, str):
            raise BadRequest("invite must be a string")
        if not invite:
            raise Forbidden("sign-up on this server needs an invite code: ask its admin for one")
        if not await self.store.invite_usable(token_hash(invite)):
            raise bad_invite()

    def _invite_hash(self, invite: Any) -> str | None:
        """What the store spends under `invite` sign-ups (a hash no code has, when the
        request brings none: it is refused unless no admin exists yet)."""
        if self.settings.signup != "invite":
            return None
        return token_hash(invite) if isinstance(invite, str) and invite else "-"

    async def sign_in(self, email: Any, password: Any, address: str) -> tuple[Account, str]:
        """The account and a new session's token. `Unauthorized` for a wrong email or
        password (the same answer for both), `RateLimited` past the throttle."""
        who = email.strip().lower() if isinstance(email, str) else ""
        # counted before the password is checked: attempts sent at once cannot all
        # pass a check that none of them has added to yet
        await self.throttle.attempt(who, address)
        account = await self.store.account_by_email(who) if who else None
        given = password if isinstance(password, str) and len(password) <= MAX_LENGTH else ""
        stored = account.password_hash if account is not None else None
        if account is None or not await self.passwords.verify(stored, given):
            raise Unauthorized("wrong email or password")
        user_of(account, "session")  # a disabled account is refused here too
        await self.throttle.succeeded(who, address)
        return account, await self.start_session(account)

    # -- accounts identity providers vouch for ----------------------------------------------

    async def for_oidc(
        self, claims: dict[str, Any], invite: str | None = None
    ) -> tuple[Account, str]:
        """The account of a verified OIDC sign-in (made on first sign-in when sign-up
        allows: `invite`, the code the sign-in was started with, is spent then) and a
        new session's token."""
        issuer, subject = str(claims["iss"]).rstrip("/"), str(claims["sub"])
        account = await self.store.account_by_subject(issuer, subject)
        if account is None:
            rule = self.settings.signup
            if (
                rule != "open"
                and not (rule == "invite" and invite)
                and await self.store.has_admin()
            ):
                raise Forbidden(
                    "there is no account for you on this server, and sign-up is "
                    + ("by invitation: ask its admin for a code" if rule == "invite" else "closed")
                )
            account = await self._vouched(
                issuer, subject, claims, admin_if_none=True, invite=self._invite_hash(invite)
            )
        user_of(account, "session")
        return account, await self.start_session(account)

    async def for_jwt(self, claims: dict[str, Any], issuer: str) -> User:
        """The user of a verified bearer JWT: its `sub` under `issuer` — the issuer the
        token was checked against (`auth.jwt.issuer`), or a name of the keys that
        checked it (`BearerJwt.verify` says which), never the token's own `iss` claim
        unchecked. An account is made on first use (named by its `email`, else
        `jwt:<sub>`)."""
        subject = str(claims["sub"])
        account = await self.store.account_by_subject(issuer, subject)
        if account is None:
            account = await self._vouched(issuer, subject, claims, admin_if_none=False)
        return user_of(account, "jwt")

    async def _vouched(
        self,
        issuer: str,
        subject: str,
        claims: dict[str, Any],
        *,
        admin_if_none: bool,
        invite: str | None = None,
    ) -> Account:
        email = claims.get("email") if isinstance(claims.get("email"), str) else None
        name = claims.get("name") if isinstance(claims.get("name"), str) else None
        account = Account(
            id=self.ids.next_str(),
            name=(name or email or f"jwt:{subject}")[:MAX_NAME],
            issuer=issuer,
            subject=subject,
            created_at=time.time(),
        )
        try:
            return await self.store.add_account(account, admin_if_none=admin_if_none, invite=invite)
        except Conflict:  # made at the same moment by another request
            found = await self.store.account_by_subject(issuer, subject)
            if found is None:
                raise
            return found

    # -- sessions ---------------------------------------------------------------------------

    async def start_session(self, account: Account) -> str:
        token = new_token()
        expires = time.time() + self.settings.session_days * 86400
        await self.store.add_session(token_hash(token), account.id, expires)
        return token

    async def by_session(self, token: str) -> User:
        account = await self.store.session_account(token_hash(token))
        if account is None:
            raise Unauthorized("your session has ended: sign in again")
        return user_of(account, "session")

    async def sign_out(self, token: str) -> None:
        await self.store.delete_session(token_hash(token))

    # -- a user's API keys ------------------------------------------------------------------

    async def by_api_key(self, key: str) -> User:
        account = await self.store.api_key_account(token_hash(key))
        if account is None:
            raise Unauthorized("this API key is not valid (it may have been revoked)")
        return user_of(account, "apikey")

    async def create_key(self, user: User, name: Any) -> tuple[ApiKey, str]:
        """A new key of the user and the key itself (shown this once). A key cannot make
        keys (`Forbidden`): revoking a leaked one must cut off whoever holds it."""
        if user.method not in ("session", "jwt"):
            raise Forbidden("keys are made by a signed-in user, not with another key")
        label = text_field(name, "name", "API key")
        if len(await self.store.list_api_keys(user.id)) >= MAX_KEYS:
            raise BadRequest(f"at most {MAX_KEYS} keys per user: revoke one first")
        secret = new_token(API_KEY_PREFIX)
        key = ApiKey(self.ids.next_str(), user.id, label, secret[:12], time.time())
        await self.store.add_api_key(key, token_hash(secret))
        return key, secret

    async def list_keys(self, user: User) -> list[ApiKey]:
        return await self.store.list_api_keys(user.id)

    async def revoke_key(self, user: User, key_id: str) -> None:
        if not await self.store.revoke_api_key(user.id, key_id):
            raise NotFound("you have no such key")

    # -- admin ------------------------------------------------------------------------------

    async def list_users(self) -> list[Account]:
        return await self.store.list_accounts()

    async def change_user(self, user_id: str, body: Any) -> Account:
        """An admin's change `{"disabled"?, "role"?, "tokensPerDay"?}` (`tokensPerDay`
        null: back to the default). Disabling ends the account's sessions; its keys and
        JWTs are refused while it stays disabled."""
        if not isinstance(body, dict):
            raise BadRequest("send a JSON object")
        unknown = set(body) - {"disabled", "role", "tokensPerDay"}
        if unknown:
            raise BadRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
        disabled, role = body.get("disabled"), body.get("role")
        if disabled is not None and not isinstance(disabled, bool):
            raise BadRequest("disabled must be true or false")
        if role is not None and role not in ("admin", "user"):
            raise BadRequest("role must be admin or user")
        quota = body.get("tokensPerDay")
        if quota is not None and (
            not isinstance(quota, int) or isinstance(quota, bool) or quota < 0
        ):
            raise BadRequest("tokensPerDay must be a whole number of tokens (0: no quota)")
        change = AccountChange(
            disabled=disabled,
            role=role,
            tokens_per_day=quota,
            default_quota="tokensPerDay" in body and quota is None,
        )
        account = await self.store.update_account(user_id, change)
        if account is None:
            raise NotFound("no such user")
        return account

    async def invite(self, admin: User, days: Any = None) -> tuple[str, float]:
        """A new invite code (shown this once) and when it expires."""
        if days is None:
            days = INVITE_DAYS
        if not isinstance(days, (int, float)) or isinstance(days, bool) or not 0 < days <= 90:
            raise BadRequest("days must be a number from 1 to 90")
        code = new_token("inv_")
        expires = time.time() + float(days) * 86400
        await self.store.add_invite(token_hash(code), admin.id, expires)
        return code, expires
