"""The "The Perplexica UI with accounts" section of docs/security.md, run as written: Debian's nginx with the
its nginx block serves a UI at `/` (a stand-in that asks as the Perplexica UI does: fetches
to `/api/…`, a WebSocket on `/`, no credentials of its own) and the server behind it;
in headless Chromium the UI is refused until its visitor signs in at `/signin`, then
works with the session cookie."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from app.main import create_app
from tests.client import sse_chat
from tests.identity import browser, question, sign_up
from tests.servers import ServerThread, chromium, free_port, serve, wait_for_port

README = Path(__file__).resolve().parent.parent / "docs" / "security.md"

#: what the stand-in UI does on load, as the Perplexica UI does: list the chats, ask for
#: suggestions (a POST), then ask a question over a WebSocket on `/`
UI_PAGE = """<!doctype html><meta charset="utf-8"><title>ui</title>
<pre id="out"></pre>
<script type="module">
const out = {};
const show = () => { document.querySelector("#out").textContent = JSON.stringify(out); };
out.chats = (await fetch("/api/chats")).status;
out.suggestions = (await fetch("/api/suggestions", {
  method: "POST", headers: {"Content-Type": "application/json"},
  body: JSON.stringify({history: [["human", "q"], ["assistant", "a"]]}),
})).status;
const ws = new WebSocket(`ws://${location.host}/?chatModel=fake-chat`);
ws.onmessage = (m) => {
  const frame = JSON.parse(m.data);
  if (frame.type === "signal") ws.send(JSON.stringify({
    type: "message", focusMode: "deepSeek", message: {content: "hello from the ui"}}));
  if (frame.type === "messageEnd" || frame.type === "error") {
    out.answer = frame.status || frame.key; show(); ws.close();
  }
};
ws.onclose = (e) => { out.closed = e.code; out.done = true; show(); };
</script>"""


def readme_site_block() -> str:
    blocks = re.findall(
        r"```nginx title=\"the UI and the server on one site\"\n(.*?)```", README.read_text(), re.S
    )
    assert len(blocks) == 1, "docs/security.md has one nginx block for the UI with accounts"
    return blocks[0]


@contextlib.contextmanager
def nginx(block: str, port: int) -> Iterator[None]:
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(binary).exists():
        pytest.fail("nginx is not installed: run `bash scripts/test.sh`, which installs it")
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
        yield
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def site(settings) -> Iterator[str]:
    """nginx on a free loopback port with the page's block (TLS taken out, its
    upstreams pointed here), the server and the stand-in UI behind it."""

    async def ui(request: Request) -> HTMLResponse:
        return HTMLResponse(UI_PAGE)

    port = free_port()
    public = f"http://127.0.0.1:{port}"
    app = create_app(settings.replace(auth={"mode": "accounts"}, server={"public_url": public}))
    server = ServerThread(app).start()
    try:
        with serve(Starlette(routes=[Route("/", ui)])) as stand_in:
            block = readme_site_block()
            block = block.replace("server 127.0.0.1:8080;", f"server 127.0.0.1:{server.port};")
            block = block.replace("server 127.0.0.1:3000;", f"server 127.0.0.1:{stand_in.port};")
            block = block.replace("listen 443 ssl;", f"listen 127.0.0.1:{port};")
            block = "\n".join(l for l in block.splitlines() if "ssl_certificate" not in l)  # noqa: E741
            with nginx(block, port):
                yield public
    finally:
        server.stop()


def test_the_ui_on_the_same_site_works_once_signed_in_and_never_as_anyone(site, fake_model):
    fake_model.replies.insert(0, ("follow-up", "one?\ntwo?\nthree?"))
    with chromium() as browser:
        page = browser.new_page()
        page.goto(site + "/")
        page.wait_for_function("() => document.querySelector('#out').textContent.includes('done')")
        refused = page.evaluate("JSON.parse(document.querySelector('#out').textContent)")
        assert refused["chats"] == 401 and refused["suggestions"] == 401
        assert refused["answer"] == "UNAUTHORIZED" and refused["closed"] == 4401
        assert fake_model.requests == []

        page.goto(site + "/signin")
        page.wait_for_selector("#signin:not([hidden])")
        page.click("#signin-toggle")
        page.fill("#signin-email", "ada@example.test")
        page.fill("#signin-password", "correct horse battery")
        page.click("#signin-submit")
        page.wait_for_url(site + "/")  # sent on to what serves / (the UI)
        page.wait_for_function("() => document.querySelector('#out').textContent.includes('done')")
        works = page.evaluate("JSON.parse(document.querySelector('#out').textContent)")
        assert works["chats"] == 200 and works["suggestions"] == 200
        assert works["answer"] == "completed"
        browser.close()


@pytest.mark.anyio
async def test_a_share_link_on_the_same_site_opens_the_shared_page_without_signing_in(
    site, fake_model
):
    async with browser(site) as ada, httpx.AsyncClient(base_url=site, timeout=15) as anyone:
        await sign_up(ada, "ada@example.test")
        await sse_chat(ada, question("what is rust", chatId="91"))
        made = await ada.post("/api/chats/91/share", json={})
        assert made.status_code == 201, made.text
        assert made.json()["url"].startswith(site + "/s/")  # server.public_url
        page = await anyone.get(made.json()["url"])
    assert page.status_code == 200 and "<h2>what is rust</h2>" in page.text  # not the UI's
