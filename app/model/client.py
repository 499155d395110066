"""The one place that talks to the model (any OpenAI-compatible `/chat/completions`).

Streaming reads the raw SSE lines of the response and decodes them with
`wire.AnswerDecoder`; the SDK's parsed stream costs several times more CPU per
chunk, and the per-token path decides how many streams a core can carry. The
answer's stream (`stream`, `answer`) is read by `upstream.StreamingClient` when the
model is reached directly (its headers and errors the SDK's), else (a proxy)
through the SDK's client; everything else goes through the SDK.

Errors: `ModelError` (CHAT_ERROR) when the model cannot be reached,
`StreamError` (STREAM_ERROR) when it answers non-2xx or the stream breaks or
carries a malformed chunk, `ConfigError` when no model is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar, Unpack, cast
from urllib.parse import urlsplit

import httpx2
import openai
import orjson

from ..config import LLMSettings
from ..errors import ConfigError, ModelError, StreamError
from .base import SHORT_TIMEOUT, Short, Traits
from .base import ChatModel as ChatModel
from .errors import (
    ContextTooLong,
    NoToolTurn,
    ToolsUnsupported,
    cannot_stream_tools,
    model_errors,
    refuses_tools,
    retry_after,
    stalled,
    status_detail,
)
from .learned import Learned
from .quirks import (
    SYSTEM_PROMPT_PLACES,
    THINK_TAGS,
    instructions_estimate,
    refused_parameter,
    with_instructions_in_user,
    without_refused,
)
from .tokens import REASONING_TOKENS
from .upstream import Redirected, StreamedResponse, StreamingClient, streaming_client, usable_for
from .wire import (
    AnswerDecoder,
    Delta,
    Message,
    Sink,
    Tool,
    ToolCall,
    ToolMessage,
    ToolTurn,
    Verbatim,
    nothing_back,
    split_think,
    tool_delta,
)

log = logging.getLogger("app.llm")  # the model's log lines keep one name


@contextlib.contextmanager
def read_errors(decoder: AnswerDecoder) -> Iterator[None]:
    """What reading an answer's body raises, said as what happened: a read timeout
    (aiohttp's, read straight from it) is a stall; a connection closed before a line of
    the answer came is the empty answer of a prompt longer than the model's window
    (llama-cpp-python's server closes it so, where llama.cpp's sends an empty 200)."""
    try:
        yield
    except TimeoutError as exc:
        raise stalled(exc) from exc
    except ConnectionResetError as exc:
        if decoder.received:  # it broke off mid-answer
            raise
        raise nothing_back() from exc


PROBE_SECONDS = 10.0
#: how long a first answer waits for the model list `probe` is reading
LIST_SECONDS = 2.0

T = TypeVar("T")


class LLMClient:
    """Streams and completes chat requests; one instance per app, closed with `aclose()`."""

    def __init__(self, settings: LLMSettings) -> None:
        self.settings = settings
        self.host = urlsplit(settings.base_url).hostname or ""
        #: what its answers and model lists showed of each model
        self.learned = Learned(settings)
        if settings.system_prompt not in SYSTEM_PROMPT_PLACES:
            raise ConfigError(
                f"llm.system_prompt must be one of {', '.join(SYSTEM_PROMPT_PLACES)},"
                f" not {settings.system_prompt!r}"
            )
        if settings.think_tags not in THINK_TAGS:
            raise ConfigError(
                f"llm.think_tags must be one of {', '.join(THINK_TAGS)},"
                f" not {settings.think_tags!r}"
            )
        #: the model list being read by `probe` (an answer that starts meanwhile waits)
        self._listing: asyncio.Future[None] | None = None
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
        if self._listing is not None and not self._listing.done():
            await self._listed()
        out: list[Delta] = []
        watched = self.learned.watch_count(name, messages, out.append)
        decoder = AnswerDecoder(watched, self.learned.splitter(name))
        with model_errors("model", self.host):
            async with self._open_stream(client, self._answer_body(messages, name)) as response:
                chunks = body_reader(response)
                with read_errors(decoder):
                    async for data in chunks:
                        try:
                            done = decoder.feed(data)
                        except StreamError:
                            for delta in out + decoder.splitter.release():  # what came before
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
        ended = decoder.end()
        self.learned.answered(name, decoder)
        for delta in ended:
            yield delta

    async def answer(
        self, messages: Sequence[Message], sink: Sink, *, model: str | None = None
    ) -> None:
        """The answer's deltas handed to `sink` as they arrive; returns at its end.

        On a direct connection to the model (`StreamingClient`) the stream is parsed,
        and `sink` called, in the callback that read it from the socket — no task is
        woken per token; otherwise the deltas come as `stream` yields them. What
        `sink` raises ends the stream with it. Cancelling is safe: it closes the
        upstream response, as closing `stream` does."""
        client = self._require()
        name = model or self.settings.model
        if self._listing is not None and not self._listing.done():
            await self._listed()
        decoder = AnswerDecoder(
            self.learned.watch_count(name, messages, sink), self.learned.splitter(name)
        )
        try:
            await self._read(client, self._answer_body(messages, name), decoder)
        except BaseException:  # cancelled or broken: what was held back is saved as answer
            for delta in decoder.splitter.release():
                sink(delta)
            raise
        ended = decoder.end()
        self.learned.answered(name, decoder)
        for delta in ended:
            sink(delta)

    async def _read(
        self, client: openai.AsyncOpenAI, body: dict[str, Any], decoder: AnswerDecoder
    ) -> None:
        """The streamed answer to `body`, fed to `decoder` to its end. On a direct
        connection (`StreamingClient`) it is fed in the callback that read it from the
        socket. Cancelling is safe: it closes the upstream response."""
        with model_errors("model", self.host):
            async with self._open_stream(client, body) as response:
                with read_errors(decoder):
                    if isinstance(response, StreamedResponse):
                        await response.pump(decoder.feed)
                    else:
                        async for data in body_reader(response):
                            if decoder.feed(data):
                                break

    async def _listed(self) -> None:
        """Wait for the model list `probe` is reading, at most `LIST_SECONDS` (a
        first answer that starts with the server)."""
        if self._listing is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LIST_SECONDS):
                    await asyncio.shield(self._listing)

    def traits(self, model: str) -> Traits:
        """What its model list said of `model`, or its answers showed (`Learned.traits`)."""
        return self.learned.traits(model)

    def _answer_body(self, messages: Sequence[Message], name: str) -> dict[str, Any]:
        """An answer's request: streamed, its usage asked for, at most
        `llm.max_output_tokens` long (a model that never stops is cut there)."""
        body: dict[str, Any] = {
            "model": name,
            "messages": list(messages),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.settings.max_output_tokens > 0:
            body["max_tokens"] = self.settings.max_output_tokens
        return body

    @contextlib.asynccontextmanager
    async def _open_stream(
        self, client: openai.AsyncOpenAI, body: dict[str, Any]
    ) -> AsyncIterator[Any]:
        """The streamed response to `body`, opened (shaped for its model by `_send`); a
        429 is retried once (after its Retry-After, at most `RETRY_AFTER_CAP` seconds) —
        only here, before the first token."""
        post = functools.partial(self._post_streamed, client)
        for attempt in range(2):
            try:
                response = await self._send(body["model"], body, post)
                try:
                    yield response
                finally:
                    await response.aclose()
                return
            except openai.RateLimitError as exc:
                if attempt:
                    raise
                await asyncio.sleep(retry_after(exc))

    async def _post_streamed(
        self, client: openai.AsyncOpenAI, body: dict[str, Any]
    ) -> StreamedResponse | httpx2.Response:
        try:
            if self._streaming is None:
                raise Redirected
            return await self._streaming.post("/chat/completions", orjson.dumps(body))
        except Redirected:  # a redirect is the SDK's to follow, as before
            return await _post_chat(client, body, stream=True)

    async def _send(
        self, name: str, body: dict[str, Any], post: Callable[[dict[str, Any]], Awaitable[T]]
    ) -> T:
        """`post(body)`, `body` shaped for the model `name`: its instructions where
        `llm.system_prompt` puts them, without the parameters its server was seen to
        refuse. A request refused for a parameter (`quirks.refused_parameter`) is sent
        once more without it, and the parameter is never sent to that model again.
        Raises what `post` raises."""
        if self.settings.system_prompt == "user":
            body = {**body, "messages": with_instructions_in_user(body["messages"])}
        refused = self.learned.refused.get(name, set())
        shaped = without_refused(body, refused) if refused else body
        try:
            return await post(shaped)
        except openai.APIStatusError as exc:
            parameter = refused_parameter(exc.status_code, status_detail(exc), shaped)
            if parameter is None:
                raise
            log.warning(
                "model %s refused the parameter %s: it is not sent to it again", name, parameter
            )
            refused = self.learned.refused.setdefault(name, set())
            refused.add(parameter)
        return await post(without_refused(body, refused))

    async def complete(self, messages: Sequence[Message], **call: Unpack[Short]) -> str:
        """A short answer (classify, rewrite, title, ranking, suggestions, planning), read
        whole: its text, without its reasoning — `<think>…</think>`, or everything up
        to a lone `</think>` (a template that leaves the opening tag out, as `stream`
        splits it). A reasoning model's reasoning counts against `max_tokens`: it is
        given `REASONING_TOKENS` more, so that a short answer is not left empty.

        Streamed, and read to its end: cancelling, or `timeout` passing, closes the
        request at once, and a server that stops when its client goes (llama.cpp's)
        stops working on it — an abandoned call never runs on beside the answer. Nor
        does one past its `max_tokens`: a server that ignores it (and streams a title
        as long as an answer) is read no further than more pieces than that allows,
        each at least a token, and the call ends there, as one cut at `max_tokens`."""
        client = self._require()
        name = call.get("model") or self.settings.effective_small_model
        body: dict[str, Any] = {"model": name, "messages": list(messages), "stream": True}
        most = 0
        if max_tokens := call.get("max_tokens"):
            extra = REASONING_TOKENS if self.learned.reasons(name) else 0
            body["max_tokens"] = most = max_tokens + extra
        parts: list[str] = []
        apart = False
        usage: dict[str, Any] | None = None
        pieces = 0

        def take(delta: Delta) -> None:
            nonlocal apart, usage, pieces
            if decoder.done:
                return  # past `max_tokens`: the rest of the read is not taken
            if delta.kind == "content":
                parts.append(delta.text)
                pieces += 1
            elif delta.kind == "reasoning":
                apart = True
                pieces += 1
            elif delta.kind == "usage":
                usage = delta.usage
            if most and pieces > most:  # the model went on past it: read no more
                decoder.done = True
                decoder.finish = "length"

        decoder = AnswerDecoder(take, Verbatim())
        with model_errors("model", self.host):
            async with asyncio.timeout(call.get("timeout", SHORT_TIMEOUT)):
                await self._read(client, body, decoder)
        decoder.end()
        reasoning, content, lone = split_think("".join(parts))
        whole = decoder.finish == "stop"  # not cut at max_tokens: a lone tag would be in it
        self.learned.learn(name, lone_close=lone, reasoned=apart or bool(reasoning), whole=whole)
        if self.settings.system_prompt == "system" and usage is not None:
            self.learned.check_count(name, usage, instructions_estimate(messages))
        return content.strip()

    async def tool_turn(
        self, messages: Sequence[ToolMessage], tools: Sequence[Tool], *, model: str | None = None
    ) -> ToolTurn:
        """One tool turn (`_tool_turn`); a turn with calls shows that the model takes
        tools, `ToolsUnsupported` that it does not (`traits`)."""
        name = model or self.settings.model
        try:
            turn = await self._tool_turn(messages, tools, name)
        except ToolsUnsupported:
            self.learned.tools[name] = False
            raise
        if turn.calls:
            self.learned.tools[name] = True
        return turn

    async def _tool_turn(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], name: str
    ) -> ToolTurn:
        """Streamed, so that a cancel closes the request at once and a proxy that cuts
        quiet connections never sees one; the calls' pieces (`tool_calls` deltas by
        `index`, several calls in one answer) are put together as they come. A server
        that cannot stream tool calls (an empty answer, a 5xx, a refusal that names
        streaming) is asked once more without streaming, and so from then on for that
        model; when that fails too, or when a refusal names the tools themselves,
        `ToolsUnsupported`."""
        client = self._require()
        body: dict[str, Any] = {
            "model": name,
            "messages": list(messages),
            "tools": list(tools),
            "tool_choice": "auto",
        }
        if self.settings.max_output_tokens > 0:  # a model that never stops is cut there too
            body["max_tokens"] = self.settings.max_output_tokens
        try:
            if name not in self.learned.unstreamed_tools:
                try:
                    with model_errors("model", self.host):
                        content, calls = await self._streamed_tool_turn(client, name, body)
                except StreamError as exc:
                    if not cannot_stream_tools(exc):
                        raise
                    log.info(
                        "model %s cannot stream tool calls: its tool rounds are not streamed",
                        name,
                    )
                    self.learned.unstreamed_tools.add(name)
            if name in self.learned.unstreamed_tools:
                try:
                    with model_errors("model", self.host):
                        content, calls = await self._whole_tool_turn(client, name, body)
                except StreamError as exc:
                    if cannot_stream_tools(exc):  # nor answer them whole
                        raise ToolsUnsupported("the model does not take tools") from exc
                    raise
        except StreamError as exc:
            cause = exc.__cause__
            if (
                isinstance(cause, openai.APIStatusError)
                and not isinstance(exc, ContextTooLong)
                and refuses_tools(cause.status_code, status_detail(cause))
            ):
                raise ToolsUnsupported("the model does not take tools") from exc
            raise
        reasoning, text, lone = split_think("".join(content))
        self.learned.learn(name, lone_close=lone, reasoned=bool(reasoning))
        # every call has an id, unique in its turn: the tool answers sent back name it
        made, seen = [], set()
        for index, (call_id, function, arguments) in sorted(calls.items()):
            call_id = call_id if call_id and call_id not in seen else f"call-{index}"
            seen.add(call_id)
            made.append(ToolCall(call_id, function, arguments))
        return ToolTurn(text.strip(), tuple(made))

    async def _streamed_tool_turn(
        self, client: openai.AsyncOpenAI, name: str, body: dict[str, Any]
    ) -> tuple[list[str], dict[int, list[str]]]:
        """The text and calls (index → [id, name, arguments]) of a streamed tool turn,
        read as the answer's stream is (a connection its server closed after an empty
        answer is not taken again for the next request); `NoToolTurn` when the stream
        held no chunk at all."""
        post = functools.partial(self._post_streamed, client)
        response = await self._send(name, {**body, "stream": True}, post)
        content: list[str] = []
        calls: dict[int, list[str]] = {}
        received = False
        try:
            buffer = b""
            async for data in body_reader(response):
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.startswith(b"data:"):
                        received = True
                        if line[5:].strip() != b"[DONE]":
                            tool_delta(line[5:].strip(), content, calls)
        finally:
            await response.aclose()
        if not received:
            raise NoToolTurn("the model sent an empty answer to a request with tools")
        return content, calls

    async def _whole_tool_turn(
        self, client: openai.AsyncOpenAI, name: str, body: dict[str, Any]
    ) -> tuple[list[str], dict[int, list[str]]]:
        """The text and calls of a tool turn asked for without streaming; `NoToolTurn`
        when the answer holds no message."""
        post = functools.partial(_post_chat, client, stream=False)
        response = await self._send(name, body, post)
        try:
            raw = await response.aread()
        finally:
            await response.aclose()
        try:
            answer = orjson.loads(raw)
            message = answer["choices"][0]["message"]
            calls = {
                i: [
                    str(call.get("id") or ""),
                    str(call["function"].get("name") or ""),
                    call["function"].get("arguments") or "",
                ]
                for i, call in enumerate(message.get("tool_calls") or ())
            }
            content = [message.get("content") or ""]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise NoToolTurn("the model's answer to a request with tools has no message") from exc
        if self.settings.system_prompt == "system":
            self.learned.check_count(
                name, answer.get("usage"), instructions_estimate(body["messages"])
            )
        for i, parts in calls.items():
            if not isinstance(parts[2], str):  # arguments sent as an object, not as JSON text
                calls[i][2] = orjson.dumps(parts[2]).decode()
        return content, calls

    async def probe(self) -> str | None:
        """Ask the model server for its models (`GET /models`): any answer but a
        refused key means it can be reached (some servers have no such route). What
        the list says of a model is learned (`Learned.learn_listed_body`); an answer that starts
        while it is read waits for it (`_listed`)."""
        client = self._require()
        self._listing = listing = asyncio.get_running_loop().create_future()
        try:
            with model_errors("model", self.host):
                try:
                    async with asyncio.timeout(PROBE_SECONDS):
                        listed = await client.get("/models", cast_to=httpx2.Response)
                        self.learned.learn_listed_body(await listed.aread())
                except openai.APIStatusError as exc:  # it answered: only a key refused counts
                    if exc.status_code not in (401, 403):
                        return None
                    raise
        except (ModelError, StreamError) as exc:
            return exc.message
        finally:
            if not listing.done():
                listing.set_result(None)
        return None

    async def aclose(self) -> None:
        if self._streaming is not None:
            await self._streaming.aclose()
        if self._client is not None:
            await self._client.close()


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
