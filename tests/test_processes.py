"""Stop and resume across two real server processes sharing Redis and the store."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import orjson
import pytest
from httpx_ws import aconnect_ws

from app.streams import rediskeys
from tests.client import answer_of, chat_body, iter_sse, read_events, rest, wait_for
from tests.conftest import USER, RedisSentinelGroup
from tests.servers import processes

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["redis", "cluster"])
def pair(request, tmp_path, model_url, fake_search):
    """Two server processes on one Redis, or on a three-master Redis Cluster, searching
    the fake web."""
    cluster = request.param == "cluster"
    if cluster:
        redis_url = request.getfixturevalue("redis_cluster").url
    else:
        redis_url = request.getfixturevalue("redis_url")
    env = {
        "REDIS_CLUSTER": "true" if cluster else "false",
        "LLM_BASE_URL": model_url,
        "LLM_API_KEY": "test-key",
        "LLM_MODEL": "fake-chat",
        "STORE_URL": f"sqlite:///{tmp_path}/chat.db",
        "REDIS_URL": redis_url,
        "STREAM_HANDLE_TTL_SECONDS": "1.5",
        "STREAM_FLUSH_INTERVAL_MS": "10",
        "SEARCH_PROVIDER": "tavily",
        "TAVILY_API_KEY": fake_search.api_key,
        "TAVILY_BASE_URL": fake_search.base_url + "/tavily",
    }
    with processes(2, env) as (a, b):
        yield a, b


async def saved_answer(client, base_url, chat_id, status=None, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        chat = (await client.get(f"{base_url}/api/chats/{chat_id}")).json()
        answer = chat["messages"][-1]
        if status is None or answer["status"] == status or time.monotonic() > deadline:
            return answer
        await asyncio.sleep(0.05)


async def test_cancel_on_another_process_stops_the_sse_stream_and_the_model_call(pair, fake_model):
    a, b = pair
    async with httpx.AsyncClient(timeout=10, event_hooks=USER) as http:
        body = chat_body("long #tokens=500 #delay=0.02", chatId="900")
        async with http.stream("POST", a.url + "/api/chat/sse", json=body) as response:
            stream = iter_sse(response)
            head = await read_events(stream, 6)
            answer_id = head[0].data["messageId"]
            cancel = await http.post(
                b.url + "/api/chat/cancel", json={"chatId": "900", "userId": "1"}
            )
            assert cancel.status_code == 200
            assert cancel.json() == {"chatId": "900", "messageId": answer_id, "cancelled": True}
            tail = await rest(stream)
        events = head + tail
        assert events[-1].type == "messageEnd"
        assert events[-1].data["status"] == "cancelled"
        assert [int(e.id.split(":")[1]) for e in events] == list(range(1, len(events) + 1))
        record = await fake_model.wait_stream_end()
        assert record.outcome == "client_closed"
        assert record.tokens_sent < 500
        answer = await saved_answer(http, b.url, "900", "cancelled")
        assert answer["status"] == "cancelled"
        assert answer["content"] == answer_of(events)
        # nothing in flight any more
        again = await http.post(a.url + "/api/chat/cancel", json={"chatId": "900", "userId": "1"})
        assert again.status_code == 404 and again.json()["cancelled"] is False


async def test_cancel_over_websocket_on_another_process(pair, fake_model):
    a, b = pair
    async with httpx.AsyncClient(timeout=10, event_hooks=USER) as http:
        async with (
            aconnect_ws(a.ws_url + "/api/chat/ws", http) as ws_a,
            aconnect_ws(b.ws_url + "/api/chat/ws", http) as ws_b,
        ):
            await ws_a.receive_text()
            await ws_b.receive_text()
            await ws_a.send_text(
                orjson.dumps(chat_body("long #tokens=500 #delay=0.02", chatId="901")).decode()
            )
            frames = [orjson.loads(await ws_a.receive_text()) for _ in range(5)]
            await ws_b.send_text('{"type": "cancel", "chatId": "901", "userId": "1"}')
            ack = orjson.loads(await ws_b.receive_text())
            assert ack == {
                "type": "cancelled",
                "chatId": "901",
                "messageId": frames[0]["messageId"],
                "cancelled": True,
            }
            while frames[-1]["type"] not in ("messageEnd", "error"):
                frames.append(orjson.loads(await ws_a.receive_text()))
            assert frames[-1]["type"] == "messageEnd" and frames[-1]["status"] == "cancelled"
            await ws_b.send_text('{"type": "cancel", "chatId": "901", "userId": "1"}')
            assert orjson.loads(await ws_b.receive_text())["key"] == "NOT_FOUND"
        assert (await fake_model.wait_stream_end()).outcome == "client_closed"
        assert (await saved_answer(http, b.url, "901", "cancelled"))["status"] == "cancelled"


async def test_cancel_before_the_first_token(pair, fake_model):
    a, b = pair
    async with httpx.AsyncClient(timeout=10, event_hooks=USER) as http:
        async with http.stream(
            "POST", a.url + "/api/chat/sse", json=chat_body("slow start #wait=3", chatId="902")
        ) as response:
            started = time.monotonic()
            cancel = await http.post(
                b.url + "/api/chat/cancel", json={"chatId": "902", "userId": "1"}
            )
            assert cancel.status_code == 200
            events = await rest(iter_sse(response))
        assert time.monotonic() - started < 2.5
        assert events[-1].type == "messageEnd" and events[-1].data["status"] == "cancelled"
        assert answer_of(events) == ""
        assert (await saved_answer(http, b.url, "902", "cancelled"))["status"] == "cancelled"


async def test_cancel_refusals(pair, fake_model):
    a, b = pair
    async with httpx.AsyncClient(timeout=10, event_hooks=USER) as http:
        unknown = await http.post(
            b.url + "/api/chat/cancel", json={"chatId": "12345", "userId": "1"}
        )
        assert unknown.status_code == 404
        assert unknown.json() == {
            "type": "error",
            "key": "NOT_FOUND",
            "data": unknown.json()["data"],
            "cancelled": False,
        }
        async with http.stream(
            "POST",
            a.url + "/api/chat/sse",
            json=chat_body("long #tokens=200 #delay=0.02", chatId="903"),
        ) as response:
            stream = iter_sse(response)
            await read_events(stream, 2)
            other_user = await http.post(
                b.url + "/api/chat/cancel", json={"chatId": "903", "userId": "2"}
            )
            assert other_user.status_code == 403 and other_user.json()["key"] == "FORBIDDEN"
            second = await http.post(
                b.url + "/api/chat/sse", json=chat_body("me too", chatId="903")
            )
            assert second.status_code == 409 and second.json()["key"] == "BAD_REQUEST"
            assert "already running" in second.json()["data"]
            resume_other = await http.get(
                b.url + "/api/chat/sse/resume", params={"chatId": "903", "userId": "2"}
            )
            assert resume_other.status_code == 403
            assert (
                await http.post(b.url + "/api/chat/cancel", json={"chatId": "903", "userId": "1"})
            ).status_code == 200
            await rest(stream)
        missing = await http.get(b.url + "/api/chat/sse/resume", params={"chatId": "777"})
        assert missing.status_code == 404 and missing.json()["key"] == "NOT_FOUND"


async def test_resume_on_another_process_continues_without_gap_or_duplicate(pair, fake_model):
    a, b = pair
    tokens = 300
    async with httpx.AsyncClient(timeout=20, event_hooks=USER) as http:
        async with http.stream(
            "POST",
            a.url + "/api/chat/sse",
            json=chat_body(f"long #tokens={tokens} #delay=0.005", chatId="904"),
        ) as response:
            head = await read_events(iter_sse(response), 25)
        last_id = head[-1].id
        async with http.stream(
            "GET",
            b.url + "/api/chat/sse/resume",
            params={"chatId": "904"},
            headers={"Last-Event-ID": last_id},
        ) as response:
            assert response.status_code == 200
            tail = await rest(iter_sse(response))
        events = head + tail
        assert [int(e.id.split(":")[1]) for e in events] == list(range(1, len(events) + 1))
        assert answer_of(events) == "".join(f"tok{i} " for i in range(tokens))
        assert events[-1].data["status"] == "completed"
        assert len(fake_model.streams) == 1  # no second model call

        # a finished generation replays to its end, on either process, over WebSocket too
        async with aconnect_ws(b.ws_url + "/api/chat/ws", http) as ws:
            await ws.receive_text()
            await ws.send_text(
                orjson.dumps(
                    {"type": "resume", "chatId": "904", "userId": "1", "lastEventId": head[10].id}
                ).decode()
            )
            frames = []
            while not frames or frames[-1]["type"] != "messageEnd":
                frames.append(orjson.loads(await ws.receive_text()))
        assert [f["eventId"] for f in frames] == [e.id for e in events[11:]]
        replay = await http.get(
            a.url + "/api/chat/sse/resume", params={"chatId": "904", "lastEventId": events[-2].id}
        )
        assert [line for line in replay.text.splitlines() if line.startswith("id:")] == [
            f"id: {events[-1].id}"
        ]


async def test_killed_process_leaves_no_handle_and_resume_ends_cleanly(pair, fake_model):
    a, b = pair
    async with httpx.AsyncClient(timeout=20, event_hooks=USER) as http:
        async with http.stream(
            "POST",
            a.url + "/api/chat/sse",
            json=chat_body("long #tokens=1000 #delay=0.01", chatId="905"),
        ) as response:
            head = await read_events(iter_sse(response), 10)
            await asyncio.sleep(0.1)  # let the flusher write what was sent
            a.kill()
        assert (await http.get(b.url + "/api/chats/905")).status_code == 200
        async with http.stream(
            "GET",
            b.url + "/api/chat/sse/resume",
            params={"chatId": "905", "lastEventId": head[2].id},
        ) as response:
            started = time.monotonic()
            tail = await rest(iter_sse(response))
        assert time.monotonic() - started < 8
        assert [int(e.id.split(":")[1]) for e in tail] == list(range(4, 4 + len(tail)))
        assert tail[-1].type == "error" and tail[-1].data["key"] == "STREAM_ERROR"
        assert "lost" in tail[-1].data["data"]
        cancel = await http.post(b.url + "/api/chat/cancel", json={"chatId": "905", "userId": "1"})
        assert cancel.status_code == 404

        # the sweeper saves what it had logged as failed, not left "streaming"
        async def closed():
            answer = (await http.get(b.url + "/api/chats/905")).json()["messages"][-1]
            return answer if answer["status"] != "streaming" else None

        answer = await wait_for(closed, timeout=10)
        assert answer["status"] == "failed"
        logged = "".join(e.data["data"] for e in head[:3] + tail if e.type == "message")
        assert answer["content"] == logged and logged.startswith("tok0 ")
        # the chat is free for a new question on the surviving process
        async with http.stream(
            "POST", b.url + "/api/chat/sse", json=chat_body("again", chatId="905")
        ) as response:
            events = await rest(iter_sse(response))
        assert events[-1].data["status"] == "completed"


async def _responses_events(http, url, after=None):
    params = {"stream": "true"} | ({"starting_after": str(after)} if after is not None else {})
    events = []
    async with http.stream("GET", url, params=params) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(orjson.loads(line[6:]))
    return events


async def test_a_background_response_is_followed_from_another_process_without_a_gap(
    pair, fake_model
):
    a, b = pair
    async with httpx.AsyncClient(timeout=10) as http:
        body = {"model": "deepSeek", "input": "long #tokens=60 #delay=0.01", "background": True}
        made = (await http.post(a.url + "/v1/responses", json=body)).json()
        assert made["status"] in ("queued", "in_progress")
        on_a = f"{a.url}/v1/responses/{made['id']}"
        head = []
        async with http.stream("GET", on_a, params={"stream": "true"}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    head.append(orjson.loads(line[6:]))
                    if len(head) == 12:
                        break
        tail = await _responses_events(http, f"{b.url}/v1/responses/{made['id']}", after=11)
        done = (await http.get(f"{b.url}/v1/responses/{made['id']}")).json()
    events = head + tail
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "".join(f"tok{i} " for i in range(60))
    assert done["status"] == "completed" and done["output"][-1]["content"][0]["text"] == text


async def test_background_responses_that_search_resume_on_another_process_mid_reasoning(
    pair, fake_model, fake_search
):
    a, b = pair
    fake_model.answer_text = "Raptor burns methane [4] with oxygen [1]."
    async with httpx.AsyncClient(timeout=10) as http:
        body = {
            "model": "webSearch",
            "input": "how do falcon engines burn methane #reasoning=6 #delay=0.02",
            "background": True,
        }
        made = (await http.post(a.url + "/v1/responses", json=body)).json()
        head = []
        async with http.stream(
            "GET", f"{a.url}/v1/responses/{made['id']}", params={"stream": "true"}
        ) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    head.append(orjson.loads(line[6:]))
                    if head[-1]["type"] == "response.reasoning_summary_text.delta":
                        break
        after = head[-1]["sequence_number"]
        tail = await _responses_events(http, f"{b.url}/v1/responses/{made['id']}", after=after)
        done = (await http.get(f"{b.url}/v1/responses/{made['id']}")).json()
    events = head + tail
    kinds = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert (
        "response.web_search_call.completed"
        in kinds[: kinds.index("response.reasoning_summary_part.added")]
    )
    thought = "".join(
        e["delta"] for e in events if e["type"] == "response.reasoning_summary_text.delta"
    )
    assert thought == "".join(f"why{i} " for i in range(6))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == fake_model.answer_text
    assert kinds[-1] == "response.completed" and events[-1]["response"]["output"] == done["output"]
    assert [item["type"] for item in done["output"]] == ["web_search_call", "reasoning", "message"]
    notes = done["output"][-1]["content"][0]["annotations"]
    assert [text[n["start_index"] : n["end_index"]] for n in notes] == ["[4]", "[1]"]


async def test_cancel_on_another_process_stops_a_background_response(pair, fake_model):
    a, b = pair
    async with httpx.AsyncClient(timeout=15) as http:
        body = {"model": "deepSeek", "input": "long #tokens=2000 #delay=0.01", "background": True}
        made = (await http.post(a.url + "/v1/responses", json=body)).json()

        async def started():
            return fake_model.streams and fake_model.streams[-1].tokens_sent > 3

        await wait_for(started)
        cancelled = await http.post(f"{b.url}/v1/responses/{made['id']}/cancel")
        record = await fake_model.wait_stream_end()
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert record.outcome == "client_closed" and record.tokens_sent < 2000


@pytest.mark.parametrize("redis", ["cluster", "sentinel"])
async def test_a_master_killed_mid_stream_costs_its_clients_nothing(
    request, redis, tmp_path, model_url, fake_model
):
    """Two server processes on a Redis Cluster with a replica per master — or on a
    master and its replica under Redis Sentinel —: the master that holds a running
    answer's handle and log is killed mid-stream, and its replica takes over. The
    client on the owner and a follower on the other process each get every event
    once, in order, and the end; the answer is saved whole."""
    stack = contextlib.ExitStack()
    if redis == "cluster":
        cluster = request.getfixturevalue("replicated_cluster")
        url = cluster.url

        def kill(answer_id: str) -> None:
            cluster.kill(cluster.node_of(rediskeys.log(answer_id)))

    else:
        group = stack.enter_context(RedisSentinelGroup())  # its own: its master dies
        url = group.url

        def kill(answer_id: str) -> None:
            group.kill()

    env = {
        "REDIS_CLUSTER": "true" if redis == "cluster" else "false",
        "REDIS_URL": url,
        "LLM_BASE_URL": model_url,
        "LLM_API_KEY": "test-key",
        "LLM_MODEL": "fake-chat",
        "STORE_URL": f"sqlite:///{tmp_path}/chat.db",
        "STREAM_HANDLE_TTL_SECONDS": "3",
        "STREAM_FLUSH_INTERVAL_MS": "10",
    }
    tokens = 400
    with stack, processes(2, env) as (a, b):
        async with httpx.AsyncClient(timeout=30, event_hooks=USER) as http:
            body = chat_body(f"long #tokens={tokens} #delay=0.01", chatId="960")
            async with http.stream("POST", a.url + "/api/chat/sse", json=body) as response:
                owner = iter_sse(response)
                head = await read_events(owner, 8)
                params = {"chatId": "960", "lastEventId": head[-1].id}
                async with http.stream(
                    "GET", b.url + "/api/chat/sse/resume", params=params
                ) as followed:
                    follower = iter_sse(followed)
                    followed_head = await read_events(follower, 2)
                    await asyncio.to_thread(kill, head[0].data["messageId"])
                    owner_tail = await rest(owner)
                    follower_tail = followed_head + await rest(follower)
            events = head + owner_tail
            seqs = [int(e.id.split(":")[1]) for e in events]
            assert seqs == list(range(1, len(events) + 1))
            assert answer_of(events) == "".join(f"tok{i} " for i in range(tokens))
            assert events[-1].type == "messageEnd" and events[-1].data["status"] == "completed"
            assert [e.id for e in follower_tail] == [e.id for e in events[8:]]
            saved = await saved_answer(http, b.url, "960", "completed")
            assert saved["content"] == answer_of(events)
