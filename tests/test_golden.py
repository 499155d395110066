"""Golden transcripts: the exact bytes of an SSE response and the exact WebSocket frames
for fixed requests, so that a change of the code behind them cannot change the wire.

Only what differs from run to run is normalised: the answer id the server makes,
the ports of the loopback servers, the signature of the sources link, the
simple format's timestamps and the times of `timings`. To write
the files again after a deliberate protocol change: `GOLDEN_UPDATE=1 pytest
tests/test_golden.py`, then read the diff.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import orjson
import pytest
from httpx_ws import aconnect_ws

from tests.client import chat_body
from tests.fakes.search import RELEVANT_QUESTION

pytestmark = pytest.mark.anyio

GOLDEN = Path(__file__).resolve().parent / "golden"

CASES = {
    "plain": chat_body("hello there", chatId="101", messageId="102"),
    "web": chat_body(
        RELEVANT_QUESTION + " in detail please",
        chatId="201",
        messageId="202",
        focusMode="webSearch",
        history=[["human", "earlier"], ["assistant", "before"]],
    ),
    "simple": chat_body(
        RELEVANT_QUESTION, chatId="301", messageId="302", focusMode="webSearch", format="simple"
    ),
    "failed": chat_body("hello #fail=500", chatId="401", messageId="402"),
}


def normalise(text: str, answer_id: str, ports: list[int]) -> str:
    text = text.replace(answer_id, "ANSWER")
    for port in ports:
        text = text.replace(f":{port}", ":PORT")
    text = re.sub(r"\?sig=[0-9a-f]{32}", "?sig=SIG", text)  # signed with a per-database key
    text = re.sub(r'"(startMs|endMs)":[0-9.e+-]+', r'"\1":0', text)  # the stages' timings
    return re.sub(r'"timestamp":[0-9.e+-]+', '"timestamp":0', text)


def check(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("GOLDEN_UPDATE"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} differs from the golden transcript"


def answer_id_of(text: str) -> str:
    """The one id in the transcript that the server made: the answer's."""
    (answer_id,) = set(re.findall(r'"messageId":"(\d+)"', text))
    return answer_id


@pytest.mark.parametrize("case", sorted(CASES))
async def test_golden_transcript_over_sse_and_websocket(
    case, client, server, fake_model, fake_search
):
    fake_model.replies.insert(0, ("Standalone question", "how falcon engines burn methane"))
    # the classifier of the web modes answers in JSON (plain text would decide nothing)
    decision = {
        "skipSearch": False,
        "sources": ["web"],
        "question": "how falcon engines burn methane",
    }
    fake_model.replies.insert(0, ("decision (JSON)", orjson.dumps(decision).decode()))
    ports = [server.port, int(fake_search.base_url.rsplit(":", 1)[1])]
    body = CASES[case]

    async with client.stream("POST", "/api/chat/sse", json=body) as response:
        assert response.status_code == 200
        sse = (await response.aread()).decode()
    check(f"{case}.sse", normalise(sse, answer_id_of(sse), ports))

    ws_body = {**body, "message": {**body["message"], "chatId": body["message"]["chatId"] + "9"}}
    ws_body["message"]["messageId"] = body["message"]["messageId"] + "9"
    async with aconnect_ws(server.ws_url + "/api/chat/ws", httpx.AsyncClient(timeout=10)) as ws:
        frames = [await ws.receive_text()]
        await ws.send_text(orjson.dumps(ws_body).decode())
        while orjson.loads(frames[-1])["type"] not in ("messageEnd", "error", "complete"):
            frames.append(await ws.receive_text())
    text = "\n".join(frames) + "\n"
    for old, new in (
        (ws_body["message"]["chatId"], body["message"]["chatId"]),
        (ws_body["message"]["messageId"], body["message"]["messageId"]),
    ):
        text = text.replace(f'"{old}"', f'"{new}"').replace(f"/{old}", f"/{new}")
    check(f"{case}.ws", normalise(text, answer_id_of(text), ports))
