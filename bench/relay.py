"""The references for the paced benchmark, two minimal servers in one process:

* `POST /relay` — the least a Python server can do to relay a model's stream and
  still read it: the `openai` SDK's raw lines (`with_streaming_response`), each
  `data:` line decoded with orjson, its text sent on as an SSE event through a
  plain Starlette streaming response. It parses, but saves nothing, numbers
  nothing, registers nothing.
* `POST /passthrough` — a byte passthrough: aiohttp posts to the model and its
  body's bytes go out as they come, parsed by no one (how a proxy forwards).

    python -m bench.relay --port 9100 --model-url http://127.0.0.1:9001/v1
    POST /relay        {"content": "#tokens=500 #rate=20"}
    POST /passthrough  {"content": "#tokens=500 #rate=20"}
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
import openai
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route


def make_app(model_url: str) -> Starlette:
    client = openai.AsyncOpenAI(base_url=model_url, api_key="bench", max_retries=0)

    async def relay(request: Request) -> StreamingResponse:
        content = orjson.loads(await request.body())["content"]

        async def events() -> AsyncIterator[bytes]:
            async with client.chat.completions.with_streaming_response.create(
                model="m", messages=[{"role": "user", "content": content}], stream=True
            ) as response:
                async for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = orjson.loads(line[6:]).get("choices") or [{}]
                    text = (choices[0].get("delta") or {}).get("content")
                    if text:
                        yield b"data: " + orjson.dumps({"type": "message", "data": text}) + b"\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    session: aiohttp.ClientSession | None = None

    async def passthrough(request: Request) -> StreamingResponse:
        nonlocal session
        if session is None:
            session = aiohttp.ClientSession()
        content = orjson.loads(await request.body())["content"]
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": content}]}
        upstream = await session.post(model_url + "/chat/completions", json=body)

        async def forward() -> AsyncIterator[bytes]:
            try:
                async for data in upstream.content.iter_any():
                    yield data
            finally:
                upstream.release()

        return StreamingResponse(forward(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/relay", relay, methods=["POST"]),
            Route("/passthrough", passthrough, methods=["POST"]),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--model-url", required=True)
    args = parser.parse_args()
    uvicorn.run(
        make_app(args.model_url),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        http="httptools",
        loop="uvloop",
    )


if __name__ == "__main__":
    main()
