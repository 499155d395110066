"""The first ten minutes: what a newcomer meets. Errors that say what to do — five
ways a model fails, five messages and five log lines —, a check at start, a second
server on a taken port, a restart, and the demo model that needs no key.
"""

from __future__ import annotations

import logging
import re
import socket
import time
from pathlib import Path

import httpx
import orjson
import pytest

from app.chat.service import ChatService
from app.config import Settings
from app.main import announce, create_app
from tests.client import chat_body, iter_sse, rest, sse_chat, wait_for
from tests.conftest import USER
from tests.servers import AppProcess, serve

pytestmark = pytest.mark.anyio


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def silent_port():
    """A port that accepts connections and never says a word."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    yield silent.getsockname()[1]
    silent.close()


def failing_model(case: str, settings: Settings, silent_port: int) -> dict:
    model_port = int(settings.llm.base_url.split(":")[2].split("/")[0])
    return {
        "refused": {"base_url": f"http://127.0.0.1:{closed_port()}/v1"},
        "dns": {"base_url": "http://model.invalid/v1"},
        "tls": {"base_url": f"https://127.0.0.1:{model_port}/v1"},
        "key": {"api_key": "sk-wrong-key-0123456789abcdef0123"},
        "timeout": {
            "base_url": f"http://127.0.0.1:{silent_port}/v1",
            "read_timeout_seconds": 0.5,
        },
    }[case]


#: what a user reads, and what the log says, for each way the model fails
CASES = {
    "refused": ("CHAT_ERROR", "refused the connection", "connection refused"),
    "dns": ("CHAT_ERROR", "host name does not resolve", "does not resolve"),
    "tls": ("CHAT_ERROR", "secure connection", "secure connection failed"),
    "key": ("STREAM_ERROR", "refused the server's API key", "answered 401"),
    "timeout": ("CHAT_ERROR", "did not answer in time", "did not answer in time"),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_each_way_a_model_fails_is_said_in_its_own_words(
    settings, fake_model, silent_port, caplog, case
):
    key, said, logged = CASES[case]
    broken = settings.replace(llm=failing_model(case, settings, silent_port))
    with caplog.at_level(logging.DEBUG), serve(create_app(broken)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20, event_hooks=USER) as http:
            started = time.monotonic()
            events = await sse_chat(http, chat_body("q", chatId=f"m-{case}"))
            elapsed = time.monotonic() - started
    error = events[-1]
    assert error.type == "error" and error.data["key"] == key, error.data
    assert said in error.data["data"], error.data
    assert elapsed < 5
    # in words: no class names, addresses or the model's own text for the user
    assert not any(word in error.data["data"] for word in ("127.0.0.1", "Error", "invalid api"))
    lines = [r for r in caplog.records if r.name == "app.llm"]
    assert any(logged in r.getMessage() for r in lines), [r.getMessage() for r in lines]
    hosts = {getattr(r, "fields", {}).get("modelHost") for r in lines}
    assert hosts & {"127.0.0.1", "model.invalid"}
    everything = "\n".join(r.getMessage() + str(getattr(r, "fields", "")) for r in caplog.records)
    assert "sk-wrong-key" not in everything and "test-key" not in everything


async def test_the_check_at_start_says_when_the_model_cannot_be_reached(settings, fake_model):
    broken = settings.replace(llm={"base_url": f"http://127.0.0.1:{closed_port()}/v1"})
    with serve(create_app(broken)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20) as http:

            async def warned():
                ready = await http.get("/readyz")
                return ready.json().get("warnings") and ready

            ready = await wait_for(warned, timeout=10)
            assert ready.status_code == 200  # ready all the same: the model may come
            assert "refused the connection" in ready.json()["warnings"]["model"]
            config = (await http.get("/api/config")).json()
            assert "refused the connection" in config["modelProblem"]


async def test_the_check_at_start_finds_a_healthy_model_and_search(settings, fake_model):
    with serve(create_app(settings)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20) as http:
            await wait_for(lambda: _probed(running), timeout=10)
            ready = (await http.get("/readyz")).json()
            assert ready == {"status": "ready"}
            assert (await http.get("/api/config")).json()["searchProblem"] is None


async def _probed(running) -> bool:
    service: ChatService = running.app.state.service
    return not any(t.get_name() == "probe" for t in service.chores._tasks)


async def test_the_check_at_start_says_when_web_search_cannot_be_reached(settings, fake_model):
    offline = settings.replace(tavily={"base_url": f"http://127.0.0.1:{closed_port()}/tavily"})
    with serve(create_app(offline)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20) as http:

            async def said():
                return (await http.get("/api/config")).json()["searchProblem"]

            problem = await wait_for(said, timeout=10)
            assert "tavily search service refused the connection" in problem.lower()
            assert "(" not in problem


async def test_a_second_server_on_a_taken_port_says_so_before_serving(tmp_path, model_url):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    env = {"LLM_BASE_URL": model_url, "LLM_API_KEY": "k", "STORE_URL": f"sqlite:///{tmp_path}/c.db"}
    second = AppProcess(env)
    second.port = port
    second.env["PORT"] = str(port)
    try:
        second.start()  # the port answers: it is the first server's
        assert second.proc is not None and second.proc.wait(15) != 0
        output = second.output()
        assert f"port {port} is in use" in output and "set PORT" in output
        assert "serving" not in output and "startup complete" not in output.lower()
    finally:
        second.stop()
        taken.close()


async def test_a_question_during_a_restart_says_so_with_retry_after(server, fake_model):
    """While the server drains for a restart, a question on any transport is refused
    saying so — 503 with `Retry-After` over HTTP, an `error` frame on a WebSocket
    that stays open meanwhile — so a client tries again, elsewhere or a moment later."""
    from httpx_ws import aconnect_ws

    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        async with aconnect_ws(server.ws_url + "/api/chat/ws", http) as ws:
            server.app.state.service.accepting = False
            refused = await http.post("/api/chat/sse", json=chat_body("q"))
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["key"] == "INTERNAL"  # PROTOCOL's keys: none says "restart"
            assert "restarting" in refused.json()["data"]
            await ws.send_text(orjson.dumps(chat_body("q")).decode())
            frame = orjson.loads(await ws.receive_text())
            while frame["type"] == "signal":  # the socket's own signals come first
                frame = orjson.loads(await ws.receive_text())
            assert (frame["type"], frame["key"]) == ("error", "INTERNAL")
            assert "restarting" in frame["data"]
        v1 = await http.post(
            "/v1/chat/completions",
            json={"model": "deepSeek", "messages": [{"role": "user", "content": "q"}]},
        )
    assert v1.status_code == 503 and v1.headers["retry-after"] == "1"
    assert "restarting" in v1.json()["error"]["message"]


class _Ids:
    worker = 3


class _Service:
    ids = _Ids()


def test_the_start_up_warnings_say_how_to_fix_what_they_warn_of(caplog):
    bare = Settings().replace(server={"host": "0.0.0.0"}, llm={"api_key": ""})
    with caplog.at_level(logging.INFO):
        announce(bare, _Service())  # type: ignore[arg-type]
    text = caplog.text
    assert "AUTH_API_KEYS=" in text and "SERVER_HOST=127.0.0.1" in text
    assert "LLM_API_KEY" in text and "--demo" in text


async def test_model_requests_are_not_logged_one_line_each(settings, fake_model, caplog):
    from app import logs

    logs.configure()
    logging.getLogger().addHandler(caplog.handler)  # configure() set the root's handlers
    try:
        with caplog.at_level(logging.DEBUG):
            with serve(create_app(settings)) as running:
                async with httpx.AsyncClient(
                    base_url=running.url, timeout=10, event_hooks=USER
                ) as http:
                    await sse_chat(http, chat_body("hello there, a question of some length"))
    finally:
        logging.getLogger().handlers[:] = []
    assert any(r.name == "app.generation" for r in caplog.records)  # it does capture
    chatty = [
        r
        for r in caplog.records
        if r.levelno < logging.WARNING and r.name.split(".")[0] in logs.QUIET
    ]
    assert chatty == [], [(r.name, r.getMessage()) for r in chatty]


# -- the demo model ------------------------------------------------------------------------------


@pytest.fixture
def demo(settings) -> Settings:
    return settings.replace(
        llm={"base_url": "demo://?pace=0.005", "model": "demo", "api_key": ""},
        search={"provider": "demo"},
    )


async def test_the_demo_model_streams_reasons_cites_and_titles(demo):
    with serve(create_app(demo)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20, event_hooks=USER) as http:
            body = chat_body("what is a methane rocket engine?", chatId="demo1")
            body["focusMode"] = "webSearch"
            async with http.stream("POST", "/api/chat/sse", json=body) as response:
                assert response.status_code == 200
                events = await rest(iter_sse(response))
            types = [e.type for e in events]
            assert types[-1] == "messageEnd" and "sources" in types and "reasoning" in types
            sources = next(e for e in events if e.type == "sources").data["data"]
            assert "(demo)" in sources[0]["metadata"]["title"]
            answer = "".join(e.data["data"] for e in events if e.type == "message")
            assert "[1]" in answer and "made up" in answer
            assert sum(t == "message" for t in types) > 20  # word by word, not at once

            async def titled():
                chats = (await http.get("/api/chats")).json()["chats"]
                return chats and chats[0]["title"] != body["message"]["content"] and chats[0]

            chat = await wait_for(titled, timeout=5)
            assert chat["title"].lower().startswith("methane rocket")
            asked = await http.post("/api/suggestions", json={"chatId": "demo1", "userId": "1"})
            suggestions = asked.json()["suggestions"]
            assert len(suggestions) >= 3 and all(s.endswith("?") for s in suggestions)
            assert not any("not_needed" in s or "fake" in s for s in suggestions)
            config = (await http.get("/api/config")).json()
            assert config["demo"] is True and config["searchProblem"] is None
            models = (await http.get("/api/models")).json()["chatModelProviders"]
            assert "made-up" in orjson.dumps(models).decode()


async def test_the_demo_paces_its_answer_like_a_person_reads(demo):
    paced = demo.replace(llm={"base_url": "demo://?pace=0.05"})
    with serve(create_app(paced)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=30, event_hooks=USER) as http:
            async with http.stream("POST", "/api/chat/sse", json=chat_body("hello")) as response:
                arrivals = []
                async for item in iter_sse(response):
                    if getattr(item, "type", None) == "message":
                        arrivals.append(time.monotonic())
    gaps = [b - a for a, b in zip(arrivals[1:], arrivals[2:], strict=False)]
    assert len(gaps) > 10
    assert 0.03 < sorted(gaps)[len(gaps) // 2] < 0.2  # the median: ~20 words a second


async def test_python_m_app_demo_says_it_is_the_demo(tmp_path):
    process = AppProcess({"STORE_URL": f"sqlite:///{tmp_path}/d.db"}, args=("--demo",)).start()
    try:
        async with httpx.AsyncClient(base_url=process.url, timeout=20, event_hooks=USER) as http:
            events = await sse_chat(http, chat_body("hi", focusMode="webSearch"))
            assert events[-1].type == "messageEnd"
        serving = next(
            orjson.loads(line) for line in process.output().splitlines() if '"serving"' in line
        )
        assert serving["demo"] is True and serving["model"] == "demo"
        assert serving["searchProvider"] == "demo"
        assert "answers are made up" in process.output()
    finally:
        process.stop()


async def test_without_a_model_key_the_config_says_so_before_and_after_the_check(settings):
    keyless = settings.replace(llm={"api_key": ""})
    with serve(create_app(keyless)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20) as http:
            assert "LLM_API_KEY" in (await http.get("/api/config")).json()["modelProblem"]
            await wait_for(lambda: _probed(running), timeout=10)
            config = (await http.get("/api/config")).json()
            assert config["modelProblem"] == (
                "no model key is configured: set llm.api_key (LLM_API_KEY)"
            )
            ready = await http.get("/readyz")
            assert ready.status_code == 200 and "llm.api_key" in ready.json()["warnings"]["model"]


async def test_an_over_large_body_is_refused_naming_the_limit_and_its_setting(settings):
    small = settings.replace(limits={"max_body_bytes": 2000})
    with serve(create_app(small)) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=20) as http:
            body = chat_body("x" * 3000)
            refused = await http.post("/api/chat/sse", json=body)
            assert refused.status_code == 413
            reason = refused.json()["data"]
            assert "2000 bytes" in reason and "limits.max_body_bytes" in reason


def test_the_warning_for_auth_off_points_at_a_page_of_the_docs(caplog):
    bare = Settings().replace(server={"host": "0.0.0.0"})
    with caplog.at_level(logging.INFO):
        announce(bare, _Service())  # type: ignore[arg-type]
    page = re.search(r"\((docs/[a-z]+\.md)\)", caplog.text)
    assert page is not None and (Path(__file__).parents[1] / page[1]).is_file()
