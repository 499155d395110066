"""The store's records: what a chat, a message, a file, a collection, an account …
is, as the rest of the server sees it (plain frozen dataclasses; no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "Account",
    "AccountChange",
    "ApiKey",
    "Chat",
    "Checkpoint",
    "CollectionRecord",
    "DocumentRecord",
    "FileRecord",
    "GroupRecord",
    "Saved",
    "ShareRecord",
    "StoredChunk",
    "StoredMessage",
    "StoredResponse",
    "StreamingAnswer",
    "Usage",
]


@dataclass(frozen=True, slots=True)
class Chat:
    id: str
    user_id: str
    title: str
    focus_mode: str
    created_at: float


@dataclass(frozen=True, slots=True)
class StoredMessage:
    id: str
    chat_id: str
    role: str  # "user" | "assistant"
    content: str
    created_at: float
    status: str = "completed"  # answers: completed | cancelled | failed | streaming
    reasoning: str = ""
    rewritten: str | None = None
    sources: list[dict[str, Any]] = field(default_factory=list)
    reply_to: str | None = None  # an answer's question
    steps: list[str] = field(default_factory=list)  # an answer's progress lines
    error: dict[str, str] | None = None  # a failed answer's {"key", "data"}
    #: the model that answered, as its usage names it (`@<provider>/<model>` for a
    #: provider other than the default)
    model: str | None = None
    truncated: bool = False  # an answer cut at the model's output cap


@dataclass(frozen=True, slots=True)
class StreamingAnswer:
    """An answer still `streaming`, as the sweeper lists them: which it is, not what it
    holds (its text is read only for one that turns out to be an orphan)."""

    id: str
    chat_id: str
    created_at: float


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """What an answer asked through the Responses API keeps beside it (PROTOCOL §11):
    what its request said that the response echoes (`request`: model, instructions,
    metadata, …), the answer it continued (`previous`, for `previous_response_id`),
    and, once it has ended, `outcome`: the events of its stream that are not the
    answer's text (its searches and notes, its end with usage, images and related
    questions), each `{"type", "data"}`."""

    answer_id: str
    request: dict[str, Any]
    previous: str | None = None
    outcome: list[dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class FileRecord:
    """An uploaded file: `status` is `indexing`, `ready` or `failed` (then `error`)."""

    id: str
    user_id: str
    name: str
    kind: str
    size: int
    created_at: float
    status: str = "indexing"
    pages: int = 0
    chunks: int = 0
    error: str = ""

    @property
    def extension(self) -> str:
        return self.name.rsplit(".", 1)[-1].lower() if "." in self.name else ""

    def to_json(self) -> dict[str, Any]:
        return {
            "fileId": self.id,
            "name": self.name,
            "type": self.kind,
            "size": self.size,
            "pages": self.pages,
            "chunks": self.chunks,
            "status": self.status,
            "error": self.error or None,
            "createdAt": iso(self.created_at),
        }


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """A passage of a file: its number, the page it starts on (1-based), its text and
    its embedding (float32 bytes, or None without an embeddings model)."""

    n: int
    page: int
    text: str
    vector: bytes | None = None


@dataclass(frozen=True, slots=True)
class CollectionRecord:
    """A knowledge collection (PROTOCOL §12): owned by `owner`, readable by the users in
    `shared` and the members of the groups in `groups`. `documents` and `chunks` are
    counted when it is read (failed documents have no chunks)."""

    id: str
    owner: str
    name: str
    description: str
    created_at: float
    shared: tuple[str, ...] = ()
    documents: int = 0
    chunks: int = 0
    groups: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "description": self.description,
            "owner": self.owner,
            "documents": self.documents,
            "chunks": self.chunks,
            "createdAt": iso(self.created_at),
            "shared": list(self.shared),
            "groups": list(self.groups),
        }


@dataclass(frozen=True, slots=True)
class GroupRecord:
    """A group of users (accounts), made by the admin; a collection shared with it is
    readable by each member."""

    id: str
    name: str
    created_at: float
    members: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "members": list(self.members),
            "createdAt": iso(self.created_at),
        }


@dataclass(frozen=True, slots=True)
class DocumentRecord:
    """A document of a collection: `status` is `indexing`, `ready` or `failed` (then
    `error`, and `code` the HTTP status that says what kind of refusal it was)."""

    id: str
    collection_id: str
    import_id: str
    title: str
    kind: str
    size: int
    created_at: float
    url: str = ""
    status: str = "indexing"
    pages: int = 0
    chunks: int = 0
    error: str = ""
    code: int = 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "title": self.title,
            "type": self.kind,
            "url": self.url or None,
            "size": self.size,
            "pages": self.pages,
            "chunks": self.chunks,
            "status": self.status,
            "createdAt": iso(self.created_at),
        }
        if self.status == "failed":
            out["error"] = self.error
            out["code"] = self.code
        return out


@dataclass(frozen=True, slots=True)
class Usage:
    """The tokens one answer cost, as the model counted them (or estimated, when it
    did not say)."""

    model: str
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    estimated: bool = False
    answers: int = 1  # how many answers, in a sum

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "reasoning_tokens": self.reasoning_tokens,
            "total_tokens": self.total_tokens,
        }


@dataclass(frozen=True, slots=True)
class Saved:
    """What an ended answer saves: its text and status, its progress lines and error,
    and what its question learnt while it ran (the rewrite; the sources, when they
    could not be saved at once)."""

    content: str
    reasoning: str
    status: str
    question_id: str | None = None
    rewritten: str | None = None
    sources: list[dict[str, Any]] | None = None
    usage: Usage | None = None
    steps: list[str] | None = None
    error: dict[str, str] | None = None
    #: it was cut at the model's output cap (`llm.max_output_tokens`)
    truncated: bool = False


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A running answer as far as it got: its text, reasoning and progress lines.
    `content` and `reasoning` may be only what follows the first `content_from` and
    `reasoning_from` bytes (UTF-8) of them, which the store holds already: a
    checkpoint then sends what was added, not the whole answer again. A `content_from`
    of -1 says the store's copy is not known (a checkpoint whose outcome was lost):
    the answer is sent whole. `steps_changed` False says the store holds these
    progress lines already."""

    answer_id: str
    content: str
    reasoning: str
    steps: list[str]
    content_from: int = 0
    reasoning_from: int = 0
    steps_changed: bool = True


