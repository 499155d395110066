"""Hostile and malformed input, fuzzed and hand-made: request bodies, WebSocket
frames, headers and query parameters over raw sockets, routes that fail — always a
well-formed answer in the protocol's shape, never a 500."""

from __future__ import annotations

import json
import socket
from typing import Any
from urllib.parse import quote

import httpx
import orjson
import pytest
from httpx_ws import aconnect_ws
from hypothesis import HealthCheck, example, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from app.errors import BadRequest
from app.main import create_app
from app.protocol import loads, parse_chat_request
from tests.client import chat_body
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
@example(limit="", since="", chat=".", last="")  # a dot segment
@example(limit="", since="", chat="..", last="")
@hyp_settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_query_parameters_and_headers_never_make_a_500(fuzz_server, limit, since, chat, last):
    # "." and ".." as a path segment are dot segments the client removes: escaped, they
    # reach the server as the id they are
    segment = quote(chat, safe="").replace(".", "%2E") or "x"
    with httpx.Client(base_url=fuzz_server.url, timeout=20) as http:
        answers = [
            http.get("/api/chats", params={"limit": limit, "userId": "1"}),
            http.get("/api/usage", params={"since": since, "userId": "1"}),
            http.get("/api/chat/sse/resume", params={"chatId": chat, "lastEventId": last}),
            http.get(f"/sources/{segment}", params={"sig": last}),
            http.get(f"/api/chats/{segment}", params={"userId": limit}),
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
        # one that claims more body than it sends is answered 408 at the body timeout
        answer = exchange(port, raw_request("POST", target, headers, body, length))
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


async def test_unicode_digits_are_a_400_not_a_500(server, fake_model):
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        listed = await http.get("/api/chats", params={"limit": "²", "userId": "1"})
        assert listed.status_code == 400 and listed.json()["key"] == "BAD_REQUEST"
        async with aconnect_ws(server.ws_url + "/api/chat/ws", http) as ws:
            await ws.receive_text()
            await ws.send_text(
                orjson.dumps({"type": "resume", "chatId": "c1", "lastEventId": "1:²"}).decode()
            )
            frame = orjson.loads(await ws.receive_text())
    assert frame["type"] == "error" and frame["key"] == "BAD_REQUEST", frame


async def test_a_bug_in_any_route_still_answers_in_its_protocols_shape(
    settings, fake_model, monkeypatch
):
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr("app.transport.api.choose_provider", broken)
    monkeypatch.setattr("app.transport.openai.model_ids", broken)
    with serve(create_app(settings)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=10) as http:
            config = await http.get("/api/config")
            models = await http.get("/v1/models")
    assert config.status_code == 500
    assert config.json() == {"type": "error", "key": "INTERNAL", "data": "internal error"}
    assert models.status_code == 500 and models.json()["error"]["message"] == "internal error"


async def test_an_unknown_route_answers_in_its_protocols_shape(client):
    for path in ("/api/nope", "/api/chats/a/b", "/sources/a/b"):
        answer = await client.get(path)
        assert answer.status_code == 404, path
        assert answer.json()["type"] == "error" and answer.json()["key"] == "NOT_FOUND", path
    answer = await client.get("/v1/nope")
    # as OpenAI answers an unknown URL: no code (`model_not_found` is for a model)
    assert answer.status_code == 404 and answer.json()["error"]["code"] is None
    answer = await client.put("/api/chats")
    assert answer.status_code == 405 and answer.json()["key"] == "BAD_REQUEST"
    assert (await client.get("/")).status_code == 200  # the web client, as before
