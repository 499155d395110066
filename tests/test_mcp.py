"""`/mcp` (PROTOCOL §14, server): the official `mcp` client through real uvicorn with the
fake model and the fake web — tools, progress, cancel, resume, auth, bad input."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
import orjson
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from mcp.client.client import Client
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from app.main import create_app
from app.transport.mcp_sessions import Call, MemorySessions, RedisSessions
from tests import test_processes
from tests.client import wait_for
from tests.fakes.search import RELEVANT_QUESTION
from tests.identity import browser, sign_up
from tests.servers import ROOT, AppProcess, npm_packages, serve
from tests.test_collections import create

pytestmark = pytest.mark.anyio

HANDSHAKE = {"accept": "application/json, text/event-stream", "content-type": "application/json"}


@contextlib.asynccontextmanager
async def session(url: str, key: str | None = None) -> AsyncIterator[ClientSession]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=30) as http,
        streamable_http_client(url + "/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as client,
    ):
        await client.initialize()
        yield client


def initialize(version: str = "2025-06-18") -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": version,
            "capabilities": {},
            "clientInfo": {"name": "test", "version": "1"},
        },
    }


async def test_the_tools_are_listed(settings, fake_model, fake_search):
    with serve(create_app(settings)) as server:
        async with session(server.url) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
    assert set(tools) == {"web_search", "ask", "deep_research"}
    assert tools["ask"].input_schema["required"] == ["question"]


async def test_web_search_answers_results_as_structured_content(settings, fake_model, fake_search):
    with serve(create_app(settings)) as server:
        async with session(server.url) as client:
            result = await client.call_tool(
                "web_search", {"query": RELEVANT_QUESTION, "max_results": 3}
            )
    assert not result.is_error
    results = result.structured_content["results"]
    assert 0 < len(results) <= 3
    assert {"title", "url", "snippet"} <= set(results[0])
    assert results[0]["url"] in result.content[0].text


async def test_ask_answers_with_citations_progress_and_a_saved_chat(
    settings, fake_model, fake_search
):
    fake_model.answer_text = "Raptor burns methane [1]."
    notes: list[tuple[float, str | None]] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        notes.append((value, message))

    with serve(create_app(settings)) as server:
        async with session(server.url) as client:
            result = await client.call_tool(
                "ask", {"question": RELEVANT_QUESTION}, progress_callback=progress
            )
        data = result.structured_content
        async with httpx.AsyncClient() as http:
            saved = await http.get(server.url + f"/api/chats/{data['chatId']}?userId=0")
        chat = saved.json()
    assert not result.is_error
    assert data["answer"] == "Raptor burns methane [1]."
    assert data["sources"][0]["n"] == 1 and data["sources"][0]["url"].startswith("http")
    assert "Raptor burns methane [1]." in result.content[0].text
    assert chat["messages"][-1]["id"] == data["messageId"]
    assert chat["messages"][-1]["content"] == data["answer"]
    assert notes and all(isinstance(m, str) and m for _, m in notes)
    assert [v for v, _ in notes] == sorted(v for v, _ in notes)


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_each_revision_the_sdk_speaks_answers_with_progress(
    settings, fake_model, fake_search, mode
):
    notes: list[str | None] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        notes.append(message)

    with serve(create_app(settings)) as server:
        async with Client(server.url + "/mcp", mode=mode) as client:
            version = client.protocol_version
            result = await client.call_tool(
                "ask", {"question": RELEVANT_QUESTION}, progress_callback=progress
            )
    assert version == ("2026-07-28" if mode == "auto" else "2025-11-25")
    assert result.structured_content["answer"] == "".join(f"tok{i} " for i in range(5))
    assert notes


async def add_as_anyone(
    http: httpx.AsyncClient, collection_id: str, files: dict[str, bytes]
) -> None:
    """Documents added to a collection of user "0" (auth off, no `userId`), indexed."""
    url = f"/api/collections/{collection_id}"
    added = await http.post(url + "/documents", files=[("files", f) for f in files.items()])
    imported = url + f"/imports/{added.json()['import']['id']}"

    async def indexed() -> bool:
        progress = (await http.get(imported)).json()
        return bool(progress["done"] == progress["total"])

    await wait_for(indexed, timeout=60)


async def test_search_collection_is_listed_to_a_reader_and_finds_passages(
    settings, fake_model, fake_search
):
    with serve(create_app(settings.replace(embeddings={"model": ""}))) as server:
        async with session(server.url) as client:
            before = {t.name for t in (await client.list_tools()).tools}
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                collection = await create(http, user="0")
                text = b"The Raptor engine burns liquid methane with liquid oxygen."
                await add_as_anyone(http, collection["id"], {"raptor.txt": text})
            after = {t.name for t in (await client.list_tools()).tools}
            result = await client.call_tool(
                "search_collection",
                {"collection_id": collection["id"], "query": "methane engine", "limit": 3},
            )
    assert "search_collection" not in before and "search_collection" in after
    passages = result.structured_content["results"]
    assert passages[0]["metadata"]["collectionId"] == collection["id"]
    assert "methane" in passages[0]["pageContent"]


async def test_deep_research_reports_each_step_as_progress(settings, fake_model, fake_search):
    fake_model.tool_rounds[:] = [[("web_search", {"query": "raptor"})], [("done", {})]]
    notes: list[str | None] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        notes.append(message)

    with serve(create_app(settings)) as server:
        async with session(server.url) as client:
            result = await client.call_tool(
                "deep_research", {"question": RELEVANT_QUESTION}, progress_callback=progress
            )
        async with httpx.AsyncClient() as http:
            chat_id = result.structured_content["chatId"]
            chat = (await http.get(server.url + f"/api/chats/{chat_id}?userId=0")).json()
    assert chat["chat"]["focusMode"] == "deepResearch"
    assert "round 2: enough found" in notes
    assert [q for _, q in fake_search.queries] == ["raptor"]
    assert result.structured_content["sources"]


async def test_rate_limits_count_tool_calls_as_any_answer(
    settings, fake_model, fake_search, hour_windows
):
    with serve(create_app(settings.replace(limits={"requests_per_minute": 1}))) as server:
        async with session(server.url) as client:
            first = await client.call_tool("ask", {"question": RELEVANT_QUESTION})
            second = await client.call_tool("ask", {"question": RELEVANT_QUESTION})
    assert not first.is_error
    assert second.is_error and second.content[0].text.startswith("RATE_LIMITED")


async def test_unknown_tools_and_wrong_arguments_are_json_rpc_errors(
    settings, fake_model, fake_search
):
    from mcp.shared.exceptions import MCPError

    with serve(create_app(settings)) as server:
        async with session(server.url) as client:
            for name, args in [
                ("nope", {}),
                ("ask", {}),
                ("ask", {"question": "x", "optimization_mode": "slow"}),
                ("ask", {"question": "x", "model": "other/model"}),
                ("web_search", {"query": "x", "max_results": 0}),
            ]:
                with pytest.raises(MCPError) as caught:
                    await client.call_tool(name, args)
                assert caught.value.error.code == -32602
                if "model" in args:
                    assert "default/fake-chat" in caught.value.error.message


def test_mcp_off_is_not_found(settings):
    with serve(create_app(settings.replace(mcp={"server": False}))) as server:
        response = httpx.post(server.url + "/mcp", json=initialize(), headers=HANDSHAKE)
    assert response.status_code == 404


def test_a_batch_is_refused_per_revision(settings):
    with serve(create_app(settings)) as server:
        new = httpx.post(
            server.url + "/mcp",
            content=orjson.dumps([initialize()]),
            headers={**HANDSHAKE, "mcp-protocol-version": "2025-06-18"},
        )
        old = httpx.post(
            server.url + "/mcp",
            content=orjson.dumps([initialize("2025-03-26")]),
            headers={**HANDSHAKE, "mcp-protocol-version": "2025-03-26"},
        )
    assert new.status_code == 400 and new.json()["error"]["code"] == -32600
    assert old.status_code == 400 and old.json()[0]["error"]["code"] == -32600


def test_a_body_over_the_limit_is_413_in_json_rpc(settings):
    with serve(create_app(settings.replace(limits={"max_body_bytes": 1000}))) as server:
        response = httpx.post(
            server.url + "/mcp", content=b'{"x":"' + b"a" * 5000 + b'"}', headers=HANDSHAKE
        )
    assert response.status_code == 413 and response.json()["error"]["code"] == -32600


def test_with_auth_a_request_without_a_key_is_401_naming_the_metadata(settings):
    with serve(create_app(settings.replace(auth={"api_keys": {"k1": "u1"}}))) as server:
        refused = httpx.post(server.url + "/mcp", json=initialize(), headers=HANDSHAKE)
        metadata = [
            httpx.get(server.url + path).json()
            for path in (
                "/.well-known/oauth-protected-resource/mcp",
                "/.well-known/oauth-protected-resource",
            )
        ]
        allowed = httpx.post(
            server.url + "/mcp",
            json=initialize(),
            headers={**HANDSHAKE, "authorization": "Bearer k1"},
        )
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"] == (
        f'Bearer resource_metadata="{server.url}/.well-known/oauth-protected-resource/mcp"'
    )
    for document in metadata:
        assert document["resource"] == server.url + "/mcp"
        assert document["authorization_servers"] == []
        assert document["bearer_methods_supported"] == ["header"]
    assert allowed.status_code == 200 and allowed.headers["mcp-session-id"]


def test_the_metadata_names_the_jwt_issuer(settings):
    auth = {"mode": "accounts", "jwt": {"issuer": "https://id.example", "audience": "mcp"}}
    with serve(create_app(settings.replace(auth=auth))) as server:
        document = httpx.get(server.url + "/.well-known/oauth-protected-resource").json()
    assert document["authorization_servers"] == ["https://id.example"]


async def test_a_cookie_signed_call_must_come_from_the_servers_own_pages(settings):
    with serve(create_app(settings.replace(auth={"mode": "accounts"}))) as server:
        async with browser(server.url) as http:
            await sign_up(http, "a@example.test")
            own = await http.post("/mcp", json=initialize(), headers=HANDSHAKE)
            foreign = await http.post(
                "/mcp", json=initialize(), headers={**HANDSHAKE, "origin": "https://evil.test"}
            )
    assert own.status_code == 200
    assert foreign.status_code == 403


MESSAGES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
RPC = st.fixed_dictionaries(
    {
        "jsonrpc": st.sampled_from(["2.0", "1.0", 2]),
        "method": st.sampled_from(
            ["initialize", "tools/call", "tools/list", "ping", "notifications/cancelled", "nope"]
        )
        | st.text(max_size=10),
    },
    optional={"id": st.integers() | st.text(max_size=8) | st.none(), "params": MESSAGES},
)


def test_fuzzed_json_rpc_bodies_never_answer_500(settings, fake_model, fake_search):
    with serve(create_app(settings)) as server, httpx.Client(timeout=30) as http:

        @hsettings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=RPC | MESSAGES, version=st.sampled_from([None, "2025-06-18", "2025-11-25"]))
        def check(body: Any, version: str | None) -> None:
            headers = dict(HANDSHAKE)
            if version:
                headers["mcp-protocol-version"] = version
            response = http.post(server.url + "/mcp", content=json.dumps(body), headers=headers)
            assert response.status_code < 500, response.text

        check()
        garbage = http.post(server.url + "/mcp", content=b"{nope", headers=HANDSHAKE)
    assert garbage.status_code == 400 and garbage.json()["error"]["code"] == -32700


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_cancelled_call_stops_the_model_and_saves_the_answer_cancelled(
    settings, fake_model, fake_search, mode
):
    with serve(create_app(settings)) as server:
        async with (
            Client(server.url + "/mcp", mode=mode) as client,
            anyio.create_task_group() as calls,
        ):
            calls.start_soon(client.call_tool, "ask", {"question": RELEVANT_QUESTION + " #hang"})
            await wait_for(model_streams(fake_model))
            # legacy: the client sends notifications/cancelled; 2026-07-28: it closes the stream
            calls.cancel_scope.cancel()
        record = await fake_model.wait_stream_end()
        async with httpx.AsyncClient() as http:
            chats = (await http.get(server.url + "/api/chats?userId=0")).json()["chats"]
            url = server.url + f"/api/chats/{chats[0]['id']}?userId=0"

            async def saved() -> Any:
                answer = (await http.get(url)).json()["messages"][-1]
                return answer if answer["status"] != "streaming" else None

            answer = await wait_for(saved)
    assert record.outcome == "client_closed"
    assert answer["status"] == "cancelled"


def model_streams(fake_model: Any) -> Any:
    async def streaming() -> bool:
        return bool(fake_model.streams)

    return streaming


# -- raw Streamable HTTP: resume and cancel on another process ---------------------------------


async def sse_events(response: httpx.Response) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """(id, JSON-RPC message) of each event of an SSE response."""
    event_id, data = "", []
    async for line in response.aiter_lines():
        if line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif not line and data:
            text = "".join(data)  # empty: 2025-11-25's priming event
            yield event_id, orjson.loads(text) if text else {}
            event_id, data = "", []


async def open_session(http: httpx.AsyncClient, url: str, version: str) -> dict[str, str]:
    """A handshake: the headers the session's next requests carry."""
    opened = await http.post(url + "/mcp", json=initialize(version), headers=HANDSHAKE)
    headers = {
        **HANDSHAKE,
        "mcp-session-id": opened.headers["mcp-session-id"],
        "mcp-protocol-version": version,
    }
    done = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert (await http.post(url + "/mcp", json=done, headers=headers)).status_code == 202
    return headers


