"""Processes killed, stopped, or started on what a crash left: what a client was
shown is what is resumed and saved, every stream ends, nothing is left streaming or
indexing, and a start refuses what it cannot serve safely.

Real things throughout: `python -m app` processes (in PID namespaces of their own, as
two containers would run them) killed with SIGKILL, real PostgreSQL and Redis, and
the fake model and web.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from starlette.middleware.gzip import GZipMiddleware

from app.chat.keeper import AnswerKeeper
from app.main import create_app
from app.serving import uvicorn_config
from app.store import CollectionRecord, DocumentRecord, FileRecord, open_store
from app.streams import close_redis, open_redis, rediskeys
from app.streams.memory import MemoryHub
from tests.client import answer_of, chat_body, iter_sse, read_events, rest, wait_for
from tests.conftest import BOTH_TOPOLOGIES, USER, PostgresServer, new_database
from tests.logs import everything_logged
from tests.servers import AppProcess, processes, serve, serving_line

pytestmark = pytest.mark.anyio


async def received_until_cut(response: httpx.Response, head: list) -> list:
    """Every event a client got before its server died: what it had read, then what
    was already on its way (read until the connection breaks)."""
    got = list(head)
    try:
        async for item in iter_sse(response):
            if hasattr(item, "data"):
                got.append(item)
    except (httpx.HTTPError, httpx.StreamError):
        pass
    return got


async def test_after_a_kill_what_every_client_saw_is_what_is_resumed_and_saved(
    hosts_env, fake_model
):
    """Three chats stream on A; A is killed outright. Each client resumes on B from the
    last event it received: nothing it was shown is missing from B's replay, and the
    saved answer is exactly what it was shown plus what the resume replayed."""
    with processes(2, hosts_env) as (a, b):
        async with httpx.AsyncClient(timeout=30, event_hooks=USER) as http:
            chats = ["d1", "d2", "d3"]
            bodies = [chat_body("long #tokens=3000 #delay=0.005", chatId=c) for c in chats]
            async with (
                http.stream("POST", a.url + "/api/chat/sse", json=bodies[0]) as r1,
                http.stream("POST", a.url + "/api/chat/sse", json=bodies[1]) as r2,
                http.stream("POST", a.url + "/api/chat/sse", json=bodies[2]) as r3,
            ):
                responses = [r1, r2, r3]
                heads = [await read_events(iter_sse(r), 40) for r in responses]
                a.kill()
                shown = [
                    await received_until_cut(r, h) for r, h in zip(responses, heads, strict=True)
                ]
            for chat, events in zip(chats, shown, strict=True):
                seqs = [int(e.id.rsplit(":", 1)[1]) for e in events]
                assert seqs == list(range(1, len(seqs) + 1)), chat  # in order, no gap
                async with http.stream(
                    "GET",
                    b.url + "/api/chat/sse/resume",
                    params={"chatId": chat, "lastEventId": events[-1].id},
                ) as response:
                    assert response.status_code == 200, chat
                    tail = await rest(iter_sse(response))
                # the resume goes on right after what the client had: nothing shown is
                # missing from what Redis kept
                assert int(tail[0].id.rsplit(":", 1)[1]) == seqs[-1] + 1, (chat, tail[0])
                assert tail[-1].type == "error" and tail[-1].data["key"] == "STREAM_ERROR"

                async def saved(chat: str = chat) -> dict | None:
                    row = (await http.get(b.url + f"/api/chats/{chat}")).json()["messages"][-1]
                    return row if row["status"] != "streaming" else None

                row = await wait_for(saved, timeout=15)
                assert row["status"] == "failed"
                assert row["content"] == answer_of(events + tail), chat
                assert len(answer_of(events)) > 100


async def v1_shown(lines: AsyncIterator[str], chunks: int | None = None) -> tuple[str, str]:
    """(answer id, text) a `/v1` stream's client was shown: the next `chunks` chunks
    of its lines, or all until the stream ends or breaks."""
    answer_id, text, seen = "", [], 0
    try:
        async for line in lines:
            if not line.startswith("data: {"):
                continue
            chunk = orjson.loads(line[6:])
            answer_id = chunk["id"].removeprefix("chatcmpl-")
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
            seen += 1
            if seen == chunks:
                break
    except (httpx.HTTPError, httpx.StreamError):
        pass
    return answer_id, "".join(text)


async def test_v1_streams_cut_by_a_kill_are_saved_with_what_their_clients_saw(
    hosts_env, fake_model
):
    """`/v1` streams cannot resume: when their process is killed, the sweeper on
    another one saves each answer with at least the text its client was shown."""
    body = {
        "model": "deepSeek",
        "stream": True,
        "user": "7",
        "messages": [{"role": "user", "content": "long #tokens=3000 #delay=0.01"}],
    }
    with processes(2, hosts_env) as (a, b):
        async with httpx.AsyncClient(timeout=30) as http, contextlib.AsyncExitStack() as stack:
            responses = [
                await stack.enter_async_context(
                    http.stream("POST", a.url + "/v1/chat/completions", json=body)
                )
                for _ in range(8)
            ]
            lines = [r.aiter_lines() for r in responses]
            heads = await asyncio.gather(*(v1_shown(each, 20) for each in lines))
            a.kill()
            tails = await asyncio.gather(*(v1_shown(each) for each in lines))
            shown = {h[0]: h[1] + t[1] for h, t in zip(heads, tails, strict=True)}
            await stack.aclose()

            async def saved() -> dict | None:
                chats = (await http.get(b.url + "/api/chats", params={"userId": "7"})).json()
                rows = {}
                for chat in chats["chats"]:
                    reply = await http.get(b.url + f"/api/chats/{chat['id']}?userId=7")
                    row = reply.json()["messages"][-1]
                    if row["status"] == "streaming":
                        return None
                    rows[row["messageId"]] = row
                return rows

            rows = await wait_for(saved, timeout=20)
            assert rows.keys() == shown.keys()
            for answer_id, text in shown.items():
                assert text.startswith("tok0 ") and len(text) > 60
                assert rows[answer_id]["status"] == "failed"
                assert rows[answer_id]["content"].startswith(text), answer_id


async def test_an_answer_the_store_never_took_is_saved_from_redis_after_its_process_died(
    hosts_env, fake_model
):
    """An answer ends while PostgreSQL is away; its process waits longer than the
    replay TTL for the store, then dies (kill -9). When the store is back, another
    process saves the answer from its log, whole: the log was held meanwhile."""
    pg = PostgresServer()
    pg.start()
    try:
        env = {**hosts_env, "STORE_URL": new_database(pg.url), "STREAM_REPLAY_TTL_SECONDS": "1"}
        with processes(2, env) as (a, b):
            async with httpx.AsyncClient(timeout=30, event_hooks=USER) as http:
                body = chat_body("q #tokens=30 #delay=0.05", chatId="held")
                async with http.stream("POST", a.url + "/api/chat/sse", json=body) as response:
                    events = iter_sse(response)
                    head = await read_events(events, 3)
                    pg.stop()
                    events = head + await rest(events)
                assert events[-1].type == "messageEnd"  # the client saw nothing of it
                await asyncio.sleep(4)  # past the replay TTL, the store still away
                a.kill()
                pg.start()

                async def saved():
                    answer = await http.get(b.url + "/api/chats/held")
                    if answer.status_code != 200:
                        return None
                    row = answer.json()["messages"][-1]
                    return row if row["status"] != "streaming" else None

                row = await wait_for(saved, timeout=30)
                assert row["status"] == "completed"
                assert row["content"] == answer_of(events)
    finally:
        pg.remove()


async def test_without_redis_a_crash_loses_at_most_a_flush_interval(
    tmp_path, model_url, fake_model
):
    """One process, SQLite, no Redis, killed outright mid-answer: when it starts again
    the answer is closed with what was checkpointed — all a client had seen but at most
    `stream.flush_interval_ms` of it."""
    env = {
        "LLM_BASE_URL": model_url,
        "LLM_API_KEY": "test-key",
        "STORE_URL": f"sqlite:///{tmp_path}/chat.db",
        "STREAM_FLUSH_INTERVAL_MS": "200",
    }
    crashed = AppProcess(env).start()
    async with httpx.AsyncClient(timeout=30, event_hooks=USER) as http:
        async with http.stream(
            "POST",
            crashed.url + "/api/chat/sse",
            json=chat_body("#tokens=2000 #delay=0.01", chatId="s1"),
        ) as response:
            head = await read_events(iter_sse(response), 100)
            crashed.kill()
            shown = answer_of(await received_until_cut(response, head))
        restarted = AppProcess(env).start()
        try:

            async def closed():
                row = (await http.get(restarted.url + "/api/chats/s1")).json()["messages"][-1]
                return row if row["status"] != "streaming" else None

            row = await wait_for(closed, timeout=10)
        finally:
            restarted.stop()
            crashed.stop()
    assert row["status"] == "failed"
    saved = row["content"]
    assert saved and shown.startswith(saved), (saved[-40:], shown[-40:])
    # 200 ms of tokens 10 ms apart, and a little for the kill to land
    assert shown.count("tok") - saved.count("tok") <= 30


async def test_an_upload_left_indexing_by_a_dead_process_is_marked_failed(tmp_path):
    store = open_store(f"sqlite:///{tmp_path}/files.db")
    async with store:
        old = time.time() - 120
        live = await store.lease_worker("live-token", 60, 1024)
        assert live >= 0
        for file_id, indexer in (("dead", "dead-token"), ("alive", "live-token"), ("none", "")):
            record = FileRecord(file_id, "1", f"{file_id}.txt", "txt", 3, old)
            await store.add_file(record, indexer)
        keeper = AnswerKeeper(
            store, MemoryHub(replay_ttl=5), checkpoint_interval=10, sweep_interval=60
        )
        await keeper.sweep()
        status = {f.id: (f.status, f.error) for f in await store.list_files("1")}
        assert status["alive"] == ("indexing", "")
        assert status["dead"][0] == status["none"][0] == "failed"
        assert "upload it again" in status["dead"][1]


async def test_a_collection_document_left_indexing_by_a_dead_process_is_failed_and_unindexed(
    tmp_path,
):
    """A process killed between putting a batch's passages in the engine and marking
    them ready: the sweep fails its documents and takes their passages back."""
    from app.collections import open_engine
    from app.collections.base import Passage
    from app.collections.retrieval import Retriever
    from app.collections.service import CollectionService
    from app.config import CollectionSettings, EmbeddingsSettings, UploadSettings
    from app.ids import Snowflake
    from app.model import Embedder

    store = open_store(f"sqlite:///{tmp_path}/documents.db")
    engine = open_engine(f"tantivy:///{tmp_path}/engine")
    embedder = Embedder(EmbeddingsSettings(model=""))
    async with store, engine:
        old = time.time() - 120
        assert await store.lease_worker("live-token", 60, 1024) >= 0
        await store.add_collection(CollectionRecord("c1", "1", "docs", "", old))
        for doc_id, indexer in (("dead", "dead-token"), ("alive", "live-token"), ("none", "")):
            record = DocumentRecord(doc_id, "c1", "i1", f"{doc_id}.txt", "txt", 3, old)
            await store.add_documents([record], indexer)
            await engine.add("c1", [Passage(doc_id, 0, 0, record.title, "File", "kestrel")])
        settings = CollectionSettings()
        retriever = Retriever(settings, engine=engine, embedder=embedder)
        service = CollectionService(
            settings,
            UploadSettings(),
            store=store,
            retriever=retriever,
            reader=None,
            ids=Snowflake(),
        )
        assert await service.sweep() == 2
        assert await service.sweep() == 0  # each is swept once
        status = {d.id: (d.status, d.error) for d in await store.list_documents("c1")}
        assert status["alive"] == ("indexing", "")
        assert status["dead"][0] == status["none"][0] == "failed"
        assert "add it again" in status["dead"][1]
        assert [p.document_id for p in await engine.passages("c1")] == ["alive"]
        await embedder.aclose()


async def test_an_upload_cut_by_a_stop_is_failed_not_left_indexing(settings, tmp_path, fake_model):
    """A big upload is being read in the background when the server stops: it is marked
    failed (upload it again), not left `indexing` for ever."""
    from tests.test_files import make_pdf

    big = make_pdf(filler=600)
    env = {
        "LLM_BASE_URL": settings.llm.base_url,
        "LLM_API_KEY": "test-key",
        "STORE_URL": settings.store.url,
    }
    server = AppProcess(env).start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
            answer = await http.post(
                "/api/uploads?wait=false&userId=1",
                files={"files": ("big.pdf", big, "application/pdf")},
            )
            assert answer.status_code == 202
            file_id = answer.json()["files"][0]["fileId"]
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(30)
        restarted = AppProcess(env).start()
        try:
            async with httpx.AsyncClient(base_url=restarted.url, timeout=20) as http:
                record = (await http.get(f"/api/uploads/{file_id}?userId=1")).json()
            assert record["status"] in ("failed", "ready"), record
            if record["status"] == "failed":
                assert "upload it again" in record["error"]
        finally:
            restarted.stop()
    finally:
        server.stop()


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
