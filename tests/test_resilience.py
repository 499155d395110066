"""Tests that try to break it: fuzzed input, upstream faults, abrupt and stuck clients,
Redis going away — always a well-formed answer, nothing leaked, nothing lost."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from typing import Any
from urllib.parse import quote

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from app.errors import BadRequest
from app.main import create_app
from app.protocol import loads, parse_chat_request
from tests.client import SseEvent, chat_body, iter_sse, sse_chat, wait_for
from tests.conftest import USER, RedisServer
from tests.servers import serve

pytestmark = pytest.mark.anyio

KEYS = (
    "BAD_REQUEST",
    "UNAUTHORIZED",
    "FORBIDDEN",
    "RATE_LIMITED",
    "NOT_FOUND",
    "CHAT_ERROR",
    "STREAM_ERROR",
    "SEARCH_ERROR",
    "CONFIG_ERROR",
    "INTERNAL",
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)
request_like = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "cancel", "resume", "ping", "other"]) | json_values,
        "userId": st.sampled_from(["1", "0", "-1", "x", 2**64, "007"]) | json_values,
        "message": st.fixed_dictionaries(
            {},
            optional={
                "content": st.text(max_size=60) | json_values,
                "chatId": json_values,
                "messageId": json_values,
            },
        )
        | json_values,
        "focusMode": st.sampled_from(["webSearch", "deepSeek", "nope"]) | json_values,
        "optimizationMode": st.sampled_from(["speed", "quality", "x"]) | json_values,
        "copilotEnabled": json_values,
        "history": st.lists(st.lists(st.text(max_size=10), max_size=3), max_size=3) | json_values,
        "format": st.sampled_from(["default", "simple", "xml"]) | json_values,
        "files": json_values,
    },
)


@given(body=request_like | json_values)
@hyp_settings(max_examples=400, deadline=None)
def test_the_parser_accepts_or_refuses_with_bad_request_and_nothing_else(body):
    try:
        request = parse_chat_request(body, max_content_chars=100, max_history_messages=5)
    except BadRequest as exc:
        assert exc.message
        return
    assert request.content.strip() and request.focus_mode and request.user_id.isdigit()


@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
@hyp_settings(max_examples=300, deadline=None)
def test_decoding_any_bytes_is_json_or_bad_request(raw):
    try:
        loads(raw)
    except BadRequest:
        pass


def check_answer(response: httpx.Response) -> None:
    """A well-formed answer: a JSON error with a known key, or a stream that ends."""
    if response.status_code == 200:
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [
            orjson.loads(line[5:])
            for line in response.text.splitlines()
            if line.startswith("data:")
        ]
        assert data[-1]["type"] in ("messageEnd", "error", "complete")
    else:
        body = response.json()
        assert body["type"] == "error" and body["key"] in KEYS and body["data"]
        assert response.status_code in (400, 403, 404, 413, 429, 503)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, fake_model_server, fake_search_server):
    from app.config import Settings

    model, model_thread = fake_model_server
    search, _ = fake_search_server
    settings = Settings().replace(
        llm={"base_url": model_thread.url + "/v1", "api_key": model.api_key, "model": "m"},
        store={"url": f"sqlite:///{tmp_path_factory.mktemp('fuzz')}/fuzz.db"},
        tavily={"api_key": search.api_key, "base_url": search.base_url + "/tavily"},
        reader={"base_url": search.base_url + "/jina"},
        limits={"max_concurrent_generations": 0, "ws_messages_per_second": 0},
    )
    with serve(create_app(settings)) as server:
        yield server


fuzz_bodies = request_like.map(lambda b: json.dumps(b).encode()) | st.binary(max_size=300)


@given(raw=fuzz_bodies)
@hyp_settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_the_sse_endpoint_always_answers_well_formed(fuzz_server, raw):
    with httpx.Client(base_url=fuzz_server.url, timeout=20) as http:
        check_answer(http.post("/api/chat/sse", content=raw))
        assert http.get("/healthz").status_code == 200


@given(
    frames=st.lists(fuzz_bodies | st.text(max_size=100).map(str.encode), min_size=1, max_size=6),
    binary=st.booleans(),
)
@hyp_settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_the_websocket_survives_any_frames(fuzz_server, frames, binary):
    from httpx_ws import connect_ws

    with (
        httpx.Client(timeout=20) as http,
        connect_ws(fuzz_server.ws_url + "/api/chat/ws", http) as ws,
    ):
        assert orjson.loads(ws.receive_text())["type"] == "signal"
        for raw in frames:
            if binary:
                ws.send_bytes(raw)
            else:
                try:
                    ws.send_text(raw.decode())
                except UnicodeDecodeError:
                    ws.send_bytes(raw)
        ws.send_text('{"type": "ping"}')
        while True:  # every frame gets an answer; the ping's comes once the socket has caught up
            frame = orjson.loads(ws.receive_text())
            if frame == {"type": "pong"}:
                break
            assert "type" in frame
            if frame["type"] == "error":
                assert frame["key"] in KEYS


async def _state(app):
    service = app.state.service
    return {
        "generations": service.running(),
        "claims": len(service.hub.local.running()),
        "tasks": len(asyncio.all_tasks()),
    }


async def settled(server, baseline_tasks, timeout=10.0):
    """Wait until nothing runs on the server beyond what it ran when idle."""
    deadline = time.monotonic() + timeout
    while True:
        state = server.call(_state(server.app))
        if (state["generations"], state["claims"]) == (0, 0) and state["tasks"] <= baseline_tasks:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"leaked: {state} (idle tasks: {baseline_tasks})")
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("directive", "key"),
    [
        ("#fail=500", "STREAM_ERROR"),
        ("#fail=503", "STREAM_ERROR"),
        ("#fail=429", "STREAM_ERROR"),
        ("#break=3", "STREAM_ERROR"),
        ("#malformed=3", "STREAM_ERROR"),
        ("#empty", "STREAM_ERROR"),
        ("#tokens=3 #delay=1.5", "STREAM_ERROR"),  # read timeout between tokens
    ],
)
async def test_upstream_faults_end_cleanly_with_nothing_leaked(
    settings, fake_model, directive, key
):
    with serve(create_app(settings.replace(llm={"read_timeout_seconds": 0.5}))) as server:
        idle = server.call(_state(server.app))["tasks"]
        async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
            events = await sse_chat(http, chat_body(f"q {directive}", chatId="960"))
            assert events[-1].type == "error" and events[-1].data["key"] == key
            answer = (await http.get("/api/chats/960")).json()["messages"][-1]
            assert answer["status"] == "failed"
            await settled(server, idle + 2)  # the title chore may still be finishing
    for record in fake_model.streams:
        assert record.outcome != "open"


async def test_a_429_before_the_first_token_is_retried_once(client, fake_model):
    events = await sse_chat(client, chat_body("q #flaky=429"))
    assert events[-1].data["status"] == "completed"
    assert len(fake_model.streamed_requests()) == 2


async def test_a_model_that_never_answers_times_out(settings, fake_model):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never says a word
    port = silent.getsockname()[1]
    try:
        mute = settings.replace(
            llm={"base_url": f"http://127.0.0.1:{port}/v1", "read_timeout_seconds": 0.5}
        )
        with serve(create_app(mute)) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
                started = time.monotonic()
                events = await sse_chat(http, chat_body("q"))
                assert time.monotonic() - started < 5
        assert events[-1].data["key"] == "CHAT_ERROR" and "in time" in events[-1].data["data"]
    finally:
        silent.close()


async def test_two_hundred_abrupt_disconnects_leak_nothing(settings, fake_model):
    uncapped = settings.replace(limits={"max_concurrent_generations": 0})
    with serve(create_app(uncapped)) as server:
        await _two_hundred_abrupt_disconnects(server)


async def _two_hundred_abrupt_disconnects(server):
    idle = server.call(_state(server.app))["tasks"]
    async with httpx.AsyncClient(
        base_url=server.url,
        timeout=30,
        limits=httpx.Limits(max_connections=60),
        event_hooks=USER,
    ) as http:

        async def hang_up(i):
            body = chat_body(f"q{i} #tokens=30 #delay=0.01 #reasoning=0", chatId=str(10_000 + i))
            async with http.stream("POST", "/api/chat/sse", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if '"data":"tok1 "' in line:
                        return  # drop the connection mid-answer
            raise AssertionError("the answer ended before the client hung up")

        for start in range(0, 200, 50):
            await asyncio.gather(*(hang_up(i) for i in range(start, start + 50)))
        state = await settled(server, idle + 2, timeout=30)
        assert state["generations"] == 0
        metrics = (await http.get("/metrics")).text
        assert 'searchchat_connections_active{transport="sse"} 0.0' in metrics
        saved = (await http.get("/api/chats/10199")).json()["messages"][-1]
        assert saved["status"] == "completed"  # each kept going after its client left
        assert saved["content"].endswith("tok29 ")


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


async def test_redis_down_refuses_new_work_clearly_then_recovers(settings, fake_model):
    redis = RedisServer()
    app = create_app(settings.replace(redis={"url": redis.url}, stream={"flush_interval_ms": 10}))
    with redis, serve(app) as running:
        redis.stop()
        # redis is gone: a running stream was not there, but new ones are refused clearly
        async with httpx.AsyncClient(base_url=running.url, timeout=20, event_hooks=USER) as http:
            refused = await http.post("/api/chat/sse", json=chat_body("q"))
            assert refused.status_code == 503 and refused.json()["key"] == "INTERNAL"
            assert "registry is unavailable" in refused.json()["data"]
            assert "127.0.0.1" not in refused.text and "Error" not in refused.text
            cancel = await http.post("/api/chat/cancel", json={"chatId": "1", "userId": "1"})
            assert cancel.status_code == 503
        redis.start()
        async with httpx.AsyncClient(base_url=running.url, timeout=20, event_hooks=USER) as http:
            # Redis came back empty: new work waits (503 + Retry-After) until every owner
            # has had time to re-assert what it runs
            async def accepted():
                ready = await http.get("/readyz")
                probe = await http.post("/api/chat/sse", json=chat_body("probe #tokens=1"))
                if probe.status_code == 503:
                    assert probe.headers["retry-after"].isdigit()
                    assert "recovering" in probe.json()["data"], probe.text
                return ready.status_code == 200 and probe.status_code == 200

            await wait_for(accepted, timeout=15)
            async with http.stream(
                "POST",
                "/api/chat/sse",
                json=chat_body("long #tokens=200 #delay=0.01", chatId="980"),
            ) as response:
                stream = iter_sse(response)
                async for item in stream:
                    if isinstance(item, SseEvent) and item.type == "message" and item.data["data"]:
                        break
                assert (
                    await http.post("/api/chat/cancel", json={"chatId": "980", "userId": "1"})
                ).status_code == 200
                tail = [e async for e in stream if isinstance(e, SseEvent)]
            assert tail[-1].data["status"] == "cancelled"


async def test_streams_continue_while_redis_restarts(settings, fake_model):
    redis = RedisServer()
    app = create_app(settings.replace(redis={"url": redis.url}, stream={"flush_interval_ms": 10}))
    with redis, serve(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
            async with http.stream(
                "POST",
                "/api/chat/sse",
                json=chat_body("long #tokens=150 #delay=0.02", chatId="990"),
            ) as response:
                events = []
                async for item in iter_sse(response):
                    if isinstance(item, SseEvent):
                        events.append(item)
                        if len(events) == 10:
                            redis.stop()  # redis stops mid-answer
                        if len(events) == 60:
                            redis.start()  # ... and comes back
            assert events[-1].data["status"] == "completed"
            assert "".join(e.data["data"] for e in events if e.type == "message") == "".join(
                f"tok{i} " for i in range(150)
            )
            # once back, the generation can still be resumed here (Redis lost what it held)
            await asyncio.sleep(0.5)
            replay = await http.get("/api/chat/sse/resume", params={"chatId": "990"})
            assert replay.status_code == 200
            assert replay.text.count("data:") == len(events)


async def test_a_model_that_cannot_be_connected_to_times_out(settings, fake_model):
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)  # a backlog that is full at once: further SYNs go unanswered
    port = full.getsockname()[1]
    fillers = []
    for _ in range(4):  # fill the accept queue; connections that never get accepted
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    try:
        hanging = settings.replace(
            llm={"base_url": f"http://127.0.0.1:{port}/v1", "connect_timeout_seconds": 0.5}
        )
        with serve(create_app(hanging)) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
                started = time.monotonic()
                events = await sse_chat(http, chat_body("q"))
                elapsed = time.monotonic() - started
        assert events[-1].data["key"] == "CHAT_ERROR" and "in time" in events[-1].data["data"]
        assert elapsed < 5
    finally:
        for filler in fillers:
            filler.close()
        full.close()


async def test_a_postgres_restart_mid_generation_loses_nothing(settings, fake_model):
    from tests.conftest import PostgresServer, new_database

    postgres = PostgresServer()
    postgres.start()
    try:
        store_url = new_database(postgres.url)
        with serve(create_app(settings.replace(store={"url": store_url}))) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
                async with http.stream(
                    "POST",
                    "/api/chat/sse",
                    json=chat_body("long #tokens=60 #delay=0.02", chatId="995"),
                ) as response:
                    events = []
                    async for item in iter_sse(response):
                        if isinstance(item, SseEvent):
                            events.append(item)
                            if len(events) == 5:
                                postgres.stop()  # the database restarts mid-answer ...
                                postgres.start()
                assert events[-1].data["status"] == "completed"  # ... and the answer is saved
                answer = (await http.get("/api/chats/995")).json()["messages"][-1]
                assert answer["status"] == "completed"
                assert answer["content"] == "".join(f"tok{i} " for i in range(60))
    finally:
        postgres.remove()


#: query and header values as hostile clients send them: Unicode digits, huge numbers,
#: NUL, separators, long runs
hostile_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        ["²", "١٢", "1:²", "9" * 40, "-1", "1e999", "nan", "\x00", "%00", ":", "a:b:c"]
    ),
    st.integers().map(str),
)


@given(limit=hostile_text, since=hostile_text, chat=hostile_text, last=hostile_text)
@hyp_settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_query_parameters_and_headers_never_make_a_500(fuzz_server, limit, since, chat, last):
    with httpx.Client(base_url=fuzz_server.url, timeout=20) as http:
        answers = [
            http.get("/api/chats", params={"limit": limit, "userId": "1"}),
            http.get("/api/usage", params={"since": since, "userId": "1"}),
            http.get("/api/chat/sse/resume", params={"chatId": chat, "lastEventId": last}),
            http.get(f"/sources/{quote(chat, safe='') or 'x'}", params={"sig": last}),
            http.get(f"/api/chats/{quote(chat, safe='') or 'x'}", params={"userId": limit}),
        ]
        header = last.replace("\x00", "").encode("utf-8", "replace")
        if all(32 <= b < 127 for b in header):  # what a header can carry
            answers.append(
                http.get(
                    "/api/chat/sse/resume",
                    params={"chatId": "c1"},
                    headers={"last-event-id": header.decode()},
                )
            )
        for answer in answers:
            assert answer.status_code < 500, (answer.request.url, answer.status_code, answer.text)
            if answer.status_code >= 400:
                assert answer.json()["type"] == "error", answer.text


# -- headers and query parameters, over raw sockets, with auth off and on ------------------------

#: hostile values for any header or query parameter: the above, plus huge ones, NULs,
#: control characters and Unicode digits (sent as their UTF-8 bytes)
hostile_value = st.one_of(
    hostile_text,
    st.sampled_from(
        [
            "",
            " ",
            "Bearer ",
            "Bearer \x00",
            "bearer ²",
            "Basic Zm9vOmJhcg==",
            "a=1; a=2; =; ;;",
            "session=" + "A" * 5000,
            "null",
            "http://evil.example",
            "https://evil.example:99999",
            "application/json; charset=\x00",
            "text/plain",
            "multipart/form-data; boundary=",
            "1, 2",
            "-5",
            "0x10",
            "٣",
            "9" * 5000,
            "x" * 20000,
            "\r\nX-Injected: 1",
            "1.2.3.4, ²",
            "::1, 999.999.999.999",
        ]
    ),
)
#: the fuzzed headers, each with a value a client would send (the key of the server
#: with auth on): a request has each left out, as a client sends it, or hostile
FUZZED_HEADERS = {
    "authorization": "Bearer fuzz-key",
    "cookie": "theme=dark",
    "origin": "http://127.0.0.1",
    "content-type": "application/json",
    "x-forwarded-for": "203.0.113.7",
}
CHAT = orjson.dumps(chat_body("fuzz #tokens=1 #reasoning=0"))


@pytest.fixture(scope="module")
def fuzz_servers(tmp_path_factory, fake_model_server, fake_search_server):
    """The fuzzed server with auth off, and with accounts (and a static key) on; short
    header and body timeouts, so a request that claims more than it sends ends soon."""
    from app.config import ServerSettings, Settings

    model, model_thread = fake_model_server
    search, _ = fake_search_server
    folder = tmp_path_factory.mktemp("fuzz-raw")
    base = Settings().replace(
        llm={"base_url": model_thread.url + "/v1", "api_key": model.api_key, "model": "m"},
        tavily={"api_key": search.api_key, "base_url": search.base_url + "/tavily"},
        reader={"base_url": search.base_url + "/jina"},
        limits={"max_concurrent_generations": 0, "ws_messages_per_second": 0},
        collections={"url": f"tantivy:///{folder}/collections"},
    )
    limits = ServerSettings(header_timeout_seconds=2.0, body_timeout_seconds=0.5)
    off = base.replace(store={"url": f"sqlite:///{folder}/off.db"})
    on = base.replace(
        store={"url": f"sqlite:///{folder}/on.db"},
        auth={"mode": "accounts", "api_keys": {"fuzz-key": "1"}},
    )
    with (
        serve(create_app(off), limits=limits) as without,
        serve(create_app(on), limits=limits) as with_auth,
    ):
        yield {"off": without, "on": with_auth}


def _bytes(value: str) -> bytes:
    return value.encode("utf-8", "surrogatepass")


def exchange(port: int, request: bytes) -> tuple[int, dict[bytes, bytes], bytes] | None:
    """Send one request (`connection: close`) and read the answer to its end: status,
    headers, body (de-chunked); None when the server closed without a word."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it was all sent (a 431): its answer is read below
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
    if not got:
        return None
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if headers.get(b"transfer-encoding") == b"chunked":
        body = dechunked(body)
    return status, headers, body


