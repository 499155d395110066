"""Two hosts sharing Redis: one id each, one answer per chat, and claims, cancels and
streams that go on while Redis restarts, freezes (SIGSTOP: it accepts connections and
answers nothing), loses its data or goes away."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import httpx
import orjson
import pytest
import redis.asyncio as aioredis

from app.main import create_app
from app.streams import rediskeys
from tests.client import SseEvent, answer_of, chat_body, iter_sse, read_events, rest, wait_for
from tests.conftest import BOTH_TOPOLOGIES, USER, RedisCluster, RedisServer
from tests.servers import OWN_PID_NAMESPACE, pid_namespaces_work, processes, serve, serving_line

pytestmark = pytest.mark.anyio


async def ask(http, base, body):
    async with http.stream("POST", base + "/api/chat/sse", json=body) as response:
        if response.status_code != 200:
            return response.status_code, orjson.loads(await response.aread())
        return 200, await rest(iter_sse(response))


ANSWERS_PER_HOST = 40  # enough for two hosts' ids to collide if they were minted alike


async def test_two_hosts_whose_server_is_pid_1_never_mint_the_same_id(env, fake_model):
    if not pid_namespaces_work():
        pytest.skip("unshare cannot make PID namespaces here")
    with processes(2, env, prefix=OWN_PID_NAMESPACE) as (a, b):
        lines = [serving_line(a), serving_line(b)]
        assert [line["pid"] for line in lines] == [1, 1]  # the same pid, as in two containers
        assert lines[0]["workerNumber"] != lines[1]["workerNumber"]
        async with httpx.AsyncClient(timeout=30, event_hooks=USER) as http:
            pairs = [
                ask(http, server.url, chat_body(f"q{i}-{n} #tokens=2 #reasoning=0"))
                for i in range(ANSWERS_PER_HOST)
                for n, server in enumerate((a, b))
            ]
            results = await asyncio.gather(*pairs)
            total = 2 * ANSWERS_PER_HOST
            assert [status for status, _ in results] == [200] * total
            answers = {events[0].data["messageId"] for _, events in results}
            chats = {events[0].data["chatId"] for _, events in results}
            questions = {events[-1].data["questionMessageId"] for _, events in results}
            assert len(answers) == len(chats) == len(questions) == total  # no row lost
            listed = (await http.get(a.url + "/api/chats?limit=1000")).json()["chats"]
            assert len(listed) == total


@BOTH_TOPOLOGIES
@pytest.mark.parametrize("same_chat", [True, False])
async def test_a_double_clicked_send_starts_exactly_one_answer(env, fake_model, same_chat):
    with processes(2, env) as (a, b):
        async with httpx.AsyncClient(timeout=30, event_hooks=USER) as http:

            async def double_click(i):
                ids = {"messageId": f"m{i}"} | ({"chatId": f"c{i}"} if same_chat else {})
                # long enough that the second click lands while the first runs (after
                # its end, the same messageId is a regeneration, rightly answered)
                body = chat_body(f"q{i} #tokens=20 #delay=0.1 #reasoning=0", **ids)
                return await asyncio.gather(ask(http, a.url, body), ask(http, b.url, body))

            pairs = await asyncio.gather(*(double_click(i) for i in range(20)))
            for first, second in pairs:
                assert sorted([first[0], second[0]]) == [200, 409], (first, second)
                refused = first if first[0] == 409 else second
                assert refused[1]["key"] == "BAD_REQUEST"
            chats = (await http.get(a.url + "/api/chats")).json()["chats"]
            assert len(chats) == 20  # no empty chat left by the refused one
            for chat in chats:
                messages = (await http.get(a.url + f"/api/chats/{chat['id']}")).json()["messages"]
                assert [m["role"] for m in messages] == ["user", "assistant"]  # one answer each


async def test_after_a_redis_restart_running_chats_stay_claimed_cancellable_and_followed(
    env, fake_model
):
    redis = RedisServer()
    env = {**env, "REDIS_URL": redis.url, "STREAM_FLUSH_INTERVAL_MS": "50"}
    with redis, processes(2, env) as (a, b):
        async with httpx.AsyncClient(timeout=30, event_hooks=USER) as http:
            body = chat_body("long #tokens=3000 #delay=0.01", chatId="r1")
            async with http.stream("POST", a.url + "/api/chat/sse", json=body) as response:
                owner = iter_sse(response)
                head = await read_events(owner, 10)
                async with http.stream(
                    "GET",
                    b.url + "/api/chat/sse/resume",
                    params={"chatId": "r1", "lastEventId": head[-1].id},
                ) as follower_response:
                    follower = iter_sse(follower_response)
                    await read_events(follower, 5)
                    redis.stop()
                    await asyncio.sleep(3)
                    redis.start()  # back, empty

                    async def settled(path, **kwargs):
                        # while owners re-assert, the other host says "retry", never 404
                        response = await http.request(path[0], b.url + path[1], **kwargs)
                        if response.status_code == 503:
                            assert response.headers["retry-after"].isdigit()
                            return None
                        return response

                    second = await wait_for(
                        lambda: settled(
                            ("POST", "/api/chat/sse"), json=chat_body("me too", chatId="r1")
                        ),
                        timeout=15,
                    )
                    assert second.status_code == 409  # the chat is still running

                    async def resume_status():
                        params = {"chatId": "r1", "lastEventId": head[-1].id}
                        async with http.stream(
                            "GET", b.url + "/api/chat/sse/resume", params=params
                        ) as response:
                            if response.status_code == 200:
                                assert await read_events(iter_sse(response), 1)
                            return response.status_code

                    assert await resume_status() == 200  # not 404: the owner re-asserted
                    cancel = await wait_for(
                        lambda: settled(
                            ("POST", "/api/chat/cancel"), json={"chatId": "r1", "userId": "1"}
                        ),
                        timeout=15,
                    )
                    assert cancel.status_code == 200 and cancel.json()["cancelled"]
                    owner_rest = await rest(owner)
                    follower_rest = await rest(follower)
            assert owner_rest[-1].data["status"] == "cancelled"
            assert follower_rest[-1].type == "messageEnd"  # followed through the outage
            assert follower_rest[-1].data["status"] == "cancelled"
            follower_ids = [int(e.id.split(":")[1]) for e in follower_rest]
            assert follower_ids == sorted(set(follower_ids))  # in order, no duplicate
        lost_lines = b.output().count("cancel listener lost redis")
        assert lost_lines <= 1, b.output()  # said once per outage, not twice a second


async def test_after_a_cluster_master_restarts_empty_running_chats_stay_claimed_and_followed(
    env, fake_model
):
    """A master of a three-master Redis Cluster without replicas restarts empty while
    three answers run, one chat claimed on each master: the owner finds a claim gone
    (the chat on that master) and a handle gone whose claim lives on (an answer on it
    whose chat is elsewhere), and writes again what it holds. Meanwhile the other
    host says "retry", never 404; every chat stays claimed, resumable and
    cancellable, and every follower ends with the end, in order."""
    with RedisCluster() as cluster:  # its own: one of its masters restarts
        env = {**env, "REDIS_URL": cluster.url, "REDIS_CLUSTER": "true"}
        env["STREAM_FLUSH_INTERVAL_MS"] = "50"
        masters = cluster.masters()
        chats = ["r" + cluster.ids_on(m, lambda i: rediskeys.run("r" + i))[0] for m in masters]
        with processes(2, env) as (a, b):
            async with httpx.AsyncClient(timeout=30, event_hooks=USER) as http:
                async with contextlib.AsyncExitStack() as streams:
                    owners, heads = [], []
                    for chat in chats:
                        body = chat_body("long #tokens=3000 #delay=0.01", chatId=chat)
                        response = await streams.enter_async_context(
                            http.stream("POST", a.url + "/api/chat/sse", json=body)
                        )
                        owners.append(iter_sse(response))
                        heads.append(await read_events(owners[-1], 10))
                    answers = [head[0].data["messageId"] for head in heads]
                    followers = []
                    for chat, head in zip(chats, heads, strict=True):
                        params = {"chatId": chat, "lastEventId": head[-1].id}
                        response = await streams.enter_async_context(
                            http.stream("GET", b.url + "/api/chat/sse/resume", params=params)
                        )
                        followers.append(iter_sse(response))
                        await read_events(followers[-1], 3)
                    # the master of an answer whose chat is claimed on another one, if
                    # any (it is also the master of one of the chats)
                    where = [
                        (cluster.node_of(rediskeys.gen(answer)), cluster.node_of(rediskeys.run(c)))
                        for answer, c in zip(answers, chats, strict=True)
                    ]
                    victim = next((gen for gen, run in where if gen is not run), masters[0])
                    victim.stop()
                    await asyncio.sleep(0.5)
                    victim.start()  # back, empty, with its slots
                    await asyncio.to_thread(cluster.wait_ok)

                    # the owner finds the loss at its first beat once the node is back
                    # (retried every ≤ 0.5 s): before that, a process that has not been
                    # told may take a chat whose claim was lost (README, Scaling)
                    async def reasserted():
                        return "re-asserted" in a.output()

                    await wait_for(reasserted, timeout=10)

                    async def settled(method, path, **kwargs):
                        # while owners re-assert, the other host says "retry", never 404
                        response = await http.request(method, b.url + path, **kwargs)
                        if response.status_code == 503:
                            assert response.headers["retry-after"].isdigit()
                            return None
                        return response

                    for chat, head in zip(chats, heads, strict=True):
                        second = await wait_for(
                            lambda chat=chat: settled(
                                "POST", "/api/chat/sse", json=chat_body("me too", chatId=chat)
                            ),
                            timeout=15,
                        )
                        assert second.status_code == 409  # still running

                        async def resumed(chat=chat, head=head):
                            params = {"chatId": chat, "lastEventId": head[-1].id}
                            async with http.stream(
                                "GET", b.url + "/api/chat/sse/resume", params=params
                            ) as response:
                                if response.status_code == 503:  # not yet re-asserted
                                    return None
                                assert response.status_code == 200  # not 404
                                return await read_events(iter_sse(response), 1)

                        assert await wait_for(resumed, timeout=15)
                        cancel = await wait_for(
                            lambda chat=chat: settled(
                                "POST", "/api/chat/cancel", json={"chatId": chat, "userId": "1"}
                            ),
                            timeout=15,
                        )
                        assert cancel.status_code == 200 and cancel.json()["cancelled"]
                    for owner, follower in zip(owners, followers, strict=True):
                        assert (await rest(owner))[-1].data["status"] == "cancelled"
                        tail = await rest(follower)
                        assert tail[-1].type == "messageEnd"  # followed through it
                        assert tail[-1].data["status"] == "cancelled"
                        ids = [int(e.id.split(":")[1]) for e in tail]
                        assert ids == sorted(set(ids))  # in order, no duplicate
            assert "re-asserted" in a.output()


async def test_a_registry_that_fails_mid_relay_ends_the_stream_with_an_error_event(
    settings, fake_model
):
    redis = RedisServer()
    pair_env = settings.replace(redis={"url": redis.url}, stream={"handle_ttl_seconds": 1.0})
    with redis, serve(create_app(pair_env)) as a, serve(create_app(pair_env)) as b:
        async with httpx.AsyncClient(timeout=30, event_hooks=USER) as http:
            body = chat_body("long #tokens=3000 #delay=0.01", chatId="e3")
            async with http.stream("POST", a.url + "/api/chat/sse", json=body) as owner:
                head = await read_events(iter_sse(owner), 5)
                async with http.stream(
                    "GET",
                    b.url + "/api/chat/sse/resume",
                    params={"chatId": "e3", "lastEventId": head[-1].id},
                ) as response:
                    follower = iter_sse(response)
                    await read_events(follower, 2)
                    redis.stop()  # and it stays away
                    tail = await rest(follower)
                await http.post(a.url + "/api/chat/cancel", json={"chatId": "e3", "userId": "1"})
    assert tail[-1].type == "error" and tail[-1].data["key"] == "STREAM_ERROR"
    assert "unavailable" in tail[-1].data["data"]


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


def freeze(redis: RedisServer) -> None:
    assert redis.proc is not None
    os.kill(redis.proc.pid, signal.SIGSTOP)


def thaw(redis: RedisServer) -> None:
    assert redis.proc is not None
    os.kill(redis.proc.pid, signal.SIGCONT)


async def test_a_redis_that_stops_answering_fails_like_one_that_refuses(settings, fake_model):
    """Redis freezes (connections are accepted, nothing is answered) mid-answer: the
    running answer still ends with its `messageEnd` in bounded time, a new question is
    a 503 within seconds instead of hanging, `/readyz` says which part is away — and
    once Redis answers again, new questions work and the answer was saved."""
    redis = RedisServer()
    app = create_app(settings.replace(redis={"url": redis.url, "timeout_seconds": 1.0}))
    with redis, serve(app) as running:
        try:
            async with httpx.AsyncClient(
                base_url=running.url, timeout=30, event_hooks=USER
            ) as http:
                async with http.stream(
                    "POST",
                    "/api/chat/sse",
                    json=chat_body("long #tokens=100 #delay=0.02", chatId="h1"),
                ) as response:
                    stream = iter_sse(response)
                    await read_events(stream, 10)
                    freeze(redis)
                    started = time.monotonic()
                    tail = await rest(stream)
                    ended_after = time.monotonic() - started
                assert tail[-1].type == "messageEnd", tail[-1]
                assert ended_after < 8, ended_after  # ~2 s of tokens left, and the end
                started = time.monotonic()
                refused = await http.post("/api/chat/sse", json=chat_body("q", chatId="h2"))
                refused_after = time.monotonic() - started
                assert refused.status_code == 503, refused.text
                assert "registry is unavailable" in refused.json()["data"]
                started = time.monotonic()
                ready = await http.get("/readyz")
                ready_after = time.monotonic() - started
                assert ready.status_code == 503 and "redis" in ready.json()["failing"]
                # redis.timeout_seconds (1 s) each, not the kernel's minutes
                assert refused_after < 3 and ready_after < 3, (refused_after, ready_after)
                thaw(redis)

                async def accepted() -> bool:
                    probe = await http.post(
                        "/api/chat/sse", json=chat_body("probe #tokens=1", chatId="h3")
                    )
                    return probe.status_code == 200

                await wait_for(accepted, timeout=20)
                row = (await http.get("/api/chats/h1")).json()["messages"][-1]
                assert row["status"] == "completed"
                assert row["content"] == "".join(f"tok{i} " for i in range(100))
                # the end Redis missed is done again: the answer's keys are kept for
                # replay only, not for as long as a running answer may run
                replay_ms = settings.stream.replay_ttl_seconds * 1000
                direct = aioredis.Redis.from_url(redis.url)
                try:

                    async def ended_again() -> bool:
                        ttls = [
                            await direct.pttl(key(row["messageId"]))
                            for key in (rediskeys.gen, rediskeys.owner)
                        ]
                        return all(0 < ttl <= replay_ms for ttl in ttls)

                    await wait_for(ended_again, timeout=10)
                    assert 0 < await direct.pttl(rediskeys.latest("h1")) <= replay_ms
                finally:
                    await direct.aclose()
        finally:
            thaw(redis)


async def test_streams_go_on_at_checkpoint_pace_while_redis_is_frozen(settings, fake_model):
    """While Redis does not answer, the store is what makes events durable: a running
    answer keeps reaching its client (checkpoint by checkpoint), not frozen until Redis
    is back, and what it showed is saved."""
    redis = RedisServer()
    changed = settings.replace(
        redis={"url": redis.url, "timeout_seconds": 0.5}, stream={"flush_interval_ms": 100}
    )
    with redis, serve(create_app(changed)) as running:
        try:
            async with httpx.AsyncClient(
                base_url=running.url, timeout=30, event_hooks=USER
            ) as http:
                async with http.stream(
                    "POST",
                    "/api/chat/sse",
                    json=chat_body("long #tokens=400 #delay=0.02", chatId="f1"),
                ) as response:
                    stream = iter_sse(response)
                    head = await read_events(stream, 10)
                    freeze(redis)
                    await asyncio.sleep(2.0)  # the outage is noticed
                    during = await read_events(stream, 20)  # still coming, Redis frozen
                    assert len(during) == 20
                    row = (await http.get("/api/chats/f1")).json()["messages"][-1]
                    assert row["status"] == "streaming"
                    # what the client was shown is in the store already
                    assert row["content"].startswith(answer_of(head + during)), row["content"]
                    thaw(redis)
                    tail = await rest(stream)
                assert tail[-1].type == "messageEnd"
        finally:
            thaw(redis)
