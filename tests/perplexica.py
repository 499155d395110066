"""Harness for end-to-end tests with Perplexica's real web UI (PROTOCOL §9).

* `perplexica_ui`: the UI built once by `scripts/perplexica_ui.sh` (cached between runs)
  and served by `next start` on a free port, for the whole session;
* `backend`: this server in-process on 127.0.0.1:18080 (the address baked into the
  build), with the fake model and the fake SearxNG behind a recorder (`searxng`) that
  keeps every query and answer, one per module (`backend.restart()` gives a fresh one);
* `ui` / `ui_defaults`: a Chromium page (1280 px wide) that fails the test on a page
  error and reaches no host but 127.0.0.1, with helpers that act as a user (`ask`,
  `pick_focus`, `attach`, …) and keep what went over the WebSocket and HTTP, so a
  failing step says what the server answered.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import pytest

from app.config import Settings
from app.main import create_app
from tests.fakes.model import FakeModel
from tests.fakes.search import FakeSearch
from tests.servers import ROOT, ServerThread, free_port, serve
from tests.servers import chromium as launch_chromium

BUILD_SCRIPT = ROOT / "scripts" / "perplexica_ui.sh"
#: the build inlines these addresses into the UI's JavaScript (scripts/perplexica_ui.sh)
API_PORT = 18080
API_URL = f"http://127.0.0.1:{API_PORT}"
FAILED_TO_CONNECT = "Failed to connect to the server. Please try again later."
ASK_FIRST = "Ask anything..."
ASK_FOLLOW_UP = "Ask a follow-up"
#: the focus modes the UI offers: its title in the picker → the `focusMode` it sends
FOCUS_MODES = {
    "All": "webSearch",
    "Academic": "academicSearch",
    "Writing": "writingAssistant",
    "Wolfram Alpha": "wolframAlphaSearch",
    "Youtube": "youtubeSearch",
    "Reddit": "redditSearch",
}


# -- the UI: built once, served by Next.js -------------------------------------------


@pytest.fixture(scope="session")
def perplexica_build() -> Path:
    """The built UI's directory (the script builds it the first time, then answers from cache)."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            ["bash", str(BUILD_SCRIPT)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"building the Perplexica UI took over 30 minutes:\n{_tail(error.stderr)}")
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        pytest.fail(
            f"scripts/perplexica_ui.sh failed (exit {done.returncode}): the Perplexica UI "
            f"could not be built (Node 18+ and the npm registry are needed).\n{_tail(done.stderr)}"
        )
    built = Path(lines[-1])
    if not (built / ".next" / "BUILD_ID").is_file():
        pytest.fail(f"scripts/perplexica_ui.sh printed {built}, which holds no .next/BUILD_ID")
    if time.monotonic() - started > 5:
        print(f"\nbuilt the Perplexica UI in {time.monotonic() - started:.0f} s: {built}")
    return built