@dataclass(frozen=True, slots=True)
class Account:
    """A person or an app's user (PROTOCOL §7). `email` (lower-case, unique) and
    `password_hash` for password sign-in; `issuer` + `subject` (unique together) for
    an account an identity provider vouches for (OIDC sign-in, bearer JWTs).
    `tokens_per_day` None means `limits.tokens_per_day`."""

    id: str
    name: str
    role: str = "user"  # "admin" | "user"
    email: str | None = None
    password_hash: str | None = field(default=None, repr=False)
    disabled: bool = False
    tokens_per_day: int | None = None
    issuer: str | None = None
    subject: str | None = None
    created_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "email": self.email,
            "name": self.name,
            "role": self.role,
            "disabled": self.disabled,
            "tokensPerDay": self.tokens_per_day,
            "signIn": "password" if self.password_hash else ("oidc" if self.issuer else None),
            "createdAt": iso(self.created_at),
        }


@dataclass(frozen=True, slots=True)
class AccountChange:
    """What an admin changes of an account; None leaves a field as it is, and
    `default_quota` sets `tokens_per_day` back to the default."""

    disabled: bool | None = None
    role: str | None = None
    tokens_per_day: int | None = None
    default_quota: bool = False


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A user's API key as listed: never the key itself (only its hash is stored) but
    its first characters, to tell keys apart."""

    id: str
    user_id: str
    name: str
    prefix: str
    created_at: float

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "prefix": self.prefix,
            "createdAt": iso(self.created_at),
        }


@dataclass(frozen=True, slots=True)
class ShareRecord:
    """A shared chat (PROTOCOL §15): `id` is the random part of its link; `snapshot`
    what the link shows (the chat, its messages and files, as the chat service took
    them; None where a list leaves it out); `display_name` the only name of its owner
    it shows, when the owner chose one."""

    id: str
    chat_id: str
    user_id: str
    title: str
    created_at: float
    updated_at: float
    display_name: str | None = None
    snapshot: dict[str, Any] | None = None


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# -- scheduled research (PROTOCOL §16) ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Schedule:
    """A question asked on a cron schedule, answered in its own chat. `options` holds
    what the answer is asked with (`focusMode`, `optimizationMode`, `sources`,
    `collections`, `chatModel`), as the API took them; `failures` counts the failed
    runs in a row; a schedule paused by them has `enabled` false and `paused_reason`.
    `last_run_at` (read only) is when its latest completed run ended."""

    id: str
    user_id: str
    chat_id: str
    question: str
    cron: str
    timezone: str
    next_run_at: float
    created_at: float
    options: dict[str, Any] = field(default_factory=dict)
    webhook_url: str | None = None
    webhook_secret: str | None = None
    notify: str = "always"  # always | changed
    enabled: bool = True
    paused_reason: str | None = None
    failures: int = 0
    last_run_at: float | None = None


@dataclass(frozen=True, slots=True)
class ScheduleRun:
    """One run of a schedule: for its due time (`due_at`; a run asked for now is due when
    asked), held by the process whose lease token is `owner` until `lease_until` (the
    database's clock). `attempt` 2 is a retry after the first holder went away."""

    id: str
    schedule_id: str
    due_at: float
    status: str = "running"  # running | completed | failed | cancelled
    attempt: int = 1
    started_at: float | None = None
    ended_at: float | None = None
    message_id: str | None = None
    changed: bool | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "dueAt": iso(self.due_at),
            "startedAt": iso(self.started_at) if self.started_at is not None else None,
            "endedAt": iso(self.ended_at) if self.ended_at is not None else None,
            "status": self.status,
            "messageId": self.message_id,
            "changed": self.changed,
            "attempt": self.attempt,
            "retry": self.attempt > 1,
        }
        if self.error:
            out["error"] = self.error
        return out


@dataclass(frozen=True, slots=True)
class Delivery:
    """A webhook to send (an outbox row): its body is sent as it is, signed with
    `secret`, until it is delivered or `expires_at` passes; `next_at` is when the
    next attempt is due."""

    id: str
    url: str
    secret: str
    body: str
    next_at: float
    expires_at: float
    attempts: int = 0
    status: str = "pending"  # pending | delivered | failed
    error: str | None = None
