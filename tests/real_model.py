"""A real language model on loopback: Gemma 3 270M (Q4_K_M GGUF) served by
llama-cpp-python's OpenAI-compatible server, built once by `scripts/real_model.sh` and
cached under `~/.cache/searchchat/real-model`.

It is a base model that follows no instructions: it runs on past any sensible length,
echoes prompts, answers JSON requests with prose. That makes it the adversary the
server's handling of real models is proven against (tests marked `real_model`).
"""

from __future__ import annotations

import functools
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.servers import ROOT, free_port

#: the name the model is served under
ALIAS = "gemma3"


@functools.cache
def built() -> tuple[str, str]:
    """The model server's python and the model file (built on first use)."""
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "real_model.sh")],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"scripts/real_model.sh failed:\n{done.stderr[-3000:]}")
    python, gguf = done.stdout.strip().splitlines()[-2:]
    return python, gguf


@dataclass
class LlamaServer:
    """One llama-cpp-python server process on a loopback port."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def cpu_seconds(self) -> float:
        """The CPU time the server process has used so far (user + system)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks

    def idle_after(self, seconds: float = 1.0) -> bool:
        """Whether the server used almost no CPU over `seconds` (it is not generating)."""
        before = self.cpu_seconds()
        time.sleep(seconds)
        return self.cpu_seconds() - before < 0.25 * seconds


def start_llama(tmp_dir: Path, *, n_ctx: int = 2048, chat_format: str = "gemma") -> LlamaServer:
    python, gguf = built()
    port = free_port()
    log = tmp_dir / f"llama-{port}.log"
    args = [
        python,
        "-m",
        "llama_cpp.server",
        "--model",
        gguf,
        "--model_alias",
        ALIAS,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(n_ctx),
        "--n_threads",
        "2",
        "--chat_format",
        chat_format,
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    server = LlamaServer(process, port, log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the model server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(server.url + "/models", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    pytest.fail(f"the model server did not start:\n{log.read_text()[-3000:]}")


def stop_llama(server: LlamaServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(10)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(10)


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """Gemma 3 270M with llama.cpp's `gemma` chat format (which drops system messages)."""
    server = start_llama(tmp_path_factory.mktemp("llama"))
    try:
        yield server
    finally:
        stop_llama(server)


@pytest.fixture(scope="session")
def llama_tools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """The same model with `chatml-function-calling`: real (if clumsy) tool calls."""
    server = start_llama(
        tmp_path_factory.mktemp("llama-tools"), chat_format="chatml-function-calling"
    )
    try:
        yield server
    finally:
        stop_llama(server)