def ask_call(question: str, request_id: int = 7) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "tools/call",
        "params": {
            "name": "ask",
            "arguments": {"question": question},
            "_meta": {"progressToken": "p1"},
        },
    }


#: two server processes on one Redis, or on a Redis Cluster, searching the fake web
pair = test_processes.pair


@pytest.mark.parametrize("version", ["2025-06-18", "2025-11-25"])
async def test_a_dropped_call_resumes_on_the_other_process(pair, fake_model, version):
    a, b = pair
    question = RELEVANT_QUESTION + " #tokens=30 #delay=0.05"
    async with httpx.AsyncClient(timeout=30) as http:
        headers = await open_session(http, a.url, version)
        seen: list[tuple[str, dict[str, Any]]] = []
        async with http.stream(
            "POST", a.url + "/mcp", json=ask_call(question), headers=headers
        ) as live:
            async for event_id, message in sse_events(live):
                seen.append((event_id, message))
                if message.get("method") == "notifications/progress":
                    break  # the connection drops here
        last = seen[-1][0]
        resumed: list[tuple[str, dict[str, Any]]] = []
        async with http.stream(
            "GET", b.url + "/mcp", headers={**headers, "last-event-id": last}
        ) as again:
            assert again.status_code == 200
            async for event_id, message in sse_events(again):
                resumed.append((event_id, message))
                if "result" in message:
                    break
        result = resumed[-1][1]
        data = result["result"]["structuredContent"]
        chat = (await http.get(b.url + f"/api/chats/{data['chatId']}?userId=0")).json()
    assert result["id"] == 7
    assert data["answer"] == "".join(f"tok{i} " for i in range(30))
    assert chat["messages"][-1]["content"] == data["answer"]
    last_seq = int(last.rpartition(":")[2])
    assert last_seq > 0  # the id names the progress event's seq
    progress = [m for _, m in resumed if m.get("method") == "notifications/progress"]
    assert all(m["params"]["progress"] > last_seq for m in progress)
    assert all(m["params"]["progressToken"] == "p1" for m in progress)
    assert [i.rpartition(":")[0] for i, _ in resumed] == [last.rpartition(":")[0]] * len(resumed)


