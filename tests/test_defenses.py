"""A server that defends itself with nothing in front: slow clients over raw sockets,
connections per address, one relay per answer, a cap on generations, what never
reaches a log, a browser's own EventSource, bad input in every route, and
middleware that would see a stream's start but not its body."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from typing import Any

import httpx
import orjson
import pytest
from httpx_ws import aconnect_ws
from starlette.middleware.gzip import GZipMiddleware

from app.config import ServerSettings
from app.main import create_app
from tests.client import chat_body, iter_sse, read_events, sse_chat
from tests.conftest import USER
from tests.servers import chromium, serve

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


@pytest.mark.parametrize("reader", ["jina", "builtin"])
@pytest.mark.parametrize("provider", ["tavily", "searxng", "google", "ddgs"])
async def test_no_key_and_no_question_reach_any_log(
    settings, fake_model, fake_search, secret_keys, caplog, provider, reader
):
    """Every logger, at INFO as the README runs it, while each provider searches and
    each reader reads: no key, no question — the URLs that hold them included."""
    from app import logs

    changed = settings.replace(
        llm={"api_key": MODEL_KEY},
        embeddings={"api_key": MODEL_KEY},
        search={"provider": provider, "timeout_seconds": 3.0},
        tavily={"api_key": SEARCH_KEY},
        google={"api_key": SEARCH_KEY},
        reader={"provider": reader, "allow_private_networks": True},
    )
    logs.configure()
    logging.getLogger().addHandler(caplog.handler)  # configure() set the root's handlers
    try:
        with caplog.at_level(logging.INFO), serve(create_app(changed)) as running:
            async with httpx.AsyncClient(
                base_url=running.url, timeout=20, event_hooks=USER
            ) as http:
                body = chat_body(f"what do {QUESTION_WORD} eat", focusMode="webSearch")
                body["optimizationMode"] = "balanced"
                events = await sse_chat(http, body)
                assert events[-1].type == "messageEnd"
                # and a model that refuses the key, quoting it as OpenAI does
                fake_model.api_key = "another-key"
                refused = await sse_chat(http, chat_body(f"{QUESTION_WORD} again"))
                assert refused[-1].data["key"] == "STREAM_ERROR"
                assert "MODELSECRET" not in refused[-1].data["data"]
    finally:
        logging.getLogger().handlers[:] = []
    text = everything_logged(caplog.records)
    assert "answered 401" in text  # the refusal is logged, in words
    for secret in ("SEARCHSECRET", "MODELSECRET", "sk-MODE", QUESTION_WORD):
        assert secret not in text, (secret, [line for line in text.splitlines() if secret in line])


def test_settings_never_show_a_key_or_a_password():
    from app.config import Settings

    settings = Settings().replace(
        llm={"api_key": MODEL_KEY},
        tavily={"api_key": SEARCH_KEY},
        store={"url": "postgresql://chat:PGPASSWORD@db/chat"},
        redis={"url": "redis://:REDISPASSWORD@cache:6379/0"},
        auth={"api_keys": {"STATICKEY": "1"}},
    )
    shown = repr(settings)
    for secret in ("MODELSECRET", "SEARCHSECRET", "PGPASSWORD", "REDISPASSWORD", "STATICKEY"):
        assert secret not in shown, secret


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


# -- 4. a browser's own EventSource ---------------------------------------------------------------


async def test_every_sse_stream_says_retry_and_a_resume_past_the_end_is_204(client, fake_model):
    async with client.stream("POST", "/api/chat/sse", json=chat_body("q", chatId="e1")) as r:
        first = await r.aread()
    assert first.startswith(b"retry: 2000\n\n")
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

    monkeypatch.setattr("app.api.choose_provider", broken)
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


def test_a_middleware_that_could_wrap_bodies_is_refused_at_start(settings):
    app = create_app(settings)
    app.add_middleware(GZipMiddleware)
    with pytest.raises(RuntimeError, match="GZipMiddleware is not known to leave response bodies"):
        app.build_middleware_stack()


def test_a_middleware_marked_stream_safe_is_taken(settings):
    class Tag:
        stream_safe = True

        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await self.app(scope, receive, send)

    app = create_app(settings)
    app.add_middleware(Tag)
    app.build_middleware_stack()


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
