"""The load generator: many concurrent SSE and WebSocket clients, cheap per event.

SSE clients speak HTTP/1.1 over raw asyncio streams (chunked decoding and
event splitting by hand, JSON only where a figure needs it), WebSocket clients
the protocol's frames by hand (a handshake without extensions, unmasked server
frames read with two `readexactly`s); both are far cheaper per event than a
general client library, so the load generator's core is not the bottleneck it
measures.

    python -m bench.load --url http://127.0.0.1:8080 --streams 200 --tokens 200 --rate 20 --seconds 10

runs a bounded load (half SSE, half WebSocket) and prints what it saw; the
benchmark suite (`python -m bench.run`) uses the functions below. The server's
model must be `bench.fastmodel` (`LLM_BASE_URL=http://127.0.0.1:9001/v1`): the
load asks for paced, time-stamped tokens with directives (`#tokens=`, `#rate=`,
`#stamp`) in its questions, which only that fake model understands.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import orjson

_ids = itertools.count(1)


def chat_id() -> str:
    return str(10**15 + next(_ids) + (time.time_ns() // 1000 % 10**9) * 10**6)


def request(content: str, **fields: object) -> dict:
    return {
        "userId": str(fields.pop("userId", "1")),
        "focusMode": "deepSeek",
        "message": {"chatId": chat_id(), "content": content},
        **fields,
    }


@dataclass
class StreamResult:
    events: int = 0
    tokens: int = 0
    answer: list[str] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    sent_ns: list[int] = field(default_factory=list)
    first_event_s: float = 0.0
    end: str = ""
    answer_id: str = ""


async def _sse_chunks(
    url: str, path: str, body: bytes | None, headers: dict[str, str] | None = None
) -> AsyncIterator[bytes]:
    """The decoded body chunks of a streamed HTTP/1.1 response."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port, limit=2**22)
    try:
        method = "POST" if body is not None else "GET"
        head = [f"{method} {path} HTTP/1.1", f"Host: {parts.netloc}", "Accept: text/event-stream"]
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))
        status_line = await reader.readline()
        if b" 200 " not in status_line:
            raise RuntimeError(f"server answered {status_line!r}")
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                chunked = True
        while True:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    return
                data = await reader.readexactly(size + 2)
                yield data[:-2]
            else:
                data = await reader.read(65536)
                if not data:
                    return
                yield data
    finally:
        writer.close()


async def sse_stream(
    url: str,
    body: dict,
    *,
    parse: bool = True,
    stamps: bool = False,
    path: str = "/api/chat/sse",
    headers: dict[str, str] | None = None,
    payload: bytes | None = None,
    stop_after: int = 0,
) -> StreamResult:
    """Read one SSE stream to its end (or `stop_after` events). With `parse`, decode
    every event (answer, seqs, latencies); else only count them."""
    result = StreamResult()
    started = time.perf_counter()
    buffer = b""
    data = payload if payload is not None else (orjson.dumps(body) if body else None)
    async for chunk in _sse_chunks(url, path, data, headers):
        if not result.first_event_s:
            result.first_event_s = time.perf_counter() - started
        if not parse:
            result.events += chunk.count(b"data: ")
            if b'"messageEnd"' in chunk or b'"type":"error"' in chunk:
                result.end = "messageEnd" if b'"messageEnd"' in chunk else "error"
            continue
        buffer += chunk
        *events, buffer = buffer.split(b"\n\n")
        now_ns = time.time_ns()
        for raw in events:
            # a block may open with `retry:` or a ping comment line (no block without data)
            while raw.startswith((b":", b"retry:")):
                raw = raw.partition(b"\n")[2]
            if not raw:
                continue
            event_id, _, data_line = raw.partition(b"\ndata: ")
            event = orjson.loads(data_line)
            result.events += 1
            result.seqs.append(int(event_id.rsplit(b":", 1)[1]))
            _account(result, event, now_ns, stamps)
            if stop_after and result.events >= stop_after:
                return result
    return result


def _account(result: StreamResult, event: dict, now_ns: int, stamps: bool) -> None:
    kind = event["type"]
    if not result.answer_id and "messageId" in event:
        result.answer_id = event["messageId"]
    if kind == "message" and event["data"]:
        result.tokens += 1
        result.answer.append(event["data"])
        if stamps:
            sent = int(event["data"][1:-1])
            result.sent_ns.append(sent)
            result.latencies_ms.append((now_ns - sent) / 1e6)
    elif kind in ("messageEnd", "error"):
        result.end = event.get("status", kind)


