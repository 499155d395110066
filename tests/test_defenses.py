"""A server that defends itself with nothing in front: slow clients over raw sockets,
connections per address, one relay per answer, a cap on generations, what never
reaches a log, a browser's own EventSource, bad input in every route, and
middleware that would see a stream's start but not its body."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import threading
import time
import traceback
import typing
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from httpx_ws import aconnect_ws
from starlette.middleware.gzip import GZipMiddleware

from app.config import ServerSettings
from app.main import create_app
from app.serving import open_connections, uvicorn_config
from tests.client import chat_body, iter_sse, read_events, sse_chat
from tests.conftest import USER
from tests.fakes.rerank import FakeRerank
from tests.servers import AppProcess, chromium, serve

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


# -- 1. slow clients ------------------------------------------------------------------------


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


def test_a_body_that_stops_arriving_is_closed(settings, fake_model):
    with guarded(settings, body_timeout_seconds=1.0) as running:
        with raw(running.port) as sock:
            sock.sendall(
                b"POST /api/chat/sse HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n" + b'{"type":"m'
            )
            started = time.monotonic()
            closed, _ = closed_within(sock, 5)
        assert closed and time.monotonic() - started < 3


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


# -- 3. nothing secret or personal in any log -------------------------------------------------

QUESTION_WORD = "zanzibarquokka"
SEARCH_KEY = "tvly-SEARCHSECRET0123456789"
MODEL_KEY = "sk-MODELSECRET0123456789abcdef"


@pytest.fixture
def secret_keys(fake_model, fake_search):
    before = (fake_model.api_key, fake_search.api_key)
    fake_model.api_key, fake_search.api_key = MODEL_KEY, SEARCH_KEY
    yield
    fake_model.api_key, fake_search.api_key = before


def everything_logged(records: list[logging.LogRecord]) -> str:
    out = []
    for r in records:
        out.append(f"{r.name} {r.getMessage()} {getattr(r, 'fields', '')}")
        if r.exc_info:
            out.append(logging.Formatter().formatException(r.exc_info))
    return "\n".join(out)


@pytest.fixture
def fake_ddgs(monkeypatch, fake_search):
    """ddgs at its client boundary (`app.search.ddgs.new_client`): its text results are
    the fake search's pages on loopback, so a reader reads them there."""
    import app.search.ddgs
    from tests.test_search_provider import RecordedDdgs

    fake = RecordedDdgs()
    fake.answers["text"] = [
        {"title": r["title"], "href": r["url"], "body": r["snippet"]} for r in fake_search.results()
    ]
    monkeypatch.setattr(app.search.ddgs, "new_client", fake.factory)
    yield fake
    fake.release.set()


async def import_urls(http: httpx.AsyncClient, urls: list[str]) -> str:
    """A collection with `urls` read into it (by the reader): its id."""
    made = await http.post("/api/collections", json={"name": "logs"})
    collection_id = made.json()["collection"]["id"]
    started = await http.post(f"/api/collections/{collection_id}/documents", json={"urls": urls})
    assert started.status_code == 202, started.text
    progress_url = f"/api/collections/{collection_id}/imports/{started.json()['import']['id']}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        progress = (await http.get(progress_url)).json()
        if progress["done"] == progress["total"]:
            assert not progress["failed"], progress
            return collection_id
        await asyncio.sleep(0.1)
    raise AssertionError(f"the import did not finish: {progress}")