async def test_a_cancel_sent_to_the_other_process_stops_the_call(pair, fake_model):
    a, b = pair
    async with httpx.AsyncClient(timeout=30) as http:
        headers = await open_session(http, a.url, "2025-06-18")
        async with http.stream(
            "POST", a.url + "/mcp", json=ask_call(RELEVANT_QUESTION + " #hang"), headers=headers
        ) as live:
            await wait_for(model_streams(fake_model))
            cancel = {
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": {"requestId": 7},
            }
            assert (
                await http.post(b.url + "/mcp", json=cancel, headers=headers)
            ).status_code == 202
            messages = [m async for _, m in sse_events(live)]
        record = await fake_model.wait_stream_end()
    assert record.outcome == "client_closed"
    assert "(cancelled)" in messages[-1]["result"]["content"][0]["text"]


async def test_a_resume_from_the_start_replays_what_the_live_call_sent(
    settings, fake_model, fake_search
):
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(timeout=30) as http:
            headers = await open_session(http, server.url, "2025-11-25")
            call = ask_call(RELEVANT_QUESTION)
            async with http.stream("POST", server.url + "/mcp", json=call, headers=headers) as live:
                sent = [(i, m) async for i, m in sse_events(live) if m]
            first = sent[0][0].rpartition(":")[0] + ":0"
            async with http.stream(
                "GET", server.url + "/mcp", headers={**headers, "last-event-id": first}
            ) as again:
                replayed = [(i, m) async for i, m in sse_events(again)]
    assert [m.get("method") for _, m in sent][:1] == ["notifications/progress"]
    assert replayed == sent


