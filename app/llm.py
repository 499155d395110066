"""The one place that talks to the model (any OpenAI-compatible `/chat/completions`).

Streaming reads the raw SSE lines of the response and decodes each `data:` line
with orjson; the SDK's parsed stream costs several times more CPU per chunk, and
the per-token path decides how many streams a core can carry. The answer's
stream (`stream`) is read by `upstream.StreamingClient` when the model is reached
directly (its headers and errors the SDK's), else (a proxy) through the SDK's
client; everything else goes through the SDK.

Errors: `ModelError` (CHAT_ERROR) when the model cannot be reached,
`StreamError` (STREAM_ERROR) when it answers non-2xx or the stream breaks or
carries a malformed chunk, `ConfigError` when no model is configured.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import re
import socket
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import httpx2
import numpy as np
import openai
import orjson

from .config import EmbeddingsSettings, LLMSettings
from .errors import ConfigError, ModelError, StreamError
from .upstream import Redirected, StreamedResponse, StreamingClient, usable_for

log = logging.getLogger("app.llm")

Message = dict[str, str]


@dataclass(slots=True)
class Delta:
    """A piece of the model's answer: `reasoning`, `content` or `keepalive`; or, last,
    `usage`: the tokens the model counted (`usage` holds its `usage` object). Not
    frozen, like `Event`: one is made per token."""

    kind: str
    text: str = ""
    usage: dict[str, Any] | None = None


KEEPALIVE = Delta("keepalive")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call the model asked for; `arguments` as it sent them (JSON text,
    perhaps broken: the caller parses it tolerantly)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolTurn:
    """What the model answered to a request with tools: text, and the calls it made."""

    content: str
    calls: tuple[ToolCall, ...]


class ToolsUnsupported(StreamError):
    """The model (or the server in front of it) refused a request with `tools`."""


class ContextTooLong(StreamError):
    """The model refused a request as longer than its context window (a 400)."""


class ChatModel(Protocol):
    """What answers: `LLMClient` (any OpenAI-compatible server) or the built-in demo
    model (`app.demo`), chosen by `llm.base_url` (`open_model`)."""

    @property
    def configured(self) -> bool: ...

    def stream(
        self, messages: Sequence[Message], *, model: str | None = None
    ) -> AsyncIterator[Delta]: ...

    async def answer(
        self,
        messages: Sequence[Message],
        sink: Callable[[Delta], None],
        *,
        model: str | None = None,
    ) -> None:
        """What `stream` yields, handed to `sink` as it comes; returns at the end."""
        ...

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        model: str | None = None,
        max_tokens: int | None = None,
        timeout: float = 60.0,
    ) -> str: ...

    async def tool_turn(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]],
        *,
        model: str | None = None,
    ) -> ToolTurn:
        """One streamed request with `tools` (OpenAI's format), read to its end: the
        text and the calls. `ToolsUnsupported` when the request is refused for its tools."""
        ...

    async def probe(self) -> str | None:
        """Why the model cannot be used at all (not reachable, its key refused), in
        words for a person; None when it answers."""
        ...

    async def aclose(self) -> None: ...


RETRY_AFTER_CAP = 10.0
#: an embeddings answer bigger than this is decoded in a thread (~30 vectors of 1,024)
DECODE_IN_THREAD_BYTES = 160 * 1024
PROBE_SECONDS = 10.0


class LLMClient:
    """Streams and completes chat requests; one instance per app, closed with `aclose()`."""

    def __init__(self, settings: LLMSettings) -> None:
        self.settings = settings
        self.host = urlsplit(settings.base_url).hostname or ""
        #: models seen to leave the opening `<think>` out (for this process)
        self.open_left_out: set[str] = set()
        #: models seen to reason (for this process): their short calls get room for it
        self.reasoners: set[str] = set()
        self._client: openai.AsyncOpenAI | None = None
        self._streaming: StreamingClient | None = None
        if settings.api_key:
            timeout = openai.Timeout(
                settings.timeout_seconds,
                connect=settings.connect_timeout_seconds,
                read=settings.read_timeout_seconds,
            )
            self._client = openai.AsyncOpenAI(
                base_url=settings.base_url,
                api_key=settings.api_key,
                max_retries=0,
                timeout=timeout,
                # aiohttp's C parser reads the stream for a fraction of the CPU
                http_client=openai.DefaultAioHttpClient(timeout=timeout),
            )
            if usable_for(self._client, settings.base_url):
                self._streaming = streaming_client(self._client, settings)

    @property
    def configured(self) -> bool:
        return self._client is not None

    def _require(self) -> openai.AsyncOpenAI:
        if self._client is None:
            raise ConfigError("no model is configured: set llm.api_key (LLM_API_KEY)")
        return self._client

    async def stream(
        self, messages: Sequence[Message], *, model: str | None = None
    ) -> AsyncIterator[Delta]:
        """Yield the answer's deltas as they arrive (see `answer`, which hands them to
        a function instead, for a cheaper token).

        Closing the iterator (or cancelling the task that reads it) closes the
        upstream HTTP response, which is how a cancel stops the spend.
        `<think>…</think>` inside `content` is split out into reasoning.
        """
        client = self._require()
        name = model or self.settings.model
        out: list[Delta] = []
        decoder = AnswerDecoder(out.append, self._splitter(name))
        with model_errors("model", self.host):
            async with self._open_stream(client, messages, model) as response:
                chunks = body_reader(response)
                try:
                    async for data in chunks:
                        try:
                            done = decoder.feed(data)
                        except StreamError:
                            for delta in out:  # what came before the bad chunk
                                yield delta
                            raise
                        if out:
                            for delta in out:
                                yield delta
                            out.clear()
                        if done:
                            if isinstance(chunks, StreamedResponse):
                                chunks.finish()  # the connection may serve another
                            break
                except TimeoutError as exc:  # read straight from aiohttp: its read timeout
                    raise _stalled(exc) from exc
        for delta in decoder.end():
            yield delta
        self._learn(name, lone_close=decoder.splitter.lone_close, reasoned=decoder.splitter.tagged)

    async def answer(
        self,
        messages: Sequence[Message],
        sink: Callable[[Delta], None],
        *,
        model: str | None = None,
    ) -> None:
        """The answer's deltas handed to `sink` as they arrive; returns at its end.

        On a direct connection to the model (`StreamingClient`) the stream is parsed,
        and `sink` called, in the callback that read it from the socket — no task is
        woken per token; otherwise the deltas come as `stream` yields them. What
        `sink` raises ends the stream with it. Cancelling is safe: it closes the
        upstream response, as closing `stream` does."""
        client = self._require()
        name = model or self.settings.model
        decoder = AnswerDecoder(sink, self._splitter(name))
        with model_errors("model", self.host):
            async with self._open_stream(client, messages, model) as response:
                try:
                    if isinstance(response, StreamedResponse):
                        await response.pump(decoder.feed)
                    else:
                        async for data in body_reader(response):
                            if decoder.feed(data):
                                break
                except TimeoutError as exc:
                    raise _stalled(exc) from exc
        for delta in decoder.end():
            sink(delta)
        self._learn(name, lone_close=decoder.splitter.lone_close, reasoned=decoder.splitter.tagged)

    def _splitter(self, name: str) -> ThinkSplitter:
        return ThinkSplitter(
            assume_open=name in self.open_left_out or bool(OPEN_LEFT_OUT.search(name))
        )

    def _learn(self, name: str, *, lone_close: bool, reasoned: bool) -> None:
        """Remember what a model's answer showed of it: that it leaves the opening
        `<think>` out (its next answers are split from their start), that it reasons."""
        if lone_close and name not in self.open_left_out:
            log.info(
                "model %s leaves the opening <think> out: its answers are split from their start",
                name,
            )
            self.open_left_out.add(name)
        if (reasoned or lone_close) and name not in self.reasoners:
            self.reasoners.add(name)

    def reasons(self, name: str) -> bool:
        """Whether `name` is a reasoning model: its name says so, or it was seen to."""
        return name in self.reasoners or bool(REASONING.search(name))

    @contextlib.asynccontextmanager
    async def _open_stream(
        self, client: openai.AsyncOpenAI, messages: Sequence[Message], model: str | None
    ) -> AsyncIterator[Any]:
        """The streamed response, opened; a 429 is retried once (after its Retry-After,
        at most `RETRY_AFTER_CAP` seconds) — only here, before the first token."""
        for attempt in range(2):
            try:
                body = {
                    "model": model or self.settings.model,
                    "messages": list(messages),
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                response: StreamedResponse | httpx2.Response
                try:
                    if self._streaming is None:
                        raise Redirected
                    response = await self._streaming.post("/chat/completions", orjson.dumps(body))
                except Redirected:  # a redirect is the SDK's to follow, as before
                    response = await _post_chat(client, body, stream=True)
                try:
                    yield response
                finally:
                    await response.aclose()
                return
            except openai.RateLimitError as exc:
                if attempt:
                    raise
                await asyncio.sleep(_retry_after(exc))

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        model: str | None = None,
        max_tokens: int | None = None,
        timeout: float = 60.0,
    ) -> str:
        """One non-streaming completion (rewrite, title, ranking, suggestions): its text,
        without its reasoning — `<think>…</think>`, or everything up to a lone
        `</think>` (a template that leaves the opening tag out, as `stream` splits it).
        A reasoning model's reasoning counts against `max_tokens`: it is given
        `REASONING_TOKENS` more, so that a short answer is not left empty."""
        client = self._require()
        name = model or self.settings.effective_small_model
        with model_errors("model", self.host):
            async with asyncio.timeout(timeout):
                request: dict[str, Any] = {"model": name, "messages": list(messages)}
                if max_tokens:
                    extra = REASONING_TOKENS if self.reasons(name) else 0
                    request["max_tokens"] = max_tokens + extra
                response = await _post_chat(client, request, stream=False)
                body = orjson.loads(await response.aread())
        try:
            message = body["choices"][0]["message"]
            text = message.get("content") or ""
            apart = bool(message.get("reasoning_content") or message.get("reasoning"))
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise StreamError("the model's answer has no choices[0].message") from exc
        reasoning, content, lone = split_think(text)
        self._learn(name, lone_close=lone, reasoned=apart or bool(reasoning))
        return content.strip()

    async def tool_turn(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]],
        *,
        model: str | None = None,
    ) -> ToolTurn:
        """Streamed, so that a cancel closes the request at once and a proxy that cuts
        quiet connections never sees one; the calls' pieces (`tool_calls` deltas by
        `index`, several calls in one answer) are put together as they come."""
        client = self._require()
        name = model or self.settings.model
        body = {
            "model": name,
            "messages": list(messages),
            "tools": list(tools),
            "tool_choice": "auto",
            "stream": True,
        }
        content: list[str] = []
        calls: dict[int, list[str]] = {}  # index → [id, name, arguments]
        try:
            with model_errors("model", self.host):
                response = await _post_chat(client, body, stream=True)
                try:
                    buffer = b""
                    async for data in body_reader(response):
                        buffer += data
                        *lines, buffer = buffer.split(b"\n")
                        for line in lines:
                            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                                _tool_delta(line[5:].strip(), content, calls)
                finally:
                    await response.aclose()
        except StreamError as exc:
            cause = exc.__cause__
            if (
                isinstance(cause, openai.APIStatusError)
                and not isinstance(exc, ContextTooLong)
                and refuses_tools(cause.status_code, _status_detail(cause))
            ):
                raise ToolsUnsupported("the model does not take tools") from exc
            raise
        reasoning, text, lone = split_think("".join(content))
        self._learn(name, lone_close=lone, reasoned=bool(reasoning))
        # every call has an id, unique in its turn: the tool answers sent back name it
        made, seen = [], set()
        for index, (call_id, function, arguments) in sorted(calls.items()):
            call_id = call_id if call_id and call_id not in seen else f"call-{index}"
            seen.add(call_id)
            made.append(ToolCall(call_id, function, arguments))
        return ToolTurn(text.strip(), tuple(made))

    async def probe(self) -> str | None:
        """Ask the model server for its models (`GET /models`): any answer but a
        refused key means it can be reached (some servers have no such route)."""
        client = self._require()
        try:
            with model_errors("model", self.host):
                try:
                    async with asyncio.timeout(PROBE_SECONDS):
                        await client.get("/models", cast_to=httpx2.Response)
                except openai.APIStatusError as exc:  # it answered: only a key refused counts
                    if exc.status_code not in (401, 403):
                        return None
                    raise
        except (ModelError, StreamError) as exc:
            return exc.message
        return None

    async def aclose(self) -> None:
        if self._streaming is not None:
            await self._streaming.aclose()
        if self._client is not None:
            await self._client.close()


def streaming_client(client: openai.AsyncOpenAI, settings: LLMSettings) -> StreamingClient:
    """The reader of the answer's stream, with the SDK's headers (its auth included),
    its errors, its TLS context and the model's timeouts."""
    headers = {
        name: value
        for name, value in {**client.default_headers, **client.auth_headers}.items()
        if isinstance(value, str)
    }
    return StreamingClient(
        settings.base_url,
        headers=headers,
        make_status_error=client._make_status_error_from_response,
        connect_timeout=settings.connect_timeout_seconds,
        read_timeout=settings.read_timeout_seconds,
        pool_timeout=settings.timeout_seconds,
        ssl_context=httpx2.create_ssl_context(trust_env=True),
    )


