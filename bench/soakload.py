"""The soak's clients (bench.soak): answers one after another over SSE, WebSocket
and `/v1`, each resumed where it broke, and the judge of each against the store.

Every answer's tokens carry its own tag (`#tag=` of bench.fastmodel: "s3n7.0 s3n7.1
…"), so the client knows, token by token, the text it should be shown: text of
another answer, a gap or a repeat shows at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import random
import re
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from websockets.asyncio.client import connect as ws_connect

from bench.load import _sse_chunks

RATE = 20.0  # tokens a second per stream
READ_TIMEOUT = 40.0  # no byte for this long (keep-alives come every 15 s): the stream is cut
RESUME_FOR = 90.0  # a client gives up resuming after this long
TOKEN = re.compile(r"(\S+?)\.(\d+) ")


class Server(Protocol):
    name: str

    @property
    def url(self) -> str: ...


class Refused(Exception):
    """The server said no before the stream started (503, 409, an error frame)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Cut(Exception):
    """The stream broke after it had started (it may be resumed)."""


@dataclass
class Answer:
    """One answer as its client saw it."""

    kind: str  # sse, ws, openai
    user: str
    chat_id: str
    tag: str
    tokens: int
    answer_id: str = ""
    text: str = ""  # what the client was shown, in order
    last_seq: int = 0
    seq_errors: int = 0  # an event that was not the one after the last (gap or repeat)
    wrong: str = ""  # the first text shown that is not this answer's
    end: str = ""  # completed, cancelled, error:<key>, cut, gave up resuming, …
    resumes: int = 0
    workers: list[str] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0

    @functools.cached_property
    def expected(self) -> str:
        """The whole text of this answer."""
        return "".join(f"{self.tag}.{i} " for i in range(self.tokens))

    def show(self, text: str) -> None:
        if text and not self.wrong and not self.expected.startswith(text, len(self.text)):
            self.wrong = text[:80]
        self.text += text

    def event(self, event_id: str, event: dict[str, Any]) -> bool:
        """Account one event of the default format; True for the terminal one."""
        if event_id:
            answer_id, _, seq = event_id.rpartition(":")
            if not self.answer_id:
                self.answer_id = answer_id
            elif answer_id != self.answer_id:
                self.wrong = self.wrong or f"event of answer {answer_id}"
            if int(seq) != self.last_seq + 1:
                self.seq_errors += 1
            self.last_seq = max(self.last_seq, int(seq))
        kind = event.get("type")
        if kind == "message":
            self.show(event.get("data") or "")
        elif kind == "messageEnd":
            self.end = event.get("status", "completed")
            return True
        elif kind == "error":
            self.end = f"error:{event.get('key')}"
            return True
        return False


async def sse_blocks(
    url: str, path: str, body: bytes | None, headers: dict[str, str] | None = None
) -> AsyncIterator[bytes]:
    """The blank-line separated blocks of a streamed response. Raises `Refused` (not
    200) or the connection's error before the first byte; `Cut` after it."""
    chunks = _sse_chunks(url, path, body, headers)
    buffer, opened = b"", False
    try:
        while True:
            try:
                async with asyncio.timeout(READ_TIMEOUT):
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                raise Cut("closed") from None
            except RuntimeError as exc:  # the status line was not 200
                match = re.search(r"HTTP/1.1 (\d+)", str(exc))
                raise Refused(match.group(1) if match else str(exc)[:40]) from exc
            except (OSError, asyncio.IncompleteReadError, ValueError, TimeoutError) as exc:
                if opened:
                    raise Cut(type(exc).__name__) from exc
                raise
            opened = True
            *blocks, buffer = (buffer + chunk).split(b"\n\n")
            for block in blocks:
                yield block
    finally:
        await chunks.aclose()