async def test_sigterm_ends_a_running_call_with_its_cancelled_answer(
    tmp_path, model_url, fake_model
):
    env = {
        "LLM_BASE_URL": model_url,
        "LLM_API_KEY": "test-key",
        "STORE_URL": f"sqlite:///{tmp_path}/chat.db",
        "SERVER_SHUTDOWN_GRACE_SECONDS": "1",
        "SEARCH_PROVIDER": "demo",
    }
    server = AppProcess(env).start()
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            headers = await open_session(http, server.url, "2025-11-25")
            call = ask_call("long #tokens=500 #delay=0.02")
            async with http.stream("POST", server.url + "/mcp", json=call, headers=headers) as live:
                messages, events = [], sse_events(live)
                async for _, message in events:
                    messages.append(message)
                    if message.get("method") == "notifications/progress":
                        assert server.proc is not None
                        server.proc.send_signal(signal.SIGTERM)
                        break
                messages += [m async for _, m in events]
        assert server.proc is not None
        server.proc.wait(15)
    finally:
        server.stop()
    result = messages[-1]["result"]
    assert result["content"][0]["text"].endswith("(cancelled)")
    assert result["structuredContent"]["answer"]
    assert server.proc.returncode in (0, -signal.SIGTERM)
    assert (await fake_model.wait_stream_end()).outcome == "client_closed"


