"""What answers, whatever the provider: the one interface the chat service sees
(`ChatModel`), which the OpenAI-compatible client, the Anthropic client and the demo
model implement."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict, Unpack

from .wire import Delta, Message, Sink, Tool, ToolMessage, ToolTurn

#: the seconds a short call may take in all, unless it says
SHORT_TIMEOUT = 60.0


class Short(TypedDict, total=False):
    """What a short call (`ChatModel.complete`) may say besides its messages."""

    #: the model that answers (the small model when absent or None)
    model: str | None
    #: at most this many tokens of answer (the model's own limit when absent or None)
    max_tokens: int | None
    #: the seconds it may take in all (`SHORT_TIMEOUT` when absent)
    timeout: float


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
        self, messages: Sequence[Message], sink: Sink, *, model: str | None = None
    ) -> None:
        """What `stream` yields, handed to `sink` as it comes; returns at the end.
        Cancelling is safe (it closes the stream). A model that can hand deltas on
        for less than a task's step a token (`LLMClient`) has its own."""
        async for delta in self.stream(messages, model=model):
            sink(delta)

    async def complete(self, messages: Sequence[Message], **call: Unpack[Short]) -> str: ...

    async def tool_turn(
        self, messages: Sequence[ToolMessage], tools: Sequence[Tool], *, model: str | None = None
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
