"""Test-side helpers for accounts: clients that sign up or sign in and then send their
session cookie (from the server's own origin, as a browser on its page would)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

PASSWORD = "correct horse battery"


def own_origin(base_url: str) -> dict[str, str]:
    return {"origin": base_url}


@contextlib.asynccontextmanager
async def browser(base_url: str, **kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A client that keeps cookies and says it comes from `base_url`'s pages."""
    async with httpx.AsyncClient(
        base_url=base_url, timeout=15, headers=own_origin(base_url), **kwargs
    ) as http:
        yield http


async def sign_up(
    http: httpx.AsyncClient, email: str, password: str = PASSWORD, **fields: Any
) -> dict[str, Any]:
    """Sign up (the client then holds the session cookie); the new user."""
    response = await http.post(
        "/api/auth/signup", json={"email": email, "password": password, **fields}
    )
    assert response.status_code == 201, response.text
    user: dict[str, Any] = response.json()["user"]
    return user


async def sign_in(http: httpx.AsyncClient, email: str, password: str = PASSWORD) -> dict[str, Any]:
    response = await http.post("/api/auth/login", json={"email": email, "password": password})
    assert response.status_code == 200, response.text
    user: dict[str, Any] = response.json()["user"]
    return user


def question(content: str, **fields: Any) -> dict[str, Any]:
    """A chat request that names no user: with accounts, the account decides."""
    message = {"content": content}
    for key in ("chatId", "messageId"):
        if key in fields:
            message[key] = fields.pop(key)
    return {"type": "message", "message": message, "focusMode": "deepSeek", **fields}