@pytest.mark.parametrize("reader", ["jina", "builtin"])
@pytest.mark.parametrize("provider", ["tavily", "searxng", "google", "ddgs"])
async def test_no_key_and_no_question_reach_any_log(
    settings, fake_model, fake_search, fake_ddgs, secret_keys, caplog, provider, reader
):
    """Every logger (uvicorn's included, configured as `python -m app` configures them),
    at INFO as the README runs it, while each provider searches — answers, `/api/search`,
    images, videos, discover — each reader reads (sources, and a collection's URLs), and a
    reranker ranks: no key, no question, no URL that holds either."""
    from app import logs

    rerank = FakeRerank()
    with serve(rerank.app()) as reranker:
        changed = settings.replace(
            llm={"api_key": MODEL_KEY},
            embeddings={"api_key": MODEL_KEY},
            search={"provider": provider, "timeout_seconds": 3.0},
            tavily={"api_key": SEARCH_KEY},
            google={"api_key": SEARCH_KEY},
            reader={"provider": reader, "api_key": SEARCH_KEY, "allow_private_networks": True},
            collections={"rerank": {"url": reranker.url + "/rerank", "api_key": SEARCH_KEY}},
        )
        logs.configure()
        logging.getLogger().addHandler(caplog.handler)  # configure() set the root's handlers
        try:
            with (
                caplog.at_level(logging.INFO),
                serve(create_app(changed), log_config=None, log_level="info") as running,
            ):
                async with httpx.AsyncClient(
                    base_url=running.url, timeout=20, event_hooks=USER
                ) as http:
                    await everything_that_searches_or_reads(http, fake_search.base_url)
                    # and a model that refuses the key, quoting it as OpenAI does
                    fake_model.api_key = "another-key"
                    refused = await sse_chat(http, chat_body(f"{QUESTION_WORD} again"))
                    assert refused[-1].data["key"] == "STREAM_ERROR"
                    assert "MODELSECRET" not in refused[-1].data["data"]
        finally:
            logging.getLogger().handlers[:] = []
    # each of them was asked (a test that asks nothing proves nothing)
    if provider == "ddgs":
        assert {kind for kind, _, _ in fake_ddgs.calls} == {"text", "images", "videos", "news"}
    else:
        assert provider in {asked for asked, _ in fake_search.queries}
    assert {via for via, _ in fake_search.pages_read} == {"jina" if reader == "jina" else "page"}
    assert rerank.requests and rerank.requests[-1]["query"].endswith(QUESTION_WORD)
    text = everything_logged(caplog.records)
    assert "answered 401" in text  # the refusal is logged, in words
    assert any(r.name.startswith("uvicorn") for r in caplog.records)  # uvicorn's are kept
    for secret in ("SEARCHSECRET", "MODELSECRET", "sk-MODE", QUESTION_WORD):
        assert secret not in text, (secret, [line for line in text.splitlines() if secret in line])


async def everything_that_searches_or_reads(http: httpx.AsyncClient, pages: str) -> None:
    """Ask in every way that reaches a search provider, the reader or the reranker."""
    body = chat_body(f"what do {QUESTION_WORD} eat", focusMode="webSearch")
    body["optimizationMode"] = "balanced"
    events = await sse_chat(http, body)
    assert events[-1].type == "messageEnd"
    media = {"query": f"{QUESTION_WORD} pictures", "chatHistory": []}
    assert (await http.post("/api/images", json=media)).status_code == 200
    assert (await http.post("/api/videos", json=media)).status_code == 200
    assert (await http.get("/api/discover")).status_code == 200
    searched = await http.post(
        "/api/search",
        json={"query": f"where do {QUESTION_WORD} live", "focusMode": "webSearch", "userId": "1"},
    )
    assert searched.status_code == 200, searched.text
    collection = await import_urls(
        http, [f"{pages}/pages/1?q={QUESTION_WORD}", f"{pages}/pages/2?q={QUESTION_WORD}"]
    )
    found = await http.post(
        f"/api/collections/{collection}/search", json={"query": f"FULLTEXT {QUESTION_WORD}"}
    )
    assert found.status_code == 200 and found.json()["results"], found.text


#: what a settings key's name says it holds: a secret, or a URL (whose user part may
#: hold a password, its query a key) or a proxy's URL
SECRET_WORDS = {"key", "keys", "secret", "password", "token"}
URL_WORDS = {"url", "proxy"}


