"""Background work a component owns: loops that outlive any one error, and one-off
chores that are awaited when their owner closes.

A long-lived loop (a heartbeat, a flusher, a sweeper) that dies of an unexpected
error would take its duty with it for the life of the process, logged only at
shutdown; `supervised` logs the error at once, backs off and runs it again. A
task that is started is owned by a `Chores` and awaited after it is cancelled,
so nothing is left running, or unlogged, when its owner closes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("app.chores")

#: a loop that ran this long without failing starts its back-off anew
HEALTHY_SECONDS = 10.0


async def supervised(
    name: str,
    run: Callable[[], Coroutine[Any, Any, None]],
    *,
    first_delay: float = 0.1,
    max_delay: float = 5.0,
) -> None:
    """Run `run()` for ever: when it raises (anything but a cancel) or returns, log
    it and start it again after a growing pause. Cancelling stops it."""
    delay = first_delay
    while True:
        started = time.monotonic()
        try:
            await run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s failed; starting it again in %.1f s", name, delay)
        else:
            log.error("%s stopped; starting it again in %.1f s", name, delay)
        if time.monotonic() - started > HEALTHY_SECONDS:
            delay = first_delay
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay)


class Chores:
    """The tasks one component started. `spawn` a one-off chore (its error is logged
    when it ends), `loop` a supervised one; `aclose` cancels whatever still runs and
    waits for it to end."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def loop(self, name: str, run: Callable[[], Coroutine[Any, Any, None]]) -> asyncio.Task[None]:
        return self.spawn(supervised(f"{self.owner}: {name}", run), name=name)

    def __len__(self) -> int:
        return len(self._tasks)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("%s: %s failed: %r", self.owner, task.get_name(), task.exception())

    async def aclose(self, timeout: float = 5.0) -> None:
        """Cancel every task and wait (up to `timeout`) until each has ended."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)


async def cancel_and_wait(
    tasks: list[asyncio.Task[Any]] | set[asyncio.Task[Any]], timeout: float = 10.0
) -> None:
    """Cancel tasks and wait until each has ended (their errors are theirs to log) —
    at most `timeout` seconds: one that does not end by then is logged and left."""
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        _, stuck = await asyncio.wait(pending, timeout=timeout)
        for task in stuck:
            log.error("%s did not end %.0f s after it was cancelled", task.get_name(), timeout)
