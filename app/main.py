"""`create_app(settings)`: builds the whole server; resources open in the lifespan."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from . import config, logs
from .auth import RateLimiter
from .chat.service import ChatService
from .chat.shares import Shares
from .collections import open_engine
from .collections.retrieval import Retriever
from .collections.service import CollectionService
from .config import Settings, auth_mode
from .errors import AppError, BadRequest, NotFound
from .files.service import FileService
from .identity.accounts import Accounts
from .identity.jwt import BearerJwt
from .identity.oidc import OidcSignIn
from .identity.quota import Quota
from .identity.resolver import Identity
from .identity.throttle import SignInThrottle
from .ids import Snowflake, WorkerLease
from .lifecycle import GracefulShutdown
from .logs import AccessLog
from .mcp_client import McpServers
from .metrics import Metrics
from .model import ChatModel, DemoModel, Embedder, LLMClient, is_demo
from .prompts import Prompts
from .schedules import ScheduleService
from .search.web import WebSearch, choose_provider, search_problem
from .store import Store, open_store
from .streams import close_redis, open_hub, open_redis
from .transport import (
    api,
    auth_routes,
    collections,
    mcp,
    openai,
    perplexica,
    responses,
    schedules,
    shares,
    sse,
    usage,
    ws,
)
from .transport.http import AuthMiddleware, error_response, openai_error
from .transport.streaming import SERVER_SEND

if TYPE_CHECKING:
    import redis.asyncio as aioredis

log = logging.getLogger("app")
WEB_DIR = Path(__file__).resolve().parent / "web"


@contextlib.asynccontextmanager
async def open_service(
    settings: Settings,
    *,
    metrics: Metrics,
    redis: aioredis.Redis | None = None,
    llm: ChatModel | None = None,
    store: Store | None = None,
    prompts: Prompts | None = None,
) -> AsyncIterator[ChatService]:
    """The chat service with everything it uses opened, closed on exit (after a drain
    of `server.shutdown_grace_seconds`). Parts not given are built from `settings`;
    `redis` (from `open_redis`) is the caller's to close."""
    async with contextlib.AsyncExitStack() as stack:
        the_store = store or open_store(
            settings.store.url,
            pool_size=settings.store.pool_size,
            statement_cache_size=settings.store.statement_cache_size,
        )
        await stack.enter_async_context(the_store)
        hub = open_hub(
            redis,
            replay_ttl=settings.stream.replay_ttl_seconds,
            handle_ttl=settings.stream.handle_ttl_seconds,
            max_generation_seconds=settings.llm.timeout_seconds,
            commit_linger=settings.stream.commit_linger_ms / 1000,
            timeout=settings.redis.timeout_seconds,
        )
        await stack.enter_async_context(hub)
        the_prompts = prompts or Prompts()
        the_llm = llm or open_model(settings, the_prompts)
        stack.push_async_callback(the_llm.aclose)
        embedder = Embedder(settings.embeddings)
        stack.push_async_callback(embedder.aclose)
        search = WebSearch(settings, llm=the_llm, embedder=embedder, prompts=the_prompts)
        stack.push_async_callback(search.aclose)
        ids = Snowflake()
        lease = WorkerLease(the_store, ids)
        engine = open_engine(
            settings.collections.url,
            vector_cache_bytes=settings.collections.vector_cache_mb << 20,
        )
        await stack.enter_async_context(engine)
        retriever = Retriever(settings.collections, engine=engine, embedder=embedder)
        stack.push_async_callback(retriever.aclose)
        files = FileService(
            settings.uploads,
            store=the_store,
            embedder=embedder,
            ids=ids,
            retriever=retriever,
            indexer=lease.token,
        )
        stack.push_async_callback(files.aclose)
        knowledge = CollectionService(
            settings.collections,
            settings.uploads,
            store=the_store,
            retriever=retriever,
            reader=search.reader,
            ids=ids,
            indexer=lease.token,
        )
        await knowledge.open()
        stack.push_async_callback(knowledge.aclose)
        # connected in the background: a server that is down delays nothing
        servers = await stack.enter_async_context(McpServers(settings.mcp))
        service = ChatService(
            settings,
            store=the_store,
            hub=hub,
            llm=the_llm,
            prompts=the_prompts,
            ids=ids,
            search=search,
            files=files,
            metrics=metrics,
            collections=knowledge,
            mcp=servers,
        )
        await stack.enter_async_context(lease)
        await service.open()
        try:
            yield service
        finally:
            await service.aclose(settings.server.shutdown_grace_seconds)


