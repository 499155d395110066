"""The settings' sections: one frozen dataclass a `[section]` of `config.toml`, each
key documented by the `#:` comment above it (the configuration page is generated from
them). `app.config` puts them together into `Settings` and loads them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerSettings:
    #: the address to listen on (127.0.0.1: this machine only)
    host: str = "0.0.0.0"
    #: the port to listen on (PORT too)
    port: int = 8080
    #: how often an idle SSE stream gets a `: ping` comment
    keepalive_seconds: float = 15.0
    #: the browser origins allowed to call the API
    cors_origins: tuple[str, ...] = ("*",)
    #: the address in "All Sources" links (empty: the request's Host)
    public_url: str = field(default="", repr=False)
    #: how long running answers may finish after SIGTERM
    shutdown_grace_seconds: float = 30.0
    #: worker processes of `python -m app` (WEB_CONCURRENCY too); above 1 needs redis.url
    workers: int = 1
    #: addresses whose X-Forwarded-For is believed (a reverse proxy in front)
    trusted_proxies: tuple[str, ...] = ("127.0.0.1",)
    #: the most a request's headers may take, in bytes (larger: 431)
    max_header_bytes: int = 16384
    #: a connection whose request line and headers have not all come in this long: 408
    header_timeout_seconds: float = 10.0
    #: a request body that stops arriving for this long: 408, and the connection is closed
    body_timeout_seconds: float = 10.0
    #: connections open at once from one client address (trusted proxies excepted)
    max_connections_per_address: int = 256


@dataclass(frozen=True)
class LLMSettings:
    #: the answering model's OpenAI-compatible API (`demo`: the built-in demo model, which --demo sets)
    base_url: str = field(default="https://api.deepseek.com/v1", repr=False)
    #: the model's key (empty: questions are answered CONFIG_ERROR)
    api_key: str = field(default="", repr=False)
    #: the model that answers
    model: str = "deepseek-reasoner"
    #: the model for the rewrite, classifier, titles and related questions (empty: llm.model)
    small_model: str = ""
    #: the deadline of one generation; keep-alives do not extend it
    timeout_seconds: float = 600.0
    #: the model's context window: the answer's prompt is trimmed to fit (with room
    #: for the answer), never refused upstream as too long
    context_tokens: int = 32768
    #: how long connecting to the model may take
    connect_timeout_seconds: float = 10.0
    #: how long the model may stay silent mid-answer
    read_timeout_seconds: float = 120.0
    #: the most an answer may be, in tokens: an answer cut there ends `completed` with
    #: `truncated: true` in `messageEnd` and is saved whole (a research round's call is
    #: cut there too)
    max_output_tokens: int = 8192
    #: where the instructions go: "system", or "user" for a chat template that drops
    #: system messages (llama.cpp's gemma format)
    system_prompt: str = "system"
    #: how `<think>` tags in the answer's text read: "auto" (learned per model; the
    #: first answer of a model nothing is known of is held back until its format
    #: shows), "paired" (tags come in pairs or not at all: nothing is held back; a
    #: lone `</think>` splits from where it comes), "open_left_out" (the text starts
    #: as reasoning until a `</think>`: DeepSeek-R1 behind a server without a
    #: reasoning parser)
    think_tags: str = "auto"

    @property
    def effective_small_model(self) -> str:
        return self.small_model or self.model


#: `providers.<id>.type`: an OpenAI-compatible server, or Anthropic's Messages API
PROVIDER_TYPES = ("openai", "anthropic")
#: the id of the model `[llm]` configures, among the providers
DEFAULT_PROVIDER = "default"


@dataclass(frozen=True)
class ProviderSettings:
    """One `[providers.<id>]` table: a model server beside `[llm]` (PROTOCOL §13)."""

    #: "openai" (any OpenAI-compatible server) or "anthropic" (Anthropic's Messages API)
    type: str = "openai"
    #: the name shown in the model picker (empty: the id)
    name: str = ""
    base_url: str = field(default="", repr=False)
    api_key: str = field(default="", repr=False)
    #: the models offered (empty: listed from the provider)
    models: tuple[str, ...] = ()
    #: the model of an answer's small tasks (classify, rewrite, title, suggestions);
    #: empty: the default model's
    small_model: str = ""
    #: the models' context window (0: llm.context_tokens)
    context_tokens: int = 0
    #: the most an answer may be, in tokens (0: llm.max_output_tokens)
    max_output_tokens: int = 0
    #: where the instructions go: "system", or "user" (empty: llm.system_prompt)
    system_prompt: str = ""
    #: how `<think>` tags read: "auto", "paired" or "open_left_out" (empty: llm.think_tags)
    think_tags: str = ""
    #: with accounts, only admins see and use it
    admin_only: bool = False
    #: type "anthropic": the tokens an answer may think before it writes (extended
    #: thinking, shown as reasoning; at least 1024, below max_output_tokens); 0: none
    thinking_tokens: int = 0


@dataclass(frozen=True)
class EmbeddingsSettings:
    #: the embeddings API (empty: llm.base_url)
    base_url: str = field(default="", repr=False)
    #: its key (empty: llm.api_key)
    api_key: str = field(default="", repr=False)
    #: the embeddings model, for ranking in `balanced` and for documents (empty: none, BM25 alone)
    model: str = ""


@dataclass(frozen=True)
class SearchSettings:
    #: auto: tavily with a key, else searxng with a URL, else google with a key and a
    #: CSE id, else ddgs (keyless)
    provider: str = "auto"
    #: results asked of the provider per search
    max_results: int = 8
    #: searching, ranking and reading together take at most this long
    timeout_seconds: float = 20.0


@dataclass(frozen=True)
class DdgsSettings:
    #: the region the keyless metasearch asks for
    region: str = "us-en"
    #: on, moderate or off
    safesearch: str = "moderate"
    #: "auto", or some of the library's services, comma-separated ("duckduckgo,brave")
    backend: str = "auto"
    #: per request the library makes, in whole seconds (it takes an int)
    timeout_seconds: int = 5
    #: the same query within this long is answered from a short cache
    cache_seconds: float = 120.0
    #: an http(s) or socks5 proxy URL for the library's requests (DDGS_PROXY); empty: none
    proxy: str = field(default="", repr=False)  # it may hold a password


@dataclass(frozen=True)
class TavilySettings:
    #: Tavily's key (search.provider auto picks Tavily when it is set)
    api_key: str = field(default="", repr=False)
    #: Tavily's API
    base_url: str = field(default="https://api.tavily.com", repr=False)


@dataclass(frozen=True)
class SearxngSettings:
    #: a SearxNG instance that allows JSON output
    url: str = field(default="", repr=False)  # it may hold a password


@dataclass(frozen=True)
class GoogleSettings:
    #: the Custom Search JSON API's key
    api_key: str = field(default="", repr=False)
    #: the programmable search engine's id
    cse_id: str = ""
    #: Google's API
    base_url: str = field(default="https://www.googleapis.com", repr=False)


@dataclass(frozen=True)
class ReaderSettings:
    #: how pages are read: jina (a reader service) or builtin (fetched and extracted here)
    provider: str = "jina"
    #: the jina reader's address
    base_url: str = field(default="https://r.jina.ai", repr=False)
    #: the jina reader's key, sent as a bearer key when set
    api_key: str = field(default="", repr=False)
    #: how long reading one page may take (past it, its snippet is kept)
    timeout_seconds: float = 15.0
    #: let the built-in reader read loopback, private and link-local addresses
    allow_private_networks: bool = False


@dataclass(frozen=True)
class ResearchSettings:
    #: the fixed research loop's keys, read no more (deepResearch is the research agent,
    #: `deep_rounds` and `deep_seconds`): kept so that older config files still load
    max_iterations: int = 3
    #: read no more (see max_iterations)
    time_budget_seconds: float = 120.0
    #: read no more (see max_iterations)
    sub_questions: int = 3
    #: read no more (see max_iterations)
    pages_per_question: int = 3
    #: the research agent's budget per optimization mode (PROTOCOL §1, §8): rounds of
    #: tool calls and wall-clock seconds; a budget of one round (`speed`'s) is one
    #: search and no model call
    speed_rounds: int = 1
    #: rounds of the research agent in `balanced`
    balanced_rounds: int = 6
    #: rounds of the research agent in `quality`
    quality_rounds: int = 25
    #: rounds of the research agent in deepResearch
    deep_rounds: int = 25
    #: wall-clock seconds of research in `speed`
    speed_seconds: float = 20.0
    #: wall-clock seconds of research in `balanced`
    balanced_seconds: float = 60.0
    #: wall-clock seconds of research in `quality`
    quality_seconds: float = 180.0
    #: wall-clock seconds of research in deepResearch
    deep_seconds: float = 300.0
    #: how long one round's model call may take (a model that never answers costs this)
    round_seconds: float = 45.0
    #: how long the classifier may take before its safe default is used
    classify_seconds: float = 10.0
    #: what the answer's prompt may hold, in tokens (0: llm.context_tokens)
    context_tokens: int = 0
    #: ask the first research round's model call while the classifier decides (the first
    #: question of balanced, quality and deepResearch): the first token comes a model
    #: call sooner; a question the classifier then keeps from search costs that call's
    #: prompt tokens. Turn it off for a local model server with one slot: the two queue
    round_ahead: bool = True


@dataclass(frozen=True)
class UploadSettings:
    #: the largest file one upload may hold
    max_file_bytes: int = 50 * 1024 * 1024
    #: a PDF with more pages is refused (413)
    max_pages: int = 2000
    #: the size of a passage a document is cut into
    chunk_tokens: int = 300
    #: how much consecutive passages overlap
    chunk_overlap_tokens: int = 50
    #: how long reading one file may take
    extract_timeout_seconds: float = 120.0
    #: the most file passages given to the model per question
    passages: int = 8
    #: passages embedded per call to the embeddings model
    embed_batch: int = 64


@dataclass(frozen=True)
class RerankSettings:
    """An optional reranker of collection passages: a Jina/Cohere-style `POST {url}`
    with `{"model", "query", "documents", "top_n"}` answering `{"results": [{"index",
    "relevance_score"}]}` (`/rerank` of an OpenAI-compatible server too). Empty: off."""

    #: the reranker's address (empty: no reranking)
    url: str = field(default="", repr=False)
    #: the reranker's model
    model: str = ""
    #: the reranker's key
    api_key: str = field(default="", repr=False)
    #: how long one rerank may take (past it, the fused order is kept)
    timeout_seconds: float = 10.0


@dataclass(frozen=True)
class CollectionSettings:
    """Knowledge collections (PROTOCOL §12). `url` names the engine:
    `tantivy:///data/collections` (embedded, the default; a relative path is beside the
    config file), `milvus:///data/collections.db` (Milvus Lite in a file) or
    `milvus://host:19530` (a Milvus server or cluster)."""

    #: the collections engine: tantivy:///folder, milvus:///file.db or milvus://host:19530
    url: str = field(default="tantivy:///data/collections", repr=False)  # a password, maybe
    #: documents per collection
    max_documents: int = 10_000
    #: one import request's files together (a zip unpacked)
    max_import_bytes: int = 500 * 1024 * 1024
    #: files in one import request (the entries of a zip included)
    max_import_files: int = 1000
    #: passages given to the model per question
    passages: int = 8
    #: passages taken from each ranking before fusion
    candidates: int = 50
    #: the k of reciprocal rank fusion
    rrf_k: int = 60
    #: the vectors' ranking in the fusion, BM25's being 1
    dense_weight: float = 1.0
    #: batches of documents one process reads and indexes at once
    import_concurrency: int = 2
    #: imports running at once (from the request until their last document has ended):
    #: per user (with auth off, per client address) → 429, per process → 503
    max_imports_per_user: int = 2
    #: imports running at once per process (503 past it)
    max_imports: int = 8
    #: where imported files wait for their batch (empty: the system's temp folder)
    spool_dir: str = ""
    #: the embedded engine's vectors kept in memory, all spaces together (least
    #: recently searched ones are let go past it)
    vector_cache_mb: int = 512
    rerank: RerankSettings = field(default_factory=RerankSettings)


@dataclass(frozen=True)
class StoreSettings:
    #: sqlite:///relative.db (beside config.toml), sqlite:////absolute.db or postgresql://user:pass@host/db
    url: str = field(default="sqlite:///data/chat.db", repr=False)  # it may hold a password
    #: PostgreSQL connections per worker, at most
    pool_size: int = 10
    #: prepared statements cached per connection (0 behind PgBouncer in transaction mode)
    statement_cache_size: int = 100


@dataclass(frozen=True)
class RedisSettings:
    #: empty: one process, in memory; redis://, rediss:// (TLS), unix:// or redis+sentinel://host:26379[,host:26379…]/service[/db]
    url: str = field(default="", repr=False)  # it may hold a password
    #: `url` names a node of a Redis Cluster (any one: the others are discovered)
    cluster: bool = False
    #: the longest one call may take (connecting, or an answer): a Redis that stops
    #: answering fails like one that refuses
    timeout_seconds: float = 2.0
    #: connections per process; a call waits at most timeout_seconds for one
    max_connections: int = 64


@dataclass(frozen=True)
class StreamSettings:
    #: how long a finished generation's events are kept for resume
    replay_ttl_seconds: float = 300.0
    #: the most events one write to a client carries when it has fallen behind
    max_queue_events: int = 1024
    #: how long a dead process's claim on a chat outlives it (with Redis)
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
    #: a client that cannot take a write for this long is let go
    client_timeout_seconds: float = 30.0


@dataclass(frozen=True)
class LimitsSettings:
    #: the largest request body (413 past it)
    max_body_bytes: int = 1_048_576
    #: the longest question, and each history entry, in characters
    max_content_chars: int = 32_000
    #: chat requests and suggestions per minute per user (per address with auth off;
    #: 0: no limit; 429 past it)
    requests_per_minute: int = 0
    #: the most history messages a request may carry
    max_history_messages: int = 200
    #: answers running at once per API key (per client address with auth off), 429 past it
    max_concurrent_generations: int = 16
    #: answers one process runs at once, whoever asks (503 with Retry-After past it)
    max_generations_per_process: int = 500
    #: frames per second one WebSocket may send
    ws_messages_per_second: float = 20.0
    #: tokens a user's answers may use per UTC day (0: no quota); an admin may set
    #: another number per user
    tokens_per_day: int = 0


@dataclass(frozen=True)
class OidcSettings:
    """Sign-in with an OpenID Connect provider (`[auth.oidc]`, env `AUTH_OIDC_*`)."""

    #: the provider's issuer URL (its discovery document is read from it)
    issuer: str = ""
    #: this server's client id at the provider
    client_id: str = ""
    #: this server's client secret at the provider
    client_secret: str = field(default="", repr=False)
    #: what the sign-in button says ("Sign in with <name>"); empty: the issuer's host
    name: str = ""
    #: the scopes asked for at sign-in
    scopes: tuple[str, ...] = ("openid", "email", "profile")

    @property
    def enabled(self) -> bool:
        return bool(self.issuer and self.client_id)


@dataclass(frozen=True)
class JwtSettings:
    """Bearer JWTs from an app's own identity provider (`[auth.jwt]`, env `AUTH_JWT_*`):
    keys from `issuer`'s discovery document or from `jwks_url`; or one HS256 `secret`."""

    #: the issuer whose discovery document names the keys (then audience is required)
    issuer: str = ""
    #: the keys' URL, instead of the issuer's discovery (iss is then not checked)
    jwks_url: str = field(default="", repr=False)
    #: the `aud` a token must carry
    audience: str = ""
    #: an HS256 shared secret, instead of keys
    secret: str = field(default="", repr=False)

    @property
    def enabled(self) -> bool:
        return bool(self.issuer or self.jwks_url or self.secret)


