"""Accounts, their sessions and API keys, invites, and the tokens each user's answers
used (the quotas' tally): the tables and their SQL."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .records import Account, AccountChange, ApiKey, Usage
from .sql import Database, bad_invite, mapped, no_admin_left, prefixed, taken

#: the lock of changes that must see every admin (the first account, the last enabled
#: admin), so two at once cannot both decide on what they saw
ADMINS_LOCK_ID = 7_138_337_259
ACCOUNT_COLUMNS = (
    "id, name, role, email, password_hash, disabled, tokens_per_day, issuer, subject, created_at"
)
API_KEY_COLUMNS = "id, account_id, name, prefix, created_at"

MIGRATIONS: dict[int, str | dict[str, str]] = {
    # 7: accounts, their sessions and API keys (by the SHA-256 of the secret), invites
    7: """
    CREATE TABLE accounts (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        role TEXT NOT NULL,
        email TEXT UNIQUE,
        password_hash TEXT,
        disabled {bool} NOT NULL DEFAULT {false},
        tokens_per_day {bigint},
        issuer TEXT,
        subject TEXT,
        created_at {real} NOT NULL,
        UNIQUE (issuer, subject)
    );
    CREATE TABLE sessions (
        token_hash TEXT PRIMARY KEY,
        account_id TEXT NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
        created_at {real} NOT NULL,
        expires_at {real} NOT NULL
    );
    CREATE INDEX sessions_by_account ON sessions (account_id);
    CREATE INDEX sessions_by_expiry ON sessions (expires_at);
    CREATE TABLE api_keys (
        id TEXT PRIMARY KEY,
        account_id TEXT NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
        name TEXT NOT NULL,
        prefix TEXT NOT NULL,
        key_hash TEXT NOT NULL UNIQUE,
        created_at {real} NOT NULL
    );
    CREATE INDEX api_keys_by_account ON api_keys (account_id, created_at);
    CREATE TABLE invites (
        code_hash TEXT PRIMARY KEY,
        created_by TEXT NOT NULL,
        created_at {real} NOT NULL,
        expires_at {real} NOT NULL,
        used_by TEXT,
        used_at {real}
    );
    """,
    # 9: the tokens each user's answers used, per UTC day (days since 1970): added to
    # when an answer's usage is saved and never lowered, so deleting chats or answers
    # gives no quota back (today's count starts from the answers saved so far)
    9: """
    CREATE TABLE tokens_by_day (
        user_id TEXT NOT NULL,
        day INTEGER NOT NULL,
        tokens {bigint} NOT NULL,
        PRIMARY KEY (user_id, day)
    );
    INSERT INTO tokens_by_day (user_id, day, tokens)
        SELECT c.user_id, {m_day},
               sum(coalesce(m.prompt_tokens, 0) + coalesce(m.completion_tokens, 0))
        FROM messages m JOIN chats c ON c.id = m.chat_id
        WHERE m.role = 'assistant' AND m.model IS NOT NULL
        GROUP BY c.user_id, {m_day};
    """,
}


def account_from_row(row: Any) -> Account:
    return Account(
        id=str(row[0]),
        name=row[1],
        role=row[2],
        email=row[3],
        password_hash=row[4],
        disabled=bool(row[5]),
        tokens_per_day=row[6],
        issuer=row[7],
        subject=row[8],
        created_at=row[9],
    )


def account_params(a: Account) -> tuple[Any, ...]:
    return (
        a.id,
        a.name,
        a.role,
        a.email,
        a.password_hash,
        a.disabled,
        a.tokens_per_day,
        a.issuer,
        a.subject,
        a.created_at,
    )


def account_change_sql(change: AccountChange) -> tuple[list[str], list[Any]]:
    """The `SET` clauses of an `AccountChange` and their values."""
    sets: list[str] = []
    params: list[Any] = []

    def put(column: str, value: Any) -> None:
        params.append(value)
        sets.append(f"{column} = ?")

    if change.disabled is not None:
        put("disabled", change.disabled)
    if change.role is not None:
        put("role", change.role)
    if change.default_quota:
        put("tokens_per_day", None)
    elif change.tokens_per_day is not None:
        put("tokens_per_day", change.tokens_per_day)
    return sets, params


def api_key_from_row(row: Any) -> ApiKey:
    return ApiKey(str(row[0]), str(row[1]), row[2], row[3], row[4])


class AccountTables:
    """The accounts' part of a `Store` (see `Store` for each method's contract)."""

    db: Database

    # -- token usage ----------------------------------------------------------------------

    @mapped
    async def usage(self, user_id: str, since: float = 0.0) -> list[Usage]:
        rows = await self.db.fetch(
            "SELECT m.model, count(*), sum(m.prompt_tokens), sum(m.completion_tokens),"
            " sum(coalesce(m.reasoning_tokens, 0)), {any_true}(coalesce(m.usage_estimated, {false}))"
            " FROM messages m JOIN chats c ON c.id = m.chat_id"
            " WHERE c.user_id = ? AND m.role = 'assistant' AND m.model IS NOT NULL"
            " AND m.created_at >= ? GROUP BY m.model ORDER BY m.model",
            user_id,
            since,
        )
        return [Usage(r[0], int(r[2]), int(r[3]), int(r[4]), bool(r[5]), int(r[1])) for r in rows]

    @mapped
    async def tokens_on(self, day: int, user_id: str) -> int:
        tokens = await self.db.fetchval(
            "SELECT tokens FROM tokens_by_day WHERE user_id = ? AND day = ?", user_id, day
        )
        return int(tokens or 0)

    @mapped
    async def tokens_by_user(self, day: int) -> dict[str, int]:
        rows = await self.db.fetch(
            "SELECT user_id, tokens FROM tokens_by_day WHERE day = ? AND tokens > 0", day
        )
        return {str(r[0]): int(r[1]) for r in rows}

    # -- accounts ---------------------------------------------------------------------------

    @mapped
    async def add_account(
        self, account: Account, *, admin_if_none: bool = False, invite: str | None = None
    ) -> Account:
        async with self.db.transaction() as tx:
            await tx.lock(ADMINS_LOCK_ID)
            has_admin = bool(
                await tx.fetchval("SELECT exists(SELECT 1 FROM accounts WHERE role = 'admin')")
            )
            if admin_if_none and not has_admin:
                account = replace(account, role="admin")
            try:
                await tx.execute(
                    f"INSERT INTO accounts ({ACCOUNT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    *account_params(account),
                )
            except self.db.unique_violation as exc:
                raise taken("this email or identity") from exc
            if invite is not None and has_admin:
                used = await tx.execute(
                    "UPDATE invites SET used_by = ?, used_at = ? WHERE code_hash = ?"
                    " AND used_by IS NULL AND expires_at > {now}",
                    account.id,
                    account.created_at,
                    invite,
                )
                if used != 1:
                    raise bad_invite()
            return account

    @mapped
    async def get_account(self, account_id: str) -> Account | None:
        return await self._account("id = ?", account_id)

    @mapped
    async def account_by_email(self, email: str) -> Account | None:
        return await self._account("email = ?", email)

    @mapped
    async def account_by_subject(self, issuer: str, subject: str) -> Account | None:
        return await self._account("issuer = ? AND subject = ?", issuer, subject)

    async def _account(self, where: str, *params: Any) -> Account | None:
        row = await self.db.fetchrow(
            f"SELECT {ACCOUNT_COLUMNS} FROM accounts WHERE {where}", *params
        )
        return account_from_row(row) if row else None

    @mapped
    async def list_accounts(self, limit: int = 1000) -> list[Account]:
        rows = await self.db.fetch(
            f"SELECT {ACCOUNT_COLUMNS} FROM accounts ORDER BY created_at, id LIMIT ?", limit
        )
        return [account_from_row(row) for row in rows]

    @mapped
    async def has_admin(self) -> bool:
        return bool(
            await self.db.fetchval("SELECT exists(SELECT 1 FROM accounts WHERE role = 'admin')")
        )

    @mapped
    async def update_account(self, account_id: str, change: AccountChange) -> Account | None:
        sets, params = account_change_sql(change)
        async with self.db.transaction() as tx:
            await tx.lock(ADMINS_LOCK_ID)
            if sets:
                changed = await tx.execute(
                    f"UPDATE accounts SET {', '.join(sets)} WHERE id = ?", *params, account_id
                )
                if changed != 1:
                    return None
                admins = await tx.fetchval(
                    "SELECT count(*) FROM accounts WHERE role = 'admin' AND NOT disabled"
                )
                if admins == 0:
                    raise no_admin_left()
            if change.disabled:
                await tx.execute("DELETE FROM sessions WHERE account_id = ?", account_id)
            row = await tx.fetchrow(
                f"SELECT {ACCOUNT_COLUMNS} FROM accounts WHERE id = ?", account_id
            )
            return account_from_row(row) if row else None

    # -- sessions and API keys --------------------------------------------------------------

    @mapped
    async def add_session(self, token_hash: str, account_id: str, expires_at: float) -> None:
        async with self.db.transaction() as tx:
            await tx.execute("DELETE FROM sessions WHERE expires_at <= {now}")
            await tx.execute(
                "INSERT INTO sessions (token_hash, account_id, created_at, expires_at)"
                " VALUES (?, ?, {now}, ?)",
                token_hash,
                account_id,
                expires_at,
            )

    @mapped
    async def session_account(self, token_hash: str) -> Account | None:
        row = await self.db.fetchrow(
            f"SELECT {prefixed(ACCOUNT_COLUMNS, 'a')} FROM sessions s"
            " JOIN accounts a ON a.id = s.account_id"
            " WHERE s.token_hash = ? AND s.expires_at > {now}",
            token_hash,
        )
        return account_from_row(row) if row else None

    @mapped
    async def delete_session(self, token_hash: str) -> bool:
        return await self.db.execute("DELETE FROM sessions WHERE token_hash = ?", token_hash) == 1

    @mapped
    async def add_api_key(self, key: ApiKey, key_hash: str) -> None:
        await self.db.execute(
            f"INSERT INTO api_keys ({API_KEY_COLUMNS}, key_hash) VALUES (?, ?, ?, ?, ?, ?)",
            key.id,
            key.user_id,
            key.name,
            key.prefix,
            key.created_at,
            key_hash,
        )

    @mapped
    async def api_key_account(self, key_hash: str) -> Account | None:
        row = await self.db.fetchrow(
            f"SELECT {prefixed(ACCOUNT_COLUMNS, 'a')} FROM api_keys k"
            " JOIN accounts a ON a.id = k.account_id WHERE k.key_hash = ?",
            key_hash,
        )
        return account_from_row(row) if row else None

    @mapped
    async def list_api_keys(self, account_id: str) -> list[ApiKey]:
        rows = await self.db.fetch(
            f"SELECT {API_KEY_COLUMNS} FROM api_keys WHERE account_id = ? ORDER BY created_at, id",
            account_id,
        )
        return [api_key_from_row(row) for row in rows]

    @mapped
    async def revoke_api_key(self, account_id: str, key_id: str) -> bool:
        count = await self.db.execute(
            "DELETE FROM api_keys WHERE id = ? AND account_id = ?", key_id, account_id
        )
        return count == 1

    @mapped
    async def add_invite(self, code_hash: str, created_by: str, expires_at: float) -> None:
        await self.db.execute(
            "INSERT INTO invites (code_hash, created_by, created_at, expires_at)"
            " VALUES (?, ?, {now}, ?)",
            code_hash,
            created_by,
            expires_at,
        )

    @mapped
    async def invite_usable(self, code_hash: str) -> bool:
        found = await self.db.fetchval(
            "SELECT 1 FROM invites WHERE code_hash = ? AND used_by IS NULL AND expires_at > {now}",
            code_hash,
        )
        return found is not None
