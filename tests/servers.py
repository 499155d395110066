"""Running real servers on loopback for tests: uvicorn in a thread, on port 0."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn


class ServerThread:
    """A uvicorn server for `app` on 127.0.0.1:<free port>, in its own thread and loop."""

    def __init__(self, app: Any, **config: Any) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        options = {"log_level": "warning", "ws": "websockets-sansio", "lifespan": "on"}
        options.update(config)
        self.server = uvicorn.Server(uvicorn.Config(app, **options))
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))
        finally:
            self.loop.close()

    def start(self) -> ServerThread:
        self._thread.start()
        for _ in range(500):
            if self.server.started:
                return self
            if not self._thread.is_alive():
                break
            threading.Event().wait(0.01)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=15)
        self.sock.close()

    def call(self, coro: Any, timeout: float = 10) -> Any:
        """Run a coroutine on the server's loop (to look at its state) and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextlib.contextmanager
def serve(app: Any, **config: Any) -> Iterator[ServerThread]:
    server = ServerThread(app, **config).start()
    try:
        yield server
    finally:
        server.stop()