async def open_schedules(
    service: ChatService, stack: contextlib.AsyncExitStack
) -> ScheduleService | None:
    """The scheduler of this process, looking for due runs (PROTOCOL §16), stopped with
    `stack` before the chat service; None when `schedules.enabled` is off."""
    if not service.settings.schedules.enabled:
        return None
    scheduler = ScheduleService(service)
    await scheduler.open()
    stack.push_async_callback(scheduler.aclose)
    return scheduler


def open_model(settings: Settings, prompts: Prompts) -> ChatModel:
    """The model `llm.base_url` names: the built-in demo model for `demo`, else any
    OpenAI-compatible server."""
    if is_demo(settings.llm.base_url):
        return DemoModel(prompts, settings.llm.base_url)
    return LLMClient(settings.llm)


def create_app(
    settings: Settings,
    *,
    llm: ChatModel | None = None,
    store: Store | None = None,
    prompts: Prompts | None = None,
) -> Starlette:
    """The ASGI app. Backends not given are built from `settings` and opened on start."""
    metrics = Metrics()
    mode = auth_mode(settings.auth)
    # a wildcard origin with credentials-bearing clients would let any site use a key
    origins = list(settings.server.cors_origins)
    if mode != "off" and origins == ["*"]:
        origins = []

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # first: a refusal here fails the start-up itself (`lifespan.startup.failed`),
        # and the server exits rather than answer every request with a 500
        refuse_body_middleware(app.user_middleware)
        async with contextlib.AsyncExitStack() as stack:
            redis = open_redis(
                settings.redis.url,
                timeout=settings.redis.timeout_seconds,
                max_connections=settings.redis.max_connections,
                cluster=settings.redis.cluster,
            )
            if redis is not None:
                stack.push_async_callback(close_redis, redis)
            service = await stack.enter_async_context(
                open_service(
                    settings, metrics=metrics, redis=redis, llm=llm, store=store, prompts=prompts
                )
            )
            app.state.settings = settings
            app.state.service = service
            app.state.collections = service.collections
            app.state.shares = Shares(service)
            app.state.metrics = metrics
            app.state.sessions = set()
            app.state.streams = set()
            app.state.identity = await open_identity(settings, service, redis, stack)
            app.state.limiter = RateLimiter(settings.limits.requests_per_minute, redis)
            app.state.quota = Quota(service.store, settings.limits.tokens_per_day)
            if settings.mcp.server:
                app.state.mcp = await stack.enter_async_context(
                    mcp.open_endpoint(settings, service, redis)
                )
            app.state.schedules = await open_schedules(service, stack)
            shutdown = GracefulShutdown(
                service,
                app.state.sessions,
                app.state.streams,
                settings.server.shutdown_grace_seconds,
            )
            app.state.shutdown = shutdown
            shutdown.install()
            announce(settings, service)
            try:
                yield
            finally:
                shutdown.uninstall()

    routes = [
        Route("/api/chat/sse", sse.chat, methods=["POST"]),
        Route("/api/chat/sse/resume", sse.resume, methods=["GET"]),
        Route("/api/chat/cancel", api.cancel, methods=["POST"]),
        WebSocketRoute("/api/chat/ws", ws.endpoint),
        WebSocketRoute("/", ws.endpoint),
        Route("/api/chats", api.list_chats, methods=["GET"]),
        Route("/api/chats/{chat_id}", api.get_chat, methods=["GET"]),
        Route("/api/chats/{chat_id}", api.delete_chat, methods=["DELETE"]),
        Route("/sources/{message_id}", api.sources, methods=["GET"]),
        Route("/api/config", api.config, methods=["GET"]),
        Route("/api/config", perplexica.save_config, methods=["POST"]),
        Route("/api/suggestions", api.suggestions, methods=["POST"]),
        Route("/api/usage", usage.usage, methods=["GET"]),
        Route("/api/uploads", api.upload, methods=["POST"]),
        Route("/api/uploads", api.list_uploads, methods=["GET"]),
        Route("/api/uploads/{file_id}", api.get_upload, methods=["GET"]),
        Route("/api/uploads/{file_id}", api.delete_upload, methods=["DELETE"]),
        # accounts (PROTOCOL §7)
        Route("/api/auth/signup", auth_routes.signup, methods=["POST"]),
        Route("/api/auth/login", auth_routes.login, methods=["POST"]),
        Route("/api/auth/logout", auth_routes.logout, methods=["POST"]),
        Route("/api/auth/me", auth_routes.me, methods=["GET"]),
        Route("/api/auth/oidc/login", auth_routes.oidc_login, methods=["GET"]),
        Route("/api/auth/oidc/callback", auth_routes.oidc_callback, methods=["GET"]),
        Route("/api/keys", auth_routes.list_keys, methods=["GET"]),
        Route("/api/keys", auth_routes.create_key, methods=["POST"]),
        Route("/api/keys/{key_id}", auth_routes.revoke_key, methods=["DELETE"]),
        Route("/api/admin/users", auth_routes.admin_users, methods=["GET"]),
        Route("/api/admin/users/{user_id}", auth_routes.admin_change_user, methods=["PATCH"]),
        Route("/api/admin/users/{user_id}/usage", auth_routes.admin_user_usage, methods=["GET"]),
        Route("/api/admin/invites", auth_routes.admin_invite, methods=["POST"]),
        # knowledge collections (PROTOCOL §12)
        Route("/api/collections", collections.create, methods=["POST"]),
        Route("/api/collections", collections.listed, methods=["GET"]),
        Route("/api/collections/{collection_id}", collections.get, methods=["GET"]),
        Route("/api/collections/{collection_id}", collections.update, methods=["PATCH"]),
        Route("/api/collections/{collection_id}", collections.delete, methods=["DELETE"]),
        Route(
            "/api/collections/{collection_id}/documents",
            collections.add_documents,
            methods=["POST"],
        ),
        Route("/api/collections/{collection_id}/documents", collections.documents, methods=["GET"]),
        Route(
            "/api/collections/{collection_id}/documents/{document_id}",
            collections.delete_document,
            methods=["DELETE"],
        ),
        Route(
            "/api/collections/{collection_id}/imports/{import_id}",
            collections.import_progress,
            methods=["GET"],
        ),
        Route("/api/collections/{collection_id}/search", collections.search, methods=["POST"]),
        Route("/api/groups", collections.my_groups, methods=["GET"]),
        Route("/api/admin/groups", collections.admin_groups, methods=["GET"]),
        Route("/api/admin/groups", collections.admin_create_group, methods=["POST"]),
        Route("/api/admin/groups/{group_id}", collections.admin_change_group, methods=["PATCH"]),
        Route("/api/admin/groups/{group_id}", collections.admin_delete_group, methods=["DELETE"]),
        # share links and exports (PROTOCOL §15)
        Route("/api/chats/{chat_id}/share", shares.share, methods=["POST"]),
        Route("/api/chats/{chat_id}/share", shares.unshare, methods=["DELETE"]),
        Route("/api/chats/{chat_id}/export", shares.export, methods=["GET"]),
        Route("/api/shares", shares.list_shares, methods=["GET"]),
        Route("/s/{share_id}", shares.shared, methods=["GET"]),
        # scheduled research (PROTOCOL §16)
        Route("/api/schedules", schedules.create, methods=["POST"]),
        Route("/api/schedules", schedules.listed, methods=["GET"]),
        Route("/api/schedules/{id}", schedules.get, methods=["GET"]),
        Route("/api/schedules/{id}", schedules.update, methods=["PATCH"]),
        Route("/api/schedules/{id}", schedules.delete, methods=["DELETE"]),
        Route("/api/schedules/{id}/run", schedules.run_now, methods=["POST"]),
        Route("/api/schedules/{id}/runs", schedules.runs, methods=["GET"]),
        # the Perplexica web UI (PROTOCOL §9)
        Route("/api/models", perplexica.models, methods=["GET"]),
        Route("/api/providers", api.providers, methods=["GET"]),
        Route("/api/mcp/servers", api.mcp_servers, methods=["GET"]),
        Route("/api/images", perplexica.images, methods=["POST"]),
        Route("/api/videos", perplexica.videos, methods=["POST"]),
        Route("/api/discover", perplexica.discover, methods=["GET"]),
        Route("/api/search", perplexica.search, methods=["POST"]),
        # any OpenAI client (PROTOCOL §10)
        Route("/v1/models", openai.models, methods=["GET"]),
        Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", responses.cancel, methods=["POST"]),
        *(mcp_routes() if settings.mcp.server else []),
        Route("/healthz", api.healthz, methods=["GET"]),
        Route("/readyz", api.readyz, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/", api.web_client, methods=["GET"]),
        Route("/signin", api.web_client, methods=["GET"]),
        Mount("/static", api.HtmlHeaders(StaticFiles(directory=WEB_DIR)), name="static"),
    ]
    middleware = [
        Middleware(AccessLog),
        Middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET", "POST", "PATCH", "DELETE", "OPTIONS"],
            allow_headers=["authorization", "content-type", "last-event-id", *mcp.HEADERS],
            expose_headers=mcp.EXPOSED_HEADERS,
        ),
        Middleware(AuthMiddleware, mode=mode),
    ]
    return App(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={Exception: internal_error, HTTPException: http_error},
    )


