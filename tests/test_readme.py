"""The README's examples, run as written against a real server with the demo model.

Each example is taken from README.md itself (its fenced code blocks), not copied
here: an example that drifts from the server fails this file. Only what cannot
be the same on a test machine is changed — the address (`localhost:8080`
becomes the test server's) and the ids an example shows from an earlier answer
(replaced by the real ones that answer got).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.servers import ROOT, AppProcess, npm_packages
from tests.test_files import make_pdf

README = (ROOT / "README.md").read_text()
#: the ids the README's examples show (an answer's chat and message, a file)
SHOWN_CHAT, SHOWN_ANSWER, SHOWN_FILE = "7138337258229764", "2127204015351029761", "212…"


def example(lang: str, needle: str) -> str:
    """The one README code block in `lang` that contains `needle`."""
    found = [
        block
        for block in re.findall(rf"^```{lang}\n(.*?)^```$", README, re.DOTALL | re.MULTILINE)
        if needle in block
    ]
    assert len(found) == 1, f"{len(found)} README {lang} blocks contain {needle!r}"
    return found[0]


def commands(block: str) -> list[str]:
    """The shell commands of a block (comment lines, the example output, left out)."""
    text = re.sub(r"^#.*$", "", block, flags=re.MULTILINE)
    return [c.strip() for c in re.split(r"\n(?=curl )", text) if c.strip()]


def here(text: str, server: AppProcess, **ids: str) -> str:
    text = text.replace("localhost:8080", f"127.0.0.1:{server.port}")
    for shown, real in ids.items():
        text = text.replace(shown, real)
    return text


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


def test_the_sse_example_streams_an_answer_and_resume_replays_after_its_id(demo):
    got = events(sh(here(example("sh", '"history": []'), demo)))
    assert got[-1][1]["type"] == "messageEnd" and got[-1][1]["status"] == "completed"
    assert "usage" in got[-1][1]  # as the README's events say
    chat, answer = got[0][1]["chatId"], got[0][1]["messageId"]
    assert len(got) > 26
    resume = here(
        example("sh", "/api/chat/sse/resume"), demo, **{SHOWN_CHAT: chat, SHOWN_ANSWER: answer}
    )
    replayed = events(sh(resume))
    assert replayed[0][0] == f"{answer}:26"  # exactly the events after seq 25
    assert replayed[-1][1]["type"] == "messageEnd"
    assert [d for _, d in replayed] == [d for _, d in got[25:]]


def test_the_cancel_example_stops_a_running_answer(demo):
    ask = here(example("sh", '"history": []'), demo).replace(
        '"what is deepseek"', '"what is deepseek, in a long answer"'
    )
    stream = subprocess.Popen(["bash", "-c", ask], stdout=subprocess.PIPE, text=True)
    try:
        assert stream.stdout is not None
        first = ""
        while '"chatId"' not in first:
            first = stream.stdout.readline()
        chat = json.loads(first.removeprefix("data:"))["chatId"]
        time.sleep(0.2)
        cancel = here(example("sh", "/api/chat/cancel"), demo, **{SHOWN_CHAT: chat})
        answered = json.loads(sh(commands(cancel)[0]))
        assert answered["cancelled"] is True and answered["chatId"] == chat
        rest = events(first + stream.stdout.read())
        assert rest[-1][1]["type"] == "messageEnd" and rest[-1][1]["status"] == "cancelled"
    finally:
        stream.kill()
        stream.wait()
        if stream.stdout is not None:
            stream.stdout.close()


def test_the_python_websocket_example_prints_the_answer(demo, tmp_path):
    script = tmp_path / "ws_example.py"
    script.write_text(here(example("python", "websockets.connect"), demo))
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Demo answer" in done.stdout


def test_the_python_websocket_example_prints_an_error(tmp_path, model_url):
    keyless = AppProcess({"STORE_URL": f"sqlite:///{tmp_path}/c.db", "LLM_API_KEY": ""}).start()
    try:
        script = tmp_path / "ws_example.py"
        script.write_text(here(example("python", "websockets.connect"), keyless))
        done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    finally:
        keyless.stop()
    assert done.returncode == 0, done.stderr
    assert "error CONFIG_ERROR" in done.stdout and "LLM_API_KEY" in done.stdout


def test_the_openai_examples_answer_with_citations(demo, tmp_path):
    script = tmp_path / "openai_example.py"
    script.write_text(here(example("python", "webSearch:balanced"), demo))
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Demo answer" in done.stdout and "https://" in done.stdout  # the citations
    completion = json.loads(
        sh(here(example("sh", "curl http://localhost:8080/v1/chat/completions"), demo))
    )
    assert completion["choices"][0]["message"]["content"]
    assert completion["citations"]


def test_the_upload_example_answers_from_the_files(demo, tmp_path):
    (tmp_path / "report.pdf").write_bytes(make_pdf())
    (tmp_path / "notes.md").write_text("# Notes\n\nThe report concludes that the bridge holds.\n")
    upload, ask = commands(here(example("sh", "curl -F files=@"), demo))
    files = json.loads(sh(upload, cwd=tmp_path))["files"]
    assert [f["fileName"] for f in files] == ["report.pdf", "notes.md"]
    assert all(f["status"] == "ready" for f in files)
    got = events(sh(ask.replace(SHOWN_FILE, files[0]["fileId"]), cwd=tmp_path))
    sources = next(d for _, d in got if d["type"] == "sources")["data"]
    assert sources[0]["metadata"]["fileId"] == files[0]["fileId"]
    assert got[-1][1]["type"] == "messageEnd"


def test_the_responses_examples_answer_with_annotations_and_search_parameters(demo, tmp_path):
    script = tmp_path / "responses_example.py"
    script.write_text(here(example("python", "client.responses.create"), demo))
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Demo answer" in done.stdout and "https://" in done.stdout
    assert "[1]" in done.stdout  # an annotation's marker, printed with its URL


def test_the_javascript_example_runs_with_the_npm_clients(demo, tmp_path):
    (tmp_path / "node_modules").symlink_to(Path(npm_packages("node_clients.sh")) / "node_modules")
    script = tmp_path / "example.mjs"
    script.write_text(here(example("js", "@ai-sdk/openai"), demo))
    done = subprocess.run(["node", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("Demo answer") == 2 and "https://" in done.stdout
