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
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ServerSettings:
    host: str = "0.0.0.0"
    port: int = 8080
    keepalive_seconds: float = 15.0
    cors_origins: tuple[str, ...] = ("*",)
    public_url: str = field(default="", repr=False)
    shutdown_grace_seconds: float = 30.0
    workers: int = 1
    #: addresses whose X-Forwarded-For is believed (a reverse proxy in front)
    trusted_proxies: tuple[str, ...] = ("127.0.0.1",)
    #: the most a request's headers may take, in bytes (larger: 431)
    max_header_bytes: int = 16384
    #: a connection whose request line and headers have not all come in this long: 408
    header_timeout_seconds: float = 10.0
    #: a request body that stops arriving for this long: the connection is closed
    body_timeout_seconds: float = 10.0
    #: connections open at once from one client address (trusted proxies excepted)
    max_connections_per_address: int = 256


@dataclass(frozen=True)
class LLMSettings:
    base_url: str = field(default="https://api.deepseek.com/v1", repr=False)
    api_key: str = field(default="", repr=False)
    model: str = "deepseek-reasoner"
    small_model: str = ""
    timeout_seconds: float = 600.0
    #: the model's context window: the answer's prompt is trimmed to fit (with room
    #: for the answer), never refused upstream as too long
    context_tokens: int = 32768
    connect_timeout_seconds: float = 10.0
    read_timeout_seconds: float = 120.0
    #: the most an answer may be, in tokens: an answer cut there ends `completed` with
    #: `truncated: true` in `messageEnd` and is saved whole
    max_output_tokens: int = 8192
    #: where the instructions go: "system", or "user" for a chat template that drops
    #: system messages (llama.cpp's gemma format)
    system_prompt: str = "system"

    @property
    def effective_small_model(self) -> str:
        return self.small_model or self.model


@dataclass(frozen=True)
class EmbeddingsSettings:
    base_url: str = field(default="", repr=False)
    api_key: str = field(default="", repr=False)
    model: str = ""


@dataclass(frozen=True)
class SearchSettings:
    #: auto: tavily with a key, else searxng with a URL, else google with a key and a
    #: CSE id, else ddgs (keyless)
    provider: str = "auto"
    max_results: int = 8
    timeout_seconds: float = 20.0


@dataclass(frozen=True)
class DdgsSettings:
    region: str = "us-en"
    safesearch: str = "moderate"
    #: "auto", or some of the library's services, comma-separated ("duckduckgo,brave")
    backend: str = "auto"
    #: per request the library makes, in whole seconds (it takes an int)
    timeout_seconds: int = 5
    cache_seconds: float = 120.0
    #: an http(s) or socks5 proxy URL for the library's requests (DDGS_PROXY); empty: none
    proxy: str = field(default="", repr=False)  # it may hold a password


@dataclass(frozen=True)
class TavilySettings:
    api_key: str = field(default="", repr=False)
    base_url: str = field(default="https://api.tavily.com", repr=False)


@dataclass(frozen=True)
class SearxngSettings:
    url: str = field(default="", repr=False)  # it may hold a password


@dataclass(frozen=True)
class GoogleSettings:
    api_key: str = field(default="", repr=False)
    cse_id: str = ""
    base_url: str = field(default="https://www.googleapis.com", repr=False)


@dataclass(frozen=True)
class ReaderSettings:
    provider: str = "jina"
    base_url: str = field(default="https://r.jina.ai", repr=False)
    api_key: str = field(default="", repr=False)
    timeout_seconds: float = 15.0
    allow_private_networks: bool = False


@dataclass(frozen=True)
class ResearchSettings:
    #: the fixed research loop's keys, read no more (deepResearch is the research agent,
    #: `deep_rounds` and `deep_seconds`): kept so that older config files still load
    max_iterations: int = 3
    time_budget_seconds: float = 120.0
    sub_questions: int = 3
    pages_per_question: int = 3
    #: the research agent's budget per optimization mode (PROTOCOL §1, §8): rounds of
    #: tool calls and wall-clock seconds; a budget of one round (`speed`'s) is one
    #: search and no model call
    speed_rounds: int = 1
    balanced_rounds: int = 6
    quality_rounds: int = 25
    deep_rounds: int = 25
    speed_seconds: float = 20.0
    balanced_seconds: float = 60.0
    quality_seconds: float = 180.0
    deep_seconds: float = 300.0
    #: how long one round's model call may take (a model that never answers costs this)
    round_seconds: float = 45.0
    #: how long the classifier may take before its safe default is used
    classify_seconds: float = 10.0
    #: what the answer's prompt may hold, in tokens (0: llm.context_tokens)
    context_tokens: int = 0


@dataclass(frozen=True)
class UploadSettings:
    max_file_bytes: int = 50 * 1024 * 1024
    max_pages: int = 2000
    chunk_tokens: int = 300
    chunk_overlap_tokens: int = 50
    extract_timeout_seconds: float = 120.0
    passages: int = 8  # the most file passages given to the model per question
    embed_batch: int = 64


@dataclass(frozen=True)
class RerankSettings:
    """An optional reranker of collection passages: a Jina/Cohere-style `POST {url}`
    with `{"model", "query", "documents", "top_n"}` answering `{"results": [{"index",
    "relevance_score"}]}` (`/rerank` of an OpenAI-compatible server too). Empty: off."""

    url: str = field(default="", repr=False)
    model: str = ""
    api_key: str = field(default="", repr=False)
    timeout_seconds: float = 10.0