def mcp_routes() -> list[Route]:
    """`/mcp` and its protected-resource metadata (PROTOCOL §14)."""
    return [
        Route("/mcp", mcp.Mcp(), methods=["GET", "POST", "DELETE"]),
        Route("/.well-known/oauth-protected-resource", mcp.resource_metadata, methods=["GET"]),
        Route("/.well-known/oauth-protected-resource/mcp", mcp.resource_metadata, methods=["GET"]),
    ]


#: where every answer, an unknown route's included, is JSON in the protocol's shape
JSON_PREFIXES = ("/api/", "/v1/", "/sources/")


async def http_error(request: Request, exc: Exception) -> Response:
    """An unknown route or method (Starlette's 404 and 405) in the protocol's shape
    under the API's prefixes; elsewhere (the web client's files) as Starlette says it."""
    assert isinstance(exc, HTTPException)
    if not request.url.path.startswith(JSON_PREFIXES) or exc.status_code >= 500:
        return PlainTextResponse(exc.detail, status_code=exc.status_code, headers=exc.headers)
    error: AppError = (
        NotFound("no such route")
        if exc.status_code == 404
        else BadRequest(str(exc.detail), status=exc.status_code)
    )
    return openai_error(error) if request.url.path.startswith("/v1/") else error_response(error)


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug in any route still answers in its protocol's shape (500 `INTERNAL`; OpenAI's
    under /v1/), never a plain-text page; the traceback goes to the log."""
    error = AppError("internal error")
    if request.url.path.startswith("/v1/"):
        return openai_error(error)
    return error_response(error)


async def open_identity(
    settings: Settings,
    service: ChatService,
    redis: aioredis.Redis | None,
    stack: contextlib.AsyncExitStack,
) -> Identity:
    """Who is asking, per `auth.mode`: with accounts, the accounts service on the chat
    service's store (and ids), sign-in throttling in Redis when there is one, and the
    OIDC and JWT checks when configured (their HTTP client closed with `stack`)."""
    if auth_mode(settings.auth) != "accounts":
        return Identity(settings)
    auth = settings.auth
    accounts = Accounts(auth, store=service.store, ids=service.ids, throttle=SignInThrottle(redis))
    http = httpx.AsyncClient(timeout=httpx.Timeout(10.0), follow_redirects=False)
    stack.push_async_callback(http.aclose)
    oidc = None
    if auth.oidc.enabled:
        key = (await service.store.secret("oidc-flow")).encode()
        oidc = OidcSignIn(auth.oidc, http, key)
    jwt = BearerJwt(auth.jwt, http) if auth.jwt.enabled else None
    if not await service.store.has_admin():
        log.warning(
            "accounts are on and no admin exists yet: the first account signed up becomes"
            " the admin, whatever auth.signup says (make it now, or make it before anyone"
            " can reach the server: python -m app.identity create-admin EMAIL)"
        )
    return Identity(settings, accounts=accounts, jwt=jwt, oidc=oidc)


class App(Starlette):
    """Starlette that keeps the server's own `send` in the scope (`SERVER_SEND`):
    a streamed response sends its start through the middleware, and its body
    chunks, which no middleware here looks at, straight to the server.

    So a middleware that looks at bodies (compression, tracing that records them)
    would see a stream's start and end but not its chunks — with gzip, say,
    `content-encoding: gzip` over plain text: a corrupt stream. The app's start-up
    (its lifespan) refuses any middleware but those known to look only at a
    response's start (`refuse_body_middleware`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SERVER_SEND] = send
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        try:
            await super().__call__(scope, receive, send)
        except Exception:
            # a bug: the 500 in the route's own shape has gone out (`internal_error`);
            # logged here, once, and the connection kept (the server would close it)
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))


