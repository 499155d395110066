"""Graceful shutdown on SIGTERM (and Ctrl-C).

An ASGI server tells the app it is stopping only after every connection has
closed, and closes WebSockets (1012) before that — too late to end streams
well. So the app takes the signal first: it stops accepting generations
(readiness turns 503), lets the running ones finish for
`server.shutdown_grace_seconds`, cancels the rest (each saves its partial
answer as `cancelled` and sends `messageEnd` to its clients), closes open
WebSockets with 1001, and only then hands the signal to the server, which
finds nothing left to wait for. A second signal ends the answers at once (each
still saved as `cancelled` with its `messageEnd`); a third hands the signal
over at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from .chat.service import ChatService
from .transport.streaming import StreamResponse
from .transport.ws import Session

log = logging.getLogger("app.lifecycle")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
SOCKET_FLUSH_SECONDS = 2.0

Handler = Callable[[int, FrameType | None], Any] | int | None


class GracefulShutdown:
    def __init__(
        self,
        service: ChatService,
        sessions: set[Session],
        streams: set[StreamResponse],
        grace: float,
    ) -> None:
        self.service = service
        self.sessions = sessions
        self.streams = streams
        self.grace = grace
        self.draining = False
        self.signals = 0
        self._previous: dict[int, Handler] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    def install(self) -> None:
        """Chain our handler in front of the server's (main thread only; elsewhere, as in
        tests that run the server in a thread, this does nothing)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1
        if self._loop is None or self.signals > 2:
            self._hand_over(signum, frame)
            return
        if self.signals == 2:
            log.info("shutting down now: answers end as cancelled (a third signal cuts them)")
            self._loop.call_soon_threadsafe(self.service.hurry)
            return
        self.draining = True
        log.info(
            "shutting down: draining generations (a second signal stops them at once)",
            extra={"fields": {"graceSeconds": self.grace}},
        )
        self._loop.call_soon_threadsafe(self._start, signum, frame)

    def _start(self, signum: int, frame: FrameType | None) -> None:
        self._task = asyncio.create_task(self.drain(signum, frame))

    async def drain(self, signum: int, frame: FrameType | None) -> None:
        try:
            await self.service.drain(self.grace)
            await asyncio.gather(
                *(session.close(1001, SOCKET_FLUSH_SECONDS) for session in list(self.sessions)),
                return_exceptions=True,
            )
        except Exception:
            log.exception("draining failed; stopping anyway")
        finally:
            # whatever streams remain (following other processes' generations) end
            for stream in list(self.streams):
                stream.end()
            self._hand_over(signum, frame)

    def _hand_over(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt
