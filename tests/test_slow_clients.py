"""Slow, stuck and vanishing clients against a server with nothing in front: header
and body timeouts over raw sockets, connections per address, upgraded WebSockets, and
clients that stop reading while others go on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from typing import Any

import httpx
import orjson
import pytest

from app.config import ServerSettings
from app.main import create_app
from app.serving import open_connections
from tests.client import chat_body, sse_chat, wait_for
from tests.conftest import USER
from tests.servers import AppProcess, serve

pytestmark = pytest.mark.anyio


@contextlib.contextmanager
def guarded(settings, **server: Any):
    """The app served with the protocol of `server.*` settings (small timeouts)."""
    limits = ServerSettings(**server)
    with serve(create_app(settings), limits=limits) as running:
        yield running


def raw(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def health(sock: socket.socket) -> bytes:
    """Ask GET /healthz on a kept-alive socket; the whole answer."""
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(5)
    got = b""
    while b'{"status":"ok"}' not in got:
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed the socket within `seconds`, and what it sent."""
    sock.settimeout(seconds)
    got = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return True, got
            got += chunk
    except TimeoutError:
        return False, got
    except ConnectionResetError:
        return True, got


def test_half_a_header_block_is_closed_with_408(settings, fake_model):
    with guarded(settings, header_timeout_seconds=1.0) as running:
        with raw(running.port) as sock:
            sock.sendall(b"POST /api/chat/sse HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
            started = time.monotonic()
            closed, got = closed_within(sock, 5)
        assert closed and time.monotonic() - started < 3
        assert got.startswith(b"HTTP/1.1 408")


def test_a_connection_that_sends_nothing_is_closed(settings, fake_model):
    with guarded(settings, header_timeout_seconds=1.0) as running:
        with raw(running.port) as sock:
            closed, _ = closed_within(sock, 5)
        assert closed


@pytest.mark.parametrize("length", [b"1000", b"9223372036854775808"])
def test_a_body_that_stops_arriving_is_answered_408_and_closed(settings, fake_model, length):
    """As nginx's `client_body_timeout`: a 408 in the protocol's shape, then closed; a
    length past `limits.max_body_bytes` too (the server drains such a body before its
    413, and the client stopped sending it)."""
    with guarded(settings, body_timeout_seconds=1.0) as running:
        with raw(running.port) as sock:
            sock.sendall(
                b"POST /api/chat/sse HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %s\r\n\r\n" % length + b'{"type":"m'
            )
            started = time.monotonic()
            closed, got = closed_within(sock, 5)
        assert closed and time.monotonic() - started < 3
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"content-type: application/json" in head
        assert orjson.loads(body)["key"] == "BAD_REQUEST"


def test_a_slow_body_that_keeps_coming_is_served(settings, fake_model):
    """A body sent slowly but steadily (each piece within the timeout) is answered."""
    body = orjson.dumps(chat_body("slow upload #tokens=2"))
    with guarded(settings, body_timeout_seconds=1.0) as running:
        with raw(running.port) as sock:
            sock.sendall(
                b"POST /api/chat/sse HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body)
            )
            for i in range(0, len(body), 20):
                sock.sendall(body[i : i + 20])
                time.sleep(0.1)
            _, got = closed_within(sock, 5)
        assert got.startswith(b"HTTP/1.1 200") and b"messageEnd" in got


def test_a_kept_alive_connection_serves_request_after_request(settings, fake_model):
    with guarded(settings, header_timeout_seconds=1.0) as running:
        with raw(running.port) as sock:
            for _ in range(3):
                answer = health(sock)
                assert answer.startswith(b"HTTP/1.1 200"), answer
                time.sleep(1.5)  # idle between requests is not a slow header


def test_connections_per_address_are_capped(settings, fake_model):
    with guarded(settings, max_connections_per_address=5, trusted_proxies=()) as running:
        socks = [raw(running.port) for _ in range(5)]
        try:
            time.sleep(0.2)
            with raw(running.port) as sixth:
                closed, got = closed_within(sixth, 5)
            assert closed and got.startswith(b"HTTP/1.1 503") and b"too many connections" in got
            socks.pop().close()
            time.sleep(0.2)
            with raw(running.port) as again:
                assert health(again).startswith(b"HTTP/1.1 200")
        finally:
            for sock in socks:
                sock.close()


def test_a_trusted_proxy_is_not_capped(settings, fake_model):
    with guarded(
        settings, max_connections_per_address=2, trusted_proxies=("127.0.0.1",)
    ) as running:
        socks = [raw(running.port) for _ in range(4)]
        try:
            assert health(socks[-1]).startswith(b"HTTP/1.1 200")
        finally:
            for sock in socks:
                sock.close()


UPGRADE = (
    b"GET /api/chat/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


def websocket(port: int) -> socket.socket:
    """A raw socket upgraded to a WebSocket (its first frame, `signal`, is left unread)."""
    sock = raw(port)
    sock.sendall(UPGRADE)
    sock.settimeout(5)
    assert sock.recv(4096).startswith(b"HTTP/1.1 101 "), "not upgraded"
    return sock


def test_a_websocket_handshake_that_stops_mid_headers_is_closed_with_408(settings, fake_model):
    with guarded(settings, header_timeout_seconds=1.0) as running:
        with raw(running.port) as sock:
            sock.sendall(UPGRADE[: UPGRADE.index(b"Sec-WebSocket-Key")])
            started = time.monotonic()
            closed, got = closed_within(sock, 5)
        assert closed and time.monotonic() - started < 3
        assert got.startswith(b"HTTP/1.1 408") and b"did not arrive in time" in got  # the timer
        assert orjson.loads(got.split(b"\r\n\r\n", 1)[1])["key"] == "BAD_REQUEST"


@pytest.mark.parametrize(
    "line",
    [b"GET /api/chat/ws?format=" + b"9" * 9000, b"GET /api/chat/ws"],
    ids=["long-request-line", "long-header"],
)
def test_a_websocket_handshake_too_long_for_the_websocket_library_is_refused(
    settings, fake_model, line
):
    """A request line or header over the WebSocket library's 8 KiB (but under
    `server.max_header_bytes`) gets a JSON 431 and a close, not a silent connection."""
    long_header = b"" if b"?" in line else b"X-Long: " + b"y" * 9000 + b"\r\n"
    with guarded(settings) as running:
        with raw(running.port) as sock:
            sock.sendall(line + b" HTTP/1.1\r\n" + long_header + UPGRADE.split(b"\r\n", 1)[1])
            closed, got = closed_within(sock, 5)
    assert closed and got.startswith(b"HTTP/1.1 431"), got[:200]
    assert orjson.loads(got.split(b"\r\n\r\n", 1)[1])["key"] == "BAD_REQUEST"


def test_an_upgraded_websocket_gives_its_place_back_when_it_closes(settings, fake_model):
    """The count of an address's connections goes down when a WebSocket ends (its
    protocol, not the HTTP one, sees the end), so it never holds on to closed ones."""
    with guarded(settings, max_connections_per_address=3, trusted_proxies=()) as running:
        counted = open_connections(running.server.config)
        sockets = [websocket(running.port) for _ in range(3)]
        assert counted.count("127.0.0.1") == 3
        with raw(running.port) as fourth:
            closed, got = closed_within(fourth, 5)
        assert closed and got.startswith(b"HTTP/1.1 503")
        for sock in sockets:
            sock.close()
        deadline = time.monotonic() + 5
        while counted.hosts() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert counted.hosts() == 0, "a closed WebSocket is still counted"


@pytest.mark.parametrize("trusted", [("127.0.0.0/8",), ("*",), ("10.0.0.1", "::1", "127.0.0.1")])
def test_trusted_proxies_are_addresses_networks_or_anyone(settings, fake_model, trusted):
    with guarded(settings, max_connections_per_address=2, trusted_proxies=trusted) as running:
        socks = [raw(running.port) for _ in range(4)]
        try:
            assert health(socks[-1]).startswith(b"HTTP/1.1 200")
        finally:
            for sock in socks:
                sock.close()


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nBad\x00Header: 1\r\n\r\n",
        b"POST /api/chat/sse HTTP/1.1\r\nHost: x\r\nContent-Length: \xc2\xb2\r\n\r\n",
        b"POST /api/chat/sse HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
    ],
    ids=["garbage", "nul-in-a-header", "unicode-digit-length", "bad-chunk"],
)
def test_a_request_the_parser_cannot_read_is_a_json_400(settings, fake_model, request_bytes):
    with guarded(settings) as running:
        with raw(running.port) as sock:
            sock.sendall(request_bytes)
            closed, got = closed_within(sock, 5)
    assert closed and got.startswith(b"HTTP/1.1 400"), got
    head, body = got.split(b"\r\n\r\n", 1)
    assert b"content-type: application/json" in head.lower()
    assert orjson.loads(body) == {
        "type": "error",
        "key": "BAD_REQUEST",
        "data": "invalid HTTP request",
    }


