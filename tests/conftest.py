from __future__ import annotations

import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from app.config import Settings
from app.main import create_app
from tests.fakes.model import DEFAULT_REPLIES, FakeModel
from tests.fakes.search import FakeSearch
from tests.servers import ServerThread, free_port, serve, wait_for_port


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def fake_model_server() -> Iterator[tuple[FakeModel, ServerThread]]:
    model = FakeModel()
    with serve(model.app()) as server:
        yield model, server


@pytest.fixture
def fake_model(fake_model_server: tuple[FakeModel, ServerThread]) -> FakeModel:
    model, _ = fake_model_server
    model.requests.clear()
    model.streams.clear()
    model.replies[:] = DEFAULT_REPLIES
    model.reply_delay = 0.0
    return model


@pytest.fixture
def model_url(fake_model_server: tuple[FakeModel, ServerThread], fake_model: FakeModel) -> str:
    return fake_model_server[1].url + "/v1"


@pytest.fixture(scope="session")
def fake_search_server() -> Iterator[tuple[FakeSearch, ServerThread]]:
    search = FakeSearch()
    with serve(search.app()) as server:
        search.base_url = server.url
        yield search, server


@pytest.fixture
def fake_search(fake_search_server: tuple[FakeSearch, ServerThread]) -> FakeSearch:
    search, _ = fake_search_server
    search.reset()
    return search


@pytest.fixture
def settings(tmp_path: Path, model_url: str, fake_search: FakeSearch) -> Settings:
    base = fake_search.base_url
    return Settings().replace(
        llm={
            "base_url": model_url,
            "api_key": "test-key",
            "model": "fake-chat",
            "small_model": "fake-small",
        },
        embeddings={"base_url": model_url, "api_key": "test-key", "model": "fake-embed"},
        store={"url": f"sqlite:///{tmp_path}/chat.db"},
        server={"keepalive_seconds": 15.0, "shutdown_grace_seconds": 2.0},
        search={"provider": "tavily", "max_results": 8, "timeout_seconds": 10.0},
        tavily={"api_key": fake_search.api_key, "base_url": base + "/tavily"},
        searxng={"url": base + "/searxng"},
        google={"api_key": fake_search.api_key, "cse_id": "cx1", "base_url": base + "/google"},
        reader={"provider": "jina", "base_url": base + "/jina", "timeout_seconds": 5.0},
    )


@pytest.fixture
def server(settings: Settings) -> Iterator[ServerThread]:
    with serve(create_app(settings)) as running:
        yield running


@pytest.fixture
async def client(server: ServerThread) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        yield http


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port for the whole run."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: run `bash scripts/test.sh`, which installs it")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_for_port(port)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The shared Redis, emptied for this test."""
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    return redis_server
