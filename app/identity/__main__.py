"""`python -m app.identity create-admin EMAIL`: make the first admin from the command
line, straight in the store `config.toml` (or the environment) names — before the
server is reachable by anyone, so that nobody else can be its first sign-up.

    python -m app.identity create-admin ada@example.com              # asks for a password
    printf '%s\\n' "$PASSWORD" | python -m app.identity create-admin ada@example.com
    python -m app.identity create-admin ada@example.com --name Ada

An account with that email already there is made an admin (and enabled), its
password left as it is.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import sys
import time

from .. import config
from ..errors import AppError
from ..ids import Snowflake, WorkerLease
from ..store import Account, AccountChange, open_store
from .accounts import normal_email, text_field
from .passwords import MAX_LENGTH, MIN_LENGTH, Passwords


def read_password() -> str:
    """The new password: asked twice on a terminal, else the first line of stdin."""
    if not sys.stdin.isatty():
        return sys.stdin.readline().rstrip("\r\n")
    first = getpass.getpass("Password: ")
    if getpass.getpass("Again: ") != first:
        sys.exit("the passwords differ")
    return first


async def create_admin(settings: config.Settings, email: str, name: str | None) -> str:
    """Make (or promote) the admin; what was done, in words."""
    who = normal_email(email)
    async with open_store(settings.store.url) as store:
        found = await store.account_by_email(who)
        if found is not None:
            await store.update_account(found.id, AccountChange(role="admin", disabled=False))
            return f"{who} (id {found.id}) is an admin now"
        password = read_password()
        if not MIN_LENGTH <= len(password) <= MAX_LENGTH:
            sys.exit(f"the password must be {MIN_LENGTH} to {MAX_LENGTH} characters long")
        ids = Snowflake()
        async with WorkerLease(store, ids):
            account = Account(
                id=ids.next_str(),
                name=text_field(name, "name", who.split("@")[0]),
                role="admin",
                email=who,
                password_hash=await Passwords().hash(password),
                created_at=time.time(),
            )
            made = await store.add_account(account)
        return f"{who} (id {made.id}) is made, an admin: sign in with it"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m app.identity", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    admin = commands.add_parser("create-admin", help="make the first admin (or promote one)")
    admin.add_argument("email")
    admin.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    try:
        print(asyncio.run(create_admin(config.load(), args.email, args.name)))
    except config.SettingsError as exc:
        sys.exit(f"configuration: {exc}")
    except AppError as exc:
        sys.exit(exc.message)


if __name__ == "__main__":
    main()
