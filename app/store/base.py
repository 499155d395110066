"""The store interface: chats and their messages, uploaded files, accounts (their
sessions, API keys and invites), and what the processes of one deployment share
(worker numbers for ids, secrets).

Ids are opaque strings. `created_at` is Unix seconds (float). Messages of a
chat are ordered by `created_at`, then id.

Errors are mapped at this boundary: a backend that cannot be reached raises
`Unavailable` (503), an id that is taken raises `Conflict`; missing rows are
`None`/`False`, never exceptions. No driver error leaves a backend.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ParamSpec, TypeVar

from ..cleaning import clean
from ..errors import AppError, BadRequest, Conflict, Forbidden, Unavailable

log = logging.getLogger("app.store")


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
    truncated: bool = False  # an answer cut at the model's output cap


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
    """A running answer as far as it got: its text, reasoning and progress lines."""

    answer_id: str
    content: str
    reasoning: str
    steps: list[str]


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


#: the column order both backends select in, so one mapping serves both
ACCOUNT_COLUMNS = (
    "id, name, role, email, password_hash, disabled, tokens_per_day, issuer, subject, created_at"
)
API_KEY_COLUMNS = "id, account_id, name, prefix, created_at"


def account_from_row(row: Any) -> Account:
    return Account(
        id=str(row[0]),
        name=row[1],
        role=row[2],
        email=row[3],
        password_hash=row[4],
        disabled=bool(row[5]),
        tokens_per_day=row[6],
        issuer=row[7],
        subject=row[8],
        created_at=row[9],
    )


def account_params(a: Account) -> tuple[Any, ...]:
    return (
        a.id,
        a.name,
        a.role,
        a.email,
        a.password_hash,
        a.disabled,
        a.tokens_per_day,
        a.issuer,
        a.subject,
        a.created_at,
    )


def account_change_sql(change: AccountChange, mark: str) -> tuple[list[str], list[Any]]:
    """The `SET` clauses of an `AccountChange` and their values; `mark` is the
    backend's placeholder (`?`, or `$` to be numbered from 1)."""
    sets: list[str] = []
    params: list[Any] = []

    def put(column: str, value: Any) -> None:
        params.append(value)
        sets.append(f"{column} = " + (f"${len(params)}" if mark == "$" else mark))

    if change.disabled is not None:
        put("disabled", change.disabled)
    if change.role is not None:
        put("role", change.role)
    if change.default_quota:
        put("tokens_per_day", None)
    elif change.tokens_per_day is not None:
        put("tokens_per_day", change.tokens_per_day)
    return sets, params


def api_key_from_row(row: Any) -> ApiKey:
    return ApiKey(str(row[0]), str(row[1]), row[2], row[3], row[4])


def no_admin_left() -> Conflict:
    return Conflict("at least one enabled admin must remain")


def bad_invite() -> Forbidden:
    return Forbidden("this invite code is not valid (unknown, used or expired)")


CHAT_COLUMNS = "id, user_id, title, focus_mode, created_at"
FILE_COLUMNS = "id, user_id, name, kind, size, created_at, status, pages, chunks, error"


COLLECTION_COLUMNS = "id, owner, name, description, created_at"
DOCUMENT_COLUMNS = (
    "id, collection_id, import_id, title, kind, size, created_at, url, status, pages, chunks,"
    " error, code"
)


