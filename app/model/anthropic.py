"""Anthropic's Messages API as a `ChatModel`, through the official `anthropic` SDK.

The conversation comes in OpenAI's shape (what the chat service builds for every
model) and goes out in Anthropic's: system messages become `system`, an assistant's
`tool_calls` become `tool_use` blocks and the `tool` messages answering them
`tool_result` blocks of the next user turn. The streamed answer's thinking blocks
are reasoning, its text blocks content; `stop_reason: max_tokens` is
`Delta("finish", "length")`, and the usage is reported in OpenAI's words.

Errors: `ModelError` (CHAT_ERROR) when the API cannot be reached, `StreamError`
(STREAM_ERROR) when it answers non-2xx or breaks off; both name the provider and
the model, never the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Unpack

import orjson

from ..config import LLMSettings
from ..errors import ConfigError, ModelError, StreamError
from .base import SHORT_TIMEOUT, ChatModel, Short, Traits
from .errors import (
    CAUSES,
    ContextTooLong,
    _status_message,
    connection_cause,
    context_exceeded,
    redact,
)
from .wire import Delta, Message, Sink, Tool, ToolCall, ToolMessage, ToolTurn

if TYPE_CHECKING:  # the SDK takes a second to import: only a provider that uses it does
    import anthropic

log = logging.getLogger("app.llm")  # the model's log lines keep one name

PROBE_SECONDS = 10.0


class AnthropicModel(ChatModel):
    """One Anthropic provider; `settings` is `[llm]` with the provider's keys over it
    (its address, key, models, window and output cap), so the timeouts are `[llm]`'s."""

    def __init__(
        self, settings: LLMSettings, provider: str = "anthropic", *, thinking_tokens: int = 0
    ) -> None:
        self.settings = settings
        self.provider = provider
        #: the answers' budget of extended thinking (0: none); the small tasks and the
        #: tool turns never think (a tool turn's thinking would have to be sent back)
        self.thinking_tokens = thinking_tokens
        self._client: anthropic.AsyncAnthropic | None = None
        if settings.api_key:
            import anthropic

            self._client = anthropic.AsyncAnthropic(
                api_key=settings.api_key,
                base_url=settings.base_url or None,
                max_retries=0,
                timeout=anthropic.Timeout(
                    settings.timeout_seconds,
                    connect=settings.connect_timeout_seconds,
                    read=settings.read_timeout_seconds,
                ),
            )

    @property
    def configured(self) -> bool:
        return self._client is not None

    def _require(self) -> anthropic.AsyncAnthropic:
        if self._client is None:
            raise ConfigError(f"provider {self.provider} has no api_key")
        return self._client

    async def stream(
        self, messages: Sequence[Message], *, model: str | None = None
    ) -> AsyncIterator[Delta]:
        """The answer's deltas as they arrive; closing the iterator closes the request."""
        queue: list[Delta] = []
        name = model or self.settings.model
        client = self._require()
        with self._errors(name):
            request = self._request(messages, name)
            if self.thinking_tokens:
                request["thinking"] = {"type": "enabled", "budget_tokens": self.thinking_tokens}
            events = await client.messages.create(**request, stream=True)
            async with events:
                reader = _AnswerReader(queue.append)
                async for event in events:
                    reader.feed(event)
                    for delta in queue:
                        yield delta
                    queue.clear()
        for delta in reader.end():
            yield delta

    async def complete(self, messages: Sequence[Message], **call: Unpack[Short]) -> str:
        """One answer whole (rewrite, title, suggestions): its text blocks."""
        name = call.get("model") or self.settings.effective_small_model
        client = self._require()
        request = self._request(messages, name)
        if max_tokens := call.get("max_tokens"):
            request["max_tokens"] = max_tokens
        with self._errors(name):
            async with asyncio.timeout(call.get("timeout", SHORT_TIMEOUT)):
                message = await client.messages.create(**request)
        return "".join(b.text for b in message.content if b.type == "text").strip()

    async def tool_turn(
        self, messages: Sequence[ToolMessage], tools: Sequence[Tool], *, model: str | None = None
    ) -> ToolTurn:
        """One request with `tools` (OpenAI's function schemas, given as Anthropic
        tools): its text and its `tool_use` blocks as calls."""
        name = model or self.settings.model
        client = self._require()
        request = self._request(messages, name)
        request["tools"] = [
            {
                "name": t["function"]["name"],
                "description": t["function"].get("description", ""),
                "input_schema": t["function"].get("parameters") or {"type": "object"},
            }
            for t in tools
        ]
        with self._errors(name):
            message = await client.messages.create(**request)
        text, calls = [], []
        for block in message.content:
            if block.type == "text":
                text.append(block.text)
            elif block.type == "tool_use":
                arguments = orjson.dumps(block.input).decode()
                calls.append(ToolCall(block.id, block.name, arguments))
        return ToolTurn("".join(text).strip(), tuple(calls))

    async def models(self) -> list[tuple[str, str]]:
        """The provider's models, (id, display name), as its model list gives them."""
        client = self._require()
        found: list[tuple[str, str]] = []
        with self._errors("(model list)"):
            async with asyncio.timeout(PROBE_SECONDS):
                async for info in client.models.list(limit=100):
                    found.append((info.id, info.display_name or info.id))
        return found

    def traits(self, model: str) -> Traits:
        """Every model of the Messages API takes tools; its answers think when it is
        given `thinking_tokens`."""
        return Traits(tools=True, reasoning=True if self.thinking_tokens else None)

    async def probe(self) -> str | None:
        try:
            await self.models()
        except (ModelError, StreamError, ConfigError) as exc:
            return exc.message
        return None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()

    def _request(self, messages: Sequence[Any], model: str) -> dict[str, Any]:
        system, turns = to_anthropic(messages)
        request: dict[str, Any] = {
            "model": model,
            "messages": turns,
            "max_tokens": self.settings.max_output_tokens,
        }
        if system:
            request["system"] = system
        return request

    @contextlib.contextmanager
    def _errors(self, model: str) -> Iterator[None]:
        """The SDK's errors as ours, in words naming the provider and the model (the
        API's own text goes to the log only, redacted: it may quote the prompt)."""
        import anthropic  # imported by now: the client is made only with it

        what = f"model {model} of provider {self.provider}"
        try:
            yield
        except anthropic.APIStatusError as exc:
            detail = redact(str(exc.message))
            log.warning(
                "the %s answered %d",
                what,
                exc.status_code,
                extra={"fields": {"status": exc.status_code, "detail": detail}},
            )
            if exc.status_code in (400, 413) and context_exceeded(str(exc.message)):
                raise ContextTooLong(f"the {what} refused the request as too long") from exc
            raise StreamError(_status_message(what, exc.status_code)) from exc
        except (TimeoutError, anthropic.APITimeoutError, anthropic.APIConnectionError) as exc:
            cause = connection_cause(exc)
            log.warning("cannot reach the %s: %s", what, CAUSES[cause][0])
            raise ModelError(CAUSES[cause][1].format(what=what)) from exc
        except (anthropic.AnthropicError, OSError) as exc:
            log.warning("the %s stream broke: %s", what, type(exc).__name__)
            raise StreamError(f"the {what} stream broke off") from exc


