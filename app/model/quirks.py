"""What a model server does differently, read from its answers: where its chat
template wants the instructions (`with_instructions_in_user`, `instructions_uncounted`)
and which parameters it refuses (`refused_parameter`, `without_refused`). Pure
functions: `learned.Learned` keeps what they found per model, for the process.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .errors import context_exceeded
from .tokens import tokens_in

#: where the instructions may go (`llm.system_prompt`)
SYSTEM_PROMPT_PLACES = ("system", "user")
#: how `<think>` tags in an answer's text read (`llm.think_tags`)
THINK_TAGS = ("auto", "paired", "open_left_out")

#: parameters a server may refuse, and what is sent instead (None: nothing) — OpenAI's
#: newer models refuse `max_tokens` and take `max_completion_tokens`
REFUSABLE: dict[str, str | None] = {
    "max_tokens": "max_completion_tokens",
    "response_format": None,
    "tool_choice": None,
    "stream_options": None,
    "parallel_tool_calls": None,
}
_NAMED = {name: re.compile(rf"(?<![\w.]){name}(?!\w)") for name in REFUSABLE}
#: how servers say they do not take a parameter: "Unsupported parameter: 'max_tokens'",
#: "unknown field `stream_options`", "Extra inputs are not permitted", pydantic's
#: "literal_error … Input should be 'text' or 'json_object'"
_REFUSAL = re.compile(
    r"(?i)not supported|unsupported|unknown|unrecogni[sz]ed|not allowed|not permitted"
    r"|extra (?:inputs|fields)|literal_error|validation error|input should be|n't support"
    r"|does not support|not available|invalid"
)

#: the share of the instructions' own estimate (`tokens_in`, a cautious one) under
#: which a count of the whole prompt shows they were left out
UNCOUNTED_SHARE = 0.25
#: instructions shorter than this are not judged (too few tokens to tell)
UNCOUNTED_MIN_TOKENS = 32


def refused_parameter(status: int, detail: str, body: Mapping[str, Any]) -> str | None:
    """The parameter of `body` that a refusal (`status`, the server's words `detail`)
    names as one it does not take; None when it is no such refusal. A request too
    long for the window is not one, though its words may name `max_tokens`."""
    if status not in (400, 422, 500) or context_exceeded(detail) or not _REFUSAL.search(detail):
        return None
    named = []
    for name, pattern in _NAMED.items():
        if name in body and (found := pattern.search(detail)) is not None:
            named.append((found.start(), name))
    return min(named)[1] if named else None


def without_refused(body: dict[str, Any], refused: Iterable[str]) -> dict[str, Any]:
    """`body` without the parameters in `refused` (each renamed to its alternative
    when it has one)."""
    shaped = dict(body)
    for name in refused:
        if name in shaped:
            value = shaped.pop(name)
            alternative = REFUSABLE.get(name)
            if alternative is not None and alternative not in shaped:
                shaped[alternative] = value
    return shaped


def instructions(messages: Sequence[Mapping[str, Any]]) -> str:
    """The text of the system messages, joined."""
    return "\n\n".join(
        str(m.get("content") or "") for m in messages if m.get("role") == "system"
    ).strip()


def with_instructions_in_user(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the system messages' text put at the start of the first user
    message (a chat template that drops system messages keeps it there); a new user
    message when there is none. Messages without a system message come back as they are."""
    text = instructions(messages)
    rest = [dict(m) for m in messages if m.get("role") != "system"]
    if len(rest) == len(messages) or not text:
        return rest
    for message in rest:
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):  # parts: the instructions go first, as text
                message["content"] = [{"type": "text", "text": text}, *content]
            else:
                message["content"] = f"{text}\n\n{content or ''}".rstrip()
            return rest
    return [{"role": "user", "content": text}, *rest]


def instructions_uncounted(usage: Mapping[str, Any] | None, estimate: int) -> bool:
    """Whether a response's `usage` counts clearly fewer prompt tokens than the
    instructions alone were estimated at (`estimate`): the template dropped them."""
    if not usage or estimate < UNCOUNTED_MIN_TOKENS:
        return False
    prompt = usage.get("prompt_tokens")
    return isinstance(prompt, int) and 0 < prompt < estimate * UNCOUNTED_SHARE


def instructions_estimate(messages: Sequence[Mapping[str, Any]]) -> int:
    """What the system messages of `messages` should count, cautiously (`tokens_in`)."""
    return tokens_in(instructions(messages))


#: what a model list's `capabilities` (Ollama's, LM Studio's) names tool calls and thinking by
_TOOL_CAPABILITIES = frozenset({"tools", "tool_use", "function_calling"})
_THINKING_CAPABILITIES = frozenset({"thinking", "reasoning"})
#: OpenRouter's `supported_parameters` that say a model reasons
_REASONING_PARAMETERS = frozenset({"reasoning", "include_reasoning"})


def listed_traits(entry: Mapping[str, Any]) -> tuple[bool | None, bool | None]:
    """What one entry of a server's model list says of the model: (takes tools, reasons),
    each None when it does not say. OpenRouter lists every parameter a model takes
    (`supported_parameters`): what is not there it does not take. A `capabilities` list
    (Ollama's, LM Studio's) names what a model can do, but not every server names tools
    there: only what it names counts."""
    tools: bool | None = None
    reasoning: bool | None = None
    parameters = entry.get("supported_parameters")
    if isinstance(parameters, list):
        tools = "tools" in parameters
        reasoning = not _REASONING_PARAMETERS.isdisjoint(parameters)
    capabilities = entry.get("capabilities")
    if isinstance(capabilities, list):
        if not _TOOL_CAPABILITIES.isdisjoint(capabilities):
            tools = True
        if not _THINKING_CAPABILITIES.isdisjoint(capabilities):
            reasoning = True
    return tools, reasoning
