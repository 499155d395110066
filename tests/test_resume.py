"""Following an answer: one relay per socket, a resume read from the process's own
log, a retry hint on every SSE stream, and a browser's own EventSource through a
drop."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
from httpx_ws import aconnect_ws

from app.main import create_app
from tests.client import chat_body, sse_chat
from tests.conftest import USER
from tests.servers import chromium, serve

pytestmark = pytest.mark.anyio


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


async def test_a_resume_of_an_answer_this_process_keeps_does_not_read_its_log(
    settings, fake_model, monkeypatch
):
    """Whether a resume is past the end is known from the log this process keeps (its
    end and last seq), without reading its events again."""
    with serve(create_app(settings)) as running:
        hub = running.app.state.service.hub
        reads: list[str] = []
        logged = hub.logged

        async def counted(answer_id: str) -> Any:
            reads.append(answer_id)
            return await logged(answer_id)

        monkeypatch.setattr(hub, "logged", counted)
        async with httpx.AsyncClient(base_url=running.url, timeout=20, event_hooks=USER) as http:
            events = await sse_chat(http, chat_body("q", chatId="cheap1"))
            params = {"chatId": "cheap1"}
            ended = await http.get(
                "/api/chat/sse/resume", params=params, headers={"last-event-id": events[-1].id}
            )
            earlier = await http.get(
                "/api/chat/sse/resume", params=params, headers={"last-event-id": events[1].id}
            )
    assert ended.status_code == 204 and earlier.status_code == 200
    assert reads == []


async def test_every_sse_stream_says_retry_and_a_resume_past_the_end_is_204(client, fake_model):
    async with client.stream("POST", "/api/chat/sse", json=chat_body("q", chatId="e1")) as r:
        first = await r.aread()
    assert first.startswith(b"retry: 2000\nid: ")  # no block without data
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
