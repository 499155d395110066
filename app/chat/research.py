"""deepResearch: a bounded, iterative research loop that gathers sources for a report.

    plan      the small model breaks the question into sub-questions
    iterate   search every sub-question concurrently, pick and read like `quality`;
              the small model reflects on what is missing: new sub-questions, or stop
    bounds    `research.max_iterations` iterations and `research.time_budget_seconds`

Each step is a `progress` event ("iteration 1: searching 3 sub-questions"). The
sources of all iterations, deduplicated by URL, are what the report (the
focus mode's prompt) is written from. Failures inside an iteration degrade as
in webSearch; the loop always ends with what it found. Cancelling is safe at
any step: searches and reads in flight are closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ..collections.service import CollectionSearch
from ..config import ResearchSettings
from ..errors import AppError
from ..files.service import FileService
from ..llm import ChatModel
from ..prompts import Prompts, answer_lines
from ..search.base import SearchResult
from ..search.web import Progress, WebSearch, until_deadline
from ..store import FileRecord

log = logging.getLogger("app.research")

REFLECT_SNIPPET_CHARS = 300


@dataclass
class _Prefixed:
    """Forwards a sub-search's progress with the iteration it belongs to."""

    out: Progress
    prefix: str

    def emit(self, type: str, **data: object) -> object:
        if type == "progress":
            data = {**data, "data": f"{self.prefix}{data.get('data', '')}"}
        return self.out.emit(type, **data)


class DeepResearch:
    def __init__(
        self,
        settings: ResearchSettings,
        *,
        search: WebSearch,
        files: FileService,
        llm: ChatModel,
        prompts: Prompts,
    ) -> None:
        self.settings = settings
        self.search = search
        self.files = files
        self.llm = llm
        self.prompts = prompts

    async def find_sources(
        self,
        out: Progress,
        question: str,
        files: Sequence[FileRecord] = (),
        collections: CollectionSearch | None = None,
    ) -> list[SearchResult]:
        """The sources of every iteration, deduplicated — web results and, with `files`
        and `collections`, their passages for each sub-question too."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.time_budget_seconds
        found: dict[str, SearchResult] = {}
        searched: list[str] = []
        out.emit("progress", data="planning the research")
        pending = await self._plan(question)
        for iteration in range(1, self.settings.max_iterations + 1):
            pending = [q for q in pending if q not in searched][: self.settings.sub_questions]
            if not pending:
                break
            out.emit(
                "progress",
                data=f"iteration {iteration}: searching {len(pending)} sub-question{'s' if len(pending) != 1 else ''}",
            )
            searched.extend(pending)
            new = await self._search_all(out, iteration, pending, deadline, files, collections)
            for result in new:
                found.setdefault(_key(result), result)
            out.emit("progress", data=f"iteration {iteration}: {len(found)} sources so far")
            if loop.time() >= deadline:
                out.emit(
                    "progress",
                    data=f"iteration {iteration}: time budget reached; writing the report",
                )
                break
            if iteration == self.settings.max_iterations:
                break
            pending = await self._reflect(question, searched, list(found.values()), deadline)
            if not pending:
                out.emit(
                    "progress", data=f"iteration {iteration}: enough found; writing the report"
                )
                break
        return list(found.values())

    async def _plan(self, question: str) -> list[str]:
        prompt = self.prompts.render(
            "research_plan", question=question, count=str(self.settings.sub_questions)
        )
        try:
            answer = await self.llm.complete([{"role": "user", "content": prompt}], max_tokens=300)
        except AppError as exc:
            log.info("research plan failed, searching the question itself: %s", exc.message)
            return [question]
        return answer_lines(answer) or [question]

    async def _search_all(
        self,
        out: Progress,
        iteration: int,
        questions: list[str],
        deadline: float,
        files: Sequence[FileRecord],
        collections: CollectionSearch | None = None,
    ) -> list[SearchResult]:
        """Every sub-question at once, on the web, in the files and in the collections
        (`search_collection(q)`); what has not finished by the deadline is dropped."""
        prefixed = _Prefixed(out, f"iteration {iteration}: ")
        searches = [
            self.search.find_sources(prefixed, q, "quality", self.settings.pages_per_question)
            for q in questions
        ]
        if files:
            out.emit("progress", data=f"iteration {iteration}: searching your files")
            searches += [self._in_files(files, q) for q in questions]
        if collections is not None:
            out.emit("progress", data=f"iteration {iteration}: searching your collections")
            searches += [collections(q, self.settings.pages_per_question) for q in questions]
        found = await until_deadline(searches, deadline)
        return [result for results in found if results for result in results]

    async def _in_files(self, files: Sequence[FileRecord], question: str) -> list[SearchResult]:
        passages = await self.files.passages(files, question, self.settings.pages_per_question)
        return [p.result for p in passages]

    async def _reflect(
        self, question: str, searched: list[str], found: list[SearchResult], deadline: float
    ) -> list[str]:
        """New sub-questions, or [] to stop (also when the model fails or time is up)."""
        context = "\n".join(
            f"[{i}] {r.title}: {r.text[:REFLECT_SNIPPET_CHARS]}"
            for i, r in enumerate(found, start=1)
        )
        prompt = self.prompts.render(
            "research_reflect",
            question=question,
            searched="\n".join(f"- {q}" for q in searched),
            context=context or "(nothing yet)",
            count=str(self.settings.sub_questions),
        )
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return []
        try:
            async with asyncio.timeout(remaining):
                answer = await self.llm.complete(
                    [{"role": "user", "content": prompt}], max_tokens=300
                )
        except (AppError, TimeoutError):
            return []
        if answer.strip().lower().strip(".") == "stop":
            return []
        return [q for q in answer_lines(answer) if q not in searched and q.lower() != "stop"]


def _key(result: SearchResult) -> str:
    """What makes two sources the same: the page, or the file's passage."""
    if result.collection_id:
        return f"{result.collection_id}/{result.document_id}#{result.snippet[:80]}"
    return f"{result.file_id}#{result.snippet[:80]}" if result.file_id else result.url
