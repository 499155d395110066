"""`python -m app`: serve with the settings of `config.toml` and the environment.

    python -m app            # as configured
    python -m app --demo     # the built-in demo model and demo web search: no key needed

With `server.workers` (or `WEB_CONCURRENCY`) above 1 it runs that many worker
processes on one socket; they share Redis and the store, and their metrics
are gathered through a directory of their own.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
import tempfile

import uvicorn
from uvicorn.supervisors import Multiprocess

from . import config, logs
from .main import create_app, tune_gc
from .model import is_demo
from .serving import uvicorn_config

#: what `--demo` sets in the environment (the workers read it too); a search
#: provider chosen already stays
DEMO_ENV = {"LLM_BASE_URL": "demo", "LLM_MODEL": "demo", "LLM_SMALL_MODEL": ""}


def port_free(host: str, port: int) -> bool:
    """Whether `host:port` can be listened on (nothing else holds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--demo",
        action="store_true",
        help="answer with the built-in demo model (made-up answers, no key needed)",
    )
    args = parser.parse_args(argv)
    if args.demo:
        demo = dict(DEMO_ENV)
        if is_demo(os.environ.get("LLM_BASE_URL", "")):
            del demo["LLM_BASE_URL"]  # the demo model already, with its options (a pace)
        os.environ.update(demo)
        os.environ.setdefault("SEARCH_PROVIDER", "demo")
    settings = config.load()
    logs.configure()
    server = settings.server
    if server.workers > 1 and not settings.redis.url:
        # each worker would keep its own registry: a stop or a resume would reach
        # the generation only when it lands on the worker that runs it
        sys.exit(
            "server.workers (WEB_CONCURRENCY) above 1 needs redis.url (REDIS_URL): "
            "workers share running answers, stop and resume through Redis"
        )
    if not port_free(server.host, server.port):
        sys.exit(
            f"port {server.port} is in use on {server.host}: another server runs there; "
            "set PORT (or server.port) to a free one"
        )
    if server.workers > 1 and settings.store.url.startswith("sqlite"):
        logging.getLogger("app").warning(
            "several workers share one SQLite file: their writes queue on its lock "
            "(and fail after 5 s under load); use PostgreSQL (store.url) for more than one"
        )
    tune_gc()
    if server.workers > 1:
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="searchchat-metrics-")
        workers = uvicorn_config(
            "app.main:app_factory", settings, factory=True, workers=server.workers
        )
        try:
            Multiprocess(workers, sockets=[workers.bind_socket()]).run()
        except KeyboardInterrupt:  # a third signal: the workers are stopped already
            pass
        return
    running = uvicorn.Server(uvicorn_config(create_app(settings), settings))
    try:
        running.run()
    except KeyboardInterrupt:  # the last signal cut the drain short; it is logged
        pass
    if not running.started:
        sys.exit(3)


if __name__ == "__main__":
    main()