class Embedder:
    """The `/embeddings` endpoint of the embeddings model (for ranking search results)."""

    def __init__(self, settings: EmbeddingsSettings, timeout: float = 30.0) -> None:
        self.settings = settings
        self.host = urlsplit(settings.base_url).hostname or ""
        self._client: openai.AsyncOpenAI | None = None
        if settings.model and settings.api_key:
            self._client = openai.AsyncOpenAI(
                base_url=settings.base_url, api_key=settings.api_key, max_retries=0, timeout=timeout
            )

    @property
    def configured(self) -> bool:
        return self._client is not None

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        """One float32 row per text, in order. ConfigError / ModelError / StreamError.

        Asks for base64 vectors (OpenAI's compact form, which the SDK asks for too) and
        decodes the body with orjson and numpy: a batch of 1,024-dimension vectors parsed
        into the SDK's models and Python floats would hold the event loop several times
        longer. Servers that answer plain float lists anyway are read just as well.
        The request goes through the SDK's client (headers, errors) with a body built
        here, as `_post_chat` does: its parameter walk over every input is skipped. A
        big answer (an import's batch) is decoded in a thread, off the loop that serves
        the streams."""
        if self._client is None:
            raise ConfigError("no embeddings model is configured (embeddings.model)")
        with model_errors("embeddings model", self.host):
            response = await self._client.post(
                "/embeddings",
                cast_to=httpx2.Response,
                body={
                    "model": self.settings.model,
                    "input": list(texts),
                    "encoding_format": "base64",
                },
            )
            body = await response.aread()
        if len(body) > DECODE_IN_THREAD_BYTES:
            return await asyncio.to_thread(decode_embeddings, body, len(texts))
        return decode_embeddings(body, len(texts))

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()


