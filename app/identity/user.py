"""The one `User` a request acts as, whatever authenticated it (a leaf: imports nothing
of ours)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

#: how a request proved who it is: no auth (`none`), a static key of `auth.api_keys`
#: (`key`), a session cookie (`session`), a user's own API key (`apikey`), a bearer JWT
#: (`jwt`)
Method = Literal["none", "key", "session", "apikey", "jwt"]


@dataclass(frozen=True, slots=True)
class User:
    """Who a request acts as. `tokens_per_day` is the account's own quota (None: the
    default, `limits.tokens_per_day`). Every rule of ownership takes a `User`'s `id`."""

    id: str
    method: Method = "none"
    role: str = "user"
    name: str = ""
    email: str | None = None
    tokens_per_day: int | None = None

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def by_cookie(self) -> bool:
        """Authenticated by an ambient credential a browser sends on its own (the
        session cookie): its writes must come from the server's own origin."""
        return self.method == "session"

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "email": self.email, "name": self.name, "role": self.role}
