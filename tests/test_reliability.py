"""Nothing lost, nobody in: what two hosts sharing Postgres and Redis, store and Redis
outages, a kill -9 and hostile input do to ids, answers and other people's chats.

Every test talks to real things: `python -m app` processes (in PID namespaces of
their own, as two containers would run them), real PostgreSQL and Redis that the
tests stop and start, and the fake model and web.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time

import httpx
import orjson
import pytest
from httpx_ws import aconnect_ws

from app.main import create_app
from app.streams import close_redis, open_redis, rediskeys
from tests.client import answer_of, chat_body, iter_sse, read_events, rest, wait_for
from tests.conftest import (
    BOTH_TOPOLOGIES,
    USER,
    PostgresServer,
    RedisCluster,
    RedisServer,
    new_database,
)
from tests.servers import (
    OWN_PID_NAMESPACE,
    AppProcess,
    pid_namespaces_work,
    processes,
    serve,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def env(hosts_env):
    """Two "hosts" share one Postgres database and one Redis."""
    return hosts_env


def serving_line(process: AppProcess) -> dict:
    for line in process.output().splitlines():
        if '"msg":"serving"' in line:
            return orjson.loads(line)
    raise AssertionError(f"no start-up line:\n{process.output()}")


async def ask(http, base, body):
    async with http.stream("POST", base + "/api/chat/sse", json=body) as response:
        if response.status_code != 200:
            return response.status_code, orjson.loads(await response.aread())
        return 200, await rest(iter_sse(response))


# -- 1. ids unique across hosts ---------------------------------------------------------------


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
                for i in range(100)
                for n, server in enumerate((a, b))
            ]
            results = await asyncio.gather(*pairs)
            assert [status for status, _ in results] == [200] * 200
            answers = {events[0].data["messageId"] for _, events in results}
            chats = {events[0].data["chatId"] for _, events in results}
            questions = {events[-1].data["questionMessageId"] for _, events in results}
            assert len(answers) == len(chats) == len(questions) == 200  # rows lost: 0 of 200
            listed = (await http.get(a.url + "/api/chats?limit=1000")).json()["chats"]
            assert len(listed) == 200


# -- 2. one messageId sent twice at once ---------------------------------------------------------


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


# -- 3. the store away while answers finish ---------------------------------------------------------


async def test_answers_that_end_while_postgres_is_down_are_saved_when_it_returns(
    settings, fake_model
):
    pg = PostgresServer()
    pg.start()
    try:
        app = create_app(settings.replace(store={"url": new_database(pg.url)}))
        with serve(app) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as http:

                async def answer(i):
                    body = chat_body(f"q{i} #tokens=40 #delay=0.05", chatId=f"pg{i}")
                    async with http.stream("POST", "/api/chat/sse", json=body) as response:
                        return await rest(iter_sse(response))

                streams = [asyncio.create_task(answer(i)) for i in range(10)]
                await asyncio.sleep(0.6)
                pg.stop()  # down for ~6 s while every answer finishes
                down = await http.post("/api/chat/sse", json=chat_body("new chat meanwhile"))
                assert down.status_code == 503
                assert down.json() == {
                    "type": "error",
                    "key": "INTERNAL",
                    "data": "the chat store is unavailable; try again shortly",
                }
                results = await asyncio.gather(*streams)
                for events in results:  # the clients saw nothing of it
                    assert events[-1].type == "messageEnd", events[-1]
                    assert events[-1].data["status"] == "completed"
                await asyncio.sleep(6 - 2.5)
                pg.start()

                async def saved():
                    rows = [
                        (await http.get(f"/api/chats/pg{i}")).json()["messages"][-1]
                        for i in range(10)
                    ]
                    return rows if all(r["status"] != "streaming" for r in rows) else None

                rows = await wait_for(saved, timeout=20)
                for i, row in enumerate(rows):
                    assert row["status"] == "completed"
                    assert row["content"] == answer_of(results[i])  # lost: 0 of 10
    finally:
        pg.remove()


# -- 4. kill -9 ---------------------------------------------------------------------------------


@BOTH_TOPOLOGIES
async def test_a_killed_host_leaves_no_answer_streaming_and_saves_what_resumers_saw(
    env, fake_model
):
    env = {**env, "STREAM_FLUSH_INTERVAL_MS": "200"}
    with processes(2, env) as (a, b):
        async with httpx.AsyncClient(timeout=30, event_hooks=USER) as http:
            followed = chat_body("long #tokens=2000 #delay=0.01", chatId="k1")
            lonely = chat_body("long #tokens=2000 #delay=0.01", chatId="k2")
            async with (
                http.stream("POST", a.url + "/api/chat/sse", json=followed) as first,
                http.stream("POST", a.url + "/api/chat/sse", json=lonely) as second,
            ):
                head = await read_events(iter_sse(first), 30)
                await read_events(iter_sse(second), 30)
                killed_at = time.monotonic()
                a.kill()
            # a client resumes on the surviving host and ends with what Redis had
            async with http.stream(
                "GET",
                b.url + "/api/chat/sse/resume",
                params={"chatId": "k1", "lastEventId": head[5].id},
            ) as response:
                tail = await rest(iter_sse(response))
            assert tail[-1].type == "error" and tail[-1].data["key"] == "STREAM_ERROR"
            seen = answer_of(head[:6] + tail)

            async def closed():
                rows = [
                    (await http.get(b.url + f"/api/chats/{c}")).json()["messages"][-1]
                    for c in ("k1", "k2")
                ]
                return rows if all(r["status"] != "streaming" for r in rows) else None

            rows = await wait_for(closed, timeout=3 + 8)
            closed_after = time.monotonic() - killed_at
            assert [r["status"] for r in rows] == ["failed", "failed"]
            assert {r["error"]["key"] for r in rows} == {"STREAM_ERROR"}  # and why, in words
            assert "stopped" in rows[1]["error"]["data"]
            assert rows[0]["content"] == seen and seen.startswith("tok0 ")
            assert rows[1]["content"].startswith("tok0 ")  # nobody resumed it: closed too
            assert closed_after < 3 + 5, closed_after  # handle_ttl + a few seconds
            # saved, the dead process's answers are kept in Redis for replay only, not
            # for as long as a running answer may run (ten minutes and more)
            direct = open_redis(env["REDIS_URL"], cluster=env["REDIS_CLUSTER"] == "true")
            try:

                async def kept_for_replay() -> bool:
                    ttls = [
                        await direct.pttl(key)
                        for row, chat in zip(rows, ("k1", "k2"), strict=True)
                        for key in (
                            rediskeys.gen(row["messageId"]),
                            rediskeys.owner(row["messageId"]),
                            rediskeys.log(row["messageId"]),
                            rediskeys.latest(chat),
                        )
                    ]
                    # -2: no such key (a log never written: its events were in the journal)
                    return all(ttl == -2 or 0 < ttl <= 300_000 for ttl in ttls)  # replay TTL

                await wait_for(kept_for_replay, timeout=5)
            finally:
                await close_redis(direct)
            # what a live client had shown and Redis did not get: at most one flush (200 ms
            # of tokens 10 ms apart), so the saved answer lags the screen by at most that
            shown = answer_of(head)
            assert seen.startswith(shown) or shown.startswith(seen)
            assert shown.count("tok") - seen.count("tok") <= 25


async def test_one_process_without_redis_closes_what_a_crash_left_when_it_starts(
    tmp_path, model_url, fake_model
):
    env = {
        "LLM_BASE_URL": model_url,
        "LLM_API_KEY": "test-key",
        "STORE_URL": f"sqlite:///{tmp_path}/chat.db",
    }
    crashed = AppProcess(env).start()
    async with httpx.AsyncClient(timeout=30, event_hooks=USER) as http:
        async with http.stream(
            "POST",
            crashed.url + "/api/chat/sse",
            json=chat_body("#tokens=500 #delay=0.01", chatId="s1"),
        ) as response:
            await read_events(iter_sse(response), 10)
            crashed.kill()
        restarted = AppProcess(env).start()
        try:

            async def closed():
                row = (await http.get(restarted.url + "/api/chats/s1")).json()["messages"][-1]
                return row if row["status"] != "streaming" else None

            row = await wait_for(closed, timeout=5)
            assert row["status"] == "failed"
            assert row["error"] == {
                "key": "STREAM_ERROR",
                "data": "generation lost: its server process stopped",
            }
        finally:
            restarted.stop()
            crashed.stop()


# -- 5. Redis restarted mid-stream --------------------------------------------------------------


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


# -- 6. errors inside the protocol ----------------------------------------------------------------


async def test_a_store_that_is_down_at_the_start_is_a_503_or_an_error_frame(settings, fake_model):
    pg = PostgresServer()
    pg.start()
    try:
        app = create_app(settings.replace(store={"url": new_database(pg.url)}))
        with serve(app) as server:
            pg.stop()
            async with httpx.AsyncClient(base_url=server.url, timeout=20, event_hooks=USER) as http:
                for body in (chat_body("new chat"), chat_body("in a chat", chatId="e1")):
                    refused = await http.post("/api/chat/sse", json=body)
                    assert refused.status_code == 503, refused.text
                    assert refused.headers["content-type"] == "application/json"
                    assert refused.json()["key"] == "INTERNAL"
                    assert not re.search(r"Error|127\.0\.0\.1|:\d{4,5}", refused.text)
                assert (await http.get("/api/chats")).status_code == 503
            async with aconnect_ws(server.ws_url + "/api/chat/ws", httpx.AsyncClient()) as ws:
                await ws.receive_text()
                await ws.send_text(orjson.dumps(chat_body("q", chatId="e2")).decode())
                frame = orjson.loads(await ws.receive_text())
                assert (frame["type"], frame["key"], frame["chatId"]) == ("error", "INTERNAL", "e2")
                await ws.send_text('{"type": "ping"}')
                assert orjson.loads(await ws.receive_text()) == {"type": "pong"}  # still open
    finally:
        pg.remove()


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


# -- 7. pages nobody can script ------------------------------------------------------------------


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


async def read_sse_events(client, body):
    async with client.stream("POST", "/api/chat/sse", json=body) as response:
        return await rest(iter_sse(response))


# -- 8. one ownership rule -------------------------------------------------------------------------


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


# -- 9. the concurrency cap ------------------------------------------------------------------------


async def test_behind_a_trusted_proxy_the_cap_counts_the_forwarded_address(settings, fake_model):
    capped = settings.replace(limits={"max_concurrent_generations": 1})
    with serve(create_app(capped)) as server:  # from 127.0.0.1, a trusted proxy by default
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:

            def via(address, content, chat):
                return http.post(
                    "/api/chat/sse",
                    json=chat_body(content, chatId=chat),
                    headers={"x-forwarded-for": f"203.0.113.9, {address}"},
                )

            async with http.stream(
                "POST",
                "/api/chat/sse",
                json=chat_body("long #tokens=100 #delay=0.02", chatId="p1"),
                headers={"x-forwarded-for": "198.51.100.1"},
            ) as first:
                await anext(first.aiter_lines())
                assert (await via("198.51.100.1", "same client", "p2")).status_code == 429
                assert (await via("198.51.100.2", "another client", "p3")).status_code == 200


async def test_with_auth_the_cap_counts_per_key(settings, fake_model):
    keyed = settings.replace(
        limits={"max_concurrent_generations": 1}, auth={"api_keys": {"k1": "u1", "k2": "u2"}}
    )
    with serve(create_app(keyed)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
            one = {"authorization": "Bearer k1"}
            body = {**chat_body("long #tokens=100 #delay=0.02", chatId="q1"), "userId": None}
            async with http.stream("POST", "/api/chat/sse", json=body, headers=one) as first:
                await anext(first.aiter_lines())
                again = {**chat_body("again", chatId="q2"), "userId": None}
                assert (
                    await http.post("/api/chat/sse", json=again, headers=one)
                ).status_code == 429
                other = {**chat_body("other key", chatId="q3"), "userId": None}
                two = {"authorization": "Bearer k2"}
                assert (
                    await http.post("/api/chat/sse", json=other, headers=two)
                ).status_code == 200


# -- 10. over-large input ------------------------------------------------------------------------


async def test_an_over_large_body_is_answered_413_not_reset(env, fake_model):
    with processes(1, env) as (a,):
        async with httpx.AsyncClient(timeout=30) as http:
            big = orjson.dumps(chat_body("x" * 1_500_000))
            for _ in range(5):  # every time, not by luck
                response = await http.post(a.url + "/api/chat/sse", content=big)
                assert response.status_code == 413
                assert response.json()["key"] == "BAD_REQUEST"
            huge_headers = {f"x-filler-{i}": "y" * 1000 for i in range(40)}
            response = await http.get(a.url + "/healthz", headers=huge_headers)
            assert response.status_code == 431
            assert (await http.get(a.url + "/healthz")).status_code == 200


# -- 11. operations --------------------------------------------------------------------------------


def test_several_workers_without_redis_refuse_to_start(tmp_path, model_url):
    process = AppProcess(
        {
            "LLM_API_KEY": "k",
            "STORE_URL": f"sqlite:///{tmp_path}/x.db",
            "WEB_CONCURRENCY": "2",
            "REDIS_URL": "",
        }
    )
    with pytest.raises(RuntimeError):
        process.start()  # it never listens
    assert process.proc.returncode == 1
    assert "needs redis.url" in process.output()


async def test_a_second_interrupt_stops_at_once_and_every_stream_still_ends(
    tmp_path, model_url, fake_model
):
    env = {
        "LLM_BASE_URL": model_url,
        "LLM_API_KEY": "test-key",
        "STORE_URL": f"sqlite:///{tmp_path}/x.db",
        "SERVER_SHUTDOWN_GRACE_SECONDS": "30",
    }
    server = AppProcess(env).start()
    try:
        line = serving_line(server)
        assert {"store", "redis", "model", "searchProvider", "auth"} <= set(line)
        async with httpx.AsyncClient(timeout=30, event_hooks=USER) as http:
            body = chat_body("long #tokens=2000 #delay=0.01", chatId="i1")
            async with http.stream("POST", server.url + "/api/chat/sse", json=body) as response:
                stream = iter_sse(response)
                await read_events(stream, 5)
                server.proc.send_signal(signal.SIGINT)
                await asyncio.sleep(0.5)
                started = time.monotonic()
                server.proc.send_signal(signal.SIGINT)  # do not wait out the grace
                tail = await rest(stream)
        server.proc.wait(10)
        assert time.monotonic() - started < 3
        assert tail[-1].type == "messageEnd" and tail[-1].data["status"] == "cancelled"
        assert "Traceback" not in server.output(), server.output()
    finally:
        server.stop()


async def test_start_up_says_what_is_missing(tmp_path):
    server = AppProcess(
        {
            "LLM_API_KEY": "",
            "STORE_URL": f"sqlite:///{tmp_path}/x.db",
            "SEARCH_PROVIDER": "tavily",
            "TAVILY_API_KEY": "",
        }
    ).start()
    try:
        output = server.output()
        assert "no model key (LLM_API_KEY)" in output
        assert "web search will not work" in output and "TAVILY_API_KEY" in output
    finally:
        server.stop()


async def test_an_answer_still_ends_when_the_store_refuses_to_save_it(settings, fake_model):
    """Postgres turned read-only mid-answer (as after a failover): the client gets its
    end, the chat is free again, and the answer is saved once writes come back."""
    pg = PostgresServer()
    pg.start()
    try:
        url = new_database(pg.url)
        name = url.rsplit("/", 1)[1]

        async def read_only(on: bool) -> None:
            import asyncpg

            conn = await asyncpg.connect(pg.url + "/postgres")
            try:
                value = "on" if on else "off"
                await conn.execute(
                    f"ALTER DATABASE {name} SET default_transaction_read_only = {value}"
                )
                await conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = $1 AND pid <> pg_backend_pid()",
                    name,
                )
            finally:
                await conn.close()

        with serve(create_app(settings.replace(store={"url": url}))) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=30, event_hooks=USER) as http:
                body = chat_body("#tokens=60 #delay=0.02", chatId="ro1")
                async with http.stream("POST", "/api/chat/sse", json=body) as response:
                    stream = iter_sse(response)
                    head = await read_events(stream, 5)
                    await read_only(True)
                    tail = await rest(stream)
                assert tail[-1].type == "messageEnd" and tail[-1].data["status"] == "completed"
                await read_only(False)

                async def saved():
                    response = await http.get("/api/chats/ro1")
                    if response.status_code != 200:
                        return None
                    answer = response.json()["messages"][-1]
                    return answer if answer["status"] == "completed" else None

                answer = await wait_for(saved, timeout=20)
                assert answer["content"] == answer_of(head + tail)
                again = await read_sse_events(http, chat_body("again #tokens=2", chatId="ro1"))
                assert again[-1].data["status"] == "completed"  # not "already running"
    finally:
        pg.remove()