@pytest.fixture(scope="session")
def perplexica_ui(perplexica_build: Path) -> Iterator[str]:
    """`next start` of the built UI on a free loopback port: its base URL."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not on PATH after scripts/perplexica_ui.sh")
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="perplexica-ui-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        [node, "node_modules/next/dist/bin/next", "start", "-p", str(port), "-H", "127.0.0.1"],
        cwd=perplexica_build,
        env={**os.environ, "NEXT_TELEMETRY_DISABLED": "1", "NODE_ENV": "production"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the whole group is ended below
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"next start exited with {proc.returncode}:\n{_read(log.name)}")
            try:
                with urllib.request.urlopen(url + "/", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"next start did not answer on {url} in 60 s:\n{_read(log.name)}")
            time.sleep(0.1)
        yield url
    finally:
        _end_group(proc)
        log.close()
        os.unlink(log.name)


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tail(text: str | bytes | None, lines: int = 40) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


def _read(path: str) -> str:
    return _tail(Path(path).read_text(errors="replace"))


# -- the fake SearxNG, recorded ------------------------------------------------------


@dataclass
class SearxngCall:
    params: dict[str, str]
    status: int = 0
    body: Any = None

    @property
    def category(self) -> str:
        return self.params.get("categories", "")

    @property
    def engines(self) -> set[str]:
        return {e.strip().lower() for e in self.params.get("engines", "").split(",") if e.strip()}

    @property
    def results(self) -> list[dict[str, Any]]:
        items = self.body.get("results") if isinstance(self.body, dict) else None
        return [item for item in items or [] if isinstance(item, dict)]


@dataclass
class SearxngRecorder:
    """The fake search app behind an ASGI layer that keeps every SearxNG query and answer."""

    app: Any
    calls: list[SearxngCall] = field(default_factory=list)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/searxng/"):
            await self.app(scope, receive, send)
            return
        call = SearxngCall(dict(parse_qsl(scope.get("query_string", b"").decode())))
        self.calls.append(call)
        chunks: list[bytes] = []

        async def keep(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                call.status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    with contextlib.suppress(ValueError):
                        call.body = json.loads(b"".join(chunks) or b"null")
            await send(message)

        await self.app(scope, receive, keep)

    def of(self, category: str = "") -> list[SearxngCall]:
        """The calls of one category (`""`: web searches, without a category)."""
        return [call for call in self.calls if call.category == category]


@pytest.fixture(scope="session")
def searxng_recorder(
    fake_search_server: tuple[FakeSearch, ServerThread],
) -> Iterator[tuple[SearxngRecorder, ServerThread]]:
    search, _ = fake_search_server
    recorder = SearxngRecorder(search.app())
    with serve(recorder) as server:
        yield recorder, server


@pytest.fixture
def searxng(
    searxng_recorder: tuple[SearxngRecorder, ServerThread], fake_search: FakeSearch
) -> SearxngRecorder:
    """What the server asked the fake SearxNG during this test (and what it got)."""
    recorder, _ = searxng_recorder
    recorder.calls.clear()
    return recorder


# -- this server on the port the build talks to --------------------------------------


def fixed_port_server(app: Any, port: int) -> ServerThread:
    """`tests.servers.ServerThread` on the port the UI build talks to, started."""
    try:
        return ServerThread(app, port=port).start()
    except OSError as error:
        pytest.fail(
            f"cannot listen on 127.0.0.1:{port} ({error}): the Perplexica UI build talks to "
            "this port only; is another test run or server using it?"
        )


class Backend:
    """This server on 127.0.0.1:18080; `restart()` replaces it by a fresh one (empty
    caches, same database)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.server = fixed_port_server(create_app(settings), API_PORT)

    url = API_URL

    def restart(self) -> None:
        self.server.stop()
        self.server = fixed_port_server(create_app(self.settings), API_PORT)

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="module")
def perplexica_settings(
    tmp_path_factory: pytest.TempPathFactory,
    fake_model_server: tuple[FakeModel, ServerThread],
    fake_search_server: tuple[FakeSearch, ServerThread],
    searxng_recorder: tuple[SearxngRecorder, ServerThread],
) -> Settings:
    """tests/conftest.py's `settings` (fake model, fake search), for a whole module, with
    SearxNG as the search provider (through the recorder) and CORS open to the UI's origin."""
    model = fake_model_server[1].url + "/v1"
    search, search_server = fake_search_server
    base = search_server.url
    store = tmp_path_factory.mktemp("perplexica") / "chat.db"
    return Settings().replace(
        llm={
            "base_url": model,
            "api_key": "test-key",
            "model": "fake-chat",
            "small_model": "fake-small",
        },
        embeddings={"base_url": model, "api_key": "test-key", "model": "fake-embed"},
        store={"url": f"sqlite:///{store}"},
        server={"keepalive_seconds": 15.0, "shutdown_grace_seconds": 2.0, "cors_origins": ("*",)},
        search={"provider": "searxng", "max_results": 8, "timeout_seconds": 10.0},
        tavily={"api_key": search.api_key, "base_url": base + "/tavily"},
        searxng={"url": searxng_recorder[1].url + "/searxng"},
        google={"api_key": search.api_key, "cse_id": "cx1", "base_url": base + "/google"},
        reader={"provider": "jina", "base_url": base + "/jina", "timeout_seconds": 5.0},
    )


@pytest.fixture(scope="module")
def backend(perplexica_settings: Settings) -> Iterator[Backend]:
    running = Backend(perplexica_settings)
    try:
        yield running
    finally:
        running.stop()


# -- Chromium and the page -----------------------------------------------------------


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """Debian's Chromium through Playwright, one per module."""
    with launch_chromium() as browser:
        yield browser


