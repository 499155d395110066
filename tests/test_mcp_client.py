"""The research agent's MCP client (PROTOCOL §14 client): an admin's MCP servers on
loopback — the tests' own `MCPServer` over Streamable HTTP, the reference
`@modelcontextprotocol/server-everything` from npm, one that is down and one that hangs —
their tools called by the fake model through real uvicorn."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.config import McpServerSettings, Settings, SettingsError, load
from app.main import create_app
from tests.client import answer_of, chat_body, sse_chat, wait_for
from tests.conftest import USER
from tests.fakes.mcp_server import LINK, FakeMcp
from tests.identity import browser, sign_up
from tests.logs import everything_logged
from tests.servers import ServerThread, free_port, npm_packages, serve, wait_for_port

pytestmark = pytest.mark.anyio

QUESTION = "how do methane rocket engines work"
SECRET = "Bearer mcp-secret-7f3a9c"


@pytest.fixture
def fake_mcp() -> Iterator[tuple[FakeMcp, ServerThread]]:
    fake = FakeMcp(slow_seconds=30)
    with serve(fake.app()) as server:
        yield fake, server


def with_servers(settings: Settings, **servers: McpServerSettings) -> Settings:
    return settings.replace(mcp={"servers": servers})


def handbook(server: ServerThread, **keys: Any) -> McpServerSettings:
    return McpServerSettings(url=server.url + "/mcp", headers={"Authorization": SECRET}, **keys)


def research(**fields: Any) -> dict[str, Any]:
    return chat_body(QUESTION, focusMode="webSearch", optimizationMode="balanced", **fields)


def tool_steps(events: list[Any]) -> list[dict[str, Any]]:
    return [
        e.data["step"]
        for e in events
        if e.type == "progress" and e.data.get("step", {}).get("kind") == "tool"
    ]


def offered(fake_model: Any) -> set[str]:
    first = fake_model.tool_requests()[0]
    return {t["function"]["name"] for t in first["tools"]}


async def listing(http: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    response = await http.get("/api/mcp/servers")
    assert response.status_code == 200, response.text
    return {s["name"]: s for s in response.json()["servers"]}


async def ready(http: httpx.AsyncClient, *names: str) -> dict[str, dict[str, Any]]:
    async def all_ready() -> Any:
        servers = await listing(http)
        return servers if all(servers[n]["status"] == "ready" for n in names) else None

    servers: dict[str, dict[str, Any]] = await wait_for(all_ready, timeout=30)
    return servers


@contextlib.asynccontextmanager
async def app_with(settings: Settings):
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60, event_hooks=USER) as http:
            yield http


# -- the agent answers with a tool ---------------------------------------------------------


async def test_the_agent_answers_with_a_tool_of_an_admins_mcp_server(
    settings, fake_model, fake_search, fake_mcp
):
    fake, mcp = fake_mcp
    fake_model.tool_rounds[:] = [[("handbook__lookup", {"topic": "raptor"})], [("done", {})]]
    async with app_with(with_servers(settings, handbook=handbook(mcp))) as http:
        servers = await ready(http, "handbook")
        events = await sse_chat(http, research())
    assert fake.calls == ["lookup:raptor"]
    assert fake.last_headers()["authorization"] == SECRET  # the admin's header was sent
    tools = {t["name"]: t for t in servers["handbook"]["tools"]}
    assert tools["lookup"]["description"] == "Look a topic up in the handbook."
    # offered with the server's own schema
    schema = next(
        t["function"]
        for t in fake_model.tool_requests()[0]["tools"]
        if t["function"]["name"] == "handbook__lookup"
    )
    assert schema["parameters"]["properties"]["topic"]["type"] == "string"
    assert schema["parameters"]["required"] == ["topic"]
    steps = tool_steps(events)
    assert [(s["server"], s["tool"], s["status"]) for s in steps] == [
        ("handbook", "lookup", "running"),
        ("handbook", "lookup", "done"),
    ]
    # what it returned went to the model as a tool message, and its link became a source
    second = fake_model.tool_requests()[1]["messages"]
    told = [m["content"] for m in second if m["role"] == "tool"]
    assert "Raptor burns methane" in told[0]
    sources = next(e for e in events if e.type == "sources").data["data"]
    mine = [s for s in sources if s["metadata"].get("url") == LINK]
    assert mine and mine[0]["metadata"]["tool"] == "handbook__lookup"
    assert mine[0]["metadata"]["title"] == "Raptor handbook"
    assert events[-1].type == "messageEnd" and answer_of(events)


def everything_script() -> str:
    """The reference server from npm (installed on first use)."""
    home = npm_packages("mcp_servers.sh")
    return os.path.join(
        home, "node_modules", "@modelcontextprotocol", "server-everything", "dist", "index.js"
    )


@pytest.fixture
def everything() -> Iterator[str]:
    """The reference server, over Streamable HTTP on loopback: its URL."""
    port = free_port()
    process = subprocess.Popen(
        ["node", everything_script(), "streamableHttp"],
        env={**os.environ, "PORT": str(port)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        process.wait(10)


async def test_the_reference_server_from_npm_answers_a_call(
    settings, fake_model, fake_search, everything
):
    config = McpServerSettings(url=everything, tools=("echo", "get-sum"))
    fake_model.tool_rounds[:] = [
        [("everything__get-sum", {"a": 2, "b": 40}), ("everything__echo", {"message": "hi"})],
        [("done", {})],
    ]
    async with app_with(with_servers(settings, everything=config)) as http:
        servers = await ready(http, "everything")
        events = await sse_chat(http, research())
    # `tools` keeps the list to the two named
    assert {t["name"] for t in servers["everything"]["tools"]} == {"echo", "get-sum"}
    assert {"everything__echo", "everything__get-sum"} <= offered(fake_model)
    assert not any(name.startswith("everything__get-env") for name in offered(fake_model))
    done = [s for s in tool_steps(events) if s["status"] == "done"]
    assert sorted(s["tool"] for s in done) == ["echo", "get-sum"]
    told = [m["content"] for m in fake_model.tool_requests()[1]["messages"] if m["role"] == "tool"]
    assert any("42" in t for t in told) and any("hi" in t for t in told)


async def test_a_stdio_server_is_started_by_its_command_when_allowed(
    settings, fake_model, fake_search
):
    local = McpServerSettings(command="node", args=(everything_script(), "stdio"))
    fake_model.tool_rounds[:] = [[("local__echo", {"message": "from stdio"})], [("done", {})]]
    config = with_servers(settings, local=local).replace(mcp={"allow_stdio": True})
    async with app_with(config) as http:
        await ready(http, "local")
        events = await sse_chat(http, research())
    assert [s["status"] for s in tool_steps(events)] == ["running", "done"]
    told = [m["content"] for m in fake_model.tool_requests()[1]["messages"] if m["role"] == "tool"]
    assert told == ["Echo: from stdio"]
    async with app_with(with_servers(settings, local=local)) as http:

        async def refused() -> Any:
            server = (await listing(http))["local"]
            return server if server["status"] == "down" else None

        stopped = await wait_for(refused, timeout=5)
    assert "allow_stdio" in stopped["error"]  # without it, the command is never run


# -- failures fail the step, and the answer goes on -----------------------------------------


async def test_a_slow_an_erring_and_a_flooding_tool_fail_their_steps_with_why(
    settings, fake_model, fake_search, fake_mcp
):
    _, mcp = fake_mcp
    fake_model.tool_rounds[:] = [
        [
            ("handbook__slow", {"topic": "a"}),
            ("handbook__broken", {"topic": "b"}),
            ("handbook__lookup", {"topic": "d"}),
        ],
        [("handbook__flood", {"topic": "c"})],  # a round of its own: it ends the session
        [("done", {})],
    ]
    config = handbook(mcp, timeout_seconds=1.0)
    async with app_with(with_servers(settings, handbook=config)) as http:
        await ready(http, "handbook")
        started = time.monotonic()
        events = await sse_chat(http, research())
        took = time.monotonic() - started
    ended = {s["tool"]: s for s in tool_steps(events) if s["status"] != "running"}
    assert ended["slow"]["status"] == "failed" and "within 1 s" in ended["slow"]["error"]
    assert ended["broken"]["status"] == "failed" and "failed" in ended["broken"]["error"]
    assert ended["flood"]["status"] == "failed" and "too much" in ended["flood"]["error"]
    assert events[-1].type == "messageEnd" and answer_of(events)
    assert took < 15  # the slow tool's 30 s were not waited for
    # the model was told why, in the tool role
    told = [m["content"] for m in fake_model.tool_requests()[1]["messages"] if m["role"] == "tool"]
    assert any("within 1 s" in t for t in told)
    assert all(len(t) < 25_000 for t in told)


async def test_a_long_result_is_cut_to_max_result_chars(
    settings, fake_model, fake_search, fake_mcp
):
    _, mcp = fake_mcp
    fake_model.tool_rounds[:] = [[("handbook__long", {"topic": "a"})], [("done", {})]]
    cut = settings.replace(mcp={"max_result_chars": 1000})
    async with app_with(with_servers(cut, handbook=handbook(mcp))) as http:
        await ready(http, "handbook")
        events = await sse_chat(http, research())
    ended = [s for s in tool_steps(events) if s["status"] != "running"]
    assert ended[0]["status"] == "done" and ended[0]["truncated"] is True
    told = [m["content"] for m in fake_model.tool_requests()[1]["messages"] if m["role"] == "tool"]
    assert told[0].startswith("yyy") and len(told[0]) < 1100


async def test_a_down_and_a_hanging_server_delay_no_answer(
    settings, fake_model, fake_search, fake_mcp
):
    _, mcp = fake_mcp
    hanging = socket.socket()
    hanging.bind(("127.0.0.1", 0))
    hanging.listen(8)  # accepts, never answers
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        hanging.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                accepted.append(hanging.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    down_port = free_port()  # nothing listens there
    fake_model.tool_rounds[:] = [[("handbook__lookup", {"topic": "raptor"})], [("done", {})]]
    try:
        config = with_servers(
            settings,
            handbook=handbook(mcp),
            down=McpServerSettings(url=f"http://127.0.0.1:{down_port}/mcp", timeout_seconds=5),
            hangs=McpServerSettings(
                url=f"http://127.0.0.1:{hanging.getsockname()[1]}/mcp", timeout_seconds=20
            ),
        )
        async with app_with(config) as http:
            await ready(http, "handbook")
            started = time.monotonic()
            events = await sse_chat(http, research())
            took = time.monotonic() - started
            servers = await listing(http)
    finally:
        stop.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        hanging.close()
    assert took < 10  # the hanging server's 20 s were not waited for
    assert events[-1].type == "messageEnd"
    assert servers["down"]["status"] == "down" and "refused" in servers["down"]["error"]
    assert servers["down"]["tools"] == []
    assert servers["hangs"]["status"] == "connecting"
    assert not any(n.startswith(("down__", "hangs__")) for n in offered(fake_model))


async def test_a_server_that_goes_down_fails_the_step_and_comes_back(
    settings, fake_model, fake_search
):
    fake = FakeMcp()
    port = free_port()
    quick = {"timeout_graceful_shutdown": 1}  # its open GET stream is not waited for
    first = ServerThread(fake.app(), port=port, **quick).start()
    fake_model.tool_rounds[:] = [[("handbook__lookup", {"topic": "raptor"})], [("done", {})]]
    async with app_with(with_servers(settings, handbook=handbook(first))) as http:
        await ready(http, "handbook")
        first.stop()
        events = await sse_chat(http, research())
        failed = [s for s in tool_steps(events) if s["status"] == "failed"]
        assert failed and failed[0]["tool"] == "lookup" and failed[0]["error"]
        assert events[-1].type == "messageEnd"
        again = ServerThread(fake.app(), port=port, **quick).start()
        try:
            await ready(http, "handbook")  # connected again in the background
        finally:
            again.stop()


# -- what a request may and may not do -------------------------------------------------------


async def test_a_server_not_default_is_offered_only_when_the_request_names_it(
    settings, fake_model, fake_search, fake_mcp
):
    _, mcp = fake_mcp
    config = with_servers(settings, handbook=handbook(mcp, default=False))
    async with app_with(config) as http:
        await ready(http, "handbook")
        fake_model.tool_rounds[:] = [[("done", {})]]
        await sse_chat(http, research())
        without = offered(fake_model)
        fake_model.reset()
        fake_model.tool_rounds[:] = [[("done", {})]]
        await sse_chat(http, research(sources=["web", "mcp:handbook"]))
        named = offered(fake_model)
    assert not any(n.startswith("handbook__") for n in without)
    assert "handbook__lookup" in named and "web_search" in named


async def test_a_request_cannot_add_a_server(settings, fake_model, fake_search, fake_mcp):
    _, mcp = fake_mcp
    fake_model.tool_rounds[:] = [[("other__lookup", {"topic": "x"})], [("done", {})]]
    async with app_with(settings) as http:
        events = await sse_chat(
            http, research(sources=["web", "mcp:other"], mcp={"servers": {"other": mcp.url}})
        )
        refused = await http.post("/api/chat/sse", json=research(sources=[f"mcp:{mcp.url}/mcp"]))
        servers = (await http.get("/api/mcp/servers")).json()["servers"]
    assert servers == []
    assert not tool_steps(events)
    assert not any(n.startswith("other__") for n in offered(fake_model))
    assert refused.status_code == 400 and refused.json()["key"] == "BAD_REQUEST"


async def test_tool_results_are_data_kept_in_the_tool_role(
    settings, fake_model, fake_search, fake_mcp
):
    _, mcp = fake_mcp
    fake_model.tool_rounds[:] = [[("handbook__sneaky", {"topic": "x"})], [("done", {})]]
    async with app_with(with_servers(settings, handbook=handbook(mcp))) as http:
        await ready(http, "handbook")
        await sse_chat(http, research())
    messages = fake_model.tool_requests()[1]["messages"]
    told = [m["content"] for m in messages if m["role"] == "tool"]
    assert "fact one" in told[0] and "fact two" in told[0]
    for marker in ("</context>", "<|im_start|>", "<|im_end|>"):
        assert marker not in told[0]
    assert all("fact one" not in str(m["content"]) for m in messages if m["role"] != "tool")


@pytest.mark.parametrize("revision", ["stateless", "handshake"])
async def test_the_list_is_refreshed_when_the_server_says_it_changed(
    settings, fake_model, fake_search, revision
):
    fake = FakeMcp(handshake=revision == "handshake")
    fake_model.tool_rounds[:] = [[("handbook__grow", {})], [("done", {})]]
    with serve(fake.app()) as mcp:
        async with app_with(with_servers(settings, handbook=handbook(mcp))) as http:
            before = await ready(http, "handbook")
            await sse_chat(http, research())

            async def grown() -> Any:
                tools = {t["name"] for t in (await listing(http))["handbook"]["tools"]}
                return "extra" in tools

            assert await wait_for(grown, timeout=10)
    assert "extra" not in {t["name"] for t in before["handbook"]["tools"]}
    versions = {h.get("mcp-protocol-version") for h in fake.headers} - {None}
    if revision == "handshake":  # the probe, then the handshake revision
        assert "2025-11-25" in versions
    else:
        assert versions == {"2026-07-28"}


# -- the listing, and secrets ---------------------------------------------------------------


async def test_the_listing_is_for_admins_and_secrets_show_nowhere(
    settings, fake_model, fake_search, fake_mcp, caplog
):
    caplog.set_level(logging.DEBUG)
    _, mcp = fake_mcp
    down = McpServerSettings(
        url=f"http://127.0.0.1:{free_port()}/mcp", headers={"X-Api-Key": "other-secret-99"}
    )
    config = with_servers(settings, handbook=handbook(mcp), down=down).replace(
        auth={"mode": "accounts"}
    )
    with serve(create_app(config)) as server:
        async with browser(server.url) as admin, browser(server.url) as someone:
            await sign_up(admin, "admin@example.org")
            await sign_up(someone, "someone@example.org")
            servers = await ready(admin, "handbook")
            refused = await someone.get("/api/mcp/servers")
            shown = (await admin.get("/api/mcp/servers")).text
            picker = (await someone.get("/api/config")).json()["mcpServers"]
    assert refused.status_code == 403
    assert servers["handbook"]["status"] == "ready" and servers["handbook"]["tools"]
    assert picker == [{"name": "handbook", "default": True}, {"name": "down", "default": True}]
    logged = everything_logged(caplog.records)
    for secret in ("mcp-secret-7f3a9c", "other-secret-99"):
        assert secret not in shown and secret not in logged
    assert mcp.url not in shown
    assert repr(config.mcp).count("secret") == 0


# -- configuration ------------------------------------------------------------------------------


def test_a_server_is_a_url_or_with_allow_stdio_a_command(tmp_path):
    path = tmp_path / "config.toml"

    def loaded(text: str, env: dict[str, str] | None = None) -> Settings:
        path.write_text(text)
        return load(path, env or {})

    both = '[mcp.servers.x]\nurl = "http://127.0.0.1:1/mcp"\ncommand = "tool"\n'
    with pytest.raises(SettingsError, match="either url"):
        loaded(both)
    with pytest.raises(SettingsError, match="allow_stdio"):
        loaded('[mcp.servers.x]\ncommand = "tool"\n')
    with pytest.raises(SettingsError, match="a name is"):
        loaded('[mcp.servers."a__b"]\nurl = "http://127.0.0.1:1/mcp"\n')
    stdio = loaded('[mcp]\nallow_stdio = true\n[mcp.servers.x]\ncommand = "tool"\nargs = ["-v"]\n')
    assert stdio.mcp.servers["x"].args == ("-v",)
    env = {"MCP_SERVERS_GH_HEADERS": "Authorization:Bearer k", "MCP_SERVERS_GH_DEFAULT": "false"}
    github = loaded('[mcp.servers.gh]\nurl = "https://example.org/mcp"\n', env).mcp.servers["gh"]
    assert dict(github.headers) == {"Authorization": "Bearer k"} and github.default is False
    assert "Bearer" not in repr(github)
