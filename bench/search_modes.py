"""Time a webSearch question spends searching, ranking and reading, per optimization mode.

    python -m bench.search_modes --questions 20

Runs the server, the fake model and the fake search/reader APIs on loopback
(all fakes answer at once, so this is the server's own overhead plus the
round trips), and measures, per question, the time from sending the request
to the `message ""` event that opens the answer.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import httpx

from app.config import Settings
from app.main import create_app
from tests.client import SseEvent, iter_sse
from tests.fakes.model import FakeModel
from tests.fakes.search import RELEVANT_QUESTION, FakeSearch
from tests.servers import serve


async def one(client: httpx.AsyncClient, mode: str, i: int) -> float:
    body = {
        "userId": "1",
        "focusMode": "webSearch",
        "optimizationMode": mode,
        "message": {"content": f"{RELEVANT_QUESTION} {i}"},
    }
    started = time.perf_counter()
    opened = 0.0
    async with client.stream("POST", "/api/chat/sse", json=body) as response:
        async for item in iter_sse(response):
            if isinstance(item, SseEvent) and item.type == "message" and not opened:
                opened = time.perf_counter() - started
    return opened


async def run(url: str, questions: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for mode in ("speed", "balanced", "quality"):
            times = sorted([await one(client, mode, i) * 1000 for i in range(questions)])
            print(
                f"{mode:9s} search+rank+read: median {statistics.median(times):6.1f} ms   max {times[-1]:6.1f} ms   (n={questions})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--questions", type=int, default=20)
    args = parser.parse_args()
    model, search = FakeModel(), FakeSearch()
    model.replies.insert(0, ("pick the search results", "<output>0,1,2,3,4,5</output>"))
    with (
        serve(model.app()) as model_server,
        serve(search.app()) as search_server,
        tempfile.TemporaryDirectory() as tmp,
    ):
        search.base_url = search_server.url
        settings = Settings().replace(
            llm={"base_url": model_server.url + "/v1", "api_key": model.api_key, "model": "m"},
            embeddings={
                "base_url": model_server.url + "/v1",
                "api_key": model.api_key,
                "model": "e",
            },
            store={"url": f"sqlite:///{tmp}/bench.db"},
            tavily={"api_key": search.api_key, "base_url": search_server.url + "/tavily"},
            reader={"provider": "jina", "base_url": search_server.url + "/jina"},
        )
        with serve(create_app(settings)) as server:
            asyncio.run(run(server.url, args.questions))


if __name__ == "__main__":
    main()