@dataclass
class Frame:
    """A WebSocket frame, parsed."""

    sent: bool
    data: Any

    @property
    def type(self) -> str:
        return str(self.data.get("type")) if isinstance(self.data, dict) else "?"


class UI:
    """The Perplexica UI in one browser tab, driven as a user would, with what it
    exchanged with the server kept for assertions and failure messages."""

    def __init__(self, page: Any, base: str) -> None:
        self.page = page
        self.base = base
        self.errors: list[str] = []
        self.console_errors: list[str] = []
        self.frames: list[Frame] = []
        self.ws_urls: list[str] = []
        self.responses: list[tuple[str, str, int]] = []  # (method, url, status), API only
        self.requested: list[str] = []  # every URL the page asked for
        page.on("pageerror", lambda error: self.errors.append(str(error)))
        page.on(
            "console",
            lambda message: (
                self.console_errors.append(message.text) if message.type == "error" else None
            ),
        )
        page.on("websocket", self._websocket)
        page.on("request", lambda request: self.requested.append(request.url))
        page.on("response", self._response)

    # -- what went over the wire ------------------------------------------------------

    def _websocket(self, ws: Any) -> None:
        self.ws_urls.append(ws.url)
        ws.on("framesent", lambda payload: self._frame(True, payload))
        ws.on("framereceived", lambda payload: self._frame(False, payload))

    def _frame(self, sent: bool, payload: str | bytes) -> None:
        try:
            data = json.loads(payload)
        except ValueError:
            data = payload
        self.frames.append(Frame(sent, data))

    def _response(self, response: Any) -> None:
        if response.url.startswith(API_URL):
            self.responses.append((response.request.method, response.url, response.status))

    def sent(self) -> list[dict[str, Any]]:
        """The `message` frames the UI sent."""
        return [f.data for f in self.frames if f.sent and f.type == "message"]

    def received(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [f.data for f in self.frames if not f.sent and (kind is None or f.type == kind)]

    def chat_id(self) -> str:
        sent = self.sent()
        assert sent, "the UI sent no message"
        return str(sent[-1]["message"]["chatId"])

    def local_storage(self) -> dict[str, str]:
        return dict(self.page.evaluate("() => Object.fromEntries(Object.entries(localStorage))"))

    def toasts(self) -> list[str]:
        return [t.strip() for t in self.page.locator("[data-sonner-toast]").all_inner_texts()]

    def report(self) -> str:
        """What happened so far, for a failure message."""
        frames = [
            ("→ " if f.sent else "← ") + json.dumps(f.data)[:300]
            for f in self.frames
            if f.type not in {"message"} or f.sent
        ][-15:]
        bad = [f"{m} {u} → {s}" for m, u, s in self.responses if s >= 400]
        try:
            toasts = self.toasts()
            failed = self.page.get_by_text(FAILED_TO_CONNECT).count() > 0
        except Exception as error:  # the page may be gone
            toasts, failed = [f"({error})"], False
        return (
            f"\n  url: {self.page.url}"
            f"\n  'Failed to connect' page: {failed}"
            f"\n  toasts: {toasts}"
            f"\n  page errors: {self.errors}"
            f"\n  API answers >= 400: {bad[-10:]}"
            f"\n  console errors: {self.console_errors[-5:]}"
            f"\n  WebSocket: {self.ws_urls}\n    " + "\n    ".join(frames)
        )

    # -- waiting ----------------------------------------------------------------------

    def wait_until(self, check: Callable[[], Any], what: str, timeout: float = 15) -> Any:
        """Poll `check` (letting Playwright deliver events) until it is truthy."""
        deadline = time.monotonic() + timeout
        while True:
            if self.errors:  # fail where it happened, not only at teardown
                raise AssertionError(f"the page threw while waiting for {what}{self.report()}")
            found = check()
            if found:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout:.0f} s waiting for {what}{self.report()}"
                )
            self.page.wait_for_timeout(50)

    def see(self, locator: Any, what: str, timeout: float = 15) -> Any:
        """Wait for `locator` to be visible (fail with the report)."""
        try:
            locator.first.wait_for(state="visible", timeout=timeout * 1000)
        except Exception as error:
            raise AssertionError(f"{what} did not show: {error}{self.report()}") from None
        return locator

    # -- acting as a user -------------------------------------------------------------

    def open(self, path: str = "/") -> UI:
        self.page.goto(self.base + path)
        return self

    def home(self) -> UI:
        """Open a new chat and wait until the UI is connected (`/api/models`, `signal open`)."""
        self.open("/")
        self.see(self.page.get_by_placeholder(ASK_FIRST), "the home page's input (connected)")
        return self

    def pick_focus(self, title: str) -> None:
        self.page.get_by_role("button", name="Focus").click()
        # the option's name is its icon's title (simple-icons SVGs have one), its title and
        # its description: "YouTube Youtube Search and watch videos"
        option = re.compile(r"(^|\s)" + re.escape(title) + r"\s")
        self.page.get_by_role("button", name=option).click()

    def pick_optimization(self, title: str) -> None:
        self.page.get_by_role("button", name="Speed").click()
        # the option's name is its title and description ("Speed Prioritize speed…"), the
        # picker's own is the mode's title
        option = re.compile("^" + re.escape(title) + r"\s")
        self.page.get_by_role("button", name=option).click()

    def attach(self, *files: Path) -> dict[str, Any]:
        """Attach files through the input's file picker; the `/api/uploads` answer."""
        with self.page.expect_response(
            lambda r: r.url == API_URL + "/api/uploads", timeout=15_000
        ) as answer:
            self.page.locator('input[type="file"]').first.set_input_files(
                [str(path) for path in files]
            )
        response = answer.value
        assert response.status == 200, f"/api/uploads → {response.status}: {response.text()}"
        body: dict[str, Any] = response.json()
        return body

    def ask(self, question: str, timeout: float = 20) -> dict[str, Any]:
        """Type a question in the input on screen, send it, wait for its `messageEnd`
        and for the UI to finish; the `message` frame the UI sent."""
        first = self.page.get_by_placeholder(ASK_FIRST)
        box = first if first.count() else self.page.get_by_placeholder(ASK_FOLLOW_UP)
        self.see(box, "the question input")
        sent_before = len(self.sent())
        box.fill(question)
        box.press("Enter")
        return self.wait_answered(sent_before, timeout)

    def wait_answered(self, sent_before: int, timeout: float = 20) -> dict[str, Any]:
        frame = self.wait_until(
            lambda: len(self.sent()) > sent_before and self.sent()[sent_before],
            "the UI to send the question",
        )
        index = next(i for i, f in enumerate(self.frames) if f.sent and f.data is frame)

        def ended() -> bool:
            return any(f.type in {"messageEnd", "error"} for f in self.frames[index + 1 :])

        self.wait_until(ended, "messageEnd for " + json.dumps(frame["message"]), timeout)
        errors = [f.data for f in self.frames[index + 1 :] if f.type == "error"]
        assert not errors, f"the server answered an error frame: {errors}{self.report()}"
        # loading is over when nothing spins and the answer's actions (Rewrite) are back
        spinning = self.page.locator(".animate-spin")
        rewrite = self.page.get_by_role("button", name="Rewrite")
        self.wait_until(
            lambda: spinning.count() == 0 and rewrite.count() > 0, "the answer to finish"
        )
        return dict(frame)

    def rewrite(self, index: int = -1, timeout: float = 20) -> dict[str, Any]:
        """Click Rewrite under an answer (the last by default); the frame sent."""
        sent_before = len(self.sent())
        self.page.get_by_role("button", name="Rewrite").nth(index).click()
        return self.wait_answered(sent_before, timeout)

    def answer_frames_text(self, message_id: str) -> str:
        return "".join(
            str(f.data.get("data", ""))
            for f in self.frames
            if not f.sent and f.type == "message" and f.data.get("messageId") == message_id
        )

    def source_titles(self, answer: int = -1) -> list[str]:
        """The titles of the source cards of an answer (the last by default): the cards
        shown, or all of them from the "View N more" dialog when there is one."""
        sections = self.page.locator("xpath=//h3[normalize-space()='Sources']/../..")
        if sections.count() == 0:
            return []
        section = sections.nth(answer)
        more = section.get_by_role("button", name=re.compile(r"View \d+ more"))
        if more.count() == 0:
            return [p.strip() for p in section.locator("a > p:first-child").all_inner_texts()]
        more.click()
        dialog = self.page.get_by_role("dialog")
        self.see(dialog.get_by_text("Sources", exact=True), "the sources dialog")
        # a user reads the dialog once it has opened: closing it while its opening
        # transition runs can leave the page behind it inert (Headless UI 2.2)
        self.wait_until(
            lambda: dialog.evaluate("d => d.getAnimations({subtree: true}).length === 0"),
            "the sources dialog to finish opening",
        )
        titles = [p.strip() for p in dialog.locator("a > p:first-child").all_inner_texts()]
        self.page.keyboard.press("Escape")
        dialog.wait_for(state="hidden")
        # the dialog marks the rest of the page inert while open, and clears it only once
        # its closing transition ends
        self.wait_until(
            lambda: self.page.evaluate("document.querySelector('[inert]') === null"),
            "the page behind the sources dialog to be usable again",
        )
        return titles


