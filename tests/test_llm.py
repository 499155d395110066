"""The model client's stream, read under the SDK's transport or through it."""

from __future__ import annotations

import aiohttp
import pytest

import app.llm
from app.config import LLMSettings
from app.llm import LLMClient, body_reader

pytestmark = pytest.mark.anyio


async def deltas(client: LLMClient) -> list[tuple[str, str]]:
    messages = [{"role": "user", "content": "count #tokens=40 #reasoning=5"}]
    return [(d.kind, d.text) async for d in client.stream(messages)]  # type: ignore[arg-type]


async def test_the_stream_reads_under_the_sdk_and_gives_what_the_sdk_would(
    model_url, fake_model, monkeypatch
):
    client = LLMClient(LLMSettings(base_url=model_url, api_key=fake_model.api_key, model="m"))
    readers = []

    def recording(http):
        reader = body_reader(http)
        readers.append(reader)
        return reader

    monkeypatch.setattr(app.llm, "body_reader", recording)
    fast = await deltas(client)
    # the aiohttp response's own reader, not the SDK's layers over it
    assert isinstance(readers[0], aiohttp.streams.AsyncStreamIterator)

    monkeypatch.setattr(app.llm, "body_reader", lambda http: http.aiter_bytes())
    try:
        assert await deltas(client) == fast
    finally:
        await client.aclose()
    assert [kind for kind, _ in fast].count("reasoning") == 5
    assert "".join(text for kind, text in fast if kind == "content").count("tok") == 40
