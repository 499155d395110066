"""A kill -9 cuts `/v1` streams, which cannot resume: the sweeper on another process
saves each with at least what its client was shown."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from tests.client import wait_for
from tests.servers import processes

pytestmark = pytest.mark.anyio


async def shown_until_cut(response: httpx.Response, head: int) -> tuple[str, str]:
    """(the answer id, the text a /v1 client was shown before its server died)."""
    text, answer_id, seen = [], "", 0
    try:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            answer_id = chunk["id"].removeprefix("chatcmpl-")
            delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
            text.append(delta.get("content") or "")
            seen += 1
            if seen == head:
                return answer_id, "".join(text)
    except (httpx.HTTPError, httpx.StreamError):
        pass
    return answer_id, "".join(text)


async def test_v1_streams_cut_by_a_kill_are_saved_with_what_their_clients_saw(
    hosts_env, fake_model
):
    count = 12
    with processes(2, hosts_env) as (a, b):
        async with httpx.AsyncClient(timeout=30) as http:
            body = {
                "model": "deepSeek",
                "stream": True,
                "user": "7",
                "messages": [{"role": "user", "content": "long #tokens=3000 #delay=0.01"}],
            }
            async with contextlib_stack(http, a.url, body, count) as responses:
                heads = await asyncio.gather(*(shown_until_cut(r, 20) for r in responses))
                a.kill()
                tails = await asyncio.gather(*(shown_until_cut(r, 10**9) for r in responses))
            shown = {h[0]: h[1] + t[1] for h, t in zip(heads, tails, strict=True)}

            async def closed():
                chats = (await http.get(b.url + "/api/chats", params={"userId": "7"})).json()
                rows = {}
                for chat in chats["chats"]:
                    got = await http.get(b.url + f"/api/chats/{chat['id']}", params={"userId": "7"})
                    row = got.json()["messages"][-1]
                    if row["status"] == "streaming":
                        return None
                    rows[row["messageId"]] = row
                return rows if len(rows) == count else None

            rows = await wait_for(closed, timeout=30)
            for answer_id, text in shown.items():
                assert len(text) > 20
                assert rows[answer_id]["content"].startswith(text), answer_id


import contextlib  # noqa: E402


@contextlib.asynccontextmanager
async def contextlib_stack(http, url, body, count):
    async with contextlib.AsyncExitStack() as stack:
        responses = [
            await stack.enter_async_context(
                http.stream("POST", url + "/v1/chat/completions", json=body)
            )
            for _ in range(count)
        ]
        yield responses
