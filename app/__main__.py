"""`python -m app`: serve with the settings of `config.toml` and the environment.

With `server.workers` (or `WEB_CONCURRENCY`) above 1 it runs that many worker
processes on one socket; they share Redis and the store, and their metrics
are gathered through a directory of their own.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

import uvicorn

from . import config, logs
from .main import create_app, tune_gc
from .serving import uvicorn_options


def main() -> None:
    settings = config.load()
    logs.configure()
    if settings.server.workers > 1 and not settings.redis.url:
        # each worker would keep its own registry: a stop or a resume would reach
        # the generation only when it lands on the worker that runs it
        sys.exit(
            "server.workers (WEB_CONCURRENCY) above 1 needs redis.url (REDIS_URL): "
            "workers share running answers, stop and resume through Redis"
        )
    if settings.server.workers > 1 and settings.store.url.startswith("sqlite"):
        logging.getLogger("app").warning(
            "several workers share one SQLite file: their writes queue on its lock "
            "(and fail after 5 s under load); use PostgreSQL (store.url) for more than one"
        )
    tune_gc()
    options = uvicorn_options(settings)
    if settings.server.workers > 1:
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="searchchat-metrics-")
        uvicorn.run(
            "app.main:app_factory", factory=True, workers=settings.server.workers, **options
        )
    else:
        uvicorn.run(create_app(settings), **options)


if __name__ == "__main__":
    main()
