"""Prompts: one file per prompt in `prompts/`, loaded once, rendered with named placeholders."""

from __future__ import annotations

import re
from pathlib import Path

from .config import ROOT

NAMES = (
    "rewrite_question",
    "title",
    "suggestions",
    "web_search_response",
    "web_search_select",
    "deepseek",
    "math_assistant",
    "writing_assistant",
    "translator",
    "research_report",
    "academic_search",
    "youtube_search",
    "reddit_search",
    "wolfram_alpha_search",
    "files_response",
    "instructions",
    "classify",
    "researcher",
    "planner",
    "schedule_changed",
)
_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")
_WORD = re.compile(r"\w+")
#: so many of a prompt's own words in a row, in a model's answer, are an echo of it
ECHO_WORDS = 6
#: so many of its first words, beginning an answer, are the prompt's beginning
HEAD_WORDS = 4


class Prompts:
    """All prompts, read at start. A missing file fails the start, not a request."""

    def __init__(self, directory: Path | None = None, names: tuple[str, ...] = NAMES) -> None:
        directory = directory or ROOT / "prompts"
        self._texts: dict[str, str] = {}
        for name in names:
            path = directory / f"{name}.txt"
            if not path.is_file():
                raise FileNotFoundError(f"prompt file missing: {path}")
            self._texts[name] = path.read_text(encoding="utf-8")

    def which(self, text: str) -> str | None:
        """The name of the prompt `text` was rendered from (the one whose words before
        its first placeholder begin it, the longest such), or None."""
        best, best_len = None, 0
        for name, template in self._texts.items():
            head = template.split("{", 1)[0]
            if len(head) > best_len and text.startswith(head):
                best, best_len = name, len(head)
        return best

    def echoes(self, name: str, text: str) -> bool:
        """Whether `text`, a model's answer to prompt `name`, repeats the prompt's own
        words — a base model that continues its prompt instead of following it: it
        begins as the prompt does, or holds `ECHO_WORDS` of the prompt's words in a row
        (what fills its placeholders is not its own words: a rewrite may repeat the
        question)."""
        words = _WORD.findall(text.lower())
        template = self._texts[name]
        runs: set[tuple[str, ...]] = set()
        for part in _PLACEHOLDER.split(template)[::2]:  # the text between placeholders
            own = _WORD.findall(part.lower())
            runs.update(tuple(own[i : i + ECHO_WORDS]) for i in range(len(own) - ECHO_WORDS + 1))
        head = _WORD.findall(template.lower())[:HEAD_WORDS]
        if len(words) >= HEAD_WORDS and words[:HEAD_WORDS] == head:
            return True
        return any(
            tuple(words[i : i + ECHO_WORDS]) in runs for i in range(len(words) - ECHO_WORDS + 1)
        )

    def render(self, name: str, **values: str) -> str:
        """The prompt with `{name}` placeholders filled; unknown braces stay as they are.

        Values are inserted in one pass, so braces inside a value (search
        results, user text) are never treated as placeholders.
        """
        text = self._texts[name]
        return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), text)


def answer_lines(text: str) -> list[str]:
    """The non-empty lines of a model's list answer, without bullets or numbering."""
    out = []
    for line in text.splitlines():
        line = line.strip().lstrip("-*•").strip()
        head, dot, rest = line.partition(". ")
        if dot and head.isdigit():
            line = rest.strip()
        if line:
            out.append(line)
    return out
