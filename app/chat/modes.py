"""Focus modes as strategies: each one names its system prompt and where its sources
come from (the web, a restricted web, deep research, or none); the list of modes
the protocol accepts derives from `MODES`.

A mode with sources answers from what they found, with its own prompt; when its
sources do not apply to a request (web search with copilot off) or find nothing,
the model answers alone with `PLAIN_PROMPT`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..protocol import ChatRequest
    from ..search.base import SearchResult
    from ..search.web import Progress, WebSearch
    from .research import DeepResearch


@dataclass(frozen=True, slots=True)
class SourceJob:
    """What a strategy may use to find the sources of one question."""

    out: Progress
    question: str
    request: ChatRequest
    web: WebSearch
    research: DeepResearch


class Sources(abc.ABC):
    """Where a mode's sources come from."""

    def applies(self, request: ChatRequest) -> bool:
        """Whether this request wants sources at all."""
        return True

    @abc.abstractmethod
    async def find(self, job: SourceJob) -> list[SearchResult]:
        """The sources, best first; [] when nothing was found (a `progress` event
        said why). Cancelling is safe."""


class WebSources(Sources):
    """Web search ranked and read by the request's optimization mode; off with copilot off."""

    def applies(self, request: ChatRequest) -> bool:
        return request.copilot_enabled

    async def find(self, job: SourceJob) -> list[SearchResult]:
        return await job.web.find_sources(job.out, job.question, job.request.optimization_mode)


class ResearchSources(Sources):
    """The deepResearch loop: plan, search sub-questions, reflect, repeat."""

    async def find(self, job: SourceJob) -> list[SearchResult]:
        return await job.research.find_sources(job.out, job.question)


@dataclass(frozen=True, slots=True)
class FocusMode:
    """`prompt` names the system prompt in `prompts/`; `sources` is None for a mode
    that never searches."""

    name: str
    prompt: str
    sources: Sources | None = None


#: the plain-chat prompt, for a mode whose sources do not apply or found nothing
PLAIN_PROMPT = "deepseek"

MODES: dict[str, FocusMode] = {
    mode.name: mode
    for mode in (
        FocusMode("webSearch", "web_search_response", WebSources()),
        FocusMode("translator", "translator"),
        FocusMode("deepSeek", PLAIN_PROMPT),
        FocusMode("mathAssistant", "math_assistant"),
        FocusMode("writingAssistant", "writing_assistant"),
        FocusMode("deepResearch", "research_report", ResearchSources()),
    )
}
