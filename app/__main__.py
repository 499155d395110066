"""`python -m app`: serve with the settings of `config.toml` and the environment.

With `server.workers` (or `WEB_CONCURRENCY`) above 1 it runs that many worker
processes on one socket; they share Redis and the store, and their metrics
are gathered through a directory of their own.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import uvicorn

from . import config, logs
from .main import create_app, tune_gc


def main() -> None:
    settings = config.load()
    logs.configure()
    tune_gc()
    options: dict[str, Any] = {
        "host": settings.server.host,
        "port": settings.server.port,
        "ws": "websockets-sansio",
        "log_config": None,
        "access_log": False,
        "proxy_headers": True,
        # the app drains on SIGTERM before uvicorn starts closing connections;
        # this only bounds what is left after that
        "timeout_graceful_shutdown": 5,
    }
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
