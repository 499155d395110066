"""Where an answer's time went: one span per stage (classify, each search, each read,
each research round, the model's first byte, the first token out), in milliseconds
since the request was accepted. The answer's `messageEnd` carries them as `timings`
and its generation log line as `timings`, without the searches' queries.

A leaf: it imports nothing of this package, so the chat service and the research
tools both record into one `Timings` without importing each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

#: the most spans one answer keeps (a deep research of many rounds stays small)
MAX_SPANS = 200
#: what a span says that may be the user's words (a search's query): kept out of logs
PRIVATE = frozenset({"query"})


class Timings:
    """The spans of one answer, in the order they started. A span is a dict:
    `stage`, `startMs`, `endMs` (absent while it runs) and what tells it apart
    (`query`, `pages`, `n`, `speculative`); one that was cancelled says
    `cancelled: true`, one that raised `failed: true`."""

    __slots__ = ("origin", "_spans")

    def __init__(self, origin: float | None = None) -> None:
        #: the `time.monotonic()` the spans count from
        self.origin = time.monotonic() if origin is None else origin
        self._spans: list[dict[str, Any]] = []

    def _ms(self, at: float | None = None) -> float:
        return round(((time.monotonic() if at is None else at) - self.origin) * 1000, 1)

    def start(self, stage: str, *, at: float | None = None, **detail: Any) -> dict[str, Any]:
        """A span that starts now (or at the monotonic time `at`)."""
        span: dict[str, Any] = {"stage": stage, "startMs": self._ms(at), **detail}
        if len(self._spans) < MAX_SPANS:
            self._spans.append(span)
        return span

    def end(self, span: dict[str, Any], *, at: float | None = None, **detail: Any) -> None:
        """End `span` now (or at `at`); a span ends once, later calls change nothing."""
        if "endMs" not in span:
            span["endMs"] = self._ms(at)
            span.update(detail)

    def mark(self, stage: str, *, at: float | None = None, **detail: Any) -> None:
        """A moment rather than a span: it starts and ends at once."""
        self.end(self.start(stage, at=at, **detail), at=at)

    @contextlib.contextmanager
    def span(self, stage: str, **detail: Any) -> Iterator[dict[str, Any]]:
        """A span around a block: ended however the block ends, marked `cancelled`
        or `failed` when it did not end by itself."""
        span = self.start(stage, **detail)
        try:
            yield span
        except asyncio.CancelledError:
            self.end(span, cancelled=True)
            raise
        except BaseException:
            self.end(span, failed=True)
            raise
        finally:
            self.end(span)

    def to_json(self) -> list[dict[str, Any]]:
        """The spans as they are now (one still running has no `endMs`), each with its
        stage and times first."""
        first = ("stage", "startMs", "endMs")
        return [
            {k: span[k] for k in first if k in span}
            | {k: v for k, v in span.items() if k not in first}
            for span in self._spans
        ]

    def to_log(self) -> list[dict[str, Any]]:
        """`to_json` without what may be the user's words (a search's query), for the
        generation's log line: no question reaches a log."""
        return [{k: v for k, v in span.items() if k not in PRIVATE} for span in self.to_json()]
