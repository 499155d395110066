"""Token estimates without a tokenizer: what a prompt and its parts cost
(`tokens_in`, `cut_to_tokens`), and which models reason (`REASONING`), whose
reasoning counts against a short call's `max_tokens`.
"""

from __future__ import annotations

import re

#: model names whose template is known to leave the opening `<think>` out
OPEN_LEFT_OUT = re.compile(r"(?i)(^|[^a-z0-9])(r1|qwq)([^a-z0-9]|$)|deepseek-r1|thinking")
#: model names that say they reason (their reasoning counts against `max_tokens`)
REASONING = re.compile(rf"(?i){OPEN_LEFT_OUT.pattern[4:]}|reason|think")
#: what a reasoning model is given beyond a short call's `max_tokens`, for its reasoning
REASONING_TOKENS = 4096


def tokens_in(text: str) -> int:
    """A cautious count of the tokens `text` makes for a model: three ASCII characters
    a token, and every other character one (Chinese, Japanese or Korean text is about
    a token a character in most tokenizers, often less; prose in English about four
    characters a token). Not on the per-token path: for prompts and their parts."""
    if text.isascii():
        return (len(text) + 2) // 3
    ascii_chars = len(text.encode("ascii", "ignore"))
    return (ascii_chars + 2) // 3 + len(text) - ascii_chars


def cut_to_tokens(text: str, tokens: int) -> str:
    """The longest start of `text` within `tokens` (`tokens_in`)."""
    if tokens <= 0:
        return ""
    if tokens_in(text) <= tokens:
        return text
    low, high = tokens, min(len(text), tokens * 3)  # a character is a third of a token or more
    while low < high:
        middle = (low + high + 1) // 2
        if tokens_in(text[:middle]) <= tokens:
            low = middle
        else:
            high = middle - 1
    return text[:low]