@dataclass(frozen=True)
class CollectionSettings:
    """Knowledge collections (PROTOCOL §12). `url` names the engine:
    `tantivy:///data/collections` (embedded, the default; a relative path is beside the
    config file), `milvus:///data/collections.db` (Milvus Lite in a file) or
    `milvus://host:19530` (a Milvus server or cluster)."""

    url: str = field(default="tantivy:///data/collections", repr=False)  # a password, maybe
    max_documents: int = 10_000  # per collection
    max_import_bytes: int = 500 * 1024 * 1024  # one request's files together (a zip unpacked)
    max_import_files: int = 1000  # files in one request (the entries of a zip included)
    passages: int = 8  # passages given to the model per question
    candidates: int = 50  # taken from each ranking before fusion
    rrf_k: int = 60
    dense_weight: float = 1.0  # the vectors' ranking in the fusion, BM25's being 1
    import_concurrency: int = 2  # batches of one process read and indexed at once
    #: imports running at once (from the request until their last document has ended):
    #: per user (with auth off, per client address) → 429, per process → 503
    max_imports_per_user: int = 2
    max_imports: int = 8
    #: where imported files wait for their batch (empty: the system's temp folder)
    spool_dir: str = ""
    #: the embedded engine's vectors kept in memory, all spaces together (least
    #: recently searched ones are let go past it)
    vector_cache_mb: int = 512
    rerank: RerankSettings = field(default_factory=RerankSettings)


@dataclass(frozen=True)
class StoreSettings:
    url: str = field(default="sqlite:///data/chat.db", repr=False)  # it may hold a password
    pool_size: int = 10  # Postgres connections per worker, at most
    statement_cache_size: int = 100  # 0 behind PgBouncer in transaction mode


@dataclass(frozen=True)
class RedisSettings:
    url: str = field(default="", repr=False)  # it may hold a password
    #: `url` names a node of a Redis Cluster (any one: the others are discovered)
    cluster: bool = False
    #: the longest one call may take (connecting, or an answer): a Redis that stops
    #: answering fails like one that refuses
    timeout_seconds: float = 2.0
    max_connections: int = 64  # per process; a call waits at most timeout_seconds for one


@dataclass(frozen=True)
class StreamSettings:
    replay_ttl_seconds: float = 300.0
    max_queue_events: int = 1024
    handle_ttl_seconds: float = 15.0
    #: without Redis (or while it is away): how often a running answer is saved as far
    #: as it got, so a crash loses at most this much of it
    flush_interval_ms: float = 200.0
    #: with Redis: how long new events wait to share one journal write (group commit);
    #: an event reaches readers once that write is acknowledged
    commit_linger_ms: float = 5.0
    #: how long a browser's EventSource waits before it reconnects (SSE `retry:`)
    retry_ms: int = 2000
    #: no event is larger: sources and steps are trimmed to fit
    max_event_bytes: int = 262144
    client_timeout_seconds: float = 30.0


@dataclass(frozen=True)
class LimitsSettings:
    max_body_bytes: int = 1_048_576
    max_content_chars: int = 32_000
    requests_per_minute: int = 0
    max_history_messages: int = 200
    max_concurrent_generations: int = 16
    #: answers one process runs at once, whoever asks (503 with Retry-After past it)
    max_generations_per_process: int = 500
    ws_messages_per_second: float = 20.0
    #: tokens a user's answers may use per UTC day (0: no quota); an admin may set
    #: another number per user
    tokens_per_day: int = 0


@dataclass(frozen=True)
class OidcSettings:
    """Sign-in with an OpenID Connect provider (`[auth.oidc]`, env `AUTH_OIDC_*`)."""

    issuer: str = ""
    client_id: str = ""
    client_secret: str = field(default="", repr=False)
    #: what the sign-in button says ("Sign in with <name>"); empty: the issuer's host
    name: str = ""
    scopes: tuple[str, ...] = ("openid", "email", "profile")

    @property
    def enabled(self) -> bool:
        return bool(self.issuer and self.client_id)


@dataclass(frozen=True)
class JwtSettings:
    """Bearer JWTs from an app's own identity provider (`[auth.jwt]`, env `AUTH_JWT_*`):
    keys from `issuer`'s discovery document or from `jwks_url`; or one HS256 `secret`."""

    issuer: str = ""
    jwks_url: str = field(default="", repr=False)
    audience: str = ""
    secret: str = field(default="", repr=False)

    @property
    def enabled(self) -> bool:
        return bool(self.issuer or self.jwks_url or self.secret)


#: auth.mode: no auth, static keys (auth.api_keys), or accounts
AUTH_MODES = ("off", "keys", "accounts")
SIGNUP_RULES = ("open", "invite", "closed")


@dataclass(frozen=True)
class AuthSettings:
    api_keys: Mapping[str, str] = field(default_factory=dict, repr=False)
    #: off | keys | accounts; "off" with api_keys set means "keys"
    mode: str = "off"
    #: who may make an account: open | invite (with an admin's invite code) | closed
    signup: str = "open"
    session_days: float = 30.0
    oidc: OidcSettings = field(default_factory=OidcSettings)
    jwt: JwtSettings = field(default_factory=JwtSettings)


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

    def replace(self, **sections: Mapping[str, Any]) -> Settings:
        """A copy with some keys changed: `settings.replace(llm={"model": "x"})`."""
        changed = {
            name: _replaced(getattr(self, name), values) for name, values in sections.items()
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
        env_name = where.replace(".", "_").upper()
        if env_name in env:
            values[key] = _from_env(env[env_name], kind, env_name)
        elif key in raw:
            values[key] = _coerce(raw[key], kind, where)
    return values


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
