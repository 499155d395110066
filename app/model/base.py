"""What answers, whatever the provider: the one interface the chat service sees
(`ChatModel`), which the OpenAI-compatible client, the Anthropic client and the demo
model implement."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .wire import Delta, Message, ToolTurn


@dataclass(frozen=True, slots=True)
class Traits:
    """What is known of one model (PROTOCOL §13 `tools`, `reasoning`): whether it takes
    tool calls, whether it reasons; None while it is not known (yet)."""

    tools: bool | None = None
    reasoning: bool | None = None


class ChatModel(Protocol):
    """What answers: `LLMClient` (any OpenAI-compatible server), `AnthropicModel` or the
    built-in demo model (`app.model.demo`), chosen by `llm.base_url` (`open_model`) and
    the providers. A class that names it as its base gets its `answer`."""

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
        """What `stream` yields, handed to `sink` as it comes; returns at the end.
        Cancelling is safe (it closes the stream). A model that can hand deltas on
        for less than a task's step a token (`LLMClient`) has its own."""
        async for delta in self.stream(messages, model=model):
            sink(delta)

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

    def traits(self, model: str) -> Traits:
        """What its provider's model list said of `model`, or its answers showed."""
        ...

    async def probe(self) -> str | None:
        """Why the model cannot be used at all (not reachable, its key refused), in
        words for a person; None when it answers."""
        ...

    async def aclose(self) -> None: ...