async def ws_stream(
    url: str, body: dict, *, stamps: bool = False, parse: bool = True
) -> StreamResult:
    result = StreamResult()
    reader, writer = await _ws_connect(url + "/api/chat/ws")
    try:
        async with contextlib.aclosing(_ws_frames(reader, writer)) as frames:
            await anext(frames)  # signal: open
            started = time.perf_counter()
            writer.write(_ws_frame(orjson.dumps(body)))
            async for frame in frames:
                if not result.first_event_s:
                    result.first_event_s = time.perf_counter() - started
                result.events += 1
                if not parse and b'"messageEnd"' not in frame and b'"error"' not in frame:
                    continue
                event = orjson.loads(frame)
                if "eventId" in event:
                    result.seqs.append(int(event["eventId"].rsplit(":", 1)[1]))
                _account(result, event, time.time_ns(), stamps)
                if event["type"] in ("messageEnd", "error"):
                    return result
        return result
    finally:
        writer.close()


async def _ws_connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A WebSocket client's handshake by hand (no extension asked for): a general
    client library parses every frame in Python and costs the load generator's core
    several times what the server's frames are measured at."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port, limit=2**24)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        (
            f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 101"):
        writer.close()
        status = head.partition(b"\r\n")[0]
        raise RuntimeError(f"server answered {status!r}")
    return reader, writer


def _ws_frame(payload: bytes, opcode: int = 0x1) -> bytes:
    """One final, masked client frame (the mask is zero: XOR with it changes nothing)."""
    size = len(payload)
    if size < 126:
        head = bytes([0x80 | opcode, 0x80 | size])
    elif size < 65536:
        head = bytes([0x80 | opcode, 0x80 | 126]) + size.to_bytes(2, "big")
    else:
        head = bytes([0x80 | opcode, 0x80 | 127]) + size.to_bytes(8, "big")
    return head + b"\0\0\0\0" + payload


async def _ws_frames(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> AsyncIterator[bytes]:
    """The server's text and binary messages (unmasked, as servers send them); a ping
    is answered, a close ends them."""
    message = b""
    while True:
        try:
            first, second = await reader.readexactly(2)
        except asyncio.IncompleteReadError:
            return
        size = second & 0x7F
        if size == 126:
            size = int.from_bytes(await reader.readexactly(2), "big")
        elif size == 127:
            size = int.from_bytes(await reader.readexactly(8), "big")
        payload = await reader.readexactly(size) if size else b""
        opcode = first & 0x0F
        if opcode == 0x8:
            return
        if opcode == 0x9:
            writer.write(_ws_frame(payload, 0xA))
            continue
        if opcode == 0xA:
            continue
        message += payload
        if first & 0x80:
            yield message
            message = b""


async def mixed_load(
    url: str,
    streams: int,
    tokens: int,
    rate: float,
    *,
    stamps: bool = True,
    ramp_seconds: float = 2.0,
) -> list[StreamResult]:
    """`streams` concurrent streams, half SSE and half WebSocket, started over
    `ramp_seconds`, each `tokens` tokens at `rate` tokens a second."""
    content = f"#tokens={tokens} #rate={rate:g}" + (" #stamp" if stamps else "")

    async def one(i: int) -> StreamResult:
        await asyncio.sleep(ramp_seconds * i / streams)
        body = request(content, userId=i + 1)
        if i % 2:
            return await ws_stream(url, body, stamps=stamps)
        return await sse_stream(url, body, stamps=stamps)

    return await asyncio.gather(*(one(i) for i in range(streams)))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", required=True)
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20)
    parser.add_argument("--seconds", type=float, default=10, help="upper bound on the run")
    args = parser.parse_args()

    async def run() -> list[StreamResult]:
        async with asyncio.timeout(args.seconds + args.tokens / args.rate + 30):
            return await mixed_load(args.url, args.streams, args.tokens, args.rate)

    results = asyncio.run(run())
    report(results, args.tokens)


def report(results: list[StreamResult], tokens: int) -> dict[str, float]:
    latencies = [x for r in results for x in r.latencies_ms]
    in_order = all(r.seqs == list(range(1, len(r.seqs) + 1)) for r in results)
    complete = sum(r.tokens == tokens and r.end == "completed" for r in results)
    summary = {
        "streams": len(results),
        "complete": complete,
        "in_order": float(in_order),
        "p50_ms": percentile(latencies, 0.5),
        "p99_ms": percentile(latencies, 0.99),
    }
    print(
        f"{complete}/{len(results)} streams complete, all in order: {in_order}, "
        f"added latency p50 {summary['p50_ms']:.1f} ms, p99 {summary['p99_ms']:.1f} ms"
    )
    return summary


if __name__ == "__main__":
    main()
