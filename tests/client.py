"""Test-side clients: read an SSE stream or a WebSocket conversation into events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson


@dataclass
class SseEvent:
    id: str | None
    data: dict[str, Any]

    @property
    def type(self) -> str:
        return self.data["type"]


async def iter_sse(response: httpx.Response) -> AsyncIterator[SseEvent | str]:
    """Events (and comment lines, as str) of an SSE response, as they arrive."""
    event_id, data = None, []
    async for line in response.aiter_lines():
        if line == "":
            if data:
                yield SseEvent(event_id, orjson.loads("\n".join(data)))
            event_id, data = None, []
        elif line.startswith(":"):
            yield line
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


async def sse_chat(
    client: httpx.AsyncClient, body: dict[str, Any], **kwargs: Any
) -> list[SseEvent]:
    """POST a chat request and read the whole stream (raises on a non-200)."""
    async with client.stream("POST", "/api/chat/sse", json=body, **kwargs) as response:
        assert response.status_code == 200, (response.status_code, await response.aread())
        return [e async for e in iter_sse(response) if isinstance(e, SseEvent)]


def chat_body(content: str, **fields: Any) -> dict[str, Any]:
    message = {"content": content}
    for key in ("chatId", "messageId"):
        if key in fields:
            message[key] = fields.pop(key)
    return {"type": "message", "userId": "1", "message": message, "focusMode": "deepSeek", **fields}


def answer_of(events: list[Any]) -> str:
    return "".join(
        e.data["data"] if hasattr(e, "data") else e["data"] for e in events if _type(e) == "message"
    )


def reasoning_of(events: list[Any]) -> str:
    return "".join(
        e.data["data"] if hasattr(e, "data") else e["data"]
        for e in events
        if _type(e) == "reasoning"
    )


def _type(e: Any) -> str:
    return e.type if hasattr(e, "type") else e["type"]


async def wait_for(predicate: Callable[[], Awaitable[Any]], timeout: float = 5.0) -> Any:
    """Poll `predicate` until it returns something true; AssertionError after `timeout`."""
    for _ in range(int(timeout / 0.02)):
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def read_events(stream: AsyncIterator[SseEvent | str], count: int) -> list[SseEvent]:
    """The next `count` events of a stream from `iter_sse` (fewer if it ends)."""
    got: list[SseEvent] = []
    async for item in stream:
        if isinstance(item, SseEvent):
            got.append(item)
            if len(got) == count:
                break
    return got


async def rest(stream: AsyncIterator[SseEvent | str]) -> list[SseEvent]:
    """Every remaining event of a stream from `iter_sse`."""
    return [item async for item in stream if isinstance(item, SseEvent)]


async def read_sse_events(client, body):
    async with client.stream("POST", "/api/chat/sse", json=body) as response:
        return await rest(iter_sse(response))
