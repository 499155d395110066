"""A chat's conversation: its stored turns, the standalone form of a follow-up
question, and its title — what the service and its generations both need."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..errors import AppError
from ..model import ChatModel
from ..prompts import Prompts, answer_lines
from ..store import Store

log = logging.getLogger("app.chat")

HISTORY_MESSAGES = 20
#: what a small-model prompt (classifier, rewrite, suggestions) holds of a conversation
HISTORY_CHARS = 6000
TURN_CHARS = 2000  # of each turn in it
TITLE_MAX_CHARS = 80


async def stored_history(
    store: Store, chat_id: str, before: str | None = None
) -> list[tuple[str, str]]:
    """The chat's last turns as (role, text), up to the message `before` (excluded)."""
    pairs = []
    for m in await store.list_messages(chat_id):
        if m.id == before:
            break
        if m.content and (m.role == "user" or m.status in ("completed", "cancelled")):
            pairs.append((m.role, m.content))
    return pairs[-HISTORY_MESSAGES:]


def format_history(history: Sequence[tuple[str, str]], chars: int = HISTORY_CHARS) -> str:
    """The conversation as lines for a small-model prompt: its latest turns within
    `chars` characters, each cut to `TURN_CHARS` (a pasted document in an earlier turn
    does not make every later classifier call long and slow)."""
    lines: list[str] = []
    for role, text in reversed(history):
        who = "human" if role == "user" else "assistant"
        line = f"{who}: {text[:TURN_CHARS]}{'…' if len(text) > TURN_CHARS else ''}"
        chars -= len(line) + 1
        if chars < 0:
            break
        lines.append(line)
    return "\n".join(reversed(lines))


async def rewrite(
    llm: ChatModel, prompts: Prompts, question: str, history: Sequence[tuple[str, str]]
) -> str | None:
    """The standalone form of `question`, or None when it needs none (or the model failed)."""
    prompt = prompts.render(
        "rewrite_question", history=format_history(history) or "(none)", question=question
    )
    try:
        text = await llm.complete([{"role": "user", "content": prompt}], max_tokens=200)
    except AppError as exc:
        log.info("rewrite skipped: %s", exc.message)
        return None
    text = text.strip().strip("\"'“”").strip()
    if not text or text.lower().strip(" .") == "not_needed" or text == question:
        return None
    return text


async def suggest(
    llm: ChatModel, prompts: Prompts, history: Sequence[tuple[str, str]]
) -> list[str]:
    """3 to 5 follow-up questions for a conversation (small model). Raises `AppError`."""
    prompt = prompts.render("suggestions", history=format_history(history[-HISTORY_MESSAGES:]))
    text = await llm.complete([{"role": "user", "content": prompt}])
    return answer_lines(text)[:5]


async def make_title(
    llm: ChatModel, prompts: Prompts, store: Store, chat_id: str, question: str
) -> None:
    """Give a new chat a title written by the small model (its first line stays the
    title when the model fails)."""
    prompt = prompts.render("title", question=question)
    try:
        title = await llm.complete([{"role": "user", "content": prompt}], max_tokens=30)
    except AppError as exc:
        log.info("title for chat %s not made: %s", chat_id, exc.message)
        return
    title = (answer_lines(title) or [""])[0].strip("\"'“”")
    if title:
        await store.set_title(chat_id, title[:TITLE_MAX_CHARS])
