"""The configuration reference (docs/configuration.md), rendered from the settings.

Every section of `Settings` is a frozen dataclass; a key's meaning is the `#:`
comment above its field, a section's is its class docstring. A field whose type
is itself such a dataclass is a nested table (`[auth.oidc]`), and one that maps names
to such a dataclass a table of named tables (`[mcp.servers.<name>]`), rendered the same
way, so a new section or key appears here with nothing else to change.

    python -m app.config_doc > docs/configuration.md
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from app.config import Settings, named_tables

COMMAND = "python -m app.config_doc > docs/configuration.md"

HEADER = f"""\
# Configuration

<!-- Generated from app/config.py by `{COMMAND}`: edit the settings, not this page. -->

The server reads `config.toml` at the repository root (`APP_CONFIG=<path>` names another
file; a relative SQLite or collections path is taken beside that file). Every key is
overridden by an environment variable: `[section] key` by `SECTION_KEY` in capitals, a
nested table's key by `SECTION_TABLE_KEY` (`[auth.oidc] issuer` → `AUTH_OIDC_ISSUER`).
`PORT` overrides `server.port` and `WEB_CONCURRENCY` `server.workers` (unless
`SERVER_WORKERS` is set). In the environment a list is comma-separated and a table is
comma-separated `key:value` pairs (`AUTH_API_KEYS=<key>:<user id>`).

```toml
[llm]
base_url = "http://127.0.0.1:11434/v1"   # LLM_BASE_URL
model = "deepseek-r1"                    # LLM_MODEL

[redis]
url = "redis://127.0.0.1:6379/0"         # REDIS_URL
```

Keys, secrets and URLs are never shown: not in the logs, not in the settings' reprs.
"""

_TYPES: dict[Any, str] = {bool: "bool", int: "int", float: "float", str: "string"}


def described_fields(cls: type[Any]) -> dict[str, str]:
    """Each field's `#:` comment (the lines above it, joined), by field name."""
    descriptions: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        found = re.match(r"(\w+)\s*:", stripped)
        if found and pending:
            descriptions[found.group(1)] = " ".join(pending)
        pending = []
    return descriptions


def type_name(kind: Any) -> str:
    """A field's type as a reader of the TOML file sees it."""
    if kind in _TYPES:
        return _TYPES[kind]
    origin = typing.get_origin(kind)
    if origin is tuple:
        return "list of " + type_name(typing.get_args(kind)[0])
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        return "table"
    return getattr(kind, "__name__", str(kind))


def default_of(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def shown(value: Any) -> str:
    """A default as it would be written in config.toml (empty strings and tables: empty)."""
    if value in ("", None) or (isinstance(value, Mapping) and not value):
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, tuple):
        return "`[" + ", ".join(f'"{item}"' for item in value) + "]`"
    return f"`{value}`"


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def sections(cls: type[Any], path: str) -> Iterator[tuple[str, type[Any]]]:
    """`(dotted name, dataclass)` of `cls`'s tables, each followed by its nested ones."""
    for name, kind in typing.get_type_hints(cls).items():
        where = f"{path}.{name}" if path else name
        table = named_tables(kind) if path else None  # `[providers]` has a page of its own
        if table is not None:  # `[mcp.servers.<name>]`
            kind, where = table, f"{where}.<name>"
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            yield where, kind
            yield from sections(kind, where)


def render_section(name: str, cls: type[Any]) -> str:
    kinds = typing.get_type_hints(cls)
    meanings = described_fields(cls)
    lines = [f"## `[{name}]`", ""]
    doc = inspect.getdoc(cls) or ""
    if doc and not doc.startswith(f"{cls.__name__}("):  # not the signature dataclass writes
        lines += [" ".join(doc.split()), ""]
    lines += ["| key | type | default | environment | meaning |", "|---|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        kind = kinds[field.name]
        if (isinstance(kind, type) and dataclasses.is_dataclass(kind)) or named_tables(kind):
            continue
        env = f"{name}.{field.name}".replace(".", "_").upper()
        lines.append(
            f"| `{field.name}` | {type_name(kind)} | {cell(shown(default_of(field)))} "
            f"| `{env}` | {cell(meanings.get(field.name, ''))} |"
        )
    return "\n".join(lines) + "\n"


def render() -> str:
    """The whole page, as docs/configuration.md holds it."""
    parts = [HEADER]
    parts += [render_section(name, cls) for name, cls in sections(Settings, "")]
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