class Load:
    """`streams` clients, each running one answer after another until `stopping`."""

    def __init__(self, workers: list[Server], streams: int, seed: int) -> None:
        self.workers = workers
        self.streams = streams
        self.random = random.Random(seed)
        self.answers: list[Answer] = []
        self.refused: Counter[str] = Counter()
        self.active = 0
        self.stopping = False
        self._users = itertools.count(10**12 + int(time.time()) % 10**6 * 10**3)
        self._chats = itertools.count(10**15 + int(time.time() * 1000) % 10**12)

    async def client(self, slot: int) -> None:
        for n in itertools.count():
            if self.stopping:
                return
            kind = ("sse", "ws", "openai")[(slot + n) % 3]
            tokens = self.random.randint(40, 400)
            answer = Answer(
                kind, str(next(self._users)), str(next(self._chats)), f"s{slot}n{n}", tokens
            )
            answer.started = time.time()
            self.active += 1
            try:
                await self.run(answer)
            except Refused as exc:
                self.refused[exc.why] += 1
                await asyncio.sleep(0.5 + self.random.random())
                continue
            except Exception as exc:  # a bug of this client: counted, and the slot goes on
                self.refused[f"client error: {type(exc).__name__}: {exc}"[:120]] += 1
                if not (answer.answer_id or answer.text):
                    await asyncio.sleep(1.0)
                    continue
                answer.end = answer.end or "client error"
            finally:
                self.active -= 1
            answer.ended = time.time()
            self.answers.append(answer)

    async def run(self, answer: Answer) -> None:
        """Start the answer on one worker (the other if the first cannot be reached),
        follow it, resume it where it broke."""
        order = list(self.workers)
        self.random.shuffle(order)
        last_error: Exception | None = None
        for worker in order:
            answer.workers.append(worker.name)
            try:
                await self.start(worker, answer)
                return
            except Cut:
                break
            except Refused:
                raise
            except Exception as exc:  # could not reach it: the other one
                last_error = exc
                answer.workers.pop()
        else:
            raise Refused(f"unreachable: {type(last_error).__name__}")
        if answer.kind == "openai":  # no resume in the OpenAI API
            answer.end = answer.end or "cut"
            return
        await self.resume(answer)

    async def start(self, worker: Server, answer: Answer) -> None:
        """Ask on `worker` and read to the end; raises `Cut` when the stream breaks."""
        content = f"#tokens={answer.tokens} #rate={RATE:g} #tag={answer.tag}"
        message = {"chatId": answer.chat_id, "content": content}
        question = {"userId": answer.user, "focusMode": "deepSeek", "message": message}
        if answer.kind == "sse":
            await self.sse(worker, "/api/chat/sse", orjson.dumps(question), None, answer)
        elif answer.kind == "ws":
            await self.ws(worker, {"type": "message", **question}, answer)
        else:
            await self.openai(worker, answer, content)

    async def resume(self, answer: Answer) -> None:
        deadline = time.monotonic() + RESUME_FOR
        while time.monotonic() < deadline:
            answer.resumes += 1
            # the other worker first: the one it broke on may be the one that died
            for worker in sorted(self.workers, key=lambda w: w.name == answer.workers[-1]):
                answer.workers.append(worker.name)
                last = f"{answer.answer_id}:{answer.last_seq}" if answer.answer_id else ""
                try:
                    if answer.kind == "sse":
                        path = f"/api/chat/sse/resume?chatId={answer.chat_id}&userId={answer.user}"
                        headers = {"Last-Event-ID": last} if last else {}
                        await self.sse(worker, path, None, headers, answer)
                    else:
                        frame = {"type": "resume", "chatId": answer.chat_id, "userId": answer.user}
                        await self.ws(
                            worker, frame | ({"lastEventId": last} if last else {}), answer
                        )
                    return
                except Refused as exc:
                    if exc.why.startswith("404") or "NOT_FOUND" in exc.why:
                        answer.end = f"resume {exc.why}"
                        return
                except Exception:  # cut again, unreachable, 503 while Redis recovers
                    pass
            await asyncio.sleep(0.5)
        answer.end = answer.end or "gave up resuming"

    async def sse(
        self,
        worker: Server,
        path: str,
        body: bytes | None,
        headers: dict[str, str] | None,
        answer: Answer,
    ) -> None:
        async for block in sse_blocks(worker.url, path, body, headers):
            if not block or block.startswith(b":"):
                continue
            event_id, data = b"", b""
            for line in block.split(b"\n"):
                if line.startswith(b"id: "):
                    event_id = line[4:]
                elif line.startswith(b"data: "):
                    data = line[6:]
            if data and answer.event(event_id.decode(), orjson.loads(data)):  # not `retry:`
                return

    async def ws(self, worker: Server, frame: dict[str, Any], answer: Answer) -> None:
        try:
            socket = await ws_connect(
                worker.url.replace("http", "ws", 1) + "/api/chat/ws",
                compression=None,
                open_timeout=20,
                max_size=2**24,
            )
        except (OSError, TimeoutError):
            raise
        except Exception as exc:  # refused upgrade (503)
            raise Refused(f"ws: {type(exc).__name__}") from exc
        try:
            await socket.recv()  # signal: open (a failure here raises: not started)
            await socket.send(orjson.dumps(frame).decode())
            while True:
                try:
                    async with asyncio.timeout(READ_TIMEOUT):
                        event = orjson.loads(await socket.recv())
                except Exception as exc:
                    raise Cut(type(exc).__name__) from exc
                if event.get("type") == "error" and "eventId" not in event:
                    raise Refused(f"ws {event.get('key')}: {str(event.get('data'))[:40]}")
                if event.get("type") in ("keep-alive", "signal", "pong"):
                    continue
                if answer.event(event.get("eventId", ""), event):
                    return
        finally:
            with contextlib.suppress(Exception):
                await socket.close()

    async def openai(self, worker: Server, answer: Answer, content: str) -> None:
        question = {
            "model": "deepSeek",
            "stream": True,
            "user": answer.user,
            "messages": [{"role": "user", "content": content}],
        }
        async for block in sse_blocks(worker.url, "/v1/chat/completions", orjson.dumps(question)):
            if not block.startswith(b"data: "):
                continue
            if block == b"data: [DONE]":
                answer.end = answer.end or "completed"
                return
            chunk = orjson.loads(block[6:])
            if "error" in chunk:
                answer.end = f"error:{chunk['error'].get('code') or chunk['error'].get('type')}"
                continue
            answer.answer_id = answer.answer_id or chunk["id"].removeprefix("chatcmpl-")
            for choice in chunk.get("choices", ()):
                answer.show(choice.get("delta", {}).get("content") or "")
                if choice.get("finish_reason"):
                    answer.end = "completed"


