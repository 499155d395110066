"""What a search finds and what it is kept to: the types that the protocol, the
search providers, uploads, collections and the chat service all share.

A leaf: it imports nothing of this package, so the request parser (`protocol.py`)
needs nothing of `search/` to read a request's filters.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, date, datetime, time, timedelta
from urllib.parse import urlsplit


@dataclass(frozen=True, slots=True)
class SearchResult:
    """One hit. `content` is the page's text once read (else empty: use `snippet`).
    A passage of an uploaded file has its `file_id` (and `page`, 1-based, in a PDF);
    its `url` is "File", as the Perplexica UI expects of file sources. A passage of a
    knowledge collection has its `collection_id` and `document_id` (and `page`)."""

    title: str
    url: str
    snippet: str = ""
    content: str = ""
    file_id: str = ""
    page: int = 0
    date: str = ""  # when the page was published, ISO 8601, when the provider says
    last_updated: str = ""  # when it last changed, ISO 8601, when the provider says
    #: a passage of a knowledge collection: its collection and document
    collection_id: str = ""
    document_id: str = ""
    score: float = 0.0
    #: a link an MCP tool returned: the tool, as the model called it (`<server>__<tool>`)
    tool: str = ""

    @property
    def text(self) -> str:
        return self.content or self.snippet

    def with_content(self, content: str) -> SearchResult:
        return replace(self, content=content)


#: `recency` → how far back it reaches
RECENCY = {
    "hour": timedelta(hours=1),
    "day": timedelta(days=1),
    "week": timedelta(weeks=1),
    "month": timedelta(days=31),
    "year": timedelta(days=366),
}
CONTEXT_SIZES = ("low", "medium", "high")  # what each means: `search.web.CONTEXT_SHARES`


@dataclass(frozen=True, slots=True)
class SearchFilters:
    """What a search is kept to (PROTOCOL §1 `search`, Perplexity's parameters): the
    domains it may (`include`) or may not (`exclude`) come from, how recent a page must
    be (`recency`), published after / before a day, and how much of the web the answer
    reads (`context_size`). Empty means no restriction."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    recency: str = ""
    after: date | None = None
    before: date | None = None
    context_size: str = ""

    @property
    def dated(self) -> bool:
        return bool(self.recency or self.after or self.before)

    def since(self, now: datetime | None = None) -> datetime | None:
        """The first moment a page may be from (UTC): the later of the start of the day
        `after` and `now` less `recency`."""
        moments = []
        if self.after is not None:
            moments.append(datetime.combine(self.after, time(), UTC))
        if self.recency:
            moments.append((now or datetime.now(UTC)) - RECENCY[self.recency])
        return max(moments) if moments else None

    def allows_domain(self, url: str) -> bool:
        host = (urlsplit(url).hostname or "").lower()
        if any(in_domain(host, d) for d in self.exclude):
            return False
        return not self.include or any(in_domain(host, d) for d in self.include)

    def allows_date(self, published: str, now: datetime | None = None) -> bool | None:
        """Whether a page published then passes the date filters; None when its date is
        unknown (or not a date). A date with a time of day is compared to the moment
        (an `hour` keeps what is at most an hour old); a bare day passes `since` when
        that day is (the page may be from any time of it)."""
        moment = moment_of(published)
        if moment is None:
            return None
        timed = len(published.strip()) > 10
        day = moment.astimezone(UTC).date() if timed else moment.date()
        since = self.since(now)
        if since is not None and (moment < since if timed else day < since.date()):
            return False
        return not (self.before and day > self.before)


def in_domain(host: str, domain: str) -> bool:
    """Whether `host` is `domain` or one of its subdomains."""
    return host == domain or host.endswith("." + domain)


def moment_of(value: str) -> datetime | None:
    """An ISO 8601 date ("2026-03-01": its midnight) or date-time ("2026-03-01T10:00:00Z";
    UTC when it names no zone) as an aware datetime; None for anything else."""
    try:
        moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        try:
            moment = datetime.combine(date.fromisoformat(value.strip()[:10]), time())
        except ValueError:
            return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