def dechunked(body: bytes) -> bytes:
    out = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, body = out + rest[:size], rest[size + 2 :]
    return out


def claims_more_than_it_sends(length: str | None, body: bytes) -> bool:
    """A Content-Length the parser takes that is larger than the body sent: the server
    rightly waits for the rest (and closes at its body timeout)."""
    text = length.strip() if length is not None else ""
    return text.isascii() and text.isdigit() and len(body) < int(text) < 2**63


def check_raw_answer(answer: tuple[int, dict[bytes, bytes], bytes] | None, path: str) -> None:
    """A well-formed answer: never a 500, and every refusal JSON in the protocol's shape
    (OpenAI's under /v1/, where the server's own refusals of the connection are ours)."""
    assert answer is not None, f"{path}: closed without an answer"
    status, headers, body = answer
    assert status != 500 and 200 <= status < 600, (path, status, body[:300])
    if status < 400:
        return
    assert headers.get(b"content-type", b"").startswith(b"application/json"), (path, status, body)
    parsed = orjson.loads(body)
    if "error" in parsed and path.startswith("/v1/"):
        assert parsed["error"]["message"], parsed
    else:
        assert parsed["type"] == "error" and parsed["key"] in KEYS and parsed["data"], parsed


def raw_request(
    method: str,
    target: bytes,
    headers: dict[str, str | None],
    body: bytes = b"",
    length: str | None = None,
) -> bytes:
    lines = [b"%s %s HTTP/1.1" % (method.encode(), target), b"host: fuzz"]
    for name, value in headers.items():
        if value is not None:
            lines.append(name.encode() + b": " + _bytes(value))
    if method == "POST":
        lines.append(
            b"content-length: " + (_bytes(length) if length is not None else b"%d" % len(body))
        )
    lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def query(raw: bool, **params: str) -> bytes:
    """A query string of `params`: percent-encoded, or (`raw`) their bytes as they are
    (a request line the parser may refuse)."""
    if raw:
        return b"&".join(k.encode() + b"=" + _bytes(v) for k, v in params.items())
    return "&".join(f"{k}={quote(v, safe='')}" for k, v in params.items()).encode()