def decode_embeddings(body: bytes, count: int) -> np.ndarray:
    """The `count` vectors of an `/embeddings` answer as a float32 matrix, rows in
    input order; each vector base64 (little-endian float32) or a list of numbers."""
    try:
        items = sorted(orjson.loads(body)["data"], key=lambda item: item["index"])
        rows = [
            np.frombuffer(base64.b64decode(v, validate=True), dtype="<f4")
            if isinstance(v := item["embedding"], str)
            else np.asarray(v, dtype=np.float32)
            for item in items
        ]
        if len(rows) != count:
            raise StreamError("the embeddings model returned a different number of vectors")
        matrix = (
            np.vstack(rows).astype(np.float32, copy=False) if rows else np.zeros((0, 0), np.float32)
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise StreamError("the embeddings model returned vectors that could not be read") from exc
    if rows and not matrix.shape[1]:
        raise StreamError("the embeddings model returned empty vectors")
    return matrix


async def _post_chat(
    client: openai.AsyncOpenAI, body: dict[str, Any], *, stream: bool
) -> httpx2.Response:
    """POST /chat/completions through the SDK's client (its retries, headers and
    errors: a non-2xx answer raises as from `create`), with a body we built: the
    SDK's `create` first walks every message against its typed parameters, ~0.6 ms
    a request here for a body it leaves as it was. The response is the HTTP one,
    its body unread when `stream`; the caller closes it."""
    return await client.post("/chat/completions", cast_to=httpx2.Response, body=body, stream=stream)


def body_reader(http: Any) -> AsyncIterable[bytes]:
    """The bytes of a streamed response, read as close to the socket as it allows:
    a `StreamedResponse` is its own reader; of the SDK's HTTP response, with
    nothing content-encoded, the aiohttp response's
    own reader under the SDK's transport (one call per read instead of three
    async-generator layers; the SDK's response still closes it), else the
    transport's stream, else the response's decoded bytes."""
    if isinstance(http, StreamedResponse):
        return http
    if http.headers.get("content-encoding", "identity") != "identity":
        return cast(AsyncIterable[bytes], http.aiter_bytes())
    stream = http.stream
    below = getattr(getattr(stream, "_stream", None), "_aiohttp_response", None)
    if below is not None:
        return cast(AsyncIterable[bytes], below.content.iter_any())
    return cast(AsyncIterable[bytes], stream)


class AnswerDecoder:
    """The model's streamed answer (`text/event-stream` bytes, as they come) turned
    into deltas handed to `sink`: one `feed` per read. A `: keep-alive` comment is a
    `keepalive` delta; `data: [DONE]` ends it (`feed` says so)."""

    __slots__ = ("sink", "splitter", "buffer", "received", "done")

    def __init__(self, sink: Callable[[Delta], None], splitter: ThinkSplitter) -> None:
        self.sink = sink
        self.splitter = splitter
        self.buffer = b""
        self.received = False
        self.done = False

    def feed(self, data: bytes) -> bool:
        """Take one read's bytes; whether the answer has ended (`[DONE]`). Raises
        `StreamError` for a chunk that cannot be read, and what `sink` raises."""
        if self.done:
            return True
        if b"\n" not in data:
            self.buffer += data
            return False
        if self.buffer:
            data, self.buffer = self.buffer + data, b""
        *lines, rest = data.split(b"\n")
        if rest:
            self.buffer = rest
        sink, splitter = self.sink, self.splitter
        for line in lines:
            if not line or line == b"\r":
                continue
            if line[0] == 58:  # b":" a comment
                if b"keep-alive" in line:
                    sink(KEEPALIVE)
                continue
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            self.received = True
            if payload == b"[DONE]":
                self.done = True
                return True
            for delta in _decode_chunk(payload, splitter):
                sink(delta)
        return False

    def end(self) -> list[Delta]:
        """What the splitter still holds, once the stream is over; `StreamError` for a
        stream that held no answer at all."""
        if not self.received:
            raise StreamError("the model sent an empty answer")
        return self.splitter.flush()


def _stalled(exc: TimeoutError) -> StreamError:
    log.warning("the model stream stalled: %r", exc)
    return StreamError("the model stream broke off: nothing came in time")


def _tool_delta(payload: bytes, content: list[str], calls: dict[int, list[str]]) -> None:
    """Add one chunk of a tool turn to its text and calls."""
    try:
        chunk = orjson.loads(payload)
        delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
        if delta.get("content"):
            content.append(delta["content"])
        for piece in delta.get("tool_calls") or ():
            parts = calls.setdefault(int(piece.get("index", len(calls))), ["", "", ""])
            function = piece.get("function") or {}
            parts[0] = piece.get("id") or parts[0]
            parts[1] = function.get("name") or parts[1]
            parts[2] += function.get("arguments") or ""
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError) as exc:
        raise StreamError("the model sent a malformed chunk") from exc


