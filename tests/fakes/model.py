"""A fake OpenAI-compatible model server (real HTTP, for real clients).

Behaviour of a streamed answer is scripted by directives in the last user
message, so one test can pick it per request:

    #tokens=N      N content tokens "tok0 ", "tok1 ", … (default 5)
    #reasoning=N   N reasoning tokens "why0 ", … sent first (default 2)
    #delay=S       seconds between tokens (default 0)
    #wait=S        seconds before the first chunk
    #keepalive=N   N ": keep-alive" comments before the first token
    #fail=CODE     answer HTTP CODE with an OpenAI-style error body
    #echo=CODE     answer HTTP CODE with an error that quotes the question (a moderation refusal)
    #flaky=CODE    answer CODE (with Retry-After: 0.2) the first time this message is asked
    #break=N       drop the connection after N content tokens
    #malformed=N   send a malformed chunk after N content tokens
    #empty         a 200 with an empty body
    #hang          send the first token, then wait until the client goes
    #size=K        each content token is K characters long
    #think         content tokens carry "<think>…</think>" cut across chunks
    #nousage       no `usage` chunk, even when `stream_options.include_usage` asks
    #nul           each content token carries a NUL character ("tok0\u0000 ")
    #lonethink     content is "Let me think.</think>The answer." (no opening tag)
    #endless       content tokens without end: only the request's `max_tokens` stops them
                   (as any answer is cut at `max_tokens`, with finish_reason "length")

A request with `tools` (the research agent's rounds) answers with streamed
`tool_calls` deltas from `tool_rounds`: each such request takes the next round, a
list of (name, arguments) calls (several: parallel calls); when none are left, a
`done` call. `tools_refused` answers such requests 400 ("tools is not supported"),
`tools_ignored` with text and no call; `tool_delay` waits before answering (or
refusing); `tool_error` answers them 400 with that text; `tool_ids_empty` sends calls
without ids. A tool request with `"stream": false` is answered with the round's calls
in one `chat.completion`; `tool_stream_empty` answers streamed ones with an empty 200
(as llama.cpp's server does for a format that cannot stream calls), `tool_stream_error`
with that status, and `tool_whole_error` the non-streamed ones. A request whose `tool` messages do not answer a call of an earlier
assistant message by its id is refused 400, as OpenAI refuses it.
`context_limit` (characters) answers any request whose messages are longer with
OpenAI's 400 "maximum context length"; `context_tokens` does the same counting
tokens as a tokenizer roughly would (a non-ASCII character one, four ASCII ones one).
With `overflow_empty` a streamed request over either limit gets an empty 200
instead, as llama.cpp's server answers it; with `overflow_closed`, a 200 whose
connection closes before its body ends, as llama-cpp-python's server answers it (its
stream raises after the head was sent).

With `stream_options: {"include_usage": true}` a last chunk carries `usage`:
prompt tokens are the words of the messages, completion tokens the chunks sent
(reasoning ones counted in `completion_tokens_details.reasoning_tokens`).
`drops_system` leaves the system messages out of that count, as a chat template that
drops them does. `refused_parameters` (name → status) refuses any request carrying
one of those parameters, in the words OpenAI uses for `max_tokens`.

Short calls (classify, rewrite, title, suggestions, ranking, planning: streamed
without `stream_options`, or not streamed) answer from `replies`: the first
(substring, reply) whose substring is in the prompt; a callable reply is called
with the prompt; streamed, the reply comes a word a chunk, cut at `max_tokens`
words. `slow_replies` (substring → seconds) delays the answer to such a prompt; one
whose client goes meanwhile is kept in `replies_closed` (its substring). A prompt with
a substring of `endless_replies` is answered a word every 5 ms without end, its
`max_tokens` ignored, until the client goes (then kept in `replies_closed` too).
`listed` models, when set, are what `GET /v1/models` serves instead of `models`.
Everything asked is kept in `requests`; every stream's end in `streams`
`GET /v1/models` lists `models`.
("completed", "client_closed", "broken").
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import re
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

DIRECTIVE = re.compile(r"#(\w+)(?:=([\w.]+))?")

DEFAULT_REPLIES: list[tuple[str, str]] = [
    ("Standalone question", "not_needed"),
    ("Write a title", "Fake Chat Title"),
    ("Follow-up questions", "What is next?\nWhy does it matter?\nWho made it?\nWhen did it start?"),
]


@dataclass
class StreamRecord:
    outcome: str = "open"
    tokens_sent: int = 0
    closed_at: float = 0.0
    #: `time.monotonic()` when the request came in, and when its first token went out
    asked_at: float = 0.0
    first_at: float = 0.0


@dataclass
class FakeModel:
    api_key: str = "test-key"
    replies: list[tuple[str, Any]] = field(default_factory=lambda: list(DEFAULT_REPLIES))
    requests: list[dict[str, Any]] = field(default_factory=list)
    streams: list[StreamRecord] = field(default_factory=list)
    embedding_dims: int = 64
    reply_delay: float = 0.0
    flaked: set[str] = field(default_factory=set)
    answer_text: str | None = None  # when set, streamed word by word instead of "tok0 tok1 …"
    tool_rounds: list[list[tuple[str, dict[str, Any]]]] = field(default_factory=list)
    tools_refused: bool = False
    tools_ignored: bool = False
    tool_delay: float = 0.0
    embedding_delay: float = 0.0  # seconds before an embeddings answer
    context_limit: int | None = None
    context_tokens: int | None = None
    tool_streams: list[StreamRecord] = field(default_factory=list)
    tool_error: str | None = None
    tool_ids_empty: bool = False
    slow_replies: dict[str, float] = field(default_factory=dict)
    replies_closed: list[str] = field(default_factory=list)
    #: prompts answered word after word without end, `max_tokens` ignored
    endless_replies: set[str] = field(default_factory=set)
    #: what `GET /v1/models` lists
    models: list[str] = field(default_factory=lambda: ["fake-chat", "fake-small"])
    overflow_empty: bool = False
    overflow_closed: bool = False
    tool_stream_empty: bool = False
    tool_stream_error: int | None = None
    tool_whole_error: int | None = None
    drops_system: bool = False
    refused_parameters: dict[str, int] = field(default_factory=dict)
    listed: list[dict[str, Any]] = field(default_factory=list)

    def reset(self) -> None:
        self.requests.clear()
        self.streams.clear()
        self.replies[:] = DEFAULT_REPLIES
        self.reply_delay = 0.0
        self.flaked.clear()
        self.answer_text = None
        self.tool_rounds.clear()
        self.tool_streams.clear()
        self.tools_refused = self.tools_ignored = self.tool_ids_empty = False
        self.tool_delay = 0.0
        self.embedding_delay = 0.0
        self.tool_error = None
        self.context_limit = self.context_tokens = None
        self.overflow_empty = self.overflow_closed = False
        self.slow_replies.clear()
        self.replies_closed.clear()
        self.endless_replies.clear()
        self.tool_stream_empty = self.drops_system = False
        self.tool_stream_error = self.tool_whole_error = None
        self.refused_parameters.clear()
        self.listed.clear()

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.completions, methods=["POST"]),
                Route("/v1/embeddings", self.embeddings, methods=["POST"]),
                Route("/v1/models", self.list_models, methods=["GET"]),
            ]
        )

    # -- what tests look at ---------------------------------------------------------

    def streamed_requests(self) -> list[dict[str, Any]]:
        """The answers' streams (not the research agent's tool rounds, nor short calls)."""
        return [
            r for r in self.requests if r.get("stream") and not r.get("tools") and not short_call(r)
        ]

    def short_requests(self) -> list[dict[str, Any]]:
        """The short calls (classify, rewrite, title, suggestions, ranking, planning)."""
        return [r for r in self.requests if short_call(r)]

    def last_system_prompt(self) -> str:
        messages = self.streamed_requests()[-1]["messages"]
        return next(m["content"] for m in messages if m["role"] == "system")

    async def wait_stream_end(self, index: int = -1, timeout: float = 5.0) -> StreamRecord:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.streams and self.streams[index].outcome != "open":
                return self.streams[index]
            await asyncio.sleep(0.01)
        raise AssertionError(f"stream did not end: {self.streams[index] if self.streams else None}")

    # -- endpoints ------------------------------------------------------------------

    def _authorised(self, request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {self.api_key}"

    def _refused(self, request: Request) -> Response:
        """401 as OpenAI answers it: the key it refused, partly starred out."""
        key = request.headers.get("authorization", "").removeprefix("Bearer ")
        shown = f"{key[:7]}{'*' * max(len(key) - 11, 3)}{key[-4:]}" if key else "(none)"
        return _error(401, f"Incorrect API key provided: {shown}. You can find your key online.")

    async def list_models(self, request: Request) -> Response:
        if not self._authorised(request):
            return self._refused(request)
        data = self.listed or [
            {"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in self.models
        ]
        return JSONResponse({"object": "list", "data": data})

    async def completions(self, request: Request) -> Response:
        asked_at = time.monotonic()
        if not self._authorised(request):
            return self._refused(request)
        body = orjson.loads(await request.body())
        self.requests.append(body)
        refused = next((p for p in self.refused_parameters if p in body), None)
        if refused is not None:
            return _error(
                self.refused_parameters[refused],
                f"Unsupported parameter: '{refused}' is not supported with this model.",
            )
        prompt = "\n".join(str(m.get("content") or "") for m in body.get("messages", []))
        over = (self.context_limit is not None and len(prompt) > self.context_limit) or (
            self.context_tokens is not None and tokens_of(prompt) > self.context_tokens
        )
        if over and self.overflow_empty and body.get("stream"):
            return Response(b"", media_type="text/event-stream")
        if over and self.overflow_closed and body.get("stream"):
            return StreamingResponse(_broken(), media_type="text/event-stream")
        if self.context_limit is not None and len(prompt) > self.context_limit:
            return _error(
                400,
                f"This model's maximum context length is {self.context_limit // 4} tokens. "
                f"However, your messages resulted in {len(prompt) // 4} tokens.",
            )
        if self.context_tokens is not None and tokens_of(prompt) > self.context_tokens:
            return _error(
                400,
                f"This model's maximum context length is {self.context_tokens} tokens. "
                f"However, your messages resulted in {tokens_of(prompt)} tokens "
                "(in the messages and the functions). Please reduce their length.",
            )
        if not answered_by_id(body.get("messages", [])):
            return _error(
                400,
                "Invalid parameter: messages with role 'tool' must be a response to a "
                "preceeding message with 'tool_calls'.",
            )
        if body.get("tools"):
            return await self._tool_answer(streamed=bool(body.get("stream")))
        if short_call(body) and body.get("stream"):
            return StreamingResponse(
                self._short_stream(prompt, body.get("max_tokens")), media_type="text/event-stream"
            )
        if not body.get("stream"):
            if self.reply_delay:
                await asyncio.sleep(self.reply_delay)
            slow = next((k for k in self.slow_replies if k in prompt), None)
            if slow is not None and await _client_went(request, self.slow_replies[slow]):
                self.replies_closed.append(slow)
                return _error(499, "client closed")
            return JSONResponse(_completion(self._reply(prompt)))
        last_user = next(
            (m["content"] for m in reversed(body["messages"]) if m["role"] == "user"), ""
        )
        script = {name: value for name, value in DIRECTIVE.findall(last_user)}
        if "fail" in script:
            return _error(int(script["fail"]), f"fake failure {script['fail']}")
        if "echo" in script:  # a refusal that quotes the prompt, as moderation errors may
            quoted = DIRECTIVE.sub("", last_user).strip()
            return _error(int(script["echo"]), f"Your request '{quoted}' was flagged")
        if "flaky" in script and last_user not in self.flaked:
            self.flaked.add(last_user)
            return _error(int(script["flaky"]), "fake flaky failure", {"Retry-After": "0.2"})
        if "empty" in script:
            return Response(b"", media_type="text/event-stream")
        record = StreamRecord(asked_at=asked_at)
        self.streams.append(record)
        usage = None
        if (body.get("stream_options") or {}).get("include_usage") and "nousage" not in script:
            counted = [
                m for m in body["messages"] if not (self.drops_system and m["role"] == "system")
            ]
            words = sum(len(str(m.get("content", "")).split()) for m in counted)
            usage = {"prompt_tokens": words}
        return StreamingResponse(
            self._stream(script, record, usage, body.get("max_tokens")),
            media_type="text/event-stream",
        )

    def tool_requests(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r.get("tools")]

    async def _tool_answer(self, *, streamed: bool = True) -> Response:
        if self.tools_refused:
            await asyncio.sleep(self.tool_delay)
            return _error(400, "registry.ollama.ai/library/gemma3 does not support tools")
        if self.tool_error is not None:
            return _error(400, self.tool_error)
        if streamed and self.tool_stream_empty:
            return Response(b"", media_type="text/event-stream")
        failed = self.tool_stream_error if streamed else self.tool_whole_error
        if failed is not None:
            return _error(failed, f"fake failure {failed}")
        calls = self.tool_rounds.pop(0) if self.tool_rounds else [("done", {})]
        if not streamed:
            made = [
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": name, "arguments": orjson.dumps(arguments).decode()},
                }
                for i, (name, arguments) in enumerate(calls)
            ]
            answer = _completion("")
            answer["choices"][0]["message"] |= {"content": None, "tool_calls": made}
            return JSONResponse(answer)
        record = StreamRecord()
        self.tool_streams.append(record)
        return StreamingResponse(self._tool_stream(calls, record), media_type="text/event-stream")

    async def _tool_stream(
        self, calls: list[tuple[str, dict[str, Any]]], record: StreamRecord
    ) -> AsyncIterator[bytes]:
        try:
            yield _chunk({"role": "assistant", "content": ""})
            if self.tool_delay:
                await asyncio.sleep(self.tool_delay)
            if self.tools_ignored:
                yield _chunk({"content": "I would search for that."})
            else:
                for i, (name, arguments) in enumerate(calls):
                    call_id = "" if self.tool_ids_empty else f"call_{i}"
                    head = {"index": i, "id": call_id, "type": "function"}
                    yield _chunk(
                        {"tool_calls": [head | {"function": {"name": name, "arguments": ""}}]}
                    )
                    text = orjson.dumps(arguments).decode()
                    for piece in (text[: len(text) // 2], text[len(text) // 2 :]):
                        yield _chunk(
                            {"tool_calls": [{"index": i, "function": {"arguments": piece}}]}
                        )
            yield _chunk({}, finish="tool_calls")
            yield b"data: [DONE]\n\n"
            record.outcome = "completed"
        finally:
            if record.outcome == "open":
                record.outcome = "client_closed"
            record.closed_at = time.monotonic()

    async def _short_stream(self, prompt: str, max_tokens: int | None) -> AsyncIterator[bytes]:
        """A short call's reply from `replies`, a word a chunk (`slow_replies` waits)."""
        slow = next((k for k in self.slow_replies if k in prompt), None)
        endless = next((k for k in self.endless_replies if k in prompt), None)
        finished = False
        try:
            if endless is not None:
                slow = endless
                yield _chunk({"role": "assistant", "content": ""})
                for i in itertools.count():
                    yield _chunk({"content": f"word{i} "})
                    await asyncio.sleep(0.005)
            if self.reply_delay:
                await asyncio.sleep(self.reply_delay)
            if slow is not None:
                await asyncio.sleep(self.slow_replies[slow])
            words = re.findall(r"\S+\s*|\s+", self._reply(prompt))
            cut = max_tokens is not None and len(words) > max_tokens
            yield _chunk({"role": "assistant", "content": ""})
            for word in words[:max_tokens] if cut else words:
                yield _chunk({"content": word})
            yield _chunk({}, finish="length" if cut else "stop")
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            if not finished and slow is not None:
                self.replies_closed.append(slow)

    def _reply(self, prompt: str) -> str:
        for needle, reply in self.replies:
            if needle in prompt:
                return reply(prompt) if callable(reply) else reply
        return "fake reply"

    async def _stream(
        self,
        script: dict[str, str],
        record: StreamRecord,
        usage: dict[str, int] | None = None,
        max_tokens: int | None = None,
    ) -> AsyncIterator[bytes]:
        tokens = int(script.get("tokens") or 5)
        reasoning = int(script.get("reasoning") or 2) if "reasoning" in script else 2
        delay = float(script.get("delay") or 0)
        keepalives = int(script.get("keepalive") or 0)
        break_at = int(script["break"]) if "break" in script else None
        malformed_at = int(script["malformed"]) if "malformed" in script else None
        try:
            if "wait" in script:
                await asyncio.sleep(float(script["wait"]))
            yield _chunk({"role": "assistant", "content": ""})
            for _ in range(keepalives):
                yield b": keep-alive\n\n"
                await asyncio.sleep(0.01)
            for i in range(reasoning):
                record.first_at = record.first_at or time.monotonic()
                yield _chunk({"reasoning_content": f"why{i} "})
                if delay:
                    await asyncio.sleep(delay)
            size = int(script.get("size") or 0)
            if self.answer_text is not None:
                pieces = re.findall(r"\S+\s*|\s+", self.answer_text)
            elif "lonethink" in script:
                pieces = ["Let me ", "think.</th", "ink>The ", "answer."]
            elif "think" in script:
                pieces = think_pieces()
            elif size:
                pieces = [f"tok{i} ".ljust(size, "x") for i in range(tokens)]
            elif "nul" in script:
                pieces = [f"tok{i}\u0000 " for i in range(tokens)]
            elif "endless" in script:
                pieces = (f"tok{i} " for i in itertools.count())
            else:
                pieces = [f"tok{i} " for i in range(tokens)]
            finish = "stop"
            for i, piece in enumerate(pieces):
                if max_tokens is not None and i == max_tokens:
                    finish = "length"
                    break
                if break_at is not None and i == break_at:
                    record.outcome = "broken"
                    raise ConnectionAbortedError("scripted break")
                if malformed_at is not None and i == malformed_at:
                    yield b'data: {"choices": [{"delta": {"content": \n\n'
                record.first_at = record.first_at or time.monotonic()
                yield _chunk({"content": piece})
                record.tokens_sent += 1
                if "hang" in script:
                    await asyncio.Event().wait()
                if delay:
                    await asyncio.sleep(delay)
            yield _chunk({}, finish=finish)
            if usage is not None:
                completion = record.tokens_sent + reasoning
                usage |= {
                    "completion_tokens": completion,
                    "total_tokens": usage["prompt_tokens"] + completion,
                    "completion_tokens_details": {"reasoning_tokens": reasoning},
                }
                yield (
                    b"data: "
                    + orjson.dumps({"id": "chatcmpl-fake", "choices": [], "usage": usage})
                    + b"\n\n"
                )
            yield b"data: [DONE]\n\n"
            record.outcome = "completed"
        finally:
            if record.outcome == "open":
                record.outcome = "client_closed"
            record.closed_at = time.monotonic()

    async def embeddings(self, request: Request) -> Response:
        if not self._authorised(request):
            return self._refused(request)
        body = orjson.loads(await request.body())
        self.requests.append(body)
        if self.embedding_delay:
            await asyncio.sleep(self.embedding_delay)
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        # as OpenAI does: base64 little-endian float32 when asked, else lists of floats
        packed = body.get("encoding_format") == "base64"
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": as_base64(vector) if packed else vector,
            }
            for i, vector in enumerate(embed(text, self.embedding_dims) for text in inputs)
        ]
        return JSONResponse(
            {"object": "list", "data": data, "model": body.get("model", "fake-embed")}
        )


