"""Auth by API key, rate limits, the concurrency cap, CORS, one owner per chat, the
sources page's headers, and what is logged: no key, password or question in any log,
nor in a setting's repr or error."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
import traceback
import typing
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from httpx_ws import WebSocketDisconnect, aconnect_ws

from app.main import create_app
from tests.client import chat_body, iter_sse, read_events, read_sse_events, rest, sse_chat
from tests.conftest import USER
from tests.fakes.rerank import FakeRerank
from tests.logs import everything_logged
from tests.servers import serve

pytestmark = pytest.mark.anyio

KEYS = {"key-eleven": "11", "key-twenty-two": "22"}
ELEVEN = {"authorization": "Bearer key-eleven"}
TWENTY_TWO = {"authorization": "Bearer key-twenty-two"}


@pytest.fixture
def secured(settings):
    with serve(create_app(settings.replace(auth={"api_keys": KEYS}))) as server:
        yield server


@pytest.fixture
async def anon(secured):
    async with httpx.AsyncClient(base_url=secured.url, timeout=10) as http:
        yield http


async def test_every_api_route_needs_a_key(anon, fake_model):
    for method, path in [
        ("POST", "/api/chat/sse"),
        ("GET", "/api/chat/sse/resume?chatId=1"),
        ("POST", "/api/chat/cancel"),
        ("GET", "/api/chats"),
        ("GET", "/api/chats/1"),
        ("DELETE", "/api/chats/1"),
        ("GET", "/api/config"),
        ("POST", "/api/suggestions"),
        ("GET", "/sources/1"),
    ]:
        for headers in (
            {},
            {"authorization": "Bearer nope"},
            {"authorization": "Basic a2V5LWVsZXZlbg=="},
        ):
            response = await anon.request(method, path, headers=headers, json={})
            assert response.status_code == 401, (method, path, headers)
            assert response.json()["key"] == "UNAUTHORIZED"
    assert (await anon.get("/healthz")).status_code == 200
    assert (await anon.get("/readyz")).status_code == 200
    assert (await anon.get("/api/config", headers=ELEVEN)).json()["authRequired"] is True
    assert fake_model.requests == []


async def test_the_key_decides_the_user(anon, fake_model):
    events = await sse_chat(
        anon, {**chat_body("mine", chatId="900", messageId="901"), "userId": None}, headers=ELEVEN
    )
    assert events[-1].data["status"] == "completed"
    other = await anon.post(
        "/api/chat/sse", json={**chat_body("claim", chatId="902"), "userId": "22"}, headers=ELEVEN
    )
    assert other.status_code == 403 and other.json()["key"] == "FORBIDDEN"
    assert [c["id"] for c in (await anon.get("/api/chats", headers=ELEVEN)).json()["chats"]] == [
        "900"
    ]
    assert (await anon.get("/api/chats", headers=TWENTY_TWO)).json()["chats"] == []
    assert (
        await anon.get("/api/chats", params={"userId": "22"}, headers=ELEVEN)
    ).status_code == 403
    assert (await anon.get("/api/chats/900", headers=ELEVEN)).status_code == 200
    assert (await anon.get("/api/chats/900", headers=TWENTY_TWO)).status_code == 403
    assert (await anon.delete("/api/chats/900", headers=TWENTY_TWO)).status_code == 403
    assert (await anon.get("/sources/901", headers=TWENTY_TWO)).status_code == 403
    assert (await anon.get("/sources/901", params={"token": "key-eleven"})).status_code == 200
    assert (
        await anon.post("/api/suggestions", json={"chatId": "900"}, headers=TWENTY_TWO)
    ).status_code == 403
    # someone else's chat id cannot be written to either
    intrude = await anon.post(
        "/api/chat/sse", json={**chat_body("hi", chatId="900"), "userId": None}, headers=TWENTY_TWO
    )
    assert intrude.status_code == 403


async def test_cancel_and_resume_only_for_the_owner(anon, fake_model):
    async with anon.stream(
        "POST",
        "/api/chat/sse",
        json={**chat_body("long #tokens=300 #delay=0.02", chatId="910"), "userId": None},
        headers=ELEVEN,
    ) as response:
        lines = response.aiter_lines()
        await anext(lines)
        assert (
            await anon.post("/api/chat/cancel", json={"chatId": "910"}, headers=TWENTY_TWO)
        ).status_code == 403
        assert (
            await anon.get("/api/chat/sse/resume", params={"chatId": "910"}, headers=TWENTY_TWO)
        ).status_code == 403
        assert (
            await anon.post("/api/chat/cancel", json={"chatId": "910"}, headers=ELEVEN)
        ).status_code == 200
        rest = [line async for line in lines]
    assert any('"status":"cancelled"' in line for line in rest)


async def test_websocket_needs_a_key(secured, fake_model):
    async with httpx.AsyncClient(timeout=10) as http:
        async with aconnect_ws(secured.ws_url + "/api/chat/ws", http) as ws:
            frame = orjson.loads(await ws.receive_text())
            assert (frame["type"], frame["key"]) == ("error", "UNAUTHORIZED")
            with pytest.raises(WebSocketDisconnect) as closed:
                await ws.receive_text()
            assert closed.value.code == 4401
        for url, headers in (
            (secured.ws_url + "/api/chat/ws?token=key-eleven", {}),
            (secured.ws_url + "/", ELEVEN),
        ):
            async with aconnect_ws(url, http, headers=headers) as ws:
                assert orjson.loads(await ws.receive_text())["type"] == "signal"
                await ws.send_text(orjson.dumps({**chat_body("hi"), "userId": "22"}).decode())
                assert orjson.loads(await ws.receive_text())["key"] == "FORBIDDEN"
                await ws.send_text(
                    orjson.dumps({**chat_body("hi", chatId="920"), "userId": None}).decode()
                )
                frames = [orjson.loads(await ws.receive_text())]
                while frames[-1]["type"] not in ("messageEnd", "error"):
                    frames.append(orjson.loads(await ws.receive_text()))
                assert frames[-1]["status"] == "completed"
            async with httpx.AsyncClient(base_url=secured.url, timeout=10) as client:
                assert (await client.get("/api/chats/920", headers=ELEVEN)).status_code == 200
            break


async def test_cors_is_open_without_auth_and_closed_with_it(client, anon):
    origin = {"origin": "https://elsewhere.example"}
    open_ = await client.get("/api/config", headers=origin)
    assert open_.headers.get("access-control-allow-origin") == "*"
    closed = await anon.get("/api/config", headers={**origin, **ELEVEN})
    assert "access-control-allow-origin" not in closed.headers


async def test_keys_and_tokens_are_not_logged(secured, caplog):
    caplog.set_level(logging.DEBUG)
    async with httpx.AsyncClient(base_url=secured.url, timeout=10) as http:
        await http.get("/api/config", headers=ELEVEN)
        await http.get("/sources/1", params={"token": "key-eleven"})
        await http.get("/api/config", headers={"authorization": "Bearer wrong-key-123"})
        async with aconnect_ws(secured.ws_url + "/api/chat/ws?token=key-eleven", http) as ws:
            await ws.receive_text()
    await asyncio.sleep(0.1)
    server_side = [
        r for r in caplog.records if r.name.startswith(("app", "uvicorn"))
    ]  # not the test's client
    text = "\n".join(r.getMessage() + str(getattr(r, "fields", "")) for r in server_side)
    assert "/api/config" in text  # the access log did run
    assert "key-eleven" not in text and "wrong-key-123" not in text and "token=" not in text


async def test_requests_per_minute_per_client(settings, fake_model):
    with serve(create_app(settings.replace(limits={"requests_per_minute": 2}))) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            await sse_chat(http, chat_body("one"))
            await sse_chat(http, chat_body("two"))
            third = await http.post("/api/chat/sse", json=chat_body("three"))
            assert third.status_code == 429
            assert third.json()["key"] == "RATE_LIMITED"
            assert 1 <= int(third.headers["retry-after"]) <= 60
            async with aconnect_ws(server.ws_url + "/api/chat/ws", http) as ws:
                await ws.receive_text()
                await ws.send_text(orjson.dumps(chat_body("four", chatId="930")).decode())
                frame = orjson.loads(await ws.receive_text())
                assert (frame["key"], frame["chatId"]) == ("RATE_LIMITED", "930")
            assert (await http.get("/api/chats")).status_code == 200  # reading is not limited


async def test_rate_limit_is_shared_across_processes_through_redis(
    settings, redis_url, fake_model, hour_windows
):
    shared = settings.replace(
        limits={"requests_per_minute": 3}, redis={"url": redis_url}, auth={"api_keys": KEYS}
    )
    with serve(create_app(shared)) as a, serve(create_app(shared)) as b:
        async with httpx.AsyncClient(timeout=10) as http:
            for url in (a.url, b.url, a.url):
                async with http.stream(
                    "POST",
                    url + "/api/chat/sse",
                    json={**chat_body("q"), "userId": None},
                    headers=ELEVEN,
                ) as r:
                    assert r.status_code == 200
                    await r.aread()
            refused = await http.post(
                b.url + "/api/chat/sse", json={**chat_body("q"), "userId": None}, headers=ELEVEN
            )
            assert refused.status_code == 429
            other_user = await http.post(
                b.url + "/api/chat/sse", json={**chat_body("q"), "userId": None}, headers=TWENTY_TWO
            )
            assert other_user.status_code == 200
            await other_user.aread()


@pytest.mark.parametrize("backend", ["memory", "redis", "cluster"])
async def test_concurrent_generations_are_capped_per_address_with_auth_off(
    settings, fake_model, backend, request
):
    """A claimed userId proves nothing: changing it does not get past the cap, while
    another client address has a cap of its own."""
    changes = {"limits": {"max_concurrent_generations": 1}}
    if backend == "redis":
        changes["redis"] = {"url": request.getfixturevalue("redis_url")}
    elif backend == "cluster":
        changes["redis"] = {"url": request.getfixturevalue("redis_cluster").url, "cluster": True}
    with serve(create_app(settings.replace(**changes))) as server:
        elsewhere = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=10) as http,
            httpx.AsyncClient(base_url=server.url, timeout=10, transport=elsewhere) as other,
        ):
            async with http.stream(
                "POST",
                "/api/chat/sse",
                json=chat_body("long #tokens=100 #delay=0.02", chatId="940"),
            ) as first:
                lines = first.aiter_lines()
                await anext(lines)
                second = await http.post("/api/chat/sse", json=chat_body("another", chatId="941"))
                assert second.status_code == 429 and second.json()["key"] == "RATE_LIMITED"
                renamed = await http.post(
                    "/api/chat/sse", json={**chat_body("as another", chatId="944"), "userId": "2"}
                )
                assert renamed.status_code == 429
                other_address = await other.post(
                    "/api/chat/sse", json={**chat_body("theirs", chatId="942"), "userId": "2"}
                )
                assert other_address.status_code == 200
                rest = [line async for line in lines]
                assert any('"status":"completed"' in line for line in rest)
            events = await sse_chat(
                http, chat_body("after", chatId="943")
            )  # the slot is free again
            assert events[-1].data["status"] == "completed"


async def test_websocket_messages_per_second(settings, fake_model):
    with serve(create_app(settings.replace(limits={"ws_messages_per_second": 5}))) as server:
        async with aconnect_ws(server.ws_url + "/api/chat/ws", httpx.AsyncClient(timeout=10)) as ws:
            await ws.receive_text()
            for _ in range(20):
                await ws.send_text('{"type": "ping"}')
            frames = [orjson.loads(await ws.receive_text()) for _ in range(20)]
            assert 3 <= sum(f["type"] == "pong" for f in frames) <= 7
            assert all(f["type"] == "pong" or f["key"] == "RATE_LIMITED" for f in frames)
            await asyncio.sleep(0.5)
            await ws.send_text('{"type": "ping"}')
            assert orjson.loads(await ws.receive_text()) == {
                "type": "pong"
            }  # still open, and allowed again


async def test_input_limits_say_which_limit(settings, fake_model):
    limited = settings.replace(
        limits={"max_content_chars": 50, "max_history_messages": 3, "max_body_bytes": 4096}
    )
    with serve(create_app(limited)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            cases = [
                (chat_body("x" * 51), "longer than 50"),
                (chat_body("q", history=[["human", "a"]] * 4), "more than 3"),
                (chat_body("q", history=[["human", "x" * 51]]), "history[0] is longer"),
                ({**chat_body("q"), "userId": "1" * 65}, "userId"),
                (chat_body("q", chatId="a/b"), "chatId"),
            ]
            for body, fragment in cases:
                response = await http.post("/api/chat/sse", json=body)
                assert response.status_code == 400 and fragment in response.json()["data"], (
                    body,
                    response.text,
                )
            deep = b'{"message": {"content": "q"}, "files": ' + b"[" * 40 + b"]" * 40 + b"}"
            assert "nested" in (await http.post("/api/chat/sse", content=deep)).json()["data"]
            async with aconnect_ws(server.ws_url + "/api/chat/ws", http) as ws:
                await ws.receive_text()
                await ws.send_text(orjson.dumps(chat_body("y" * 5000)).decode())
                frame = orjson.loads(await ws.receive_text())
                assert frame["key"] == "BAD_REQUEST" and "larger than 4096" in frame["data"]
                await ws.send_text('{"type": "ping"}')
                assert orjson.loads(await ws.receive_text()) == {"type": "pong"}


QUESTION_WORD = "zanzibarquokka"


SEARCH_KEY = "tvly-SEARCHSECRET0123456789"


MODEL_KEY = "sk-MODELSECRET0123456789abcdef"


@pytest.fixture
def secret_keys(fake_model, fake_search):
    before = (fake_model.api_key, fake_search.api_key)
    fake_model.api_key, fake_search.api_key = MODEL_KEY, SEARCH_KEY
    yield
    fake_model.api_key, fake_search.api_key = before


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


async def test_the_sources_page_links_only_http_and_sends_security_headers(
    client, fake_model, fake_search
):
    fake_search.extra[:] = [
        {"title": "evil", "url": "javascript:alert(document.cookie)", "snippet": "x"},
        {"title": "tabbed", "url": "java\tscript:alert(1)", "snippet": "x"},
        {"title": "data", "url": "data:text/html,<script>alert(1)</script>", "snippet": "x"},
    ]
    events = await read_sse_events(client, chat_body("q", messageId="x1", focusMode="webSearch"))
    assert any(e.type == "sources" for e in events)
    page = await client.get("/sources/x1", headers={"accept": "text/html"})
    assert page.status_code == 200
    hrefs = re.findall(r'href="([^"]*)"', page.text)
    assert hrefs and all(h.startswith("http") for h in hrefs)
    assert "evil" in page.text and "<script>" not in page.text
    for response in (page, await client.get("/"), await client.get("/static/index.html")):
        csp = response.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["referrer-policy"] == "no-referrer"


async def test_without_auth_a_chat_is_its_users_and_no_one_elses(server, fake_model, fake_search):
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=20) as anonymous,
        httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as owner,
    ):
        body = chat_body("long #tokens=300 #delay=0.01", chatId="o1", messageId="o2")
        body["focusMode"] = "webSearch"
        async with owner.stream("POST", "/api/chat/sse", json=body) as response:
            stream = iter_sse(response)
            head = await read_events(stream, 3)
            sources = next(e for e in head if e.type == "sources").data["data"][-1]["metadata"]
            for who, extra in ((anonymous, {"userId": None}), (anonymous, {"userId": "2"})):
                query = {"userId": extra["userId"]} if extra["userId"] else {}
                assert (await who.get("/api/chats/o1", params=query)).status_code == 403
                assert (await who.get("/sources/o2", params=query)).status_code == 403
                resume = await who.get("/api/chat/sse/resume", params={"chatId": "o1", **query})
                assert resume.status_code == 403
                cancel = await who.post("/api/chat/cancel", json={"chatId": "o1", **extra})
                assert cancel.status_code == 403
                post = await who.post(
                    "/api/chat/sse", json={**chat_body("mine now", chatId="o1"), **extra}
                )
                assert post.status_code == 403
                assert (await who.delete("/api/chats/o1", params=query)).status_code == 403
                assert (await who.get("/api/chats", params=query)).json()["chats"] == []
            # the signed link opens those sources, and nothing else, without a user
            signed = await anonymous.get("http:" + sources["url"])
            assert signed.status_code == 200 and len(signed.json()["sources"]) == 8
            forged = sources["url"].replace("/sources/o2", "/sources/o1")
            assert (await anonymous.get("http:" + forged)).status_code in (403, 404)
            assert (
                await owner.post("/api/chat/cancel", json={"chatId": "o1", "userId": "1"})
            ).status_code == 200
            await rest(stream)
        # and a chat made without a userId is user "0"'s
        await read_sse_events(anonymous, {**chat_body("anon", chatId="o3"), "userId": None})
        assert (await anonymous.get("/api/chats/o3")).status_code == 200
        assert (await owner.get("/api/chats/o3")).status_code == 403