#: how servers say they take no tools: "does not support tools", "tool_choice is not
#: supported", "unknown field `tools`", "tools param requires --jinja", "\"auto\" tool
#: choice requires --enable-auto-tool-choice", "does not support Function Calling"
_TOOL_WORD = (
    r"(?<![\w.])(?:tools|tool[ _]choice|tool[ _]use|tool[ _]calling|tool|function[ _]calling)"
    r"(?!\w)"
)
_REFUSAL_WORD = (
    r"(?:\b(?:not|unsupported|unknown|unrecogni[sz]ed|requires?|disabled|unavailable)\b|n't\b)"
)
_NO_TOOLS = re.compile(
    rf"(?i){_TOOL_WORD}\W+(?:\S+\W+){{0,6}}?{_REFUSAL_WORD}"
    rf"|{_REFUSAL_WORD}\W+(?:\S+\W+){{0,6}}?{_TOOL_WORD}"
)
#: errors that name tools but are about a request's messages, not about tools at all
_NOT_ABOUT_TOOLS = re.compile(r"(?i)tool_call|role ['\"]?tool|tool message")
#: how servers say a request is longer than the model's window
_CONTEXT_EXCEEDED = re.compile(
    r"(?i)context[ _]length|context[ _]window|maximum context|too many tokens|prompt is too long"
    r"|input is too long|exceeds? the (?:model'?s? )?(?:context|maximum)"
)


