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
#: the most each short call may write, in tokens: what its job needs, and no more than
#: a slow local model (25 tokens a second) writes well within its deadline
REWRITE_TOKENS = 80  # one sentence
TITLE_TOKENS = 20  # 3 to 5 words
SUGGESTION_TOKENS = 150  # 4 short questions
#: a rewrite longer than so many times the question (and `REWRITE_MARGIN` characters)
#: is not the question rewritten
REWRITE_TIMES = 3
REWRITE_MARGIN = 80


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
    llm: ChatModel,
    prompts: Prompts,
    question: str,
    history: Sequence[tuple[str, str]],
    *,
    timeout: float = 60.0,
) -> str | None:
    """The standalone form of `question`, or None when it needs none, or when the model
    failed, took longer than `timeout` or wrote something that is no rewrite of it
    (`standalone`)."""
    prompt = prompts.render(
        "rewrite_question", history=format_history(history) or "(none)", question=question
    )
    try:
        text = await llm.complete(
            [{"role": "user", "content": prompt}], max_tokens=REWRITE_TOKENS, timeout=timeout
        )
    except AppError as exc:
        log.info("rewrite skipped: %s", exc.message)
        return None
    text = text.strip().strip("\"'“”").strip()
    if text.lower().strip(" .") == "not_needed":
        return None
    return standalone(prompts, "rewrite_question", text, question)


def standalone(prompts: Prompts, prompt: str, text: str, question: str) -> str | None:
    """`text` as the standalone form of `question` that the model was asked for with
    `prompt`, or None when it cannot be one: empty, the question itself, far longer
    than the question (`REWRITE_TIMES`), or the prompt's own words echoed back."""
    text = text.strip()
    if not text or text == question:
        return None
    if len(text) > REWRITE_TIMES * len(question) + REWRITE_MARGIN or prompts.echoes(prompt, text):
        log.info("the model's rewrite of a question was dropped: it is no rewrite")
        return None
    return text


async def suggest(
    llm: ChatModel, prompts: Prompts, history: Sequence[tuple[str, str]]
) -> list[str]:
    """3 to 5 follow-up questions for a conversation (small model). Raises `AppError`."""
    prompt = prompts.render("suggestions", history=format_history(history[-HISTORY_MESSAGES:]))
    text = await llm.complete([{"role": "user", "content": prompt}], max_tokens=SUGGESTION_TOKENS)
    lines = answer_lines(text)
    return [
        q for q in lines if len(q) <= TITLE_MAX_CHARS * 3 and not prompts.echoes("suggestions", q)
    ][:5]


async def make_title(
    llm: ChatModel, prompts: Prompts, store: Store, chat_id: str, question: str
) -> None:
    """Give a new chat a title written by the small model. The question's first line
    stays the title when the model fails, or writes no title: nothing, more than
    `TITLE_MAX_CHARS`, or the prompt's own words."""
    prompt = prompts.render("title", question=question)
    try:
        title = await llm.complete([{"role": "user", "content": prompt}], max_tokens=TITLE_TOKENS)
    except AppError as exc:
        log.info("title for chat %s not made: %s", chat_id, exc.message)
        return
    title = (answer_lines(title) or [""])[0].strip("\"'“”").strip()
    if not title or len(title) > TITLE_MAX_CHARS or prompts.echoes("title", title):
        log.info("title for chat %s not made: the model wrote no title", chat_id)
        return
    await store.set_title(chat_id, title)