@contextlib.contextmanager
def _ui(browser: Any, base: str, local_storage: dict[str, str] | None = None) -> Iterator[UI]:
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    # the browser reaches only loopback: favicons (s2.googleusercontent.com) and the mocked
    # font would time out; images outside loopback are blocked too
    context.route(re.compile(r"^https?://(?!127\.0\.0\.1[:/])"), lambda route: route.abort())
    if local_storage:
        script = "".join(
            f"localStorage.setItem({json.dumps(k)}, {json.dumps(v)});"
            for k, v in local_storage.items()
        )
        context.add_init_script(script)
    context.set_default_timeout(15_000)
    ui = UI(context.new_page(), base)
    try:
        yield ui
    finally:
        errors = list(ui.errors)
        context.close()
    if errors:
        pytest.fail(f"the page threw: {errors}")


@pytest.fixture
def ui(
    chromium: Any,
    perplexica_ui: str,
    backend: Backend,
    fake_model: FakeModel,
    fake_search: FakeSearch,
    searxng: SearxngRecorder,
) -> Iterator[UI]:
    """A fresh tab (empty localStorage but automatic image search off, so that only the
    tests of images ask for them)."""
    with _ui(chromium, perplexica_ui, {"autoImageSearch": "false"}) as page:
        yield page


