"""The examples of the README and of every page under docs/, run as written against a
real server with the demo model.

Each example is taken from the pages themselves (their fenced code blocks), not
copied here: an example that drifts from the server fails this file. Only what
cannot be the same on a test machine is changed — the address (`localhost:8080`
becomes the test server's); an example that needs an id takes it from an earlier
answer's output, as a reader does. An example that cannot run here (it
installs the server, needs a real identity provider, a Redis Cluster, an hour...)
says so on the line before it, `<!-- not run: why -->`, and every other example
is one that a test below runs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.servers import ROOT, AppProcess, npm_packages
from tests.test_files import make_pdf

PAGES = {
    path.relative_to(ROOT).as_posix(): path.read_text()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
}
#: the languages of the examples a reader can run
RUNNABLE = ("sh", "bash", "python", "js")
NOT_RUN = "<!-- not run: "
#: (language, text only it holds) of each example a test below runs
ASK, STOP, RESUME = ("sh", '"history": []'), ("sh", "/api/chat/cancel"), ("sh", "/resume?")
REGENERATE = ("sh", '"messageId": "\'"$QUESTION"')
WEBSOCKET, OPENAI = ("python", "websockets.connect"), ("python", "webSearch:balanced")
COMPLETION = ("sh", "curl http://localhost:8080/v1/chat/completions")
UPLOAD, COLLECTION = ("sh", "tee uploads.json"), ("sh", "tee collection.json")
RESPONSES = ("python", "client.responses.create")
ADMIN, SIGN_IN, KEY = ("sh", "create-admin"), ("sh", "/api/auth/login"), ("sh", "/api/keys")
JAVASCRIPT = ("js", "@ai-sdk/openai")
SHARE = ("sh", "/api/chats/$CHAT/share")
#: run by tests/test_mcp.py
MCP = ("python", "from mcp.client.client import Client")
RUN = (
    ASK,
    STOP,
    RESUME,
    REGENERATE,
    WEBSOCKET,
    OPENAI,
    COMPLETION,
    UPLOAD,
    COLLECTION,
    RESPONSES,
    ADMIN,
    SIGN_IN,
    KEY,
    JAVASCRIPT,
    SHARE,
    MCP,
)


def blocks(lang: str) -> list[tuple[str, str, str]]:
    """(page, the line before the block, the block) of every block in `lang`."""
    pattern = rf"^([^\n]*)\n```{lang}\n(.*?)^```$"
    return [
        (page, before, block)
        for page, text in PAGES.items()
        for before, block in re.findall(pattern, text, re.DOTALL | re.MULTILINE)
    ]


def example(lang: str, needle: str) -> str:
    """The one code block in `lang` that contains `needle`, on whichever pages show it
    (a page may repeat another's example, word for word)."""
    found = {block for _, _, block in blocks(lang) if needle in block}
    assert len(found) == 1, f"{len(found)} different {lang} blocks contain {needle!r}"
    return found.pop()


def test_every_example_is_run_or_says_why_not():
    for lang in RUNNABLE:
        for page, before, block in blocks(lang):
            run = [needle for kind, needle in RUN if kind == lang and needle in block]
            if before.startswith(NOT_RUN):
                assert not run, f"{page}: an example marked not run is run: {block[:80]!r}"
            else:
                assert run, (
                    f"{page}: no test runs this example, nor does it say why: {block[:80]!r}"
                )


def here(text: str, server: AppProcess) -> str:
    return text.replace("localhost:8080", f"127.0.0.1:{server.port}")


def sh(command: str, cwd: Path | None = None, timeout: float = 60) -> str:
    done = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )
    assert done.returncode == 0, (command, done.stdout, done.stderr)
    return done.stdout