async def test_a_deleted_session_is_not_found_and_get_without_an_event_id_is_405(settings):
    with serve(create_app(settings)) as server:
        async with httpx.AsyncClient(timeout=30) as http:
            headers = await open_session(http, server.url, "2025-06-18")
            listed = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
            before = await http.post(server.url + "/mcp", json=listed, headers=headers)
            stream = await http.get(server.url + "/mcp", headers=headers)
            deleted = await http.delete(server.url + "/mcp", headers=headers)
            after = await http.post(server.url + "/mcp", json=listed, headers=headers)
            unknown = await http.get(
                server.url + "/mcp", headers={**headers, "last-event-id": "Nw:3"}
            )
    assert before.status_code == 200
    assert stream.status_code == 405
    assert deleted.status_code == 200
    assert after.status_code == 404 and after.json()["error"]["code"] == -32600
    assert unknown.status_code == 404


async def test_another_users_session_is_not_found(settings, fake_model):
    with serve(create_app(settings.replace(auth={"api_keys": {"k1": "u1", "k2": "u2"}}))) as server:
        async with httpx.AsyncClient(timeout=30) as http:
            mine = await open_session_as(http, server.url, "k1")
            theirs = {**mine, "authorization": "Bearer k2"}
            listed = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
            refused = await http.post(server.url + "/mcp", json=listed, headers=theirs)
            allowed = await http.post(server.url + "/mcp", json=listed, headers=mine)
    assert refused.status_code == 404
    assert allowed.status_code == 200