@dataclass(frozen=True)
class McpServerSettings:
    """One MCP server whose tools the research agent may call (`[mcp.servers.<name>]`,
    env `MCP_SERVERS_<NAME>_<KEY>`, PROTOCOL §14): offered as `<name>__<tool>`."""

    #: its Streamable HTTP endpoint (`https://host/mcp`)
    url: str = field(default="", repr=False)
    #: instead of `url`: a program speaking MCP on stdin/stdout (needs mcp.allow_stdio)
    command: str = ""
    #: the command's arguments
    args: tuple[str, ...] = ()
    #: HTTP headers sent with every request (`Authorization`): never logged nor shown
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    #: the tools offered (empty: all it lists)
    tools: tuple[str, ...] = ()
    #: offered to every research; false: only to a request whose `sources` names `mcp:<name>`
    default: bool = True
    #: the longest one call (and the connection, and the listing) may take
    timeout_seconds: float = 30.0


@dataclass(frozen=True)
class McpSettings:
    """The Model Context Protocol (`[mcp]`, env `MCP_*`, PROTOCOL §14)."""

    #: serve `/mcp` (Streamable HTTP) so MCP clients can search through this server
    server: bool = True
    #: characters of an MCP tool's result given to the model at most
    max_result_chars: int = 20_000
    #: let `[mcp.servers.<name>] command` start programs on this host (stdio servers)
    allow_stdio: bool = False
    #: the MCP servers whose tools the research agent may call, by name
    servers: Mapping[str, McpServerSettings] = field(default_factory=dict)