class _AnswerReader:
    """The streamed events of one answer as deltas: thinking → reasoning, text →
    content, the end's usage, and `finish: length` when the output cap cut it."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.input_tokens = 0
        self.output_tokens = 0
        self.stop_reason: str | None = None
        self.received = False

    def feed(self, event: Any) -> None:
        kind = event.type
        if kind == "content_block_delta":
            delta = event.delta
            if delta.type == "text_delta" and delta.text:
                self.sink(Delta("content", delta.text))
            elif delta.type == "thinking_delta" and delta.thinking:
                self.sink(Delta("reasoning", delta.thinking))
        elif kind == "message_start":
            self.received = True
            usage = event.message.usage
            self.input_tokens = usage.input_tokens or 0
            self.output_tokens = usage.output_tokens or 0
        elif kind == "message_delta":
            self.stop_reason = event.delta.stop_reason or self.stop_reason
            if event.usage is not None:
                self.output_tokens = event.usage.output_tokens or self.output_tokens
        elif kind == "ping":
            self.sink(Delta("keepalive"))

    def end(self) -> list[Delta]:
        if not self.received:
            raise StreamError("the model sent an empty answer")
        usage = {
            "prompt_tokens": self.input_tokens,
            "completion_tokens": self.output_tokens,
            "total_tokens": self.input_tokens + self.output_tokens,
        }
        out = [Delta("usage", usage=usage)]
        if self.stop_reason == "max_tokens":
            out.append(Delta("finish", "length"))
        return out


def to_anthropic(messages: Sequence[Any]) -> tuple[str, list[dict[str, Any]]]:
    """OpenAI-shaped messages as Anthropic's `system` and `messages`: system messages
    joined into `system`; an assistant's `tool_calls` as `tool_use` blocks; `tool`
    messages as `tool_result` blocks of a user turn; turns of one role in a row merged
    (the API wants them alternating)."""
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        content = message.get("content") or ""
        if role == "system":
            system.append(content)
            continue
        blocks: list[dict[str, Any]] = []
        if role == "tool":
            role = "user"
            blocks.append(
                {
                    "type": "tool_result",
                    "tool_use_id": message.get("tool_call_id", ""),
                    "content": content or "(nothing)",
                }
            )
        else:
            if content:
                blocks.append({"type": "text", "text": content})
            for call in message.get("tool_calls") or ():
                function = call.get("function", {})
                try:
                    arguments = orjson.loads(function.get("arguments") or "{}")
                except orjson.JSONDecodeError:
                    arguments = {}
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call.get("id", ""),
                        "name": function.get("name", ""),
                        "input": arguments if isinstance(arguments, dict) else {},
                    }
                )
        if role not in ("user", "assistant") or not blocks:
            continue
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    return "\n\n".join(system), turns