def test_python_m_app_applies_its_timeouts_and_caps_from_the_environment(tmp_path):
    """The production path: `python -m app` reads `server.*` from the environment and
    serves with the protocols that apply them."""
    process = AppProcess(
        {
            "STORE_URL": f"sqlite:///{tmp_path}/p.db",
            "COLLECTIONS_URL": f"tantivy:///{tmp_path}/collections",
            "SERVER_HEADER_TIMEOUT_SECONDS": "1",
            "SERVER_MAX_CONNECTIONS_PER_ADDRESS": "3",
            "SERVER_TRUSTED_PROXIES": "",  # the test's own address is counted
        },
        args=("--demo",),
    ).start()
    try:
        with raw(process.port) as sock:  # half a header block, then nothing
            sock.sendall(b"POST /api/chat/sse HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
            started = time.monotonic()
            closed, got = closed_within(sock, 5)
        assert closed and time.monotonic() - started < 3, process.output()
        assert got.startswith(b"HTTP/1.1 408") and b"did not arrive in time" in got  # the timer

        # WebSockets: no header timeout holds them, the cap does
        sockets = [websocket(process.port) for _ in range(3)]
        try:
            with raw(process.port) as fourth:
                closed, got = closed_within(fourth, 5)
            assert closed and got.startswith(b"HTTP/1.1 503") and b"too many" in got
        finally:
            for sock in sockets:
                sock.close()
        time.sleep(0.3)
        with raw(process.port) as again:  # their places were given back
            assert health(again).startswith(b"HTTP/1.1 200")
    finally:
        process.stop()


async def others_go_on_and_the_stuck_answer_is_saved(http: httpx.AsyncClient, stuck: str) -> None:
    """Another chat streams at full speed meanwhile; the stuck one's generation still
    ends, and is saved whole."""
    await asyncio.sleep(0.5)
    started = time.monotonic()
    events = await sse_chat(http, chat_body("meanwhile #tokens=50", chatId=str(int(stuck) + 1)))
    assert events[-1].data["status"] == "completed"
    assert time.monotonic() - started < 1.0
    deadline = time.monotonic() + 20
    while True:
        answer = (await http.get(f"/api/chats/{stuck}")).json()["messages"][-1]
        if answer["status"] != "streaming" or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert answer["status"] == "completed"
    assert len(answer["content"]) == 4000 * 2000


async def test_a_stuck_client_does_not_slow_others_and_is_let_go(settings, fake_model):
    with serve(create_app(settings.replace(stream={"client_timeout_seconds": 1.0}))) as server:
        stuck = socket.create_connection(("127.0.0.1", server.port))
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = orjson.dumps(chat_body("huge #tokens=4000 #size=2000 #reasoning=0", chatId="970"))
        stuck.sendall(
            b"POST /api/chat/sse HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            + b"content-length: %d\r\n\r\n" % len(body)
            + body
        )  # ... and never reads
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
                await others_go_on_and_the_stuck_answer_is_saved(http, "970")
                for _ in range(50):  # let go within client_timeout_seconds of its last write
                    metrics = (await http.get("/metrics")).text
                    if 'searchchat_connections_active{transport="sse"} 0.0' in metrics:
                        break
                    await asyncio.sleep(0.1)
                assert 'searchchat_connections_active{transport="sse"} 0.0' in metrics
        finally:
            stuck.close()


def masked_text_frame(text: bytes) -> bytes:
    """A client's WebSocket text frame (clients mask theirs)."""
    mask = b"\x01\x02\x03\x04"
    n = len(text)
    header = b"\x81" + (bytes([0x80 | n]) if n < 126 else b"\xfe" + n.to_bytes(2, "big"))
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(text))


