"""`python -m app` with one more route, for long runs (bench.soak): what grows inside.

    python -m bench.probe            # as `python -m app`; then GET /_probe

`GET /_probe` answers, as JSON, the number of asyncio tasks of the worker's loop,
and the sizes of every dict, set, list and deque the chat service, its answer
keeper, its hub (and the hub's local registry) and the app's connection sets hold
— the maps that would grow if something were left behind. Nothing in `app/`
changes: this module wraps the ASGI app that `app.__main__` builds (one worker
per process) and reads those objects from the outside; their attribute names are
whatever the code calls them today.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import orjson

from app import __main__ as entry

PATH = "/_probe"


def sizes(obj: Any, prefix: str) -> dict[str, int]:
    """len() of every container attribute of `obj` (slots included)."""
    out: dict[str, int] = {}
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        names += [n for n in getattr(cls, "__slots__", ()) if isinstance(n, str)]
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, dict | set | list | frozenset | collections.deque):
            out[f"{prefix}.{name}"] = len(value)
        elif type(value).__name__ == "Chores":
            out[f"{prefix}.{name}"] = len(value)
    return out


def probe(app: Any) -> dict[str, Any]:
    report: dict[str, Any] = {"tasks": len(asyncio.all_tasks())}
    state = getattr(app, "state", None)
    service = getattr(state, "service", None)
    if service is None:
        return report
    found = {"service": service}
    for name in ("keeper", "hub", "files"):
        if getattr(service, name, None) is not None:
            found[name] = getattr(service, name)
    if getattr(found.get("hub"), "local", None) is not None:
        found["hub.local"] = found["hub"].local
    maps: dict[str, int] = {}
    for prefix, obj in found.items():
        maps.update(sizes(obj, prefix))
    for name in ("sessions", "streams"):
        value = getattr(state, name, None)
        if value is not None:
            maps[f"app.{name}"] = len(value)
    report["maps"] = maps
    return report


def with_probe(app: Any) -> Any:
    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == PATH:
            body = orjson.dumps(probe(app))
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    return wrapped


def main() -> None:
    build = entry.create_app
    entry.create_app = lambda settings, **kwargs: with_probe(build(settings, **kwargs))  # type: ignore[assignment]
    entry.main()


if __name__ == "__main__":
    main()