#: the collections' queries, written with `?` (PostgreSQL numbers them)
COLLECTION_COUNTS = (
    "(SELECT count(*) FROM collection_documents d WHERE d.collection_id = c.id),"
    " (SELECT coalesce(sum(d.chunks), 0) FROM collection_documents d"
    " WHERE d.collection_id = c.id)"
)
SELECT_COLLECTION = f"SELECT {COLLECTION_COLUMNS}, {COLLECTION_COUNTS} FROM collections c"
SQL_GET_COLLECTION = f"{SELECT_COLLECTION} WHERE c.id = ?"
SQL_LIST_COLLECTIONS = (
    f"{SELECT_COLLECTION} WHERE c.owner = ? OR c.id IN"
    " (SELECT collection_id FROM collection_shares WHERE user_id = ?) OR c.id IN"
    " (SELECT s.collection_id FROM collection_group_shares s JOIN user_group_members m"
    " ON m.group_id = s.group_id WHERE m.user_id = ?)"
    " ORDER BY c.created_at DESC, c.id"
)
SQL_SHARES = "SELECT collection_id, user_id FROM collection_shares WHERE collection_id = ANY_OF"
SQL_GROUP_SHARES = (
    "SELECT collection_id, group_id FROM collection_group_shares WHERE collection_id = ANY_OF"
)
#: documents that count against `collections.max_documents` (a failed one has nothing)
SQL_COUNT_DOCUMENTS = (
    "SELECT count(*) FROM collection_documents WHERE collection_id = ? AND status != 'failed'"
)
SQL_SWEEP_DOCUMENTS = (
    "UPDATE collection_documents SET status = 'failed', error = ?, code = 500"
    " WHERE status = 'indexing' AND created_at < ? AND (indexer IS NULL OR indexer"
    " NOT IN (SELECT token FROM workers WHERE expires_at > NOW))"
    " RETURNING collection_id, id"
)
GROUP_COLUMNS = "id, name, created_at"
SQL_ADD_DOCUMENT = (
    f"INSERT INTO collection_documents ({DOCUMENT_COLUMNS}, indexer)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
SQL_FINISH_DOCUMENT = (
    "UPDATE collection_documents SET status = ?, pages = ?, chunks = ?, error = ?, code = ?"
    " WHERE id = ?"
)
SQL_GET_DOCUMENT = f"SELECT {DOCUMENT_COLUMNS} FROM collection_documents WHERE id = ?"
SQL_LIST_DOCUMENTS = (
    f"SELECT {DOCUMENT_COLUMNS} FROM collection_documents WHERE collection_id = ?"
    " ORDER BY created_at, id"
)
SQL_IMPORT_COUNTS = (
    "SELECT count(*), coalesce(sum(CASE WHEN status = 'indexing' THEN 0 ELSE 1 END), 0)"
    " FROM collection_documents WHERE collection_id = ? AND import_id = ?"
)
SQL_IMPORT_FAILED = (
    f"SELECT {DOCUMENT_COLUMNS} FROM collection_documents WHERE collection_id = ?"
    " AND import_id = ? AND status = 'failed' ORDER BY created_at, id"
)
SQL_IMPORT_DOCUMENTS = (
    f"SELECT {DOCUMENT_COLUMNS} FROM collection_documents WHERE collection_id = ?"
    " AND import_id = ? ORDER BY created_at, id"
)


def finish_document_params(d: DocumentRecord) -> tuple[Any, ...]:
    return (d.status, d.pages, d.chunks, d.error, d.code, d.id)


def collection_from_row(
    row: Any, shared: Sequence[str] = (), groups: Sequence[str] = ()
) -> CollectionRecord:
    return CollectionRecord(
        id=row[0],
        owner=row[1],
        name=row[2],
        description=row[3],
        created_at=row[4],
        shared=tuple(shared),
        documents=int(row[5] or 0) if len(row) > 5 else 0,
        chunks=int(row[6] or 0) if len(row) > 6 else 0,
        groups=tuple(groups),
    )


def limit_documents(
    records: Sequence[DocumentRecord], counted: int, max_documents: int | None
) -> list[DocumentRecord]:
    """`records` with those to be indexed past `max_documents` (of which `counted`
    are in the collection already) refused as 413."""
    if max_documents is None:
        return list(records)
    room = max(0, max_documents - counted)
    out = []
    for record in records:
        if record.status == "indexing":
            if room <= 0:
                record = dataclasses.replace(
                    record,
                    status="failed",
                    error=f"the collection has its {max_documents} documents",
                    code=413,
                )
            else:
                room -= 1
        out.append(record)
    return out


def document_from_row(row: Any) -> DocumentRecord:
    return DocumentRecord(*row)


def document_params(d: DocumentRecord) -> tuple[Any, ...]:
    return (
        d.id,
        d.collection_id,
        d.import_id,
        d.title,
        d.kind,
        d.size,
        d.created_at,
        d.url,
        d.status,
        d.pages,
        d.chunks,
        d.error,
        d.code,
    )


def file_from_row(row: Any) -> FileRecord:
    return FileRecord(*row)


def file_params(f: FileRecord) -> tuple[Any, ...]:
    return (
        f.id,
        f.user_id,
        f.name,
        f.kind,
        f.size,
        f.created_at,
        f.status,
        f.pages,
        f.chunks,
        f.error,
    )


MESSAGE_COLUMNS = (
    "id, chat_id, role, content, reasoning, rewritten, sources, status, reply_to, created_at"
)
#: what is read of a message: the inserted columns, then what its end saved
MESSAGE_SELECT = MESSAGE_COLUMNS + ", steps, error, truncated"


def chat_from_row(row: Any) -> Chat:
    """A row of `CHAT_COLUMNS` (tuple or record) as a `Chat`."""
    return Chat(
        id=str(row[0]), user_id=str(row[1]), title=row[2], focus_mode=row[3], created_at=row[4]
    )


def message_from_row(
    row: Any,
    sources: list[dict[str, Any]],
    steps: list[str] | None = None,
    error: dict[str, str] | None = None,
) -> StoredMessage:
    """A row of `MESSAGE_SELECT` as a `StoredMessage`, with its JSON already decoded."""
    return StoredMessage(
        id=str(row[0]),
        chat_id=str(row[1]),
        role=row[2],
        content=row[3],
        reasoning=row[4],
        rewritten=row[5],
        sources=sources,
        status=row[7],
        reply_to=str(row[8]) if row[8] is not None else None,
        created_at=row[9],
        steps=steps or [],
        error=error,
        truncated=bool(row[12]),
    )


def message_params(message: StoredMessage, sources: Any) -> tuple[Any, ...]:
    """The values of `MESSAGE_COLUMNS` for an insert, with the sources already encoded."""
    return (
        message.id,
        message.chat_id,
        message.role,
        message.content,
        message.reasoning,
        message.rewritten,
        sources,
        message.status,
        message.reply_to,
        message.created_at,
    )


P = ParamSpec("P")
T = TypeVar("T")
Method = Callable[P, Coroutine[Any, Any, T]]


def _always(exc: BaseException) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class DriverErrors:
    """How a backend's driver errors read (a tuple of classes each, checked in this
    order): `conflict`, a key or constraint the write broke; `data`, a value the
    database cannot keep; `unavailable`, the database cannot be reached or used now
    (retry later) — where `outage` says so of the error: a class a driver raises for
    an outage and for a mistake alike (SQLite's `OperationalError` is both "database
    is locked" and "no such column") is told apart by it. Any other driver error is
    a bug: 500 `INTERNAL`, logged."""

    unavailable: tuple[type[BaseException], ...]
    conflict: tuple[type[BaseException], ...] = ()
    data: tuple[type[BaseException], ...] = ()
    every: tuple[type[BaseException], ...] = ()  # the driver's root error(s)
    outage: Callable[[BaseException], bool] = _always


def mapping_errors(errors: DriverErrors) -> Callable[[Method[P, T]], Method[P, T]]:
    """A decorator for a backend's methods: the arguments are cleaned of NUL
    characters and lone surrogates (which PostgreSQL's text and jsonb refuse, and
    model output or a web page may hold: see `clean`), and the driver's errors become ours (see `DriverErrors`); our
    own errors (`Conflict` raised where a key is taken) pass."""

    def decorate(method: Method[P, T]) -> Method[P, T]:
        @functools.wraps(method)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
            args = clean(args)
            kwargs = clean(kwargs)
            try:
                return await method(*args, **kwargs)
            except AppError:
                raise
            except errors.conflict as exc:
                log.warning("store refused a write: %r", exc)
                raise Conflict("the store refused a conflicting write") from exc
            except errors.data as exc:
                log.warning("store refused a value: %r", exc)
                raise BadRequest("the store cannot keep a value of this request") from exc
            except errors.unavailable as exc:
                if errors.outage(exc):
                    raise unavailable(exc) from exc
                log.error("store failed in %s", method.__name__, exc_info=exc)
                raise AppError("internal error") from exc
            except errors.every as exc:
                log.error("store failed in %s", method.__name__, exc_info=exc)
                raise AppError("internal error") from exc

        return wrapper

    return decorate


def unavailable(exc: BaseException) -> Unavailable:
    """The error a client sees for a store that cannot be reached (details go to the log)."""
    log.warning("store unavailable: %r", exc)
    return Unavailable("the chat store is unavailable; try again shortly")


def taken(what: str) -> Conflict:
    return Conflict(f"{what} is already used")


def not_yours() -> Forbidden:
    return Forbidden("this chat belongs to another user")


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Store(abc.ABC):
    """Chats and messages, worker numbers and secrets (see the module docstring for errors)."""

    async def open(self) -> None:  # noqa: B027 - optional for backends without setup
        """Connect and create or upgrade the schema."""

    async def close(self) -> None:  # noqa: B027
        """Release connections. Safe to call twice."""

    async def __aenter__(self) -> Store:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @abc.abstractmethod
    async def ping(self) -> None:
        """Raise `Unavailable` if the backend cannot answer."""

    # -- chats --------------------------------------------------------------------------

    @abc.abstractmethod
    async def get_chat(self, chat_id: str) -> Chat | None: ...

    @abc.abstractmethod
    async def set_title(self, chat_id: str, title: str) -> None: ...

    @abc.abstractmethod
    async def list_chats(self, user_id: str, limit: int = 100) -> list[Chat]:
        """The user's chats, newest first."""

    @abc.abstractmethod
    async def delete_chat(self, chat_id: str) -> bool:
        """Delete a chat and its messages; False when there was none."""

    # -- messages -----------------------------------------------------------------------

    @abc.abstractmethod
    async def begin_answer(
        self,
        chat: Chat,
        question: StoredMessage,
        answer: StoredMessage,
        *,
        regenerate: bool = False,
        files: Sequence[str] = (),
    ) -> bool:
        """In one transaction: the chat unless it exists, the question, the answer's
        row, and `files` attached to the chat. With `regenerate` the question exists
        already: its answer and every later message of the chat are deleted, and its
        text set to the question's (it may have been edited). Returns whether the
        chat was created.

        Raises `Conflict` when the question's (or the answer's) id is taken, and
        `Forbidden` when the chat exists and is another user's; then nothing is
        written."""

    @abc.abstractmethod
    async def set_sources(self, message_id: str, sources: list[dict[str, Any]]) -> None: ...

    @abc.abstractmethod
    async def finish_answer(
        self, answer_id: str, saved: Saved, *, only_streaming: bool = False
    ) -> bool:
        """Set an answer's final content, reasoning and status — with `saved.question_id`,
        also the question's `rewritten` and `sources` (those given) — in one transaction.
        With `only_streaming`, only an answer still `streaming` changes (a sweeper
        closing it must not overwrite its owner's save). With `saved.usage`, its tokens
        are added to the user's count of the day (`tokens_on`). Returns whether it
        changed. Saving the same answer twice is harmless (it is counted once)."""

    @abc.abstractmethod
    async def checkpoint_answers(self, progress: Sequence[Checkpoint]) -> None:
        """Save running answers as far as they got, in one transaction; an answer no
        longer `streaming` is left as it is."""

    @abc.abstractmethod
    async def get_message(self, message_id: str) -> StoredMessage | None: ...

    @abc.abstractmethod
    async def list_messages(self, chat_id: str) -> list[StoredMessage]:
        """A chat's messages in order."""

    @abc.abstractmethod
    async def streaming_answers(
        self,
        created_before: float,
        after: tuple[float, str] | None = None,
        limit: int = 100,
    ) -> list[StoredMessage]:
        """Answers still `streaming` that began before `created_before`, oldest first
        (by `created_at`, then id), from after the (created_at, id) `after`."""

    @abc.abstractmethod
    async def delete_turn(self, answer_id: str) -> bool:
        """Delete an answer and its question (and what is kept with the answer), and
        their chat when no message is left in it; False when there was no such answer."""

    # -- Responses API answers --------------------------------------------------------------

    @abc.abstractmethod
    async def add_response(self, response: StoredResponse) -> None:
        """Keep what a response's request said (its answer must exist; it goes when its
        answer does)."""

    @abc.abstractmethod
    async def end_response(self, answer_id: str, outcome: list[dict[str, Any]]) -> None:
        """Keep what a response showed beyond its answer's text, once it has ended."""

    @abc.abstractmethod
    async def get_response(self, answer_id: str) -> StoredResponse | None: ...

    # -- what the processes of a deployment share --------------------------------------------

    @abc.abstractmethod
    async def lease_worker(self, token: str, ttl: float, workers: int) -> int:
        """A worker number in `range(workers)` that no live process holds, leased to
        `token` for `ttl` seconds. Raises `Unavailable` when every number is held."""

    @abc.abstractmethod
    async def renew_worker(self, worker: int, token: str, ttl: float) -> bool:
        """Extend the lease; False when `token` no longer holds it (it expired and
        another process took it)."""

    @abc.abstractmethod
    async def release_worker(self, worker: int, token: str) -> None: ...

    @abc.abstractmethod
    async def secret(self, name: str) -> str:
        """A random secret shared by every process of the deployment (made once)."""

    # -- uploaded files -------------------------------------------------------------------

    @abc.abstractmethod
    async def add_file(self, record: FileRecord, indexer: str = "") -> None:
        """A new upload (status `indexing`), read by the process whose worker lease has
        the token `indexer`."""

    @abc.abstractmethod
    async def fail_orphaned_files(self, error: str, created_before: float) -> int:
        """Mark `failed` (with `error`) the uploads still `indexing` that were made
        before `created_before` by a process whose worker lease has run out (it died
        while reading them). Returns how many."""

    @abc.abstractmethod
    async def finish_file(self, record: FileRecord, chunks: list[StoredChunk]) -> None:
        """Set a file's status, pages, chunk count and error, and store its chunks, in
        one transaction (a file is never half stored)."""

    @abc.abstractmethod
    async def get_file(self, file_id: str) -> FileRecord | None: ...

    @abc.abstractmethod
    async def list_files(self, user_id: str) -> list[FileRecord]:
        """The user's uploads, newest first."""

    @abc.abstractmethod
    async def delete_file(self, file_id: str) -> bool:
        """Delete a file, its chunks, and its place in chats."""

    @abc.abstractmethod
    async def file_chunks(self, file_id: str) -> list[StoredChunk]:
        """A file's chunks in order."""

    @abc.abstractmethod
    async def attach_files(self, chat_id: str, file_ids: list[str]) -> None:
        """Attach files to a chat (those attached already stay once)."""

    @abc.abstractmethod
    async def chat_files(self, chat_ids: list[str]) -> dict[str, list[FileRecord]]:
        """The files attached to each of the chats (chats without files left out)."""

    # -- knowledge collections ------------------------------------------------------------
    # Their passages live in the collections engine (app/collections); the store keeps
    # what every process must agree on: names, owners, shares, documents and status.

    @abc.abstractmethod
    async def add_collection(self, record: CollectionRecord) -> None: ...

    @abc.abstractmethod
    async def get_collection(self, collection_id: str) -> CollectionRecord | None:
        """The collection with its shares and its documents and chunks counted."""

    @abc.abstractmethod
    async def list_collections(self, user_id: str) -> list[CollectionRecord]:
        """The user's collections and those shared with them, newest first."""

    @abc.abstractmethod
    async def update_collection(self, record: CollectionRecord) -> None:
        """Its name, description and shares as `record` says."""

    @abc.abstractmethod
    async def delete_collection(self, collection_id: str) -> bool:
        """The collection, its shares and its documents' records."""

    @abc.abstractmethod
    async def add_documents(
        self,
        records: Sequence[DocumentRecord],
        indexer: str = "",
        max_documents: int | None = None,
    ) -> list[DocumentRecord]:
        """New documents of one collection (status `indexing`, or `failed` when refused
        at once), in one transaction; `indexer` is the worker lease token of the process
        that reads them. With `max_documents`, those `indexing` past that many (failed
        ones not counted) are stored `failed` (413) instead — counted in the same
        transaction, so concurrent imports cannot pass it together. Returns the records
        as stored; `NotFound` when the collection is gone."""

    @abc.abstractmethod
    async def fail_orphaned_documents(
        self, error: str, created_before: float
    ) -> list[tuple[str, str]]:
        """Mark `failed` (with `error`) the collection documents still `indexing` that
        were added before `created_before` by a process whose worker lease has run out.
        Returns their (collection id, document id): each once, whichever process
        sweeps at the same time."""

    @abc.abstractmethod
    async def ready_documents(self, document_ids: Sequence[str]) -> set[str]:
        """Which of these documents exist and are `ready`."""

    # -- groups (sharing collections with the accounts of a group) --------------------------

    @abc.abstractmethod
    async def add_group(self, record: GroupRecord) -> None:
        """A new group with its members; `Conflict` when the name is taken."""

    @abc.abstractmethod
    async def get_group(self, group_id: str) -> GroupRecord | None: ...

    @abc.abstractmethod
    async def list_groups(self, member: str | None = None) -> list[GroupRecord]:
        """Every group (or those `member` is in), by name."""

    @abc.abstractmethod
    async def update_group(self, record: GroupRecord) -> bool:
        """Its name and members as `record` says; False when it does not exist."""

    @abc.abstractmethod
    async def delete_group(self, group_id: str) -> bool:
        """The group, its members and the collections' shares with it."""

    @abc.abstractmethod
    async def finish_document(self, record: DocumentRecord) -> None:
        """Set a document's status, pages, chunk count and error."""

    @abc.abstractmethod
    async def get_document(self, document_id: str) -> DocumentRecord | None: ...

    @abc.abstractmethod
    async def list_documents(
        self, collection_id: str, import_id: str | None = None
    ) -> list[DocumentRecord]:
        """A collection's documents (of one import), oldest first."""

    @abc.abstractmethod
    async def import_progress(
        self, collection_id: str, import_id: str
    ) -> tuple[int, int, list[DocumentRecord]]:
        """An import's documents: how many, how many have ended (not `indexing`), and
        the failed ones, oldest first — without reading the others."""

    @abc.abstractmethod
    async def delete_document(self, document_id: str) -> bool: ...

    # -- token usage ----------------------------------------------------------------------

    @abc.abstractmethod
    async def usage(self, user_id: str, since: float = 0.0) -> list[Usage]:
        """What the user's answers since `since` cost, summed per model."""

    @abc.abstractmethod
    async def tokens_on(self, day: int, user_id: str) -> int:
        """Tokens (prompt + completion) the user's answers used on `day` (UTC days since
        1970, the day each answer began): a count `finish_answer` adds to, in its
        transaction, the first time an answer's usage is saved (a later save of the
        same answer adds only what it grew by), and that deleting chats or answers
        never lowers — a daily quota reads it."""

    @abc.abstractmethod
    async def tokens_by_user(self, day: int) -> dict[str, int]:
        """`tokens_on(day, …)` of every user, by user id (users without any left out)."""

    # -- accounts ---------------------------------------------------------------------------

    @abc.abstractmethod
    async def add_account(
        self, account: Account, *, admin_if_none: bool = False, invite: str | None = None
    ) -> Account:
        """Create an account and return it as stored. In one transaction: with
        `admin_if_none`, it is made `admin` when no admin exists yet (so the first
        account of a deployment is its admin, however many sign up at once); with
        `invite` (an invite code's hash) that invite is spent, unless no admin exists
        yet (nobody could have made one). Raises `Conflict` when the email or the
        issuer + subject is taken and `Forbidden` for an invite that is unknown, spent
        or expired; then nothing is written."""

    @abc.abstractmethod
    async def get_account(self, account_id: str) -> Account | None: ...

    @abc.abstractmethod
    async def account_by_email(self, email: str) -> Account | None:
        """The account of a (lower-case) email."""

    @abc.abstractmethod
    async def account_by_subject(self, issuer: str, subject: str) -> Account | None: ...

    @abc.abstractmethod
    async def list_accounts(self, limit: int = 1000) -> list[Account]:
        """Every account, oldest first."""

    @abc.abstractmethod
    async def has_admin(self) -> bool:
        """Whether any account is an admin."""

    @abc.abstractmethod
    async def update_account(self, account_id: str, change: AccountChange) -> Account | None:
        """Apply an admin's change and return the account (None when there is none).
        Disabling an account deletes its sessions in the same transaction. Raises
        `Conflict` when the change would leave no enabled admin; then nothing changes."""

    # -- sessions (cookies) and API keys, by the SHA-256 of their secret ---------------------

    @abc.abstractmethod
    async def add_session(self, token_hash: str, account_id: str, expires_at: float) -> None:
        """A new session (expired ones are deleted on the way)."""

    @abc.abstractmethod
    async def session_account(self, token_hash: str) -> Account | None:
        """The account of a session that has not expired (disabled or not: the caller
        decides), or None."""

    @abc.abstractmethod
    async def delete_session(self, token_hash: str) -> bool: ...

    @abc.abstractmethod
    async def add_api_key(self, key: ApiKey, key_hash: str) -> None: ...

    @abc.abstractmethod
    async def api_key_account(self, key_hash: str) -> Account | None:
        """The account of a key that has not been revoked, or None."""

    @abc.abstractmethod
    async def list_api_keys(self, account_id: str) -> list[ApiKey]:
        """The account's keys, oldest first."""

    @abc.abstractmethod
    async def revoke_api_key(self, account_id: str, key_id: str) -> bool:
        """Delete one of the account's keys; False when it has no such key."""

    @abc.abstractmethod
    async def add_invite(self, code_hash: str, created_by: str, expires_at: float) -> None:
        """An invite code (by its hash) that one sign-up may spend before `expires_at`."""

    @abc.abstractmethod
    async def invite_usable(self, code_hash: str) -> bool:
        """Whether an invite code (by its hash) exists, is not spent and has not expired
        (a look before a sign-up's costly work; `add_account` is what spends it)."""