def short_call(body: dict[str, Any]) -> bool:
    """Whether a request is a short call: not an answer (streamed with its usage asked
    for) nor a tool round."""
    return "messages" in body and not body.get("tools") and not body.get("stream_options")


def tokens_of(text: str) -> int:
    """Tokens as a tokenizer roughly counts them: four ASCII characters one, any other
    character one."""
    ascii_chars = len(text.encode("ascii", "ignore"))
    return ascii_chars // 4 + len(text) - ascii_chars


def answered_by_id(messages: list[dict[str, Any]]) -> bool:
    """Whether every `tool` message answers a call made before it, by the call's id."""
    called: set[str] = set()
    for m in messages:
        for call in m.get("tool_calls") or ():
            called.add(str(call.get("id") or ""))
        if m.get("role") == "tool" and (
            not m.get("tool_call_id") or m["tool_call_id"] not in called
        ):
            return False
    return True


async def _client_went(request: Request, seconds: float) -> bool:
    """Wait `seconds`, or less when the client goes: whether it went."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await request.is_disconnected():
            return True
        await asyncio.sleep(0.02)
    return False


THINK_ANSWER = "The answer."
THINK_REASONING = "Let me think."


def think_pieces() -> list[str]:
    """`<think>Let me think.</think>The answer.` cut inside both tags."""
    return ["<thi", "nk>Let me ", "think.</th", "ink>The ", "answer."]


def embed(text: str, dims: int) -> list[float]:
    """A deterministic bag-of-words embedding: shared words → similar vectors."""
    vector = [0.0] * dims
    for word in re.findall(r"\w+", text.lower()):
        vector[sum(map(ord, word)) % dims] += 1.0
    return vector


def as_base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    payload = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "fake",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _completion(text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": "fake",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(
        {"error": {"message": message, "type": "fake_error", "code": str(status)}},
        status_code=status,
        headers=headers,
    )


async def _broken() -> AsyncIterator[bytes]:
    """A body that fails before its first byte: the server closes the connection."""
    raise RuntimeError("Requested tokens exceed context window")
    yield b""  # an async generator


def main() -> None:
    """`python -m tests.fakes.model --port N`: serve the fake model on its own (benchmarks)."""
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    uvicorn.run(FakeModel().app(), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