@given(
    auth=st.sampled_from(["off", "on"]),
    headers=st.fixed_dictionaries(
        {
            name: st.one_of(st.none(), st.just(usual), hostile_value)
            for name, usual in FUZZED_HEADERS.items()
        }
    ),
    length=st.one_of(st.none(), st.none(), hostile_value),
    params=st.fixed_dictionaries(
        {
            name: hostile_value
            for name in ("format", "token", "chatModel", "starting_after", "stream", "sig")
        }
    ),
    raw_query=st.booleans(),
    body=st.one_of(st.just(CHAT), st.sampled_from([b"", b"{}"]), st.binary(max_size=60)),
)
@hyp_settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_hostile_headers_and_query_parameters_get_well_formed_answers(
    fuzz_servers, auth, headers, length, params, raw_query, body
):
    """Authorization, Cookie, Origin, Content-Type, Content-Length and X-Forwarded-For
    with any value, and the query parameters routes read (`format`, `token`,
    `chatModel`, `starting_after`, `stream`, `sig`), on every kind of route, auth off and
    on: a JSON refusal or an answer, never a 500, a plain-text page or silence."""
    port = fuzz_servers[auth].port
    p = params
    posts = [
        ("/api/chat/sse", query(raw_query, format=p["format"], chatModel=p["chatModel"])),
        ("/v1/chat/completions", b""),
    ]
    for path, qs in posts:
        target = path.encode() + (b"?" + qs if qs else b"")
        answer = exchange(port, raw_request("POST", target, headers, body, length))
        if answer is None and claims_more_than_it_sends(length, body):
            continue
        check_raw_answer(answer, path)
    gets = [
        (
            "/api/chat/sse/resume",
            query(raw_query, chatId="c1", format=p["format"], token=p["token"]),
        ),
        (
            "/v1/responses/resp_fuzz",
            query(raw_query, stream=p["stream"], starting_after=p["starting_after"]),
        ),
        ("/sources/1", query(raw_query, token=p["token"], sig=p["sig"])),
        ("/api/collections/1/imports/2", query(raw_query, stream=p["stream"])),
        ("/api/chats", query(raw_query, limit=p["starting_after"], token=p["token"])),
    ]
    get_headers = {k: v for k, v in headers.items() if k != "content-type"}
    for path, qs in gets:
        answer = exchange(port, raw_request("GET", path.encode() + b"?" + qs, get_headers))
        check_raw_answer(answer, path)