async def test_a_stuck_websocket_client_is_let_go_and_does_not_slow_others(
    settings, fake_model, caplog
):
    caplog.set_level(logging.INFO, logger="app")
    with serve(create_app(settings.replace(stream={"client_timeout_seconds": 1.0}))) as server:
        stuck = socket.create_connection(("127.0.0.1", server.port))
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.sendall(
            b"GET /api/chat/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"Sec-WebSocket-Version: 13\r\n\r\n"
        )
        assert b" 101 " in stuck.recv(4096).split(b"\r\n", 1)[0] + b" "
        body = chat_body("huge #tokens=4000 #size=2000 #reasoning=0", chatId="972")
        stuck.sendall(masked_text_frame(orjson.dumps(body)))  # ... and never reads again
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
                await others_go_on_and_the_stuck_answer_is_saved(http, "972")

                # let go within client_timeout_seconds (and a watch interval) of the stuck write
                async def let_go() -> bool:
                    return "closing a websocket that stopped reading" in caplog.text

                await wait_for(let_go, timeout=5)
        finally:
            stuck.close()


def test_a_websocket_text_frame_header_is_what_the_websocket_library_writes():
    """The frames a socket takes at once (`write_texts`) carry the header the
    `websockets` library would give them, at each length's boundary."""
    from websockets.frames import Frame, Opcode

    from app.serving import _text_head

    for length in (0, 1, 125, 126, 127, 65535, 65536, 70000):
        payload = b"x" * length
        assert _text_head(length) + payload == Frame(Opcode.TEXT, payload).serialize(mask=False)


