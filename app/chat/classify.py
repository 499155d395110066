"""Before any search: whether to search at all, which sources fit, the standalone form
of a follow-up, and the URLs the user pasted — one small-model call, in JSON.

The answer is parsed tolerantly (a well-kept JSON-repair library: fenced, trailing
commas, unquoted keys, text around it). A model that answers anything but the JSON
asked for — plain text, most often its prompt continued — decided nothing: the safe
default holds, and the question stays as asked. So it does on any failure, past
`research.classify_seconds`, and for a standalone question that is no rewrite of the
user's (`history.standalone`: far longer, or the prompt's own words). The call is
capped at `CLASSIFY_TOKENS`, which a slow local model writes within the deadline. A short message with no
conversation is not worth a model call: a greeting is told by its words, pasted URLs
by their shape.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import json_repair

from ..errors import AppError
from ..model import ChatModel
from ..prompts import Prompts
from ..protocol import SOURCE_KINDS
from .history import format_history, standalone

log = logging.getLogger("app.chat")

__all__ = ["SOURCE_KINDS", "Decision", "classify", "heuristic", "parse_decision"]

#: a question this long, or with a conversation before it, is worth the model's look
CLASSIFY_MIN_CHARS = 30
#: the most the decision may be, in tokens (its JSON, with a rewritten question)
CLASSIFY_TOKENS = 150
MAX_URLS = 3

_URL = re.compile(r"https?://[^\s<>\"'`)\]]+", re.IGNORECASE)
_GREETING = re.compile(
    r"^\s*(hi|hello|hey|thanks|thank you|thx|good (morning|afternoon|evening|night)|"
    r"bonjour|hola|hallo|ciao|你好|谢谢)\b[\s!.,?]*$",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class Decision:
    """What the classifier decided (or the safe default)."""

    question: str
    skip_search: bool = False
    sources: tuple[str, ...] = ("web",)
    urls: tuple[str, ...] = ()
    #: whether the model was asked (else a heuristic or the default decided)
    asked: bool = False
    rewritten: bool = False

    def step(self) -> dict[str, Any]:
        return {"skipSearch": self.skip_search, "sources": list(self.sources)}


def pasted_urls(text: str) -> tuple[str, ...]:
    found = [url.rstrip(".,;:!?") for url in _URL.findall(text)]
    return tuple(dict.fromkeys(found))[:MAX_URLS]


def heuristic(question: str, allowed: Sequence[str]) -> Decision:
    """Without the model: a greeting needs no search; anything else searches what is allowed."""
    urls = pasted_urls(question)
    if _GREETING.match(question) and not urls:
        return Decision(question, skip_search=True, sources=())
    return Decision(question, sources=default_sources(allowed), urls=urls)


def default_sources(allowed: Sequence[str]) -> tuple[str, ...]:
    kinds = tuple(k for k in allowed if k in ("web", "files"))
    return kinds or tuple(allowed[:1])


async def classify(
    llm: ChatModel,
    prompts: Prompts,
    question: str,
    history: Sequence[tuple[str, str]],
    allowed: Sequence[str],
    *,
    timeout: float,
) -> Decision:
    """The decision for `question` within what `allowed` permits; never raises."""
    safe = heuristic(question, allowed)
    if safe.skip_search:
        return safe
    prompt = prompts.render(
        "classify",
        allowed=", ".join(f'"{k}"' for k in allowed),
        history=format_history(history) or "(none)",
        question=question,
    )
    try:
        async with asyncio.timeout(timeout):
            text = await llm.complete(
                [{"role": "user", "content": prompt}], max_tokens=CLASSIFY_TOKENS, timeout=timeout
            )
    except (AppError, TimeoutError) as exc:
        log.info("classifier skipped: %s", getattr(exc, "message", "timeout"))
        return safe
    return parse_decision(text, question, allowed, safe, prompts)


def parse_decision(
    text: str, question: str, allowed: Sequence[str], safe: Decision, prompts: Prompts
) -> Decision:
    """The model's answer as a decision; what is not the JSON asked for keeps the safe
    default, and a `question` in it that is no rewrite of `question` keeps it as asked."""
    text = text.strip()
    parsed: Any = json_repair.loads(text) if "{" in text else None
    if not isinstance(parsed, dict):
        log.info("the classifier answered no decision: the question stands as asked")
        return safe
    written = parsed.get("question")
    rewritten = (
        standalone(prompts, "classify", written, question) if isinstance(written, str) else None
    )
    standalone_question = rewritten or question
    kinds = parsed.get("sources")
    sources = (
        tuple(dict.fromkeys(k for k in kinds if isinstance(k, str) and k in allowed))
        if isinstance(kinds, list)
        else ()
    )
    urls = parsed.get("urls")
    found = (
        tuple(u for u in urls if isinstance(u, str) and _URL.fullmatch(u))
        if isinstance(urls, list)
        else ()
    )
    skip = parsed.get("skipSearch") is True
    pasted = tuple(u for u in found if u in question) or safe.urls  # only what was pasted
    if skip and pasted:
        skip = False  # a pasted page is read whatever the model thought
    return Decision(
        standalone_question,
        skip_search=skip,
        sources=() if skip else (sources or safe.sources),
        urls=pasted[:MAX_URLS],
        asked=True,
        rewritten=standalone_question != question,
    )