@pytest.fixture
def ui_defaults(
    chromium: Any,
    perplexica_ui: str,
    backend: Backend,
    fake_model: FakeModel,
    fake_search: FakeSearch,
    searxng: SearxngRecorder,
) -> Iterator[UI]:
    """A fresh tab with the UI's own defaults (automatic image search on)."""
    with _ui(chromium, perplexica_ui) as page:
        yield page


# -- what the fake model was asked ---------------------------------------------------


def answer_requests(model: FakeModel, question: str) -> list[dict[str, Any]]:
    """The streamed (answering) requests whose last user message holds `question`."""
    found = []
    for request in model.streamed_requests():
        users = [m for m in request["messages"] if m["role"] == "user"]
        if users and question in str(users[-1]["content"]):
            found.append(request)
    return found


def conversation(request: dict[str, Any]) -> list[tuple[str, str]]:
    """A model request's turns without its system prompt: [(role, content), …]."""
    return [
        (m["role"], str(m["content"]).strip()) for m in request["messages"] if m["role"] != "system"
    ]


def system_prompt(request: dict[str, Any]) -> str:
    return "\n".join(str(m["content"]) for m in request["messages"] if m["role"] == "system")


# -- files ---------------------------------------------------------------------------


def minimal_pdf(text: str) -> bytes:
    """A one-page PDF 1.4 whose page shows `text` in Helvetica (a text layer a PDF
    library extracts), with a correct cross-reference table."""
    escaped = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
    stream = f"BT /F1 12 Tf 72 720 Td ({escaped}) Tj ET".encode("latin-1")
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
        b"/Resources << /Font << /F1 4 0 R >> >> /Contents 5 0 R >>",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
    ]
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1,
        xref,
    )
    return bytes(out)


def wait_for(check: Callable[[], Any], what: str, timeout: float = 5) -> Any:
    """Poll a condition outside the page (the fakes' records)."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found or time.monotonic() > deadline:
            assert found, f"timed out waiting for {what}"
            return found
        time.sleep(0.02)
