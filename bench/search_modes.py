"""What a webSearch answer spends per optimization mode: model calls, searches and
page reads, the time to the first answer token and to the end — with the fake model
and the fake search at fixed latencies, so the figures are the server's plan, not
the fakes' speed.

    python -m bench.search_modes                       # this checkout
    python -m bench.search_modes --old ../old-checkout # and an older one, interleaved

Latencies: the main model waits `--model-ms` (400) before its first byte (the
answer's stream, a research round), the small model `--small-ms` (300) a call (the
classifier, a rewrite, the quality pick), every search `--search-ms` (250), every
page read `--read-ms` (300). Each server runs as its own `python -m app` process on
the same fakes, configured by environment. The cases: `speed` (a first question),
`speed follow-up` (the same with a conversation before it: the classifier names the
standalone question, which is searched), `balanced`, `quality`, `deep` (focusMode
deepResearch) and `chat` (a mode without sources, writingAssistant). The classifier
keeps a first question as asked. The research agent's rounds are scripted in the
fake model's tool calls: balanced searches two angles at once, then reads the two
best pages at once, then is done; quality searches three angles at once, reads three
pages at once, then is done; `deep` does what quality does, then searches two more
angles and reads two more pages. A server without the agent runs its own fixed
pipeline on the same question. Figures are medians of `--questions`; `first token
ms` is from the request to the first answer token the client reads, `answer asked
ms` the server's own count (`messageEnd.timings`) of when it asked the model for the
answer. `server in ms` is the server's own time before it asks the model (the request
to the model's request, in the mode without sources, where nothing comes between),
`server out ms` from the model's first token to the client's: both from the
fakes' and the client's monotonic clocks, in this process, so they include two
loopback hops and the client's and the fakes' own parsing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.client import SseEvent, iter_sse
from tests.fakes.model import FakeModel
from tests.fakes.search import RELEVANT_QUESTION, RESULT_COUNT, FakeSearch
from tests.servers import ROOT, free_port, serve, wait_for_port

#: deep: focusMode deepResearch; chat: a mode without sources
MODES = ("speed", "speed follow-up", "balanced", "quality", "deep", "chat")
CLASSIFY = "Standalone question and decision (JSON)"
HISTORY = [["human", "which rockets burn methane?"], ["assistant", "Starship and Vulcan do."]]


def decision(question: str) -> str:
    return json.dumps({"skipSearch": False, "sources": ["web"], "question": question})


def script(model: FakeModel, search: FakeSearch, mode: str) -> None:
    page = f"{search.base_url}/pages/"
    if mode == "balanced":
        model.tool_rounds[:] = [
            [("web_search", {"query": "falcon methane"}), ("web_search", {"query": "raptor"})],
            [("read_url", {"urls": [page + "3", page + "1"]})],
            [("done", {})],
        ]
    elif mode == "quality":
        model.tool_rounds[:] = [
            [("web_search", {"query": q}) for q in ("falcon methane", "raptor", "merlin")],
            [("read_url", {"urls": [page + "3", page + "1", page + "2"]})],
            [("done", {})],
        ]
    elif mode == "deep":
        model.tool_rounds[:] = [
            [("web_search", {"query": q}) for q in ("falcon methane", "raptor", "merlin")],
            [("read_url", {"urls": [page + "3", page + "1", page + "2"]})],
            [("web_search", {"query": q}) for q in ("reuse", "thrust")],
            [("read_url", {"urls": [page + "4", page + "5"]})],
            [("done", {})],
        ]
    else:
        model.tool_rounds.clear()


async def one(
    client: httpx.AsyncClient, model: FakeModel, search: FakeSearch, mode: str, i: int, wait: float
) -> dict[str, float]:
    script(model, search, mode)
    asked, searched, read = len(model.requests), len(search.queries), len(search.pages_read)
    # long enough for a rewrite (or the classifier) to be asked for, as most are
    question = f"{RELEVANT_QUESTION} in detail, question {i}"
    body: dict[str, object] = {
        "userId": "1",
        "focusMode": {"deep": "deepResearch", "chat": "writingAssistant"}.get(mode, "webSearch"),
        "optimizationMode": {"deep": "quality", "speed follow-up": "speed", "chat": "speed"}.get(
            mode, mode
        ),
        "message": {"content": f"{question} #wait={wait}"},
    }
    # the classifier keeps a first question as asked; a follow-up's stands alone
    standalone = f"{question} #wait={wait}"
    if mode == "speed follow-up":
        body["history"] = HISTORY
        body["message"] = {"content": f"and how do they burn it, question {i} #wait={wait}"}
        standalone = f"how do methane rockets burn it, question {i} #wait={wait}"
    model.replies[0] = (CLASSIFY, decision(standalone))
    streams = len(model.streams)
    started = time.monotonic()
    first = end = classified = asked_at = 0.0
    async with client.stream("POST", "/api/chat/sse", json=body) as response:
        async for item in iter_sse(response):
            if not isinstance(item, SseEvent):
                continue
            step = item.data.get("step") if item.type == "progress" else None
            if isinstance(step, dict) and step.get("kind") == "classify" and not classified:
                classified = time.monotonic() - started
            if item.type in ("message", "reasoning") and item.data.get("data") and not first:
                first = time.monotonic() - started
            if item.type in ("messageEnd", "error"):
                end = time.monotonic() - started
                spans = item.data.get("timings") or []
                asked_at = next(
                    (t["startMs"] for t in spans if t["stage"] == "modelFirstByte"), 0.0
                )
    calls = [  # not embeddings, nor the chat's title (written after the end, or not yet)
        r
        for r in model.requests[asked:]
        if "input" not in r and "Write a title" not in str(r["messages"][0]["content"])
    ]
    # the answer's stream is the last the model was asked for (a title comes after the end)
    answer = model.streams[-1] if len(model.streams) > streams else None
    return {
        # the server's own time: from the request to the answer's request to the model
        # (a mode without sources asks nothing before it), and from the model's first
        # token to the client's (monotonic clocks of one machine, fakes in this process)
        "in": (answer.asked_at - started) * 1000 if answer and mode == "chat" else 0.0,
        "out": (started + first - answer.first_at) * 1000 if answer and first else 0.0,
        "calls": len(calls),
        "searches": len(search.queries) - searched,
        "reads": len(search.pages_read) - read,
        "classified": classified * 1000,  # 0: no classifier step (or none sent)
        "first": first * 1000,
        "end": end * 1000,
        "asked": asked_at,  # the server's own count: when the answer was asked of the model
    }


class Target:
    """`python -m app` from a checkout, on the shared fakes."""

    def __init__(self, name: str, folder: Path, env: dict[str, str]) -> None:
        self.name, self.folder, self.port = name, folder, free_port()
        self.env = {**os.environ, **env, "PORT": str(self.port), "SERVER_HOST": "127.0.0.1"}
        self.env["APP_CONFIG"] = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Target:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app"],
            cwd=self.folder,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port, timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def measure(
    targets: list[Target], model: FakeModel, search: FakeSearch, questions: int, wait: float
) -> dict[tuple[str, str], list[dict[str, float]]]:
    found: dict[tuple[str, str], list[dict[str, float]]] = {}
    clients = {t.name: httpx.AsyncClient(base_url=t.url, timeout=120) for t in targets}
    try:
        for i in range(questions):
            for mode in MODES:
                for target in targets:  # interleaved: the same load for each
                    got = await one(clients[target.name], model, search, mode, i, wait)
                    found.setdefault((target.name, mode), []).append(got)
    finally:
        for client in clients.values():
            await client.aclose()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--questions", type=int, default=5)
    parser.add_argument("--model-ms", type=float, default=400, help="main model's first byte")
    parser.add_argument("--small-ms", type=float, default=300, help="a small model's call")
    parser.add_argument("--search-ms", type=float, default=250)
    parser.add_argument("--read-ms", type=float, default=300)
    parser.add_argument("--old", type=Path, help="an older checkout to compare with")
    args = parser.parse_args()
    model, search = FakeModel(), FakeSearch()
    model.reply_delay, model.tool_delay = args.small_ms / 1000, args.model_ms / 1000
    model.replies.insert(0, ("pick the search results", "<output>0,1,2,3,4,5</output>"))
    model.replies.insert(0, (CLASSIFY, decision(RELEVANT_QUESTION)))  # set per question
    search.search_delay = args.search_ms / 1000
    search.page_delay.update({n: args.read_ms / 1000 for n in range(RESULT_COUNT)})
    with (
        serve(model.app()) as model_server,
        serve(search.app()) as search_server,
        tempfile.TemporaryDirectory() as tmp,
    ):
        search.base_url = search_server.url
        v1 = model_server.url + "/v1"

        def env(name: str) -> dict[str, str]:
            return {
                "LLM_BASE_URL": v1,
                "LLM_API_KEY": model.api_key,
                "LLM_MODEL": "fake-chat",
                "EMBEDDINGS_BASE_URL": v1,
                "EMBEDDINGS_API_KEY": model.api_key,
                "EMBEDDINGS_MODEL": "fake-embed",
                "STORE_URL": f"sqlite:///{tmp}/{name}.db",
                "COLLECTIONS_URL": f"tantivy:///{tmp}/{name}-collections",
                "SEARCH_PROVIDER": "tavily",
                "TAVILY_API_KEY": search.api_key,
                "TAVILY_BASE_URL": search_server.url + "/tavily",
                "READER_PROVIDER": "jina",
                "READER_BASE_URL": search_server.url + "/jina",
            }

        folders = [("new", ROOT)] + ([("old", args.old.resolve())] if args.old else [])
        targets = [Target(name, folder, env(name)) for name, folder in folders]
        for target in targets:
            target.__enter__()
        try:
            found = asyncio.run(
                measure(targets, model, search, args.questions, args.model_ms / 1000)
            )
        finally:
            for target in targets:
                target.__exit__()
    print(
        f"main model {args.model_ms:.0f} ms to its first byte, small model "
        f"{args.small_ms:.0f} ms a call, search {args.search_ms:.0f} ms, "
        f"read {args.read_ms:.0f} ms; medians of {args.questions} questions\n"
    )
    print(
        "| server | mode | model calls | searches | reads | classified ms "
        "| answer asked ms | first token ms | end ms | server in ms | server out ms |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode in MODES:
        for target in targets:
            runs = found[(target.name, mode)]
            m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            classified = f"{m['classified']:.0f}" if m["classified"] else "—"
            asked = f"{m['asked']:.1f}" if m["asked"] else "—"  # "—": no timings sent
            print(
                f"| {target.name} | {mode} | {m['calls']:.0f} | {m['searches']:.0f} | "
                f"{m['reads']:.0f} | {classified} | {asked} | {m['first']:.0f} | "
                f"{m['end']:.0f} | {m['in']:.1f} | {m['out']:.1f} |".replace("| 0.0 |", "| — |")
            )


if __name__ == "__main__":
    main()