@pytest.mark.parametrize("compression", [None, "deflate"])
async def test_websocket_frames_of_any_size_arrive_whole_with_or_without_compression(
    settings, fake_model, compression
):
    """Without compression an answer's frames are written at once; with
    permessage-deflate they go through the WebSocket library, which compresses them.
    Either way a client reads the same events, small and past 64 KiB."""
    from websockets.asyncio.client import connect

    with serve(create_app(settings)) as server:
        url = server.url.replace("http", "ws", 1) + "/api/chat/ws"
        async with connect(url, compression=compression, max_size=2**24) as ws:
            assert orjson.loads(await ws.recv())["data"] == "open"
            body = chat_body("big #tokens=4 #size=70000 #reasoning=0", chatId="973")
            await ws.send(orjson.dumps(body).decode())
            events = [orjson.loads(await ws.recv())]
            while events[-1]["type"] not in ("messageEnd", "error"):
                events.append(orjson.loads(await ws.recv()))
            assert ws.protocol.extensions if compression else not ws.protocol.extensions
    assert events[-1]["type"] == "messageEnd"
    text = "".join(e["data"] for e in events if e["type"] == "message")
    assert len(text) >= 4 * 70000 - 10
    seqs = [int(e["eventId"].rsplit(":", 1)[1]) for e in events if "eventId" in e]
    assert seqs == list(range(1, len(seqs) + 1))