@given(
    auth=st.sampled_from(["off", "on"]),
    params=st.fixed_dictionaries(
        {name: hostile_value for name in ("token", "format", "chatModel")}
    ),
)
@hyp_settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_hostile_websocket_query_parameters_get_error_frames(fuzz_servers, auth, params):
    """`token`, `format` and `chatModel` of a WebSocket's URL, with any value: the socket
    opens, and says what is wrong in an error frame (then closes, for a bad token) — or,
    for a handshake too large to read, is refused with a JSON 431."""
    from httpx_ws import WebSocketUpgradeError, connect_ws

    server = fuzz_servers[auth]
    with httpx.Client(timeout=20) as http:
        url = server.ws_url + "/api/chat/ws?" + query(False, **params).decode()
        try:
            with connect_ws(url, http) as ws:
                _chat_over(ws)
        except WebSocketUpgradeError as refused:
            answer = refused.response
            assert answer.status_code == 431, answer.status_code
            assert answer.headers["content-type"] == "application/json"


def _chat_over(ws: Any) -> None:
    """Ask one question over an open WebSocket: every frame JSON, an error frame with a
    known key (never INTERNAL), until its end; a close after an error frame is fine."""
    from httpx_ws import WebSocketDisconnect

    try:
        first = orjson.loads(ws.receive_text())
        assert first["type"] in ("signal", "error"), first
        if first["type"] == "error":
            assert first["key"] in KEYS
            return
        ws.send_text(CHAT.decode())
        while True:
            frame = orjson.loads(ws.receive_text())
            assert "type" in frame
            if frame["type"] == "error":
                assert frame["key"] in KEYS and frame["key"] != "INTERNAL", frame
                return
            if frame["type"] == "messageEnd":
                return
    except WebSocketDisconnect:
        pass  # refused (a bad token): its error frame came first


@given(value=st.none() | hostile_value | st.text(alphabet="/\\\t\r\n .:@%2fFeE", max_size=20))
@hyp_settings(max_examples=300, deadline=None)
def test_where_a_sign_in_goes_next_is_always_this_server(value):
    """`?next=` of a sign-in, whatever it holds, sends the browser to a path of this
    server: the redirect as Starlette writes it, read as a browser reads it (tabs and
    newlines dropped, backslashes as slashes)."""
    from urllib.parse import urljoin, urlsplit

    from starlette.responses import RedirectResponse

    from app.transport.auth_routes import _next

    location = RedirectResponse(_next(value)).headers["location"]
    as_read = location.translate({9: None, 10: None, 13: None}).replace("\\", "/")
    assert urlsplit(urljoin("https://chat.example/signin", as_read)).netloc == "chat.example"