def events(sse: str) -> list[tuple[str | None, dict[str, Any]]]:
    """(id, data) of each event of an SSE body."""
    out = []
    for block in sse.split("\n\n"):
        lines = block.splitlines()
        data = [line[5:].strip() for line in lines if line.startswith("data:")]
        ids = [line[3:].strip() for line in lines if line.startswith("id:")]
        if data:
            out.append((ids[0] if ids else None, json.loads("\n".join(data))))
    return out


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("readme")
    env = {"STORE_URL": f"sqlite:///{folder}/chat.db", "LLM_BASE_URL": "demo://?pace=0.01"}
    server = AppProcess(env, args=("--demo",)).start()
    yield server
    server.stop()


def test_the_sse_example_streams_an_answer_resume_replays_it_and_regenerate_answers_again(
    demo, tmp_path
):
    got = events(sh(here(example(*ASK), demo), cwd=tmp_path))
    assert got[-1][1]["type"] == "messageEnd" and got[-1][1]["status"] == "completed"
    assert "usage" in got[-1][1]  # as the events' table says
    assert events((tmp_path / "answer.sse").read_text()) == got  # what resume reads its ids from
    answer = got[0][1]["messageId"]
    assert len(got) > 26
    replayed = events(sh(here(example(*RESUME), demo), cwd=tmp_path))
    assert replayed[0][0] == f"{answer}:26"  # exactly the events after seq 25
    assert replayed[-1][1]["type"] == "messageEnd"
    assert [d for _, d in replayed] == [d for _, d in got[25:]]
    again = events(sh(here(example(*REGENERATE), demo), cwd=tmp_path))
    assert again[-1][1]["type"] == "messageEnd" and again[-1][1]["status"] == "completed"
    assert again[0][1]["chatId"] == got[0][1]["chatId"]
    assert again[-1][1]["questionMessageId"] == got[-1][1]["questionMessageId"]
    assert again[0][1]["messageId"] != answer  # a new answer to the same question


def test_the_cancel_example_stops_a_running_answer(demo, tmp_path):
    out = sh(here(example(*STOP), demo), cwd=tmp_path)
    answered = json.loads(out.splitlines()[0])
    assert answered["cancelled"] is True
    got = events((tmp_path / "long.sse").read_text())
    assert answered["chatId"] == got[0][1]["chatId"]
    assert got[-1][1]["type"] == "messageEnd" and got[-1][1]["status"] == "cancelled"
    shown = [line for line in out.splitlines() if line]
    assert '"status":"cancelled"' in shown[-1]  # the tail it shows


def test_the_python_websocket_example_prints_the_answer(demo, tmp_path):
    script = tmp_path / "ws_example.py"
    script.write_text(here(example(*WEBSOCKET), demo))
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Demo answer" in done.stdout


def test_the_python_websocket_example_prints_an_error(tmp_path, model_url):
    keyless = AppProcess({"STORE_URL": f"sqlite:///{tmp_path}/c.db", "LLM_API_KEY": ""}).start()
    try:
        script = tmp_path / "ws_example.py"
        script.write_text(here(example(*WEBSOCKET), keyless))
        done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    finally:
        keyless.stop()
    assert done.returncode == 0, done.stderr
    assert "error CONFIG_ERROR" in done.stdout and "LLM_API_KEY" in done.stdout


def test_the_openai_examples_answer_with_citations(demo, tmp_path):
    script = tmp_path / "openai_example.py"
    script.write_text(here(example(*OPENAI), demo))
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Demo answer" in done.stdout and "https://" in done.stdout  # the citations
    completion = json.loads(sh(here(example(*COMPLETION), demo)))
    assert completion["choices"][0]["message"]["content"]
    assert completion["citations"]


def test_the_upload_example_answers_from_the_files(demo, tmp_path):
    (tmp_path / "report.pdf").write_bytes(make_pdf())
    (tmp_path / "notes.md").write_text("# Notes\n\nThe report concludes that the bridge holds.\n")
    out = sh(here(example(*UPLOAD), demo), cwd=tmp_path)
    files = json.loads((tmp_path / "uploads.json").read_text())["files"]
    assert [f["fileName"] for f in files] == ["report.pdf", "notes.md"]
    assert all(f["status"] == "ready" for f in files)
    got = events(out.split("\n", 1)[1])  # after the upload's answer
    sources = next(d for _, d in got if d["type"] == "sources")["data"]
    assert sources[0]["metadata"]["fileId"] == files[0]["fileId"]
    assert got[-1][1]["type"] == "messageEnd"