def secret_fields(cls: Any = None, where: str = "") -> Iterator[tuple[str, Any]]:
    """Every key of the settings, nested tables included, whose name says it holds a
    secret or a URL: (dotted path, its field)."""
    from app.config import Settings

    for f in dataclasses.fields(cls or Settings):
        path = f"{where}{f.name}"
        kind = typing.get_type_hints(cls or Settings)[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            yield from secret_fields(kind, path + ".")
        elif set(f.name.split("_")) & (SECRET_WORDS | URL_WORDS):
            yield path, kind


def test_settings_never_show_a_key_a_password_or_a_url():
    """Every key that is or may hold a secret, found by its name (a new one is found
    too), is left out of the settings' repr."""
    from app.config import Settings

    found = dict(secret_fields())
    assert {"llm.api_key", "auth.api_keys", "collections.rerank.api_key", "ddgs.proxy"} <= set(
        found
    )
    assert {"store.url", "redis.url", "collections.url", "searxng.url"} <= set(found)
    settings = Settings()
    for n, (path, kind) in enumerate(found.items()):
        secret = f"HIDDEN{n}X"
        value: Any = f"https://u:{secret}@h/?key={secret}" if kind is str else {secret: "1"}
        section, _, key = path.rpartition(".")
        changes: dict[str, Any] = {key: value}
        for name in reversed(section.split(".")[1:]):
            changes = {name: changes}
        settings = settings.replace(**{section.split(".")[0]: changes})
        assert secret not in repr(settings), f"{path} shows in the settings' repr"


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"AUTH_API_KEYS": "SECRETKEY1:1,SECRETKEY2"}, "AUTH_API_KEYS"),
        ({"SERVER_PORT": "SECRETKEY1"}, "SERVER_PORT"),
        ({"PORT": "SECRETKEY1"}, "PORT"),
        ({"AUTH_SESSION_DAYS": "SECRETKEY1"}, "AUTH_SESSION_DAYS"),
        ({"REDIS_CLUSTER": "SECRETKEY1"}, "REDIS_CLUSTER"),
    ],
)
def test_a_bad_setting_from_the_environment_names_its_key_not_its_value(tmp_path, env, name):
    from app.config import SettingsError, load

    config = tmp_path / "config.toml"
    config.write_text("")
    with pytest.raises(SettingsError) as refused:
        load(config, env)
    shown = "".join(traceback.format_exception(refused.value))
    assert name in str(refused.value)
    assert "SECRETKEY" not in shown, shown


def test_a_bad_setting_in_the_file_names_its_key_not_its_value(tmp_path):
    from app.config import SettingsError, load

    config = tmp_path / "config.toml"
    config.write_text('[llm]\napi_key = ["SECRETKEY1"]\n')
    with pytest.raises(SettingsError) as refused:
        load(config, {})
    shown = "".join(traceback.format_exception(refused.value))
    assert "llm.api_key: expected a string, got an array" in str(refused.value)
    assert "SECRETKEY" not in shown, shown


# -- 2. one client cannot multiply the work per token -------------------------------------------


async def test_a_second_resume_on_one_socket_replaces_the_first(server, fake_model):
    async with (
        httpx.AsyncClient(timeout=20) as http,
        aconnect_ws(server.ws_url + "/api/chat/ws", http) as ws,
    ):
        assert orjson.loads(await ws.receive_text())["type"] == "signal"
        body = chat_body("long #tokens=150 #delay=0.02", chatId="rr1")
        await ws.send_text(orjson.dumps(body).decode())
        frames: list[dict] = []
        while len([f for f in frames if f.get("type") == "message"]) < 10:
            frames.append(orjson.loads(await ws.receive_text()))
        last = [f for f in frames if "eventId" in f][-1]["eventId"]
        for _ in range(5):  # five resumes of the answer this socket already follows
            resume = {"type": "resume", "chatId": "rr1", "userId": "1", "lastEventId": last}
            await ws.send_text(orjson.dumps(resume).decode())
        while frames[-1].get("type") != "messageEnd":
            frames.append(orjson.loads(await ws.receive_text()))
    after = [
        f["eventId"] for f in frames if "eventId" in f and _seq(f["eventId"]) > _seq(last) + 20
    ]
    assert after and len(after) == len(set(after)), "an event came more than once"


def _seq(event_id: str) -> int:
    return int(event_id.rsplit(":", 1)[1])


async def test_resumes_count_against_the_rate_limit(settings, fake_model):
    limited = settings.replace(limits={"requests_per_minute": 3})
    with serve(create_app(limited)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20, event_hooks=USER) as http:
            events = await sse_chat(http, chat_body("q", chatId="rl1"))
            answers = [
                await http.get(
                    "/api/chat/sse/resume", params={"chatId": "rl1", "lastEventId": events[1].id}
                )
                for _ in range(3)
            ]
    assert [a.status_code for a in answers][:2] == [200, 200]
    assert answers[-1].status_code == 429 and answers[-1].headers["retry-after"]


