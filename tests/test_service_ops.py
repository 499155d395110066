"""Running as a service: graceful shutdown, readiness, metrics, several workers, Postgres,
and background loops that meet an unexpected error."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time

import httpx
import orjson
import pytest
from httpx_ws import WebSocketDisconnect, aconnect_ws

from app.chores import supervised
from app.events import Handle
from app.main import create_app
from app.search.web import until_deadline
from app.store import open_store
from tests.client import SseEvent, answer_of, chat_body, iter_sse, wait_for
from tests.conftest import USER, new_database, start_postgres, start_redis
from tests.servers import AppProcess, serve
from tests.test_hub import redis_hub

pytestmark = pytest.mark.anyio

# uvicorn ends by re-raising the signal it caught, so a clean stop may read as -SIGTERM
STOPPED = (0, -signal.SIGTERM)


@pytest.fixture
def env(tmp_path, model_url):
    return {
        "LLM_BASE_URL": model_url,
        "LLM_API_KEY": "test-key",
        "STORE_URL": f"sqlite:///{tmp_path}/chat.db",
        "SERVER_SHUTDOWN_GRACE_SECONDS": "1",
    }


async def saved(store_url, chat_id):
    async with open_store(store_url) as store:
        return await store.list_messages(chat_id)


def metric(text, name, **labels):
    label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name + (f"{{{label_text}}}" if labels else "")) + r" ([0-9.e+-]+)"
    match = re.search(pattern, text)
    return float(match.group(1)) if match else 0.0


async def test_sigterm_cancels_what_outlives_the_grace_and_saves_it(env, fake_model):
    server = AppProcess(env).start()
    async with httpx.AsyncClient(timeout=20, event_hooks=USER) as http:
        async with http.stream(
            "POST",
            server.url + "/api/chat/sse",
            json=chat_body("long #tokens=500 #delay=0.02", chatId="600"),
        ) as response:
            stream = iter_sse(response)
            head = []
            async for item in stream:
                if isinstance(item, SseEvent):
                    head.append(item)
                if len(head) == 5:
                    break
            signalled = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            refused = await http.post(server.url + "/api/chat/sse", json=chat_body("new one"))
            ready = await http.get(server.url + "/readyz")
            tail = [item async for item in stream if isinstance(item, SseEvent)]
    events = head + tail
    assert refused.status_code == 503
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    assert events[-1].type == "messageEnd" and events[-1].data["status"] == "cancelled"
    server.proc.wait(10)
    exited = time.monotonic() - signalled
    assert server.proc.returncode in STOPPED
    assert exited < 1 + 4, exited  # grace plus a little
    assert (await fake_model.wait_stream_end()).outcome == "client_closed"
    messages = await saved(env["STORE_URL"], "600")
    assert messages[-1].status == "cancelled"
    assert messages[-1].content == answer_of(events) and messages[-1].content
    server.stop()


async def test_sigterm_lets_a_generation_finish_within_the_grace(env, fake_model):
    server = AppProcess({**env, "SERVER_SHUTDOWN_GRACE_SECONDS": "5"}).start()
    async with httpx.AsyncClient(timeout=20, event_hooks=USER) as http:
        async with http.stream(
            "POST",
            server.url + "/api/chat/sse",
            json=chat_body("short #tokens=20 #delay=0.05", chatId="601"),
        ) as response:
            stream = iter_sse(response)
            async for item in stream:
                if isinstance(item, SseEvent):
                    break
            server.proc.send_signal(signal.SIGTERM)
            events = [item async for item in stream if isinstance(item, SseEvent)]
    assert events[-1].data["status"] == "completed"
    assert server.proc.wait(10) in STOPPED
    assert (await saved(env["STORE_URL"], "601"))[-1].status == "completed"
    server.stop()


async def test_sigterm_ends_websocket_streams_then_closes_with_1001(env, fake_model):
    server = AppProcess(env).start()
    async with (
        httpx.AsyncClient(timeout=20, event_hooks=USER) as http,
        aconnect_ws(server.ws_url + "/api/chat/ws", http) as ws,
    ):
        await ws.receive_text()
        await ws.send_text(
            orjson.dumps(chat_body("long #tokens=500 #delay=0.02", chatId="602")).decode()
        )
        frames = [orjson.loads(await ws.receive_text()) for _ in range(3)]
        server.proc.send_signal(signal.SIGTERM)
        with pytest.raises(WebSocketDisconnect) as closed:
            while True:
                frames.append(orjson.loads(await ws.receive_text()))
    assert frames[-1]["type"] == "messageEnd" and frames[-1]["status"] == "cancelled"
    assert closed.value.code == 1001
    assert server.proc.wait(10) in STOPPED
    assert (await saved(env["STORE_URL"], "602"))[-1].status == "cancelled"
    server.stop()


async def test_idle_server_stops_at_once(env):
    server = AppProcess(env).start()
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(10) in STOPPED
    assert time.monotonic() - started < 2
    server.stop()


async def test_readyz_names_a_redis_that_is_down(settings, fake_model):
    with contextlib.ExitStack() as stack:
        with start_redis() as redis_url:
            running = stack.enter_context(
                serve(create_app(settings.replace(redis={"url": redis_url})))
            )
            async with httpx.AsyncClient(
                base_url=running.url, timeout=10, event_hooks=USER
            ) as http:
                assert (await http.get("/readyz")).status_code == 200
        # redis has stopped
        async with httpx.AsyncClient(base_url=running.url, timeout=10, event_hooks=USER) as http:
            ready = await http.get("/readyz")
            assert ready.status_code == 503
            assert list(ready.json()["failing"]) == ["redis"]
            assert (await http.get("/healthz")).status_code == 200


async def test_readyz_names_a_postgres_that_is_down(settings, fake_model):
    with contextlib.ExitStack() as stack:
        with start_postgres() as pg:
            app = create_app(settings.replace(store={"url": new_database(pg)}))
            running = stack.enter_context(serve(app))
            async with httpx.AsyncClient(
                base_url=running.url, timeout=10, event_hooks=USER
            ) as http:
                assert (await http.get("/readyz")).status_code == 200
        # postgres has stopped
        async with httpx.AsyncClient(base_url=running.url, timeout=10, event_hooks=USER) as http:
            ready = await http.get("/readyz")
            assert ready.status_code == 503
            assert list(ready.json()["failing"]) == ["store"]
            assert (await http.get("/healthz")).status_code == 200


async def test_metrics_count_completed_and_cancelled_generations(client, fake_model):
    async with client.stream(
        "POST", "/api/chat/sse", json=chat_body("done", chatId="610")
    ) as response:
        [e async for e in iter_sse(response)]
    async with client.stream(
        "POST", "/api/chat/sse", json=chat_body("long #tokens=500 #delay=0.02", chatId="611")
    ) as response:
        stream = iter_sse(response)
        async for item in stream:
            if isinstance(item, SseEvent) and item.type == "message" and item.data["data"]:
                break
        assert (
            await client.post("/api/chat/cancel", json={"chatId": "611", "userId": "1"})
        ).status_code == 200
        [e async for e in stream]
    await client.post("/api/chat/sse", json={"message": {"content": ""}})
    text = (await client.get("/metrics")).text
    assert metric(text, "searchchat_generations_total", status="completed") == 1
    assert metric(text, "searchchat_generations_total", status="cancelled") == 1
    assert metric(text, "searchchat_cancels_total") == 1
    assert metric(text, "searchchat_errors_total", key="BAD_REQUEST") == 1
    assert metric(text, "searchchat_events_sent_total", transport="sse") >= 10
    assert metric(text, "searchchat_time_to_first_token_seconds_count") == 2
    assert metric(text, "searchchat_generation_duration_seconds_count") == 2
    assert metric(text, "searchchat_generations_active") == 0
    assert metric(text, "searchchat_connections_active", transport="sse") == 0


async def test_two_workers_share_postgres_and_redis(
    tmp_path, model_url, fake_model, postgres_server, redis_url
):
    store_url = new_database(postgres_server)
    env = {
        "LLM_BASE_URL": model_url,
        "LLM_API_KEY": "test-key",
        "STORE_URL": store_url,
        "REDIS_URL": redis_url,
        "WEB_CONCURRENCY": "2",
        "LIMITS_MAX_CONCURRENT_GENERATIONS": "16",
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
    }
    server = AppProcess(env).start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
            for _ in range(50):  # both workers up
                if (await http.get("/readyz")).status_code == 200:
                    break
                await asyncio.sleep(0.1)

            async def ask(i):
                async with http.stream(
                    "POST",
                    "/api/chat/sse",
                    json=chat_body(f"q{i} #delay=0.01", chatId=str(620 + i)),
                ) as r:
                    return [e async for e in iter_sse(r) if isinstance(e, SseEvent)]

            results = await asyncio.gather(*(ask(i) for i in range(8)))
            assert all(events[-1].data["status"] == "completed" for events in results)
            chats = (await http.get("/api/chats", params={"userId": "1"})).json()["chats"]
            assert len(chats) == 8
            texts = {(await http.get("/metrics")).text for _ in range(6)}
            assert {
                metric(t, "searchchat_generations_total", status="completed") for t in texts
            } == {8.0}
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(15) in STOPPED
    finally:
        server.stop()


async def test_sigterm_ends_streams_that_follow_another_process(env, fake_model, redis_url):
    """A stream this process serves for another process's generation has no end of
    its own here: shutdown ends it cleanly, and the generation goes on elsewhere."""
    shared = {**env, "REDIS_URL": redis_url}
    runner = AppProcess(shared).start()
    follower = AppProcess(shared).start()
    try:
        async with httpx.AsyncClient(timeout=20, event_hooks=USER) as http:
            async with http.stream(
                "POST",
                runner.url + "/api/chat/sse",
                json=chat_body("long #tokens=400 #delay=0.02", chatId="603"),
            ) as started:
                running = iter_sse(started)
                async for item in running:
                    if isinstance(item, SseEvent):
                        break
                async with http.stream(
                    "GET",
                    follower.url + "/api/chat/sse/resume",
                    params={"chatId": "603", "userId": "1"},
                ) as resumed:
                    assert resumed.status_code == 200
                    stream = iter_sse(resumed)
                    followed = []
                    async for item in stream:
                        if isinstance(item, SseEvent):
                            followed.append(item)
                        if len(followed) == 3:
                            break
                    signalled = time.monotonic()
                    follower.proc.send_signal(signal.SIGTERM)
                    followed += [item async for item in stream if isinstance(item, SseEvent)]
                assert follower.proc.wait(10) in STOPPED
                assert time.monotonic() - signalled < 1 + 3  # grace plus a little
                # cut, not ended: the answer goes on elsewhere
                assert followed[-1].type not in ("messageEnd", "error")
                rest = [item async for item in running if isinstance(item, SseEvent)]
        assert rest[-1].type == "messageEnd" and rest[-1].data["status"] == "completed"
    finally:
        follower.stop()
        runner.stop()


async def test_a_supervised_loop_that_fails_is_started_again():
    runs = []

    async def body() -> None:
        runs.append(time.monotonic())
        if len(runs) < 3:
            raise RuntimeError("unexpected")
        await asyncio.sleep(3600)

    task = asyncio.create_task(supervised("test loop", body, first_delay=0.01))
    await wait_for(lambda: asyncio.sleep(0, len(runs) >= 3), timeout=3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_heartbeat_that_meets_an_unexpected_error_goes_on(redis_url):
    """The heartbeat fails once with an error nobody expected: it is logged and the
    heartbeat goes on, so the process keeps its claims (a dead heartbeat would let
    them expire and the chats be claimed twice)."""
    async with (
        redis_hub(redis_url, handle_ttl=1.2) as owner,
        redis_hub(redis_url, handle_ttl=1.2) as other,
    ):
        h = Handle("7", "700", "699", "1", "q")
        await owner.register(h, lambda: None)
        beat, failed = owner.beat, []

        async def failing_once() -> None:
            if not failed:
                failed.append(True)
                raise RuntimeError("a bug in the heartbeat")
            await beat()

        owner.beat = failing_once  # type: ignore[method-assign]
        await asyncio.sleep(3.0)  # two and a half claim TTLs
        assert failed
        assert await other.lookup("7") == h


async def test_until_deadline_waits_for_what_it_cancels():
    ended: list[str] = []

    async def slow(name: str) -> str:
        try:
            await asyncio.sleep(10)
        finally:
            await asyncio.sleep(0.05)  # cleaning up takes a moment
            ended.append(name)
        return name

    async def quick() -> str:
        return "quick"

    loop = asyncio.get_running_loop()
    got = await until_deadline([quick(), slow("a"), slow("b")], loop.time() + 0.1)
    assert got == ["quick", None, None]
    assert sorted(ended) == ["a", "b"]  # both had ended when it returned
