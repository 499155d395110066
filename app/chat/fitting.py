"""What fits an answer's prompt and its events: sources, history and event lists cut
to a budget of tokens or characters, and the words for a prompt the model's window
would not take. Pure functions: no I/O."""

from __future__ import annotations

import logging
from dataclasses import replace

import orjson

from ..errors import StreamError
from ..model import ContextTooLong, cut_to_tokens, tokens_in
from ..results import SearchResult
from ..search.web import CONTEXT_CHARS_PER_SOURCE, SNIPPET_CHARS
from .tools import source_key

log = logging.getLogger("app.chat")

#: tokens a message costs beyond its text (its role and separators), and a source its line
MESSAGE_TOKENS = 8
SOURCE_LINE_TOKENS = 20
#: a source cut shorter than this is left out (the window is full)
MIN_SOURCE_TOKENS = 50


def too_long(exc: ContextTooLong, sent: int) -> StreamError:
    """The error of a prompt the model would not take, in words that name its window."""
    window = f"its window is {exc.window} tokens" if exc.window else "its window is smaller"
    log.info("the prompt (about %d tokens) does not fit the model's context window", sent)
    return StreamError(
        f"the prompt (about {sent} tokens, the question and its sources) is longer than the"
        f" model's context window ({window}): ask a shorter question, or set"
        " llm.context_tokens to the model's window"
    )


def estimate_tokens(chars: int) -> int:
    """Tokens in so many characters of text, roughly (for a model that does not count)."""
    return (chars + 3) // 4


def fit_sources(
    results: list[SearchResult], room: int, chars: int = CONTEXT_CHARS_PER_SOURCE
) -> list[SearchResult]:
    """The sources, in order, within `room` tokens (`tokens_in`) of context: each at
    most `chars` characters; the one that does not fit is cut, and the rest left out
    (a pasted page, first, stays while there is any room worth the name)."""
    kept: list[SearchResult] = []
    for r in results:
        room -= SOURCE_LINE_TOKENS  # its "source N <url>" line
        if room < MIN_SOURCE_TOKENS:
            break
        text = r.text[:chars]
        cost = tokens_in(text)
        if cost > room:
            text = cut_to_tokens(text, room)
            cost = tokens_in(text)
        room -= cost
        kept.append(r if text == r.text else replace(r, content=text))
    return kept


def fit_history(
    history: list[tuple[str, str]], system: str, question: str, room: int
) -> list[tuple[str, str]]:
    """The latest turns that fit beside the prompt and the question, in `room` tokens."""
    room -= tokens_in(system) + tokens_in(question) + 2 * MESSAGE_TOKENS
    kept: list[tuple[str, str]] = []
    for role, text in reversed(history):
        room -= tokens_in(text) + MESSAGE_TOKENS
        if room < 0:
            break
        kept.append((role, text))
    return kept[::-1]


def unique(results: list[SearchResult]) -> list[SearchResult]:
    """The sources without repeats (`source_key`), the first of each kept."""
    seen: set[str] = set()
    out = []
    for r in results:
        key = source_key(r)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def text_chars(limit: int) -> int:
    """The most characters of text one event may carry within `limit` bytes: at most
    six bytes a character in JSON, and half the limit left for what is around it (an
    OpenAI chunk repeats the sources' citations)."""
    return max(64, (limit // 2 - 1024) // 6)


def fit_event(entries: list[dict[str, object]], limit: int) -> list[dict[str, object]]:
    """Sources whose event stays under `limit` bytes: passages shortened, then the last
    sources left out (the answer's context is not affected: only what is sent)."""
    budget = limit - 2048  # the event's other fields and the "All Sources" entry
    size = len(orjson.dumps(entries))
    if size <= budget:
        return entries
    cut = [
        {**e, "pageContent": str(e.get("pageContent", ""))[: SNIPPET_CHARS // 2]} for e in entries
    ]
    while cut and len(orjson.dumps(cut)) > budget:
        cut.pop()
    return cut