def test_the_collections_example_imports_asks_shares_and_deletes(demo, tmp_path):
    with zipfile.ZipFile(tmp_path / "handbooks.zip", "w") as archive:
        archive.writestr("hr/leave.md", "# Leave\n\nEveryone gets thirty days of leave a year.\n")
        archive.writestr("it/laptops.md", "# Laptops\n\nLaptops are replaced every three years.\n")
    (tmp_path / "policy.pdf").write_bytes(make_pdf())
    out = sh(here(example(*COLLECTION), demo), cwd=tmp_path, timeout=120)
    collection = json.loads((tmp_path / "collection.json").read_text())["collection"]
    assert json.loads((tmp_path / "import.json").read_text())["import"]["id"]
    answer = events(out)
    assert answer[-1][1]["type"] == "messageEnd" and answer[-1][1]["status"] == "completed"
    sources = next(d for _, d in answer if d.get("type") == "sources")["data"]
    assert sources[0]["metadata"]["collectionId"] == collection["id"]
    gone = sh(
        here(
            f"curl -s -o /dev/null -w '%{{http_code}}' 'localhost:8080/api/collections/{collection['id']}?userId=7'",
            demo,
        )
    )
    assert gone == "404"  # the example's last line deleted it


def test_the_accounts_examples_make_the_admin_sign_in_and_make_a_key(tmp_path):
    store = f"sqlite:///{tmp_path}/accounts.db"
    # the example's first line asks for the password on a terminal: its scripted one runs
    scripted = next(line for line in example(*ADMIN).splitlines() if "printf" in line)
    python = scripted.replace("python -m", f"{sys.executable} -m")
    sh(f"export STORE_URL={store} ADMIN_PASSWORD='a long passphrase'; {python}", cwd=ROOT)
    env = {"STORE_URL": store, "AUTH_MODE": "accounts", "LLM_BASE_URL": "demo://?pace=0.01"}
    server = AppProcess(env, args=("--demo",)).start()
    try:
        signed_in = sh(here(example(*SIGN_IN), server), cwd=tmp_path)
        key = json.loads(sh(here(example(*KEY), server), cwd=tmp_path))
    finally:
        server.stop()
    assert '"email":"ada@example.com"' in signed_in and '"role":"admin"' in signed_in
    assert key["name"] == "laptop" and key["key"].startswith("sck_")


def test_the_responses_examples_answer_with_annotations_and_search_parameters(demo, tmp_path):
    script = tmp_path / "responses_example.py"
    script.write_text(here(example(*RESPONSES), demo))
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Demo answer" in done.stdout and "https://" in done.stdout
    assert "[1]" in done.stdout  # an annotation's marker, printed with its URL


def test_the_javascript_example_runs_with_the_npm_clients(demo, tmp_path):
    (tmp_path / "node_modules").symlink_to(Path(npm_packages("node_clients.sh")) / "node_modules")
    script = tmp_path / "example.mjs"
    script.write_text(here(example(*JAVASCRIPT), demo))
    done = subprocess.run(["node", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("Demo answer") == 2 and "https://" in done.stdout


def test_the_share_example_shares_reads_exports_and_takes_back(demo, tmp_path):
    sh(here(example(*ASK), demo), cwd=tmp_path)  # the answer.sse it shares
    out = sh(here(example(*SHARE), demo), cwd=tmp_path)
    link = json.loads((tmp_path / "share.json").read_text())
    assert out.startswith(json.dumps(link, separators=(",", ":")))
    assert "## what is deepseek" in out  # the Markdown anyone may read
    (exported,) = tmp_path.glob("*.md")
    assert exported.read_text().startswith("# ") and "## what is deepseek" in exported.read_text()
    gone = sh(f"curl -s -o /dev/null -w '%{{http_code}}' '{link['url']}'")
    assert gone == "404"  # the example's last line took it back
