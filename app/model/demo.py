"""A built-in demo model, for trying the server with no account anywhere
(`python -m app --demo`, or `llm.base_url = "demo"`; `app.search.demo` is its web).

The demo model is no model: it makes its answers up from what it is given. It
streams at a person's reading pace, reasons first, answers from the sources in
its prompt citing them as `[N]`, and writes titles, follow-up questions and
standalone questions that read like them — enough for the web client, the
Perplexica UI, stop and resume to be tried by hand. Everything it writes says it
is a demo.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Sequence
from typing import Unpack
from urllib.parse import parse_qs, urlsplit

import orjson

from ..prompts import Prompts
from .base import ChatModel, Short, Traits
from .errors import ToolsUnsupported
from .wire import Delta, Message, Tool, ToolMessage, ToolTurn

DEMO = "demo"
#: seconds between two pieces of a streamed answer (about 25 words a second)
PACE = 0.04
_SOURCE = re.compile(r"^source (\d+) (\S+) (.*)$", re.MULTILINE)
_WORDS = re.compile(r"\S+\s*")


def is_demo(base_url: str) -> bool:
    """Whether `llm.base_url` names the demo model (`demo`, or `demo://?pace=0.01`)."""
    return base_url == DEMO or base_url.startswith(DEMO + "://")


class DemoModel(ChatModel):
    """Answers as a model would, without one (see the module docstring)."""

    configured = True

    def __init__(self, prompts: Prompts, base_url: str = DEMO) -> None:
        self.prompts = prompts
        query = parse_qs(urlsplit(base_url).query)
        self.pace = float(query.get("pace", [PACE])[0])

    async def aclose(self) -> None:
        return None

    async def probe(self) -> str | None:
        return None

    def traits(self, model: str) -> Traits:
        """It reasons, and takes no tools (it plans in JSON)."""
        return Traits(tools=False, reasoning=True)

    async def stream(
        self, messages: Sequence[Message], *, model: str | None = None
    ) -> AsyncIterator[Delta]:
        """The answer, a few words at a time at `pace`: reasoning first, then text
        that cites the sources of the system prompt."""
        system = next((m["content"] for m in messages if m["role"] == "system"), "")
        question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        sources = [(int(n), url, text) for n, url, text in _SOURCE.findall(system)]
        reasoning = (
            f"The question is “{_short(question, 80)}”. "
            + (
                f"There are {len(sources)} sources to go on; I will cite them as I use them. "
                if sources
                else "There are no sources to go on, so I answer in general terms. "
            )
            + "(This is the demo model: it makes its answers up.)"
        )
        for piece in _WORDS.findall(reasoning):
            yield Delta("reasoning", piece)
            await asyncio.sleep(self.pace)
        for piece in _WORDS.findall(_answer(question, sources)):
            yield Delta("content", piece)
            await asyncio.sleep(self.pace)

    async def tool_turn(
        self, messages: Sequence[ToolMessage], tools: Sequence[Tool], *, model: str | None = None
    ) -> ToolTurn:
        """The demo model has no tool calling: it plans in JSON (as such models do)."""
        raise ToolsUnsupported("the demo model does not take tools")

    async def complete(self, messages: Sequence[Message], **call: Unpack[Short]) -> str:
        """What the small model would write for the prompt it was given (a title,
        follow-up questions, a standalone question, a research plan, a choice of
        results), told apart by which of the server's prompts it is."""
        text = messages[-1]["content"] if messages else ""
        kind = self.prompts.which(text)
        question = _field(text, "Question:") or _field(text, "Follow up question:") or text
        if kind == "title":
            return _title(question)
        if kind == "suggestions":
            topic = topic_of(_last_human(text) or question)
            return "\n".join(
                [
                    f"What are the main alternatives to {topic}?",
                    f"How has {topic} changed in recent years?",
                    f"What are the limits of {topic}?",
                    f"Where can I read more about {topic}?",
                ]
            )
        if kind == "rewrite_question":
            return "not_needed"
        if kind == "classify":
            asked = _field(text, "Latest message:")
            return orjson.dumps(
                {"skipSearch": False, "sources": ["web"], "question": asked}
            ).decode()
        if kind == "planner":
            if "Found so far:\n(nothing yet)" in text:
                query = topic_of(_field(text, "The user's question:"))
                return orjson.dumps(
                    {"calls": [{"tool": "web_search", "args": {"query": query}}]}
                ).decode()
            return '{"done": true}'
        if kind == "web_search_select":
            return "<output>0,1,2</output>"
        await asyncio.sleep(self.pace)
        return "This is the demo model: it makes its answers up."


def _answer(question: str, sources: list[tuple[int, str, str]]) -> str:
    topic = topic_of(question)
    lines = [f"**Demo answer** (made up by the demo model) about {topic}.\n\n"]
    if sources:
        for n, _url, text in sources[:4]:
            lines.append(f"- {_short(_sentence(text), 160)} [{n}]\n")
        lines.append(
            f"\nTaken together, the sources above [1] give a first picture of {topic}. "
            "Connect a real model (`LLM_BASE_URL`, `LLM_API_KEY`) for real answers."
        )
    else:
        lines.append(
            f"A real model would now explain {topic} in a few paragraphs, with "
            "headings and lists where they help. Connect one (`LLM_BASE_URL`, "
            "`LLM_API_KEY`) for real answers."
        )
    return "".join(lines)


def _field(text: str, label: str) -> str:
    """The line after `label` in a rendered prompt ("Question:\\n<the question>")."""
    head, found, rest = text.partition(label)
    if not found:
        return ""
    return rest.strip().splitlines()[0].strip() if rest.strip() else ""


def _last_human(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("human: ")]
    return lines[-1].removeprefix("human: ") if lines else ""


def topic_of(question: str) -> str:
    words = re.sub(r"[?!.]+$", "", question.strip()).split()
    lead = {"what", "who", "how", "why", "when", "where", "which", "is", "are", "does", "do"}
    lead |= {"the", "a", "an", "tell", "me", "about", "explain", "was", "were", "can", "you"}
    while words and words[0].lower() in lead:
        words = words[1:]
    return _short(" ".join(words) or question.strip() or "this", 60)


def _title(question: str) -> str:
    words = topic_of(question).split()[:5]
    return " ".join(words).capitalize() or "Demo chat"


def _sentence(text: str) -> str:
    text = " ".join(text.split())
    end = text.find(". ")
    return text[: end + 1] if 0 < end < 200 else text


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"