async def open_session_as(http: httpx.AsyncClient, url: str, key: str) -> dict[str, str]:
    auth = {"authorization": f"Bearer {key}"}
    opened = await http.post(url + "/mcp", json=initialize(), headers={**HANDSHAKE, **auth})
    return {
        **HANDSHAKE,
        **auth,
        "mcp-session-id": opened.headers["mcp-session-id"],
        "mcp-protocol-version": "2025-06-18",
    }


def test_the_docs_example_asks_and_prints_the_cited_answer(settings, fake_model, fake_search):
    fake_model.answer_text = "Methane [1]."
    page = (ROOT / "docs" / "mcp.md").read_text()
    example = page.split("```python\n", 1)[1].split("```", 1)[0]
    with serve(create_app(settings)) as server:
        code = example.replace("http://127.0.0.1:8080", server.url)
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
        )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "Methane [1]." in lines
    assert any(line.startswith("… ") for line in lines)
    assert any(line.startswith("[1] ") for line in lines)


# -- sessions ---------------------------------------------------------------------------------


async def test_memory_sessions_expire_and_are_bounded():
    idle = MemorySessions(idle_seconds=0)
    assert await idle.owner(await idle.open("u1")) is None
    sessions = MemorySessions(max_sessions=2)
    first, second, third = [await sessions.open(u) for u in ("u1", "u2", "u3")]
    assert await sessions.owner(first) is None
    assert [await sessions.owner(s) for s in (second, third)] == ["u2", "u3"]
    await sessions.close(second)
    assert await sessions.owner(second) is None


async def test_redis_sessions_expire_when_idle(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    try:
        sessions = RedisSessions(client, idle_seconds=60, keep_seconds=30)
        session_id = await sessions.open("u1")
        call = Call(7, "p1", "ask", "c1", "a1")
        await sessions.remember(session_id, "Nw", call)
        assert await sessions.owner(session_id) == "u1"
        assert await sessions.call(session_id, "Nw") == call
        assert 0 < await client.ttl(f"mcp:session:{session_id}") <= 60
        assert 0 < await client.ttl(f"mcp:call:{session_id}:Nw") <= 30
        await sessions.close(session_id)
        assert await sessions.owner(session_id) is None
    finally:
        await client.aclose()


# -- the Node clients ------------------------------------------------------------------------


def run_node(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["node", *args],
        env={**os.environ, "MCP_CLIENTS_HOME": npm_packages("mcp_clients.sh"), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_typescript_sdk_lists_asks_with_progress_and_searches(
    settings, fake_model, fake_search
):
    fake_model.answer_text = "Raptor burns methane [1]."
    with serve(create_app(settings)) as server:
        done = run_node(
            str(ROOT / "tests" / "mcp_clients" / "sdk.mjs"),
            env={"URL": server.url + "/mcp", "QUESTION": RELEVANT_QUESTION},
        )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert got["sessionId"] and got["version"] in ("2025-06-18", "2025-11-25")
    assert got["tools"] == ["web_search", "ask", "deep_research"]
    assert got["ask"]["structured"]["answer"] == "Raptor burns methane [1]."
    assert got["ask"]["structured"]["sources"][0]["n"] == 1
    assert got["ask"]["progress"] and all(p["message"] for p in got["ask"]["progress"])
    assert 0 < len(got["search"]["results"]) <= 2


@pytest.mark.parametrize("auth", [False, True])
def test_the_inspector_cli_lists_the_tools(settings, auth):
    keys = {"k1": "u1"} if auth else {}
    with serve(create_app(settings.replace(auth={"api_keys": keys}))) as server:
        home = npm_packages("mcp_clients.sh")
        command = [
            str(Path(home) / "node_modules" / ".bin" / "mcp-inspector"),
            "--cli",
            server.url + "/mcp",
            "--transport",
            "http",
            "--method",
            "tools/list",
        ]
        if auth:
            refused = run_node(*command)
            command += ["--header", "Authorization: Bearer k1"]
        done = run_node(*command)
    assert done.returncode == 0, done.stderr[-3000:]
    names = [tool["name"] for tool in json.loads(done.stdout)["tools"]]
    assert names == ["web_search", "ask", "deep_research"]
    if auth:
        assert refused.returncode != 0
