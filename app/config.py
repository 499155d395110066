"""Settings: `config.toml` at the repository root, overridden by the environment.

Every key `[section] key` is overridden by the environment variable
`SECTION_KEY` (capitals); `PORT` overrides `server.port`, `WEB_CONCURRENCY`
`server.workers`, and `APP_CONFIG` names another file. The result is one
frozen `Settings` built once at start and passed down. Besides this module,
only `python -m app` looks at the environment (for uvicorn's worker count and
the metrics directory of several workers).

No secret is ever shown: keys, secrets and URLs (whose user part may hold a
password, and whose query a key) are left out of the settings' reprs, and an
error about a value names its key and what was expected, never the value.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .sections import (
    AUTH_MODES as AUTH_MODES,
)
from .sections import (
    DEFAULT_PROVIDER as DEFAULT_PROVIDER,
)
from .sections import (
    PROVIDER_TYPES as PROVIDER_TYPES,
)
from .sections import (
    SIGNUP_RULES as SIGNUP_RULES,
)
from .sections import (
    AuthSettings as AuthSettings,
)
from .sections import (
    CollectionSettings as CollectionSettings,
)
from .sections import (
    DdgsSettings as DdgsSettings,
)
from .sections import (
    EmbeddingsSettings as EmbeddingsSettings,
)
from .sections import (
    GoogleSettings as GoogleSettings,
)
from .sections import (
    JwtSettings as JwtSettings,
)
from .sections import (
    LimitsSettings as LimitsSettings,
)
from .sections import (
    LLMSettings as LLMSettings,
)
from .sections import (
    McpServerSettings as McpServerSettings,
)
from .sections import (
    McpSettings as McpSettings,
)
from .sections import (
    OidcSettings as OidcSettings,
)
from .sections import (
    ProviderSettings as ProviderSettings,
)
from .sections import (
    ReaderSettings as ReaderSettings,
)
from .sections import (
    RedisSettings as RedisSettings,
)
from .sections import (
    RerankSettings as RerankSettings,
)
from .sections import (
    ResearchSettings as ResearchSettings,
)
from .sections import (
    SchedulesSettings as SchedulesSettings,
)
from .sections import (
    SearchSettings as SearchSettings,
)
from .sections import (
    SearxngSettings as SearxngSettings,
)
from .sections import (
    ServerSettings as ServerSettings,
)
from .sections import (
    ShareSettings as ShareSettings,
)
from .sections import (
    StoreSettings as StoreSettings,
)
from .sections import (
    StreamSettings as StreamSettings,
)
from .sections import (
    TavilySettings as TavilySettings,
)
from .sections import (
    UploadSettings as UploadSettings,
)

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    llm: LLMSettings = field(default_factory=LLMSettings)
    embeddings: EmbeddingsSettings = field(default_factory=EmbeddingsSettings)
    search: SearchSettings = field(default_factory=SearchSettings)
    tavily: TavilySettings = field(default_factory=TavilySettings)
    searxng: SearxngSettings = field(default_factory=SearxngSettings)
    google: GoogleSettings = field(default_factory=GoogleSettings)
    ddgs: DdgsSettings = field(default_factory=DdgsSettings)
    reader: ReaderSettings = field(default_factory=ReaderSettings)
    research: ResearchSettings = field(default_factory=ResearchSettings)
    uploads: UploadSettings = field(default_factory=UploadSettings)
    store: StoreSettings = field(default_factory=StoreSettings)
    collections: CollectionSettings = field(default_factory=CollectionSettings)
    redis: RedisSettings = field(default_factory=RedisSettings)
    stream: StreamSettings = field(default_factory=StreamSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    share: ShareSettings = field(default_factory=ShareSettings)
    mcp: McpSettings = field(default_factory=McpSettings)
    #: more models beside `[llm]`, by id (`[providers.openrouter]`; env
    #: `PROVIDERS_<ID>_<KEY>`)
    providers: Mapping[str, ProviderSettings] = field(
        default_factory=lambda: types.MappingProxyType({})
    )
    schedules: SchedulesSettings = field(default_factory=SchedulesSettings)

    def replace(self, **sections: Mapping[str, Any]) -> Settings:
        """A copy with some keys changed: `settings.replace(llm={"model": "x"})`;
        `providers` is replaced whole, each a `ProviderSettings` or a mapping of its keys."""
        changed: dict[str, Any] = {
            name: _replaced(getattr(self, name), values)
            if name != "providers"
            else types.MappingProxyType(
                {
                    pid: p if isinstance(p, ProviderSettings) else ProviderSettings(**p)
                    for pid, p in values.items()
                }
            )
            for name, values in sections.items()
        }
        return dataclasses.replace(self, **changed)


def _replaced(section: Any, values: Mapping[str, Any]) -> Any:
    """A settings table with some keys changed; a nested table (`auth.oidc`) given as a
    mapping changes only the keys it names."""
    changes = {
        key: _replaced(getattr(section, key), value)
        if isinstance(value, Mapping) and dataclasses.is_dataclass(getattr(section, key))
        else value
        for key, value in values.items()
    }
    return dataclasses.replace(section, **changes)


class SettingsError(ValueError):
    """A configuration value that cannot be used (raised at start, not per request)."""


def load(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> Settings:
    """Build the settings from a TOML file and environment overrides.

    `path` defaults to `$APP_CONFIG`, else `config.toml` at the repository root;
    a missing default file means "all defaults". Raises `SettingsError` for a
    value of the wrong type or an unknown section/key in the file.
    """
    env = os.environ if env is None else env
    explicit = path if path is not None else env.get("APP_CONFIG")
    file = Path(explicit) if explicit else ROOT / "config.toml"
    data: dict[str, Any] = {}
    if file.exists():
        with file.open("rb") as fh:
            data = tomllib.load(fh)
    elif explicit:
        raise SettingsError(f"config file not found: {file}")

    sections: dict[str, Any] = {}
    for name, cls in typing.get_type_hints(Settings).items():
        if name == "providers":
            sections[name] = _providers(data.get(name, {}), env)
            continue
        values = _section(cls, data.get(name, {}), name, env)
        if name == "server" and "PORT" in env:
            values["port"] = _from_env(env["PORT"], int, "PORT")
        if name == "server" and "WEB_CONCURRENCY" in env and "SERVER_WORKERS" not in env:
            values["workers"] = _from_env(env["WEB_CONCURRENCY"], int, "WEB_CONCURRENCY")
        sections[name] = cls(**values)
    return _derive(Settings(**sections), file.resolve().parent)


def _section(cls: type[Any], raw: Any, name: str, env: Mapping[str, str]) -> dict[str, Any]:
    """The keys of one table (`name` is its dotted path, `auth.oidc`) given in the file
    or the environment (`AUTH_OIDC_ISSUER`), by type; a key whose type is itself a
    settings dataclass is a nested table, built the same way."""
    if not isinstance(raw, dict):
        raise SettingsError(f"[{name}] must be a table")
    kinds = typing.get_type_hints(cls)
    unknown = set(raw) - set(kinds)
    if unknown:
        raise SettingsError(f"unknown key(s) in [{name}]: {', '.join(sorted(unknown))}")
    values: dict[str, Any] = {}
    for key, kind in kinds.items():
        where = f"{name}.{key}"
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            values[key] = kind(**_section(kind, raw.get(key, {}), where, env))
            continue
        table = named_tables(kind)
        if table is not None:
            values[key] = _named(table, raw.get(key, {}), where, env)
            continue
        env_name = where.replace(".", "_").upper()
        if env_name in env:
            values[key] = _from_env(env[env_name], kind, env_name)
        elif key in raw:
            values[key] = _coerce(raw[key], kind, where)
    return values


def named_tables(kind: Any) -> type[Any] | None:
    """The settings dataclass of a table of named tables (`Mapping[str, X]`, as
    `[mcp.servers.<name>]`), else None."""
    if typing.get_origin(kind) is not Mapping:
        return None
    item = typing.get_args(kind)[1]
    return item if isinstance(item, type) and dataclasses.is_dataclass(item) else None


#: the name of a table among named ones (`[mcp.servers.<name>]`): what a tool's name
#: (`<name>__<tool>`) and the environment can carry
_TABLE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,29}")


def _named(cls: type[Any], raw: Any, name: str, env: Mapping[str, str]) -> Mapping[str, Any]:
    """The tables `[<name>.<each>]` of one kind, each read as any section is (its keys
    overridden by `<NAME>_<EACH>_<KEY>`). Raises `SettingsError` for a name that is not
    lower-case letters, digits, `-` and `_` (at most 30), or holds `__`."""
    if not isinstance(raw, dict):
        raise SettingsError(f"[{name}] must be a table of [{name}.<name>] tables")
    tables: dict[str, Any] = {}
    for each, table in raw.items():
        if not _TABLE_NAME.fullmatch(each) or "__" in each:
            raise SettingsError(
                f"[{name}.{each}]: a name is at most 30 lower-case letters, digits, - and _"
                " (never __)"
            )
        tables[each] = cls(**_section(cls, table, f"{name}.{each.replace('-', '_')}", env))
    return types.MappingProxyType(tables)


def mcp_checked(mcp: McpSettings) -> McpSettings:
    """`[mcp]` as it may be used: each server has a `url` or (with `mcp.allow_stdio`) a
    `command`, not both; `SettingsError` otherwise (naming the server, never its URL)."""
    for name, server in mcp.servers.items():
        where = f"[mcp.servers.{name}]"
        if bool(server.url) == bool(server.command):
            raise SettingsError(f"{where} needs either url (Streamable HTTP) or command (stdio)")
        if server.command and not mcp.allow_stdio:
            raise SettingsError(f"{where}: command (stdio) needs mcp.allow_stdio = true")
        if server.url and not server.url.startswith(("http://", "https://")):
            raise SettingsError(f"{where}: url must be an http:// or https:// address")
        if server.timeout_seconds <= 0:
            raise SettingsError(f"{where}: timeout_seconds must be above 0")
    return mcp


#: a provider's id: what `/v1` model names and the environment can carry
_PROVIDER_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")


def _providers(raw: Any, env: Mapping[str, str]) -> Mapping[str, ProviderSettings]:
    """The `[providers.<id>]` tables, and those the environment alone names
    (`PROVIDERS_OPENROUTER_BASE_URL` makes `openrouter`); each table's keys are read as
    any section's (`PROVIDERS_<ID>_<KEY>` over the file). Raises `SettingsError` for an
    id that is not lower-case letters, digits, `-` and `_`, for `default` (the `[llm]`
    model's id), and for an unknown type."""
    if not isinstance(raw, dict):
        raise SettingsError("[providers] must be a table of [providers.<id>] tables")
    ids = list(raw)
    keys = sorted((k.upper() for k in typing.get_type_hints(ProviderSettings)), key=len)
    for name in env:
        if not name.startswith("PROVIDERS_"):
            continue
        rest = name[len("PROVIDERS_") :]
        for key in reversed(keys):  # the longest key first: BASE_URL before URL
            if rest.endswith("_" + key) and len(rest) > len(key) + 1:
                found = rest[: -len(key) - 1].lower()
                if found.replace("_", "-") not in ids and found not in ids:
                    ids.append(found)
                break
    providers: dict[str, ProviderSettings] = {}
    for pid in ids:
        if not _PROVIDER_ID.fullmatch(pid) or pid == DEFAULT_PROVIDER:
            raise SettingsError(
                f"[providers.{pid}]: an id is lower-case letters, digits, - and _, and not"
                f" {DEFAULT_PROVIDER!r} (the [llm] model)"
            )
        where = f"providers.{pid.replace('-', '_')}"
        settings = ProviderSettings(**_section(ProviderSettings, raw.get(pid, {}), where, env))
        if settings.type not in PROVIDER_TYPES:
            raise SettingsError(f"{where}.type must be one of {', '.join(PROVIDER_TYPES)}")
        providers[pid] = settings
    return types.MappingProxyType(providers)


def _derive(settings: Settings, folder: Path) -> Settings:
    """Fill the keys whose default is another key (embeddings from llm), and make a
    relative SQLite path relative to the config file's folder — not to wherever the
    server happens to be started (which would open an empty history)."""
    emb = settings.embeddings
    return settings.replace(
        embeddings={
            "base_url": emb.base_url or settings.llm.base_url,
            "api_key": emb.api_key or settings.llm.api_key,
        },
        store={"url": sqlite_beside(settings.store.url, folder)},
        auth={"mode": auth_mode(settings.auth)},
        collections={"url": path_beside(settings.collections.url, folder)},
        mcp={"servers": mcp_checked(settings.mcp).servers},
    )


def auth_mode(auth: AuthSettings) -> str:
    """`auth.mode` as it applies: `keys` when only `auth.api_keys` is set. Raises
    `SettingsError` for an unknown mode or sign-up rule, and for OIDC or bearer JWTs
    without accounts (their users are accounts)."""
    mode = auth.mode.strip().lower() or "off"
    if mode not in AUTH_MODES:
        raise SettingsError(f"auth.mode must be one of {', '.join(AUTH_MODES)}, not {mode!r}")
    if auth.signup not in SIGNUP_RULES:
        raise SettingsError(f"auth.signup must be one of {', '.join(SIGNUP_RULES)}")
    if mode == "off" and auth.api_keys:
        mode = "keys"
    if mode != "accounts" and (auth.oidc.enabled or auth.jwt.enabled):
        raise SettingsError('auth.oidc and auth.jwt need auth.mode = "accounts"')
    if (auth.jwt.issuer or auth.jwt.jwks_url) and not auth.jwt.audience:
        raise SettingsError("auth.jwt.issuer and auth.jwt.jwks_url need auth.jwt.audience")
    return mode


def sqlite_beside(url: str, folder: Path) -> str:
    """`sqlite:///data/chat.db` → `sqlite:////<folder>/data/chat.db`; other URLs as they are."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or url.startswith(prefix + "/") or url == prefix + ":memory:":
        return url
    return prefix + str(folder / url[len(prefix) :])


def path_beside(url: str, folder: Path) -> str:
    """`tantivy:///data/x` → `tantivy:////<folder>/data/x` (and `milvus:///file.db`, a
    Milvus Lite file); a server URL (`milvus://host:19530`) as it is."""
    scheme, sep, rest = url.partition(":///")
    if not sep or rest.startswith("/") or scheme == "sqlite":
        return url
    return f"{scheme}:///{folder / rest}"


#: what a value of each type is said to be in an error
_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_TOML: dict[type, str] = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "a table",
}


def _described(kind: Any, *, env: bool = False) -> str:
    if kind in _KINDS:
        return _KINDS[kind]
    if typing.get_origin(kind) is tuple:
        return "a comma-separated list" if env else "a list of strings"
    return "comma-separated key:value pairs" if env else "a table of strings"


def _coerce(value: Any, kind: Any, where: str) -> Any:
    origin = typing.get_origin(kind)
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is str:
        if isinstance(value, str):
            return value
    elif origin is tuple:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
    else:
        if isinstance(value, dict) and all(isinstance(v, (str, int)) for v in value.values()):
            return types.MappingProxyType({str(k): str(v) for k, v in value.items()})
    # the value is not shown: it may be a key
    got = _TOML.get(type(value), "another kind of value")
    raise SettingsError(f"{where}: expected {_described(kind)}, got {got}")


def _from_env(text: str, kind: Any, name: str) -> Any:
    origin = typing.get_origin(kind)
    try:
        if kind is bool:
            lowered = text.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off", ""):
                return False
            raise ValueError
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if kind is str:
            return text
        if origin is tuple:
            return tuple(part.strip() for part in text.split(",") if part.strip())
        # key:value,key:value (auth.api_keys)
        pairs = {}
        for item in text.split(","):
            if not item.strip():
                continue
            key, sep, value = item.strip().rpartition(":")
            if not sep or not key:
                raise ValueError
            pairs[key] = value
        return types.MappingProxyType(pairs)
    except ValueError:
        # neither the value nor the parser's words (which quote it) are shown: it may
        # be a key, and this is printed at start
        raise SettingsError(
            f"{name}: expected {_described(kind, env=True)} (the value is not shown)"
        ) from None
