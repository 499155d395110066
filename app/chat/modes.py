"""Focus modes: what each one asks of the model, as data rather than an if/else ladder."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FocusMode:
    """`prompt` names the system prompt in `prompts/`; `searches` says whether the
    mode grounds its answer in web results (when the request allows it)."""

    name: str
    prompt: str
    searches: bool = False
    research: bool = False


MODES: dict[str, FocusMode] = {
    mode.name: mode
    for mode in (
        FocusMode("webSearch", "web_search_response", searches=True),
        FocusMode("deepSeek", "deepseek"),
        FocusMode("mathAssistant", "math_assistant"),
        FocusMode("writingAssistant", "writing_assistant"),
        FocusMode("translator", "translator"),
        FocusMode("deepResearch", "research_report", searches=True, research=True),
    )
}

#: the plain-chat prompt, for webSearch with copilot off or no search at all
PLAIN_PROMPT = "deepseek"
