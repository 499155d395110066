"""The one ownership rule (PROTOCOL §7) every owned thing goes through: chats, files,
collections, responses. A leaf: it imports nothing of ours but the errors.

Only a thing's owner may use it. What another user is told depends on the thing:
`Forbidden` by default ("this chat belongs to another user"), or the `refusal` the
caller names — a `NotFound` where even the thing's existence must not be told (a
response, another user's collection), a `Forbidden` that says why (a collection
shared read-only).
"""

from __future__ import annotations

from .errors import AppError, Forbidden


def authorize(owner: str, user: str, what: str = "chat", refusal: AppError | None = None) -> None:
    """Return when `user` may use a `what` owned by `owner`; else raise `refusal`, or
    `Forbidden("this <what> belongs to another user")` without one."""
    if owner == user:
        return
    raise refusal if refusal is not None else Forbidden(f"this {what} belongs to another user")
