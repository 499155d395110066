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
from collections.abc import Sequence
from typing import Any

from .records import (
    Account,
    AccountChange,
    ApiKey,
    Chat,
    Checkpoint,
    CollectionRecord,
    Delivery,
    DocumentRecord,
    FileRecord,
    GroupRecord,
    Saved,
    Schedule,
    ScheduleRun,
    ShareRecord,
    StoredChunk,
    StoredMessage,
    StoredResponse,
    StreamingAnswer,
    Usage,
    iso,
)
from .sql import bad_invite, mapping_errors


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
    ) -> list[StreamingAnswer]:
        """Answers still `streaming` that began before `created_before`, oldest first
        (by `created_at`, then id), from after the (created_at, id) `after`: their ids,
        not their text (the sweeper reads every running answer's row every few
        seconds, and `get_message` only an orphan's)."""

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

    # -- shared chats ------------------------------------------------------------------------

    @abc.abstractmethod
    async def put_share(self, share: ShareRecord) -> ShareRecord:
        """Share a chat, or refresh its share: a chat has one share, so a chat shared
        already keeps its share's id and `created_at`, and takes the title, display
        name, snapshot and `updated_at` of `share`. Returns the share as stored."""

    @abc.abstractmethod
    async def get_share(self, share_id: str) -> ShareRecord | None:
        """A share with its snapshot."""

    @abc.abstractmethod
    async def list_shares(self, user_id: str) -> list[ShareRecord]:
        """The user's shares without their snapshots, the latest shared first."""

    @abc.abstractmethod
    async def delete_share(self, chat_id: str) -> bool:
        """Take back a chat's share; False when it had none. (Deleting the chat
        deletes its share too.)"""

    # -- scheduled research (PROTOCOL §16) -----------------------------------------------

    @abc.abstractmethod
    async def add_schedule(self, schedule: Schedule, chat: Chat, max_per_user: int) -> bool:
        """A new schedule and its chat (unless that exists), in one transaction; False
        (nothing written) when its user has `max_per_user` schedules already — counted
        under a lock, so two at once cannot both pass."""

    @abc.abstractmethod
    async def get_schedule(self, schedule_id: str) -> Schedule | None: ...

    @abc.abstractmethod
    async def list_schedules(self, user_id: str) -> list[Schedule]:
        """The user's schedules, oldest first."""

    @abc.abstractmethod
    async def update_schedule(self, schedule: Schedule) -> bool:
        """Every field a user or a pause may change, as `schedule` says."""

    @abc.abstractmethod
    async def delete_schedule(self, schedule_id: str) -> bool:
        """The schedule and its runs; its chat stays."""

    @abc.abstractmethod
    async def delete_user_schedules(self, user_id: str) -> int:
        """A user's schedules, their runs and their chats (the user is going)."""

    @abc.abstractmethod
    async def due_schedules(self, now: float, limit: int = 100) -> list[Schedule]:
        """Enabled schedules whose `next_run_at` is at or before `now`, earliest first."""

    @abc.abstractmethod
    async def claim_run(
        self, schedule: Schedule, next_run_at: float, run: ScheduleRun, owner: str, ttl: float
    ) -> bool:
        """Take the schedule's due time `schedule.next_run_at` for `run`, leased to `owner`
        for `ttl` seconds, and move the schedule on to `next_run_at` — in one transaction,
        and only while its `next_run_at` is still the one read: of every process that
        tries for one due time, exactly one gets True."""

    @abc.abstractmethod
    async def add_run(self, run: ScheduleRun, owner: str, ttl: float) -> bool:
        """A run asked for now (not a due time), leased to `owner`."""

    @abc.abstractmethod
    async def renew_run(self, run_id: str, owner: str, ttl: float) -> bool:
        """Extend a run's lease; False when `owner` no longer holds it."""

    @abc.abstractmethod
    async def set_run_message(self, run_id: str, owner: str, message_id: str) -> bool:
        """The answer a run started (an attempt with one is counted, see `take_over_run`)."""

    @abc.abstractmethod
    async def release_run(self, run_id: str, owner: str) -> None:
        """Let the run's lease run out now (to be taken again)."""

    @abc.abstractmethod
    async def abandoned_runs(self, limit: int = 100) -> list[ScheduleRun]:
        """Runs still `running` whose lease has run out, longest ago first."""

    @abc.abstractmethod
    async def take_over_run(self, run_id: str, owner: str, ttl: float) -> ScheduleRun | None:
        """Lease an abandoned run to `owner` (one process of those that try): its attempt
        counts one more when the holder that went had started an answer. None when it is
        not abandoned, or was retried once already."""

    @abc.abstractmethod
    async def end_run(
        self,
        run: ScheduleRun,
        owner: str | None,
        pause_after: int,
        delivery: Delivery | None = None,
    ) -> bool:
        """In one transaction: the run's end (`status`, `ended_at`, `changed`, `error`,
        `message_id`) if `owner` holds it (`None`: if its lease ran out), its schedule's
        failures in a row (reset by a completed or cancelled run; the schedule disabled
        with a reason at `pause_after`), and `delivery` put in the outbox. False (nothing
        written) when the run is not `owner`'s to end."""

    @abc.abstractmethod
    async def get_run(self, run_id: str) -> ScheduleRun | None: ...

    @abc.abstractmethod
    async def list_runs(self, schedule_id: str, limit: int = 50) -> list[ScheduleRun]:
        """A schedule's runs, newest first."""

    @abc.abstractmethod
    async def previous_answer(self, schedule_id: str, run_id: str) -> str | None:
        """The answer id of the schedule's latest completed run other than `run_id`."""

    @abc.abstractmethod
    async def claim_deliveries(
        self, now: float, owner: str, ttl: float, limit: int = 20
    ) -> list[Delivery]:
        """Pending webhooks due at `now`, each leased to `owner` for `ttl` seconds (one
        process gets each)."""

    @abc.abstractmethod
    async def end_delivery(self, delivery: Delivery, owner: str) -> bool:
        """A delivery's outcome: its status, attempts, next attempt and error."""

    @abc.abstractmethod
    async def get_delivery(self, delivery_id: str) -> Delivery | None: ...


__all__ = ["Store", "bad_invite", "iso", "mapping_errors"]
