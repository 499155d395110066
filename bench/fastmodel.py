"""A fast fake OpenAI-compatible model for benchmarks: plain asyncio, no framework.

    python -m bench.fastmodel --port 9001

The tests' fake model (tests/fakes/model.py) is built for scripting failures;
this one is built to cost as little CPU per token as possible, so that a
benchmark measures the server and not its upstream. Directives in the last
user message:

    #tokens=N   N content tokens (default 100)
    #rate=R     R tokens a second per stream (default: as fast as it can)
    #stamp      each token is "t<send time in ns> " (for latency measurements)
    #tag=W      each token is "W.<i> " instead of "tok<i> " (an answer that can be told
                from every other: bench.soak checks no text of one lands in another)
    #wait=S     seconds before the first chunk

A streamed request's `max_tokens` (or `max_completion_tokens`) cuts its answer there,
ending with `finish_reason: "length"`, as a real model server does: the chat's title,
asked for in a few tokens with the question's directives in its prompt, is not
streamed as long as the answer was.

Non-streamed requests (title, rewrite) get a short fixed answer at once, and
`/v1/embeddings` requests a deterministic vector of `EMBEDDING_DIMS` floats per
input at once (so a benchmark of uploads measures the server, not a model).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import re
import time
from array import array

import orjson

DIRECTIVE = re.compile(rb"#(\w+)(?:=([\w.]+))?")
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
PREFIX = b'data: {"id":"x","object":"chat.completion.chunk","created":0,"model":"fast","choices":[{"index":0,"delta":{"content":'
SUFFIX = b'},"finish_reason":null}]}\n\n'
DONE = b'data: {"id":"x","object":"chat.completion.chunk","created":0,"model":"fast","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
CUT = DONE.replace(b'"finish_reason":"stop"', b'"finish_reason":"length"')
BATCH = 64  # tokens per write when streaming as fast as it can
EMBEDDING_DIMS = 1024  # as large as real embeddings models' (bge-m3, text-embedding-3-small…)


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def token(text: str) -> bytes:
    return PREFIX + orjson.dumps(text) + SUFFIX


COMPLETION = orjson.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": "fast",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "not_needed"},
                "finish_reason": "stop",
            }
        ],
    }
)


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            body = await reader.readexactly(length)
            if head.startswith(b"POST /v1/embeddings"):
                answer = embeddings(body)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(answer), answer)
                )
                await writer.drain()
                continue
            if b'"stream":true' not in body.replace(b" ", b""):
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(COMPLETION), COMPLETION)
                )
                await writer.drain()
                continue
            await stream(writer, body)
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()


def embeddings(body: bytes) -> bytes:
    """A vector per input: a few of its words' hashes set, the rest zero (cheap to make,
    and texts that share words come out alike)."""
    request = orjson.loads(body)
    inputs = request["input"]
    inputs = inputs if isinstance(inputs, list) else [inputs]
    packed = request.get("encoding_format") == "base64"  # as OpenAI answers it
    data = []
    for i, text in enumerate(inputs):
        vector = [0.0] * EMBEDDING_DIMS
        for word in str(text).lower().split()[:64]:
            vector[hash(word) % EMBEDDING_DIMS] += 1.0
        embedding = base64.b64encode(array("f", vector).tobytes()).decode() if packed else vector
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    return orjson.dumps({"object": "list", "data": data, "model": "fast-embed"})


async def stream(writer: asyncio.StreamWriter, body: bytes) -> None:
    request = orjson.loads(body)
    messages = request["messages"]
    last = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "").encode()
    script = {name.decode(): value.decode() for name, value in DIRECTIVE.findall(last)}
    asked = int(script.get("tokens") or 100)
    most = request.get("max_completion_tokens") or request.get("max_tokens") or asked
    tokens = min(asked, int(most))
    rate = float(script.get("rate") or 0)
    stamp = "stamp" in script
    word = script.get("tag", "")
    name = (lambda i: f"{word}.{i} ") if word else (lambda i: f"tok{i} ")
    writer.write(HEAD)
    if "wait" in script:
        await asyncio.sleep(float(script["wait"]))
    if rate:
        interval = 1.0 / rate
        start = time.monotonic()
        for i in range(tokens):
            text = f"t{time.time_ns()} " if stamp else name(i)
            writer.write(chunk(token(text)))
            await writer.drain()
            delay = start + (i + 1) * interval - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
    else:
        for first in range(0, tokens, BATCH):
            payload = b"".join(token(name(i)) for i in range(first, min(first + BATCH, tokens)))
            writer.write(chunk(payload))
            await writer.drain()
    writer.write(chunk(DONE if tokens == asked else CUT) + b"0\r\n\r\n")
    await writer.drain()


async def serve(host: str, port: int) -> None:
    server = await asyncio.start_server(handle, host, port, backlog=4096, limit=2**20)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001)
    args = parser.parse_args()
    try:
        from uvloop import run
    except ImportError:
        run = asyncio.run
    run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