async def test_a_process_caps_the_answers_it_runs(settings, fake_model):
    capped = settings.replace(
        limits={"max_generations_per_process": 2, "max_concurrent_generations": 0}
    )
    with serve(create_app(capped)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20, event_hooks=USER) as http:
            async with (
                http.stream("POST", "/api/chat/sse", json=chat_body("#hang", chatId="p1")) as a,
                http.stream("POST", "/api/chat/sse", json=chat_body("#hang", chatId="p2")) as b,
            ):
                await read_events(iter_sse(a), 2)
                await read_events(iter_sse(b), 2)
                third = await http.post("/api/chat/sse", json=chat_body("q", chatId="p3"))
                assert third.status_code == 503 and third.headers["retry-after"] == "2"
                assert "answering 2 questions already" in third.json()["data"]
                for chat in ("p1", "p2"):
                    await http.post("/api/chat/cancel", json={"chatId": chat, "userId": "1"})


async def test_a_burst_of_questions_at_once_never_passes_the_process_cap(settings, fake_model):
    """Ten questions sent at the same moment to a process capped at three: exactly three
    start (the check and the place it takes happen before the first await)."""
    capped = settings.replace(
        limits={"max_generations_per_process": 3, "max_concurrent_generations": 0}
    )
    with serve(create_app(capped)) as running:
        async with httpx.AsyncClient(
            base_url=running.url,
            timeout=20,
            event_hooks=USER,
            limits=httpx.Limits(max_connections=20),
        ) as http:
            go, answered, stop = asyncio.Event(), asyncio.Event(), asyncio.Event()
            statuses: list[int] = []

            async def ask(i: int) -> None:
                await go.wait()
                body = chat_body("#hang", chatId=f"burst{i}")
                async with http.stream("POST", "/api/chat/sse", json=body) as answer:
                    statuses.append(answer.status_code)
                    if len(statuses) == 10:
                        answered.set()
                    await stop.wait()  # an accepted answer runs on meanwhile

            asking = [asyncio.create_task(ask(i)) for i in range(10)]
            await asyncio.sleep(0.2)
            go.set()
            await asyncio.wait_for(answered.wait(), 10)
            assert running.app.state.service.running() == 3
            stop.set()
            await asyncio.gather(*asking)
            for i in range(10):
                await http.post("/api/chat/cancel", json={"chatId": f"burst{i}", "userId": "1"})
    assert sorted(statuses) == [200] * 3 + [503] * 7, statuses


async def test_the_process_cap_answers_websocket_and_v1_in_their_shapes(settings, fake_model):
    capped = settings.replace(
        limits={"max_generations_per_process": 1, "max_concurrent_generations": 0}
    )
    with serve(create_app(capped)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20, event_hooks=USER) as http:
            body = chat_body("#hang", chatId="only")
            async with http.stream("POST", "/api/chat/sse", json=body) as first:
                await read_events(iter_sse(first), 2)
                async with aconnect_ws(running.ws_url + "/api/chat/ws", http) as ws:
                    await ws.receive_text()  # signal
                    await ws.send_text(orjson.dumps(chat_body("q", chatId="ws1")).decode())
                    frame = orjson.loads(await ws.receive_text())
                v1 = await http.post(
                    "/v1/chat/completions",
                    json={"model": "deepSeek", "messages": [{"role": "user", "content": "q"}]},
                )
                await http.post("/api/chat/cancel", json={"chatId": "only", "userId": "1"})
    assert frame["type"] == "error" and "answering 1 questions already" in frame["data"], frame
    assert frame["chatId"] == "ws1"
    assert v1.status_code == 503 and v1.headers["retry-after"] == "2"
    assert v1.json()["error"]["type"] == "server_error"
    assert "answering 1 questions already" in v1.json()["error"]["message"]


async def test_websocket_resumes_count_against_the_rate_limit(settings, fake_model):
    limited = settings.replace(limits={"requests_per_minute": 3})
    with serve(create_app(limited)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20, event_hooks=USER) as http:
            events = await sse_chat(http, chat_body("q", chatId="wr1"))  # one request
            async with aconnect_ws(running.ws_url + "/api/chat/ws", http) as ws:
                await ws.receive_text()  # signal
                frames = []
                for _ in range(3):
                    resume = {"type": "resume", "chatId": "wr1", "userId": "1"}
                    resume["lastEventId"] = events[1].id
                    await ws.send_text(orjson.dumps(resume).decode())
                # the refusal and the replays come in whatever order their tasks run
                while not (
                    any(f.get("type") == "error" for f in frames)
                    and any(f.get("type") == "messageEnd" for f in frames)
                ):
                    frames.append(orjson.loads(await ws.receive_text(timeout=10)))
    refused = [f for f in frames if f.get("type") == "error"]
    assert refused[0]["key"] == "RATE_LIMITED", refused
    # the first two resumes were taken (each a replay up to the end)
    assert sum(f.get("type") == "messageEnd" for f in frames) >= 1


