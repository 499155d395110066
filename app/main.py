"""`create_app(settings)`: builds the whole server; resources open in the lifespan."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from . import api, config, logs
from .auth import Auth, RateLimiter
from .chat.research import DeepResearch
from .chat.service import ChatService
from .collections.base import open_engine
from .collections.retrieval import Retriever
from .collections.service import CollectionService
from .config import Settings
from .files.service import FileService
from .ids import Snowflake, WorkerLease
from .lifecycle import GracefulShutdown
from .llm import Embedder, LLMClient
from .logs import AccessLog
from .metrics import Metrics
from .prompts import Prompts
from .search.web import WebSearch, choose_provider, search_problem
from .store import Store, open_store
from .streams import open_hub, open_redis
from .transport import collections, openai, perplexica, sse, ws
from .transport.http import AuthMiddleware
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
    llm: LLMClient | None = None,
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
            flush_interval=settings.stream.flush_interval_ms / 1000,
            max_generation_seconds=settings.llm.timeout_seconds,
        )
        await stack.enter_async_context(hub)
        the_llm = llm or LLMClient(settings.llm)
        stack.push_async_callback(the_llm.aclose)
        the_prompts = prompts or Prompts()
        embedder = Embedder(settings.embeddings)
        stack.push_async_callback(embedder.aclose)
        search = WebSearch(settings, llm=the_llm, embedder=embedder, prompts=the_prompts)
        stack.push_async_callback(search.aclose)
        ids = Snowflake()
        engine = open_engine(settings.collections.url)
        await stack.enter_async_context(engine)
        retriever = Retriever(settings.collections, engine=engine, embedder=embedder)
        stack.push_async_callback(retriever.aclose)
        files = FileService(
            settings.uploads, store=the_store, embedder=embedder, ids=ids, retriever=retriever
        )
        chores: list[ChatService] = []  # the service spawns imports; it is made just below
        knowledge = CollectionService(
            settings.collections,
            settings.uploads,
            store=the_store,
            retriever=retriever,
            reader=search.reader,
            ids=ids,
            spawn=lambda coro: chores[0].spawn(coro),
        )
        service = ChatService(
            settings,
            store=the_store,
            hub=hub,
            llm=the_llm,
            prompts=the_prompts,
            ids=ids,
            search=search,
            files=files,
            research=DeepResearch(
                settings.research, search=search, files=files, llm=the_llm, prompts=the_prompts
            ),
            metrics=metrics,
            collections=knowledge,
        )
        chores.append(service)
        await stack.enter_async_context(WorkerLease(the_store, service.ids))
        await service.open()
        try:
            yield service
        finally:
            await service.aclose(settings.server.shutdown_grace_seconds)


def create_app(
    settings: Settings,
    *,
    llm: LLMClient | None = None,
    store: Store | None = None,
    prompts: Prompts | None = None,
) -> Starlette:
    """The ASGI app. Backends not given are built from `settings` and opened on start."""
    metrics = Metrics()
    auth = Auth(settings.auth.api_keys)
    # a wildcard origin with credentials-bearing clients would let any site use a key
    origins = list(settings.server.cors_origins)
    if auth.enabled and origins == ["*"]:
        origins = []

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            redis = open_redis(settings.redis.url)
            if redis is not None:
                stack.push_async_callback(redis.aclose)
            service = await stack.enter_async_context(
                open_service(
                    settings, metrics=metrics, redis=redis, llm=llm, store=store, prompts=prompts
                )
            )
            app.state.settings = settings
            app.state.service = service
            app.state.collections = service.collections
            app.state.metrics = metrics
            app.state.sessions = set()
            app.state.streams = set()
            app.state.auth = auth
            app.state.limiter = RateLimiter(settings.limits.requests_per_minute, redis)
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
        Route("/api/usage", api.usage, methods=["GET"]),
        Route("/api/uploads", api.upload, methods=["POST"]),
        Route("/api/uploads", api.list_uploads, methods=["GET"]),
        Route("/api/uploads/{file_id}", api.get_upload, methods=["GET"]),
        Route("/api/uploads/{file_id}", api.delete_upload, methods=["DELETE"]),
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
        # the Perplexica web UI (PROTOCOL §9)
        Route("/api/models", perplexica.models, methods=["GET"]),
        Route("/api/images", perplexica.images, methods=["POST"]),
        Route("/api/videos", perplexica.videos, methods=["POST"]),
        Route("/api/discover", perplexica.discover, methods=["GET"]),
        Route("/api/search", perplexica.search, methods=["POST"]),
        # any OpenAI client (PROTOCOL §10)
        Route("/v1/models", openai.models, methods=["GET"]),
        Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
        Route("/healthz", api.healthz, methods=["GET"]),
        Route("/readyz", api.readyz, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/", api.web_client, methods=["GET"]),
        Mount("/static", api.HtmlHeaders(StaticFiles(directory=WEB_DIR)), name="static"),
    ]
    middleware = [
        Middleware(AccessLog),
        Middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET", "POST", "PATCH", "DELETE", "OPTIONS"],
            allow_headers=["authorization", "content-type", "last-event-id"],
        ),
        Middleware(AuthMiddleware, auth=auth),
    ]
    return App(routes=routes, middleware=middleware, lifespan=lifespan)


class App(Starlette):
    """Starlette that keeps the server's own `send` in the scope (`SERVER_SEND`):
    a streamed response sends its start through the middleware, and its body
    chunks, which no middleware here looks at, straight to the server."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


def announce(settings: Settings, service: ChatService) -> None:
    """One line saying what runs, and a warning for each thing that will not work."""
    store_kind = settings.store.url.partition(":")[0]
    log.info(
        "serving",
        extra={
            "fields": {
                "store": store_kind,
                "redis": bool(settings.redis.url),
                "model": settings.llm.model,
                "modelHost": urlsplit(settings.llm.base_url).hostname,
                **dict(
                    zip(
                        ("searchProvider", "searchProviderReason"),
                        choose_provider(settings),
                        strict=True,
                    )
                ),
                "auth": bool(settings.auth.api_keys),
                "workerNumber": service.ids.worker,
                "pid": os.getpid(),
            }
        },
    )
    if not settings.llm.api_key:
        log.warning("no model key (LLM_API_KEY): every question will be refused with CONFIG_ERROR")
    problem = search_problem(settings)
    if problem:
        log.warning("web search will not work: %s; answers come without sources", problem)
    if not settings.auth.api_keys and settings.server.host not in ("127.0.0.1", "localhost"):
        log.warning(
            "auth is off on %s: anyone who reaches this port can ask (and spend the model key)",
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
