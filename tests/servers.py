"""Running real servers on loopback for tests: uvicorn in a thread, on port 0."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import uvicorn

from app.serving import BoundedHeaders, BoundedWebSocket

ROOT = Path(__file__).resolve().parent.parent


class Loopback:
    port: int
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.port}"


class ServerThread(Loopback):
    """A uvicorn server for `app` on 127.0.0.1:<free port> (or `port`), in its own thread
    and loop."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: Any = None,
        **config: Any,
    ) -> None:
        self.app = app
        self.host = host
        # proto must say TCP: asyncio only sets TCP_NODELAY on accepted sockets whose
        # proto is IPPROTO_TCP, and without it every response that is written in two
        # parts on a kept-alive connection waits 40 ms for a delayed ACK
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError:
            self.sock.close()
            raise
        self.port = self.sock.getsockname()[1]
        options = {
            "log_level": "warning",
            "ws": BoundedWebSocket,
            "http": BoundedHeaders,
            "lifespan": "on",
        }
        options.update(config)
        uvicorn_config = uvicorn.Config(app, **options)
        if limits is not None:  # the server.* settings the protocol reads
            uvicorn_config.server_limits = limits  # type: ignore[attr-defined]
        self.server = uvicorn.Server(uvicorn_config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))
        finally:
            # whatever the app's libraries left running
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.close()

    def start(self) -> ServerThread:
        self._thread.start()
        for _ in range(500):
            if self.server.started:
                return self
            if not self._thread.is_alive():
                break
            threading.Event().wait(0.01)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=15)
        self.sock.close()

    def call(self, coro: Any, timeout: float = 10) -> Any:
        """Run a coroutine on the server's loop (to look at its state) and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextlib.contextmanager
def serve(app: Any, host: str = "127.0.0.1", **config: Any) -> Iterator[ServerThread]:
    server = ServerThread(app, host, **config).start()
    try:
        yield server
    finally:
        server.stop()


@functools.cache
def npm_packages(script: str) -> str:
    """Where the npm packages a `scripts/<script>` installs into its cache are (installed
    on first use; the script prints the directory last)."""
    if shutil.which("node") is None and shutil.which("apt-get") is None:
        pytest.fail("node is not installed: run `bash scripts/test.sh`")
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / script)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"scripts/{script} failed:\n{done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(
    port: int, timeout: float = 20.0, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Until something listens on `port`; RuntimeError after `timeout`, or as soon as
    `process` (what should listen) has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the process exited ({process.returncode}) before it listened")
        time.sleep(0.02)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


#: run a command as PID 1 of a PID namespace of its own, as in a container
OWN_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM"]


def pid_namespaces_work() -> bool:
    try:
        done = subprocess.run([*OWN_PID_NAMESPACE, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


class AppProcess(Loopback):
    """The server as its own process (`python -m app`), configured by environment;
    `prefix` runs it under another command (`OWN_PID_NAMESPACE`)."""

    def __init__(
        self, env: dict[str, str], prefix: list[str] | None = None, args: tuple[str, ...] = ()
    ) -> None:
        self.prefix = prefix or []
        self.args = args
        self.port = free_port()
        self.env = {
            **os.environ,
            **env,
            "PORT": str(self.port),
            "SERVER_HOST": "127.0.0.1",
            "APP_CONFIG": "",
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_file = tempfile.NamedTemporaryFile(prefix="app-", suffix=".log", delete=False)  # noqa: SIM115

    def start(self) -> AppProcess:
        return self.spawn().wait_ready()

    def spawn(self) -> AppProcess:
        """Starts the process without waiting for it to listen (see `wait_ready`)."""
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "app", *self.args],
            env=self.env,
            cwd=ROOT,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
        )
        return self

    def wait_ready(self) -> AppProcess:
        try:
            wait_for_port(self.port, process=self.proc)
        except RuntimeError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()

    def _signal(self, signum: int) -> None:
        """Signals the server itself: under a prefix (`unshare --fork`) it is the prefix's
        child, and the prefix passes no signal on."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            return  # gone already (and its pid perhaps another's now)
        pids = [self.proc.pid]
        if self.prefix:
            with contextlib.suppress(OSError):
                children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
                pids = [int(pid) for pid in children.read_text().split()] or pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def output(self) -> str:
        """What the process logged so far (for failing tests)."""
        return Path(self.log_file.name).read_text(errors="replace")

    def kill(self) -> None:
        assert self.proc is not None
        self._signal(signal.SIGKILL)
        self.proc.wait()


def serving_line(process: AppProcess) -> dict:
    for line in process.output().splitlines():
        if '"msg":"serving"' in line:
            return orjson.loads(line)
    raise AssertionError(f"no start-up line:\n{process.output()}")


@contextlib.contextmanager
def processes(
    count: int, env: dict[str, str], prefix: list[str] | None = None
) -> Iterator[list[AppProcess]]:
    started: list[AppProcess] = []
    try:
        # all at once, as a server's workers start: each waits for the others' imports
        # no longer, and the store's migrations and Redis's worker numbers are taken
        # concurrently, as they are in production
        for _ in range(count):
            started.append(AppProcess(env, prefix).spawn())
        for proc in started:
            proc.wait_ready()
        yield started
    finally:
        for proc in started:
            proc.stop()


CHROMIUM = "/usr/bin/chromium"  # Debian's; Playwright's own download is never used


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """Debian's Chromium through Playwright, headless, closed at the end."""
    if not os.path.exists(CHROMIUM):
        pytest.fail("Chromium is not installed: run `bash scripts/test.sh`, which installs it")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        try:
            yield browser
        finally:
            browser.close()