async def test_a_resume_of_an_answer_this_process_keeps_does_not_read_its_log(
    settings, fake_model, monkeypatch
):
    """Whether a resume is past the end is known from the log this process keeps (its
    end and last seq), without reading its events again."""
    with serve(create_app(settings)) as running:
        hub = running.app.state.service.hub
        reads: list[str] = []
        logged = hub.logged

        async def counted(answer_id: str) -> Any:
            reads.append(answer_id)
            return await logged(answer_id)

        monkeypatch.setattr(hub, "logged", counted)
        async with httpx.AsyncClient(base_url=running.url, timeout=20, event_hooks=USER) as http:
            events = await sse_chat(http, chat_body("q", chatId="cheap1"))
            params = {"chatId": "cheap1"}
            ended = await http.get(
                "/api/chat/sse/resume", params=params, headers={"last-event-id": events[-1].id}
            )
            earlier = await http.get(
                "/api/chat/sse/resume", params=params, headers={"last-event-id": events[1].id}
            )
    assert ended.status_code == 204 and earlier.status_code == 200
    assert reads == []


# -- 4. a browser's own EventSource ---------------------------------------------------------------


async def test_every_sse_stream_says_retry_and_a_resume_past_the_end_is_204(client, fake_model):
    async with client.stream("POST", "/api/chat/sse", json=chat_body("q", chatId="e1")) as r:
        first = await r.aread()
    assert first.startswith(b"retry: 2000\nid: ")  # no block without data
    ids = [line[4:] for line in first.decode().splitlines() if line.startswith("id: ")]
    ended = await client.get(
        "/api/chat/sse/resume", params={"chatId": "e1"}, headers={"last-event-id": ids[-1]}
    )
    assert ended.status_code == 204 and ended.content == b""
    earlier = await client.get(
        "/api/chat/sse/resume", params={"chatId": "e1"}, headers={"last-event-id": ids[-3]}
    )
    assert earlier.status_code == 200 and earlier.text.startswith("retry: 2000")
    assert earlier.text.count("id: ") == 2


EVENTSOURCE_PAGE = """<!doctype html><meta charset=utf-8><body><script>
window.got = []; window.opened = 0; window.errors = 0;
const source = new EventSource(%s);
source.onopen = () => window.opened++;
source.onerror = () => window.errors++;
source.onmessage = (m) => window.got.push([m.lastEventId, JSON.parse(m.data).type]);
</script>"""


def test_a_browsers_eventsource_follows_a_live_answer_through_a_drop_and_stops_at_the_end(
    settings, fake_model
):
    """Chromium's own EventSource on a resume URL: it follows the live answer, a
    connection the server drops mid-answer is resumed from the browser's
    Last-Event-ID, and after the end the server's 204 stops it: every event once, then
    no more requests."""
    from starlette.responses import HTMLResponse
    from starlette.routing import Route

    changed = settings.replace(stream={"retry_ms": 300})
    app = create_app(changed)
    url = "/api/chat/sse/resume?chatId=es1&userId=1"
    app.router.routes.insert(
        0, Route("/es", lambda request: HTMLResponse(EVENTSOURCE_PAGE % orjson.dumps(url).decode()))
    )
    with serve(app) as running, chromium() as browser:
        with httpx.Client(base_url=running.url, timeout=20) as http:
            with http.stream(
                "POST", "/api/chat/sse", json=chat_body("#tokens=60 #delay=0.05", chatId="es1")
            ) as answer:
                (asked,) = list(running.app.state.streams)  # the asker's own stream
                page = browser.new_page()
                requests: list[str] = []
                page.on("request", lambda r: requests.append(r.url) if "/resume" in r.url else None)
                page.goto(running.url + "/es")
                page.wait_for_function("() => window.got.length >= 15", timeout=10_000)

                async def drop() -> None:  # the server ends the browser's stream mid-answer
                    (browsers,) = [s for s in running.app.state.streams if s is not asked]
                    browsers.end()

                running.call(drop())
                page.wait_for_function(
                    "() => window.got.some(([, type]) => type === 'messageEnd')", timeout=15_000
                )
                for _ in answer.iter_bytes():
                    pass
            page.wait_for_timeout(1500)  # long past retry: no reconnect after the 204
            got = page.evaluate("window.got")
            seqs = [int(event_id.rsplit(":", 1)[1]) for event_id, _ in got]
            assert seqs == list(range(1, len(seqs) + 1)), seqs  # every event once, in order
            assert got[-1][1] == "messageEnd"
            assert len(requests) == 3, requests  # the first, after the drop, the 204
            assert page.evaluate("window.opened") == 2
            page.close()