def refuse_body_middleware(middleware: list[Middleware]) -> None:
    """Raises `RuntimeError` naming the first middleware not known to leave response
    bodies alone (not in `STREAM_SAFE`, and not a class with `stream_safe = True`)."""
    for entry in middleware:
        cls: Any = entry.cls
        if cls not in STREAM_SAFE and not getattr(cls, "stream_safe", False):
            name = getattr(cls, "__name__", repr(cls))
            raise RuntimeError(
                f"middleware {name} is not known to leave response bodies alone: this "
                "server writes streamed chunks past middleware, so it would see a "
                "stream's start but not its body (gzip would corrupt it). Compress or "
                "trace in a proxy in front, or mark a middleware that only looks at a "
                "response's start with `stream_safe = True`."
            )


#: middleware that look only at a response's start (and the request), never its body
STREAM_SAFE: frozenset[type] = frozenset({AccessLog, CORSMiddleware, AuthMiddleware})


def announce(settings: Settings, service: ChatService) -> None:
    """One line saying what runs, and a warning for each thing that will not work."""
    store_kind = settings.store.url.partition(":")[0]
    demo = is_demo(settings.llm.base_url)
    log.info(
        "serving",
        extra={
            "fields": {
                "store": store_kind,
                "redis": bool(settings.redis.url),
                "model": settings.llm.model,
                "modelHost": "" if demo else urlsplit(settings.llm.base_url).hostname,
                "demo": demo,
                **dict(
                    zip(
                        ("searchProvider", "searchProviderReason"),
                        choose_provider(settings),
                        strict=True,
                    )
                ),
                "auth": auth_mode(settings.auth) != "off",
                "authMode": auth_mode(settings.auth),
                "workerNumber": service.ids.worker,
                "pid": os.getpid(),
            }
        },
    )
    if demo:
        log.warning(
            "demo model: answers are made up, nothing is asked of a real model; for real "
            "answers set LLM_BASE_URL and LLM_API_KEY and start without --demo"
        )
    elif not settings.llm.api_key:
        log.warning(
            "no model key (LLM_API_KEY): every question will be refused with CONFIG_ERROR; "
            "set it, or try the server with `python -m app --demo`"
        )
    problem = search_problem(settings)
    if problem:
        log.warning("web search will not work: %s; answers come without sources", problem)
    if auth_mode(settings.auth) == "off" and settings.server.host not in (
        "127.0.0.1",
        "localhost",
    ):
        log.warning(
            "auth is off on %s: anyone who reaches this port can ask (and spend the model "
            "key); turn auth on with AUTH_API_KEYS=<key>:<user id> (docs/security.md), or "
            "listen on 127.0.0.1 only with SERVER_HOST=127.0.0.1",
            settings.server.host,
        )


def tune_gc() -> None:
    """Fewer, cheaper garbage collections: a streaming server makes many short-lived
    objects per token, and the default thresholds run full collections often enough
    to stall every stream for tens of milliseconds (measured: p99 token latency at
    400 streams fell from ~90 ms to ~33 ms)."""
    gc.collect()
    gc.freeze()  # what start-up made lives for good; never scan it again
    gc.set_threshold(100_000, 50, 100)


def app_factory() -> Starlette:
    """For `uvicorn --factory app.main:app_factory` and each worker of `python -m app`."""
    logs.configure()
    tune_gc()
    return create_app(config.load())
