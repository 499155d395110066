"""The Redis hub's listener: pub/sub on a connection of its own (cancels published
for this process's generations, and which of them other processes follow), made
again whenever it fails or stops answering."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from . import rediskeys as k

log = logging.getLogger("app.streams")

#: a listener that heard nothing for this long asks Redis whether it is there
LISTEN_PING_SECONDS = 5.0


async def listen(
    blocking: Any,
    channels: tuple[str, ...],
    *,
    cluster: bool,
    timeout: float,
    subscribed: Callable[[], None],
    heard: Callable[[str, str], None],
    lost: Callable[[], None],
    reconnect: Callable[[], Awaitable[None]],
) -> None:
    """Listen to `channels` on a connection of `blocking`'s own, for ever: `heard`
    (channel, message) for each message, `subscribed` once (again) subscribed, `lost`
    when the connection fails, `reconnect` before the next try. A connection that
    answers nothing for `LISTEN_PING_SECONDS` (Redis hung, or moved to another
    address) is dropped and made again."""
    delay, failing = 0.1, False
    while True:
        if failing:
            await reconnect()
        pubsub = blocking.pubsub(ignore_subscribe_messages=True)
        try:
            if cluster:  # the slot map, to pick the node to listen on
                async with asyncio.timeout(timeout):
                    await blocking.initialize()
            async with asyncio.timeout(timeout):
                await pubsub.subscribe(*channels)
            subscribed()
            if failing:
                log.info("cancel listener: redis is back")
                failing = False
            delay = 0.1
            last = time.monotonic()
            pinged = False
            while True:
                message = await pubsub.get_message(timeout=LISTEN_PING_SECONDS / 2)
                now = time.monotonic()
                if message is not None:
                    last, pinged = now, False
                    if message.get("type") == "message":
                        heard(k.text(message["channel"]), k.text(message["data"]))
                    continue
                if now - last < LISTEN_PING_SECONDS / 2:
                    continue
                if pinged:  # asked, and nothing came back
                    raise TimeoutError("the cancel channel stopped answering")
                await pubsub.ping()
                pinged = True
        except (RedisError, OSError, TimeoutError) as exc:
            if not failing:
                log.warning("cancel listener lost redis: %r", exc)
                failing = True
            lost()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        finally:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await pubsub.aclose()
