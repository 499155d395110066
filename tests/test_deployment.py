"""The "Deployment and scaling" page (docs/deployment.md), run as written: Debian's nginx, configured with
the page's own nginx block, in front of three server processes that share
PostgreSQL and Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from httpx_ws import aconnect_ws

from tests.client import answer_of, chat_body, iter_sse, read_events, rest
from tests.conftest import BOTH_TOPOLOGIES, USER, new_database
from tests.servers import AppProcess, free_port, processes, wait_for_port

pytestmark = pytest.mark.anyio

README = Path(__file__).resolve().parent.parent / "docs" / "deployment.md"


def readme_nginx_block() -> str:
    text = README.read_text()
    blocks = re.findall(r"```nginx\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/deployment.md has one nginx configuration"
    return blocks[0]


@contextlib.contextmanager
def nginx_in_front(servers: list[AppProcess]) -> Iterator[str]:
    """nginx on a free loopback port with the page's configuration, its upstream
    pointed at `servers` and TLS taken out (the only changes)."""
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(binary).exists():
        pytest.fail("nginx is not installed: run `bash scripts/test.sh`, which installs it")
    block = readme_nginx_block()
    for default, server in zip((8081, 8082, 8083), servers, strict=True):
        block = block.replace(f"127.0.0.1:{default};", f"127.0.0.1:{server.port};")
    port = free_port()
    block = block.replace("listen 443 ssl;", f"listen 127.0.0.1:{port};")
    block = "\n".join(line for line in block.splitlines() if "ssl_certificate" not in line)
    workdir = Path(tempfile.mkdtemp(prefix="nginx-"))
    temp = "\n".join(
        f"    {kind}_temp_path {workdir}/{kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    (workdir / "nginx.conf").write_text(
        f"pid {workdir}/nginx.pid;\nerror_log {workdir}/error.log warn;\n"
        "worker_processes 1;\nevents {}\n"
        f"http {{\n    access_log off;\n{temp}\n{block}\n}}\n"
    )
    proc = subprocess.Popen(
        [binary, "-p", str(workdir), "-c", str(workdir / "nginx.conf"), "-g", "daemon off;"],
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def deployment(model_url, postgres_server, topology, fake_model):
    """Three processes behind nginx, on one Redis or (parametrised: `topology`) a Redis
    Cluster."""
    env = {
        **topology,
        "LLM_BASE_URL": model_url,
        "LLM_API_KEY": "test-key",
        "STORE_URL": new_database(postgres_server),
        "STREAM_HANDLE_TTL_SECONDS": "2",
        "STREAM_FLUSH_INTERVAL_MS": "50",
    }
    with processes(3, env) as servers, nginx_in_front(servers) as front:
        yield servers, front


async def test_sse_through_nginx_arrives_event_by_event(deployment):
    _, front = deployment
    async with httpx.AsyncClient(base_url=f"http://{front}", timeout=30, event_hooks=USER) as http:
        body = chat_body("slow #tokens=30 #delay=0.1 #reasoning=0")
        started = time.monotonic()
        async with http.stream("POST", "/api/chat/sse", json=body) as response:
            assert response.status_code == 200
            arrivals = []
            async for item in iter_sse(response):
                if not isinstance(item, str) and item.type == "message" and item.data["data"]:
                    arrivals.append(time.monotonic() - started)
    assert len(arrivals) == 30
    assert arrivals[0] < 1.0 and arrivals[-1] > 2.5  # not held back until the end


@pytest.mark.parametrize("path", ["/", "/api/chat/ws"])
async def test_websocket_upgrades_through_nginx(deployment, path):
    _, front = deployment
    async with aconnect_ws(f"ws://{front}{path}", httpx.AsyncClient(timeout=20)) as ws:
        assert orjson.loads(await ws.receive_text()) == {"type": "signal", "data": "open"}
        await ws.send_text(orjson.dumps(chat_body("hi #tokens=3")).decode())
        frames = []
        while not frames or frames[-1]["type"] not in ("messageEnd", "error"):
            frames.append(orjson.loads(await ws.receive_text()))
    assert frames[-1]["status"] == "completed"
    assert answer_of(frames) == "tok0 tok1 tok2 "


@BOTH_TOPOLOGIES
async def test_reconnects_landing_on_other_processes_resume_exactly(deployment):
    _, front = deployment
    expected = "".join(f"tok{i} " for i in range(60))
    async with httpx.AsyncClient(base_url=f"http://{front}", timeout=30, event_hooks=USER) as http:
        body = chat_body("long #tokens=60 #delay=0.03", chatId="d1")
        async with http.stream("POST", "/api/chat/sse", json=body) as response:
            seen = await read_events(iter_sse(response), 8)
        # each reconnect is a new connection: nginx sends it round the upstreams
        while seen[-1].type not in ("messageEnd", "error"):
            async with httpx.AsyncClient(
                base_url=f"http://{front}", timeout=30, event_hooks=USER
            ) as again:
                async with again.stream(
                    "GET",
                    "/api/chat/sse/resume",
                    params={"chatId": "d1"},
                    headers={"last-event-id": seen[-1].id},
                ) as response:
                    assert response.status_code == 200
                    seen += await read_events(iter_sse(response), 7)
    seqs = [int(e.id.split(":")[1]) for e in seen]
    assert seqs == list(range(1, len(seen) + 1))  # no gap, no duplicate
    assert answer_of(seen) == expected and seen[-1].data["status"] == "completed"


@BOTH_TOPOLOGIES
async def test_a_cancel_sent_to_any_process_stops_the_answer(deployment):
    _, front = deployment
    async with httpx.AsyncClient(base_url=f"http://{front}", timeout=30, event_hooks=USER) as http:
        for attempt in range(3):  # the cancel lands on each process in turn
            chat_id = f"d2-{attempt}"
            body = chat_body("long #tokens=2000 #delay=0.01", chatId=chat_id)
            async with http.stream("POST", "/api/chat/sse", json=body) as response:
                stream = iter_sse(response)
                await read_events(stream, 5)
                async with httpx.AsyncClient(base_url=f"http://{front}", timeout=10) as other:
                    cancel = await other.post(
                        "/api/chat/cancel", json={"chatId": chat_id, "userId": "1"}
                    )
                assert cancel.status_code == 200
                tail = await rest(stream)
            assert tail[-1].data["status"] == "cancelled"


@BOTH_TOPOLOGIES
async def test_one_process_killed_while_the_others_serve(deployment):
    servers, front = deployment
    async with httpx.AsyncClient(base_url=f"http://{front}", timeout=30, event_hooks=USER) as http:
        servers[0].kill()
        results = await asyncio.gather(
            *(
                http.post("/api/chat/sse", json=chat_body(f"q{i} #tokens=2", chatId=f"d3-{i}"))
                for i in range(12)
            )
        )
        assert [r.status_code for r in results] == [200] * 12
        assert all('"status":"completed"' in r.text for r in results)
        assert (await http.get("/readyz")).status_code == 200