def refuses_tools(status: int, detail: str) -> bool:
    """Whether a 4xx answer says the model or its server takes no `tools` ("does not
    support tools", "tool_choice is not supported", "unknown field tools"). An error
    about the request's size, or about its tool messages (a `tool_call_id` that does
    not match), is not such an answer, though it names tools or functions."""
    if status not in (400, 404, 422, 501):
        return False
    if context_exceeded(detail) or _NOT_ABOUT_TOOLS.search(detail):
        return False
    return bool(_NO_TOOLS.search(detail))


def context_exceeded(detail: str) -> bool:
    """Whether a model's error text says the request is longer than its window."""
    return bool(_CONTEXT_EXCEEDED.search(detail))


def _decode_chunk(payload: bytes, splitter: ThinkSplitter) -> list[Delta]:
    try:
        chunk = orjson.loads(payload)
        choices = chunk.get("choices")
        usage = chunk.get("usage")
        if choices and usage is None:  # the common case: one piece of the answer
            delta = choices[0].get("delta") or {}
            content = delta.get("content")
            if content and not (delta.get("reasoning_content") or delta.get("reasoning")):
                return splitter.feed(content)
        if "error" in chunk and not choices:
            error = chunk["error"]
            detail = error.get("message") if isinstance(error, dict) else error
            log.warning("the model reported an error mid-stream: %s", redact(str(detail)))
            raise StreamError("the model reported an error mid-stream")
        counted = [Delta("usage", usage=usage)] if isinstance(usage, dict) else []
        if not choices:
            return counted
        delta = choices[0].get("delta") or {}
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        content = delta.get("content")
    except StreamError:
        raise
    except (orjson.JSONDecodeError, AttributeError, TypeError, IndexError) as exc:
        log.warning("the model sent a malformed chunk (%d bytes)", len(payload))
        raise StreamError("the model sent a malformed chunk") from exc
    out: list[Delta] = []
    if reasoning:
        splitter.reasoning_apart()
        out.append(Delta("reasoning", reasoning))
    if content:
        out.extend(splitter.feed(content))
    return out + counted


