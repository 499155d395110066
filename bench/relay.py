"""The references for the paced benchmark: two minimal servers in one process, and
a third with no framework at all (`--bare`):

* `POST /relay` — the least a Python server can do to relay a model's stream and
  still read it: the `openai` SDK's raw lines (`with_streaming_response`), each
  `data:` line decoded with orjson, its text sent on as an SSE event through a
  plain Starlette streaming response. It parses, but saves nothing, numbers
  nothing, registers nothing.
* `POST /passthrough` — a byte passthrough: aiohttp posts to the model and its
  body's bytes go out as they come, parsed by no one (how a proxy forwards).
* `--bare` (any path) — the least any relay that reads the model must do, with no
  framework: an `asyncio.Protocol` server on uvloop, one HTTP/1.1 connection
  upstream per stream (kept alive and reused), the response parsed by httptools,
  each `data:` line decoded with orjson and its text written on as one SSE event
  (chunked, numbered as the server numbers its events, and a last `messageEnd`) in
  the same callback that read it: no task, no queue, no wake-up between the
  model's socket and the client's.

    python -m bench.relay --port 9100 --model-url http://127.0.0.1:9001/v1
    POST /relay        {"content": "#tokens=500 #rate=20"}
    POST /passthrough  {"content": "#tokens=500 #rate=20"}
    python -m bench.relay --bare --port 9101 --model-url http://127.0.0.1:9001/v1
    POST /bare         {"content": "#tokens=500 #rate=20"}
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import httptools
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


BARE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)


class BareRelay:
    """The bare relay's shared part: where the model is, and its idle connections."""

    def __init__(self, model_url: str) -> None:
        parts = urlsplit(model_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.path = parts.path.rstrip("/") + "/chat/completions"
        self.idle: list[Upstream] = []

    async def start(self, client: asyncio.Transport, content: str) -> None:
        body = orjson.dumps(
            {"model": "m", "stream": True, "messages": [{"role": "user", "content": content}]}
        )
        upstream = None
        while self.idle and upstream is None:
            upstream = self.idle.pop()
            if upstream.transport is None or upstream.transport.is_closing():
                upstream = None
        if upstream is None:
            loop = asyncio.get_running_loop()
            _, upstream = await loop.create_connection(lambda: Upstream(self), self.host, self.port)
        upstream.relay_to(client)
        assert upstream.transport is not None
        upstream.transport.write(
            b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s"
            % (self.path.encode(), self.host.encode(), self.port, len(body), body)
        )


class Upstream(asyncio.Protocol):
    """One connection to the model; relays one response at a time to its client."""

    def __init__(self, relay: BareRelay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.client: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def relay_to(self, client: asyncio.Transport) -> None:
        self.client = client
        self.parser = httptools.HttpResponseParser(self)
        self.buffer = b""
        self.seq = 0

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        buffer = self.buffer + body
        if b"\n" not in body:
            self.buffer = buffer
            return
        *lines, self.buffer = buffer.split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            choices = orjson.loads(payload).get("choices") or [{}]
            text = (choices[0].get("delta") or {}).get("content")
            if text and self.client is not None:
                self.seq += 1
                event = b"id: bare:%d\ndata: %s\n\n" % (
                    self.seq,
                    orjson.dumps({"type": "message", "data": text}),
                )
                self.client.write(b"%x\r\n%s\r\n" % (len(event), event))

    def on_message_complete(self) -> None:
        if self.client is not None:
            self.seq += 1
            event = b'id: bare:%d\ndata: {"type":"messageEnd","status":"completed"}\n\n' % self.seq
            self.client.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
            self.client = None
        self.relay.idle.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.client is not None:
            self.client.close()
        self.client = self.transport = None


class Downstream(asyncio.Protocol):
    """One client: reads a request (`{"content": ...}`), answers with the relayed
    stream."""

    def __init__(self, relay: BareRelay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.transport is None:
            return
        length = 0
        for line in self.buffer[:end].split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        if len(self.buffer) < end + 4 + length:
            return
        body, self.buffer = self.buffer[end + 4 : end + 4 + length], self.buffer[end + 4 + length :]
        self.transport.write(BARE_HEAD)
        asked = orjson.loads(body)  # {"content": …}, or a chat request's {"message": {…}}
        content = asked["content"] if "content" in asked else asked["message"]["content"]
        task = asyncio.ensure_future(self.relay.start(self.transport, content))
        task.add_done_callback(
            lambda t: t.exception() and self.transport and self.transport.close()
        )


async def serve_bare(port: int, model_url: str) -> None:
    relay = BareRelay(model_url)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Downstream(relay), "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--model-url", required=True)
    parser.add_argument("--bare", action="store_true", help="the bare relay, no framework")
    args = parser.parse_args()
    if args.bare:
        import uvloop

        uvloop.run(serve_bare(args.port, args.model_url))
        return
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