# -- 5. bad input answered in its protocol's shape ------------------------------------------------


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


async def test_the_openai_user_field_is_a_label_with_auth_on(settings, fake_model):
    keyed = settings.replace(auth={"api_keys": {"k1": "u1"}})
    with serve(create_app(keyed)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20) as http:
            answer = await http.post(
                "/v1/chat/completions",
                headers={"authorization": "Bearer k1"},
                json={
                    "model": "deepSeek",
                    "user": "end-user-42",  # a label, not a claim to be someone else
                    "messages": [{"role": "user", "content": "hi"}],
                },
            )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]


# -- 6. middleware that would see a stream's start but not its body -------------------------------


REFUSED = "middleware GZipMiddleware is not known to leave response bodies alone"


@pytest.mark.parametrize("how", ["python -m app", "plain uvicorn"])
def test_a_server_with_a_body_wrapping_middleware_refuses_to_start(settings, how):
    """A real server: with `python -m app`'s options, and with uvicorn's own defaults
    (lifespan "auto", which once kept serving a plain-text 500 to every request)."""
    app = create_app(settings)
    app.add_middleware(GZipMiddleware)
    if how == "python -m app":
        config = uvicorn_config(app, settings, host="127.0.0.1", port=0)
    else:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None)
    server = uvicorn.Server(config)
    said = Recorded()
    logging.getLogger("uvicorn.error").addHandler(said)
    exits: list[Any] = []

    def run() -> None:
        try:
            server.run()
        except SystemExit as exc:  # uvicorn's way of failing a start
            exits.append(exc.code)

    runner = threading.Thread(target=run, daemon=True)
    try:
        runner.start()
        runner.join(15)
        if runner.is_alive():  # it serves: stop it, then fail
            server.should_exit = True
            runner.join(15)
        assert not server.started and exits == [3]
        assert REFUSED in said.text()
    finally:
        logging.getLogger("uvicorn.error").removeHandler(said)


class Recorded(logging.Handler):
    """Keeps the records of the logger it is added to (whether or not they propagate)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        return everything_logged(self.records)


def test_a_middleware_marked_stream_safe_is_taken(settings):
    """The server starts (its lifespan, where the refusal is, runs) and answers
    through the middleware."""
    seen: list[str] = []

    class Tag:
        stream_safe = True

        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                seen.append(scope["path"])
            await self.app(scope, receive, send)

    app = create_app(settings)
    app.add_middleware(Tag)
    with serve(app) as server:
        assert httpx.get(server.url + "/healthz", timeout=10).status_code == 200
    assert seen == ["/healthz"]


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


async def test_a_refusal_that_quotes_the_question_logs_neither(settings, fake_model, caplog):
    """A provider's error may quote the prompt (moderation refusals do): the status and
    the error's words are logged, what it quotes is not — at any level."""
    from app.logs import quiet_third_parties

    quiet_third_parties()  # as the server configures its logging
    with caplog.at_level(logging.DEBUG):
        with serve(create_app(settings)) as running:
            async with httpx.AsyncClient(
                base_url=running.url, timeout=10, event_hooks=USER
            ) as http:
                events = await sse_chat(http, chat_body("where do wombats hide #echo=400"))
    assert events[-1].type == "error" and "wombats" not in events[-1].data["data"]
    refusal = next(r for r in caplog.records if r.getMessage() == "the model answered 400")
    assert "was flagged" in refusal.fields["detail"]  # type: ignore[attr-defined]
    logged = [f"{r.getMessage()} {getattr(r, 'fields', '')}" for r in caplog.records]
    assert not [line for line in logged if "wombats" in line]