@contextlib.contextmanager
def model_errors(what: str, host: str = "") -> Iterator[None]:
    """Map what the SDK and its HTTP layer raise to our errors, told apart by cause:
    `ModelError` (CHAT_ERROR) when the model cannot be reached — the connection was
    refused, its host name does not resolve, a secure connection fails, it does not
    answer in time — and `StreamError` (STREAM_ERROR) when it answers non-2xx (its
    key refused, say) or badly. The messages say what happened in words a person
    can use; the log line says the same with the model's host (never its key, never
    the model's own error text, which may quote the key)."""
    try:
        yield
    except openai.APIStatusError as exc:
        detail = _status_detail(exc)
        too_long = exc.status_code in (400, 413, 422) and context_exceeded(detail)
        log.warning(
            "the %s answered %d",
            what,
            exc.status_code,
            extra={
                "fields": {"modelHost": host, "status": exc.status_code, "detail": redact(detail)}
            },
        )
        if too_long:
            raise ContextTooLong(
                f"the {what} refused the request as longer than its context window"
            ) from exc
        raise StreamError(_status_message(what, exc.status_code)) from exc
    except (TimeoutError, openai.APITimeoutError, openai.APIConnectionError) as exc:
        cause = connection_cause(exc)
        log.warning(
            "cannot reach the %s: %s",
            what,
            CAUSES[cause][0],
            extra={"fields": {"modelHost": host, "cause": cause}},
        )
        raise ModelError(CAUSES[cause][1].format(what=what)) from exc
    except (openai.OpenAIError, orjson.JSONDecodeError, OSError) as exc:
        log.warning(
            "the %s stream broke: %s",
            what,
            type(exc).__name__,
            extra={"fields": {"modelHost": host}},
        )
        raise StreamError(f"the {what} stream broke off") from exc
    except Exception as exc:
        if _is_transport_error(exc):
            log.warning(
                "the %s stream broke: %s",
                what,
                type(exc).__name__,
                extra={"fields": {"modelHost": host}},
            )
            raise StreamError(f"the {what} stream broke off") from exc
        raise


#: why a model could not be reached: (for the log, for the user)
CAUSES = {
    "refused": (
        "connection refused (nothing listens at llm.base_url?)",
        "the {what} refused the connection: it is not running at the configured address",
    ),
    "dns": (
        "its host name does not resolve (check llm.base_url)",
        "the {what}'s address could not be found: its host name does not resolve",
    ),
    "tls": (
        "the secure connection failed (TLS: certificate, or https to a plain http port)",
        "a secure connection to the {what} could not be made",
    ),
    "timeout": (
        "it did not answer in time",
        "the {what} did not answer in time",
    ),
    "unreachable": (
        "the connection failed",
        "the {what} cannot be reached",
    ),
}


