"""`python -m app`: serve with the settings of `config.toml` and the environment."""

from __future__ import annotations

import logging

import uvicorn

from . import config
from .main import create_app


def main() -> None:
    settings = config.load()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    uvicorn.run(
        create_app(settings),
        host=settings.server.host,
        port=settings.server.port,
        loop="auto",
        http="auto",
        ws="websockets-sansio",
        timeout_graceful_shutdown=int(settings.server.shutdown_grace_seconds) + 5,
        log_level="info",
    )


if __name__ == "__main__":
    main()