# -- judging ------------------------------------------------------------------------------


async def saved_answer(http: Any, answer: Answer) -> dict[str, Any] | None:
    """The stored answer row of an answer, as GET /api/chats/{id} shows it."""
    chat_id = answer.chat_id
    if answer.kind == "openai":  # /v1 makes its own chat: the user's only one
        chats = (await http.get("/api/chats", params={"userId": answer.user})).json()
        if not chats.get("chats"):
            return None
        chat_id = chats["chats"][0]["id"]
    reply = await http.get(f"/api/chats/{chat_id}", params={"userId": answer.user})
    if reply.status_code == 404:
        return None
    reply.raise_for_status()
    messages = [m for m in reply.json()["messages"] if m["role"] == "assistant"]
    if answer.answer_id:
        messages = [m for m in messages if m["id"] == answer.answer_id]
    return messages[-1] if messages else None


def judge(answer: Answer, saved: dict[str, Any] | None) -> list[str]:
    """What is wrong with an answer (empty: nothing)."""
    faults = []
    expected = answer.expected
    if answer.wrong:
        faults.append("mixed: client")
    if answer.seq_errors:
        faults.append("gaps or repeats")
    if saved is None:
        if answer.text or answer.answer_id:
            faults.append("lost: no saved answer")
        return faults
    content = saved["content"]
    foreign = any(tag != answer.tag for tag, _ in TOKEN.findall(content))
    if foreign or not expected.startswith(content):
        faults.append("mixed: saved")
    if saved["status"] == "streaming":
        faults.append("stuck")
    if not content.startswith(answer.text):
        faults.append("lost")  # the client was shown text the store does not have
    elif answer.end == "completed" and content != expected:
        faults.append("lost")
    elif answer.kind != "openai" and answer.end.startswith("error") and content != answer.text:
        # a stream that ended with its error event has shown all there is: the saved
        # answer should be exactly that
        faults.append("saved more than a finished resume showed")
    return faults