def connection_cause(exc: BaseException) -> str:
    """Why a connection to the model failed, from the chain of causes under what the
    SDK raised (its aiohttp client reports a refused connection as a timeout)."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 10:
        if isinstance(current, ConnectionRefusedError):
            return "refused"
        if isinstance(current, socket.gaierror):
            return "dns"
        if isinstance(current, ssl.SSLError) or type(current).__name__ in (
            "ClientConnectorCertificateError",
            "ClientSSLError",
            "ClientConnectorSSLError",
        ):
            return "tls"
        current = current.__cause__ or current.__context__
        seen += 1
    current, seen = exc, 0
    while current is not None and seen < 10:
        if isinstance(current, OSError) and not isinstance(current, TimeoutError):
            return "unreachable"
        current = current.__cause__ or current.__context__
        seen += 1
    return "timeout"


def _status_detail(exc: openai.APIStatusError) -> str:
    """The model's own words for a non-2xx answer (for the log, redacted)."""
    body: Any = exc.body
    detail = None
    if isinstance(body, dict):
        error = body.get("error", body)
        detail = error.get("message") if isinstance(error, dict) else error
    return str(detail or exc.message)


def _status_message(what: str, status: int) -> str:
    """What a user is told of a non-2xx answer: what it means, never the model's own
    text (which may quote the key it refused)."""
    if status in (401, 403):
        return f"the {what} refused the server's API key ({status})"
    if status == 404:
        return f"the {what} does not know the model asked for, or its address is wrong (404)"
    if status == 429:
        return f"the {what} is rate limiting this server; try again shortly (429)"
    if status == 400:
        return f"the {what} refused the request (400)"
    if status >= 500:
        return f"the {what} failed ({status}); try again shortly"
    return f"the {what} answered {status}"


#: what looks like a key or a token in a model's error text
_SECRET = re.compile(
    r"sk-[^\s,;'\"]*|(key-|Bearer\s+)?[A-Za-z0-9_\-]{20,}|[A-Za-z0-9]{0,8}\*{3,}[A-Za-z0-9]{0,8}"
)


#: what a provider's error quotes (a moderation refusal may quote the prompt)
_QUOTED = re.compile(r"\"[^\"]*\"|“[^”]*”|‘[^’]*’|`[^`]*`|(?<![A-Za-z])'[^']*'")


def redact(text: str) -> str:
    """A model's error text for the log: without what could be a key ("sk-…abcd"
    included) and without what it quotes (a refusal may quote the user's prompt),
    cut to 200 characters."""
    return _SECRET.sub("[redacted]", _QUOTED.sub("“…”", text))[:200]


def _retry_after(exc: openai.APIStatusError) -> float:
    value = exc.response.headers.get("retry-after", "")
    try:
        seconds = float(value)
    except ValueError:
        seconds = 1.0
    return min(max(seconds, 0.0), RETRY_AFTER_CAP)


def _is_transport_error(exc: BaseException) -> bool:
    # the SDK's HTTP layer raises its own transport errors (RemoteProtocolError,
    # ReadError, ...) while a streamed body is read; they all end in "Error" and
    # live in the transport package, which we do not import by name
    module = type(exc).__module__ or ""
    return module.startswith(("httpx", "httpcore", "h11", "anyio", "aiohttp"))