#: auth.mode: no auth, static keys (auth.api_keys), or accounts
AUTH_MODES = ("off", "keys", "accounts")
SIGNUP_RULES = ("open", "invite", "closed")


@dataclass(frozen=True)
class AuthSettings:
    #: static API keys and the user each one is (AUTH_API_KEYS=<key>:<user id>,…)
    api_keys: Mapping[str, str] = field(default_factory=dict, repr=False)
    #: off | keys | accounts; "off" with api_keys set means "keys"
    mode: str = "off"
    #: who may make an account: open | invite (with an admin's invite code) | closed
    signup: str = "open"
    #: how long a sign-in session's cookie lasts
    session_days: float = 30.0
    oidc: OidcSettings = field(default_factory=OidcSettings)
    jwt: JwtSettings = field(default_factory=JwtSettings)


@dataclass(frozen=True)
class ShareSettings:
    #: share links (PROTOCOL §15); false: every share route answers 404
    enabled: bool = True
    #: let search engines index shared pages (false: they say `noindex`)
    indexable: bool = False


@dataclass(frozen=True)
class SchedulesSettings:
    """Scheduled research (PROTOCOL §16, `[schedules]`)."""

    #: run schedules on this server (every process looks for due runs)
    enabled: bool = True
    #: no schedule runs more often than this (its cron's shortest gap is checked)
    min_interval_seconds: float = 3600.0
    #: schedules one user may have
    max_per_user: int = 20
    #: webhooks may go to loopback, private and link-local addresses
    webhook_allow_private_networks: bool = False
    #: a schedule whose runs failed this many times in a row is disabled, saying why
    pause_after_failures: int = 5
    #: how often each process looks for due runs and webhooks to send
    tick_seconds: float = 10.0
    #: a run's lease: another process takes the run over once it has not been renewed
    #: this long (its holder renews it every third of it)
    lease_seconds: float = 60.0
    #: the longest one webhook request may take
    webhook_timeout_seconds: float = 10.0
