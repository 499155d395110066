"""Focus modes as strategies: each one names its system prompt and where its sources
come from (the web, a restricted web, deep research, or none); the list of modes
the protocol accepts derives from `MODES`.

A mode with sources answers from what they found, with its own prompt; when its
sources do not apply to a request (web search with copilot off) or find nothing,
the model answers alone with `PLAIN_PROMPT`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..events import FOCUS_MODES
from ..search.base import SearchScope

if TYPE_CHECKING:
    from ..protocol import ChatRequest


class WebSources:
    """Where a mode's sources come from: web search — all of it, or kept to `scope` —
    by the research agent (`chat/agent.py`), within the request's optimization mode's
    budget (or `budget`'s); off with copilot off."""

    #: the research budget it spends (None: the request's optimization mode)
    budget: str | None = None

    def __init__(self, scope: SearchScope | None = None) -> None:
        self.scope = scope

    def applies(self, request: ChatRequest) -> bool:
        """Whether this request wants sources at all."""
        return request.copilot_enabled


class ResearchSources(WebSources):
    """deepResearch: the research agent with the largest budget (`research.deep_rounds`,
    `deep_seconds`), on the web, the request's files and its collections, whatever the
    optimization mode; it writes a report."""

    budget = "deep"

    def applies(self, request: ChatRequest) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class FocusMode:
    """`prompt` names the system prompt in `prompts/`; `sources` is None for a mode
    that never searches."""

    name: str
    prompt: str
    sources: WebSources | None = None


#: the plain-chat prompt, for a mode whose sources do not apply or found nothing
PLAIN_PROMPT = "deepseek"

#: the restricted webs of Perplexica's focus modes: SearxNG engines, else sites
ACADEMIC = SearchScope(
    "academic sources",
    engines=("arxiv", "google scholar", "pubmed"),
    sites=("arxiv.org", "scholar.google.com", "pubmed.ncbi.nlm.nih.gov"),
)
YOUTUBE = SearchScope("YouTube", engines=("youtube",), sites=("youtube.com",))
REDDIT = SearchScope("Reddit", engines=("reddit",), sites=("reddit.com",))
#: the research agent's `discussion_search`: forums and Reddit
DISCUSSIONS = SearchScope(
    "discussions",
    engines=("reddit",),
    sites=("reddit.com", "news.ycombinator.com", "stackexchange.com"),
)
WOLFRAM_ALPHA = SearchScope("Wolfram Alpha", engines=("wolframalpha",), sites=("wolframalpha.com",))

MODES: dict[str, FocusMode] = {
    mode.name: mode
    for mode in (
        FocusMode("webSearch", "web_search_response", WebSources()),
        FocusMode("translator", "translator"),
        FocusMode("deepSeek", PLAIN_PROMPT),
        FocusMode("mathAssistant", "math_assistant"),
        FocusMode("writingAssistant", "writing_assistant"),
        FocusMode("deepResearch", "research_report", ResearchSources()),
        FocusMode("academicSearch", "academic_search", WebSources(ACADEMIC)),
        FocusMode("youtubeSearch", "youtube_search", WebSources(YOUTUBE)),
        FocusMode("redditSearch", "reddit_search", WebSources(REDDIT)),
        FocusMode("wolframAlphaSearch", "wolfram_alpha_search", WebSources(WOLFRAM_ALPHA)),
    )
}
if tuple(MODES) != FOCUS_MODES:  # the protocol's names and the strategies are one list
    raise RuntimeError(f"focus modes {tuple(MODES)} differ from the protocol's {FOCUS_MODES}")