class ThinkSplitter:
    """Splits `<think>…</think>` out of content chunks, tags cut across chunks included.

    Some templates (DeepSeek-R1's, served by llama.cpp or vLLM; Qwen3's thinking
    models) leave the opening tag out: the content begins with reasoning and has a
    lone `</think>`. With `assume_open` (a model known to do so) the content starts as
    reasoning, and turns out to have been the answer only if no `</think>` comes.
    Without it, nothing is held back — a chunk costs what it did — so the reasoning
    before a lone `</think>` has already gone out as text when the tag comes: the tag
    is taken out of the text and reported (`lone_close`), and the caller remembers the
    model so that its next answers are split from their start. (Holding back every
    answer's text until it is known to be no reasoning would hold back whole answers
    of every model that never reasons.) A model that sends its reasoning apart
    (`reasoning_content`) is not assumed anything of (`reasoning_apart`)."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, *, assume_open: bool = False) -> None:
        self.inside = assume_open
        self.assumed = assume_open
        self.tagged = False  # a tag was seen
        self.lone_close = False
        self._pending = ""
        self._assumed_text: list[str] = []

    def reasoning_apart(self) -> None:
        if self.assumed and not self.tagged and not self._assumed_text:
            self.inside = self.assumed = False

    def feed(self, text: str) -> list[Delta]:
        if not self._pending and "<" not in text:  # the common case: nothing to look at
            if self.assumed and not self.tagged:
                self._assumed_text.append(text)
            return [Delta("reasoning" if self.inside else "content", text)]
        text = self._pending + text
        self._pending = ""
        out: list[Delta] = []
        while text:
            if self.assumed and not self.tagged and text.lstrip().startswith(self.OPEN):
                text = text.lstrip()[len(self.OPEN) :]  # it was not left out after all
                self.tagged = True
                continue
            tags = [self.CLOSE] if self.inside else [self.OPEN]
            if not self.inside and not self.tagged:
                tags.append(self.CLOSE)  # a lone closing tag
            found = min(((text.find(t), t) for t in tags if t in text), default=None)
            if found is not None:
                index, tag = found
                if index:
                    out.append(Delta("reasoning" if self.inside else "content", text[:index]))
                if tag == self.CLOSE and not self.inside:
                    self.lone_close = True
                else:
                    self.inside = not self.inside
                self.tagged = True
                text = text[index + len(tag) :]
                continue
            if self.assumed and not self.tagged and not self._assumed_text:
                tags.append(self.OPEN)  # the tag may come after all, cut across chunks
            keep = max(_partial_suffix(text, t) for t in tags)
            if keep:
                self._pending = text[-keep:]
                text = text[:-keep]
            if text:
                if self.assumed and not self.tagged:
                    self._assumed_text.append(text)
                out.append(Delta("reasoning" if self.inside else "content", text))
            break
        return out

    def flush(self) -> list[Delta]:
        pending, self._pending = self._pending, ""
        out = [Delta("reasoning" if self.inside else "content", pending)] if pending else []
        if self.assumed and not self.tagged:
            # no `</think>` came: what was taken for reasoning was the answer
            out.append(Delta("content", "".join(self._assumed_text) + pending))
        return out


#: model names whose template is known to leave the opening `<think>` out
OPEN_LEFT_OUT = re.compile(r"(?i)(^|[^a-z0-9])(r1|qwq)([^a-z0-9]|$)|deepseek-r1|thinking")
#: model names that say they reason (their reasoning counts against `max_tokens`)
REASONING = re.compile(rf"(?i){OPEN_LEFT_OUT.pattern[4:]}|reason|think")
#: what a reasoning model is given beyond a short call's `max_tokens`, for its reasoning
REASONING_TOKENS = 4096


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    start = text.rfind("<", max(0, len(text) - len(tag) + 1))
    if start < 0:
        return 0
    tail = text[start:]
    return len(tail) if tag.startswith(tail) else 0


def tokens_in(text: str) -> int:
    """A cautious count of the tokens `text` makes for a model: three ASCII characters
    a token, and every other character one (Chinese, Japanese or Korean text is about
    a token a character in most tokenizers, often less; prose in English about four
    characters a token). Not on the per-token path: for prompts and their parts."""
    if text.isascii():
        return (len(text) + 2) // 3
    ascii_chars = len(text.encode("ascii", "ignore"))
    return (ascii_chars + 2) // 3 + len(text) - ascii_chars


def cut_to_tokens(text: str, tokens: int) -> str:
    """The longest start of `text` within `tokens` (`tokens_in`)."""
    if tokens <= 0:
        return ""
    if tokens_in(text) <= tokens:
        return text
    low, high = tokens, min(len(text), tokens * 3)  # a character is a third of a token or more
    while low < high:
        middle = (low + high + 1) // 2
        if tokens_in(text[:middle]) <= tokens:
            low = middle
        else:
            high = middle - 1
    return text[:low]


def split_think(text: str) -> tuple[str, str, bool]:
    """A whole completion's (reasoning, text, whether its `</think>` was lone). Whole,
    it can be split as a stream cannot: a lone `</think>` (its opening tag left out)
    means that everything up to the last one is reasoning."""
    close = text.rfind(ThinkSplitter.CLOSE)
    if close >= 0:
        first = text.find(ThinkSplitter.CLOSE)
        if ThinkSplitter.OPEN not in text[:first]:
            return text[:close], text[close + len(ThinkSplitter.CLOSE) :], True
    splitter = ThinkSplitter()
    parts = splitter.feed(text) + splitter.flush()
    return (
        "".join(d.text for d in parts if d.kind == "reasoning"),
        "".join(d.text for d in parts if d.kind == "content"),
        False,
    )


def strip_think(text: str) -> str:
    """A whole completion without its reasoning (for small-model answers)."""
    return split_think(text)[1]
