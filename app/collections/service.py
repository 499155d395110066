"""Knowledge collections (PROTOCOL §12): create, share, import, list, delete, search.

The store keeps what every process must agree on (collections, shares, documents and
their status); the engine (`base.py`) keeps the passages. Imports are read, embedded
and indexed in the background (`imports.py`); the service checks who may start or
follow one, and deletes documents and collections (a delete races with indexing and
loses nowhere: the store's row goes first, then the passages, and a batch takes back
what it indexed for a document gone meanwhile).

Search is the one retrieval path (`retrieval.py`): BM25 over each collection's own
statistics and, with embeddings, the nearest passages, fused by reciprocal rank, then
reranked by `collections.rerank.url` when one is set; only `ready` documents answer.

Who may do what (§7): the owner everything; a user it is shared with, or a member of
a group it is shared with, may read and search it (403 for a change); anyone else
gets 404, as for a collection that does not exist. Groups are made by the admin.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, BinaryIO

from ..config import CollectionSettings, UploadSettings
from ..errors import BadRequest, Forbidden, NotFound
from ..ids import Snowflake, parse_id
from ..ownership import authorize
from ..results import SearchResult
from ..search.reader import Reader
from ..store import CollectionRecord, DocumentRecord, GroupRecord, Store
from .base import Hit
from .imports import SWEEP_GRACE, Importer, ImportSlot, Progress
from .retrieval import Retriever

MAX_NAME_CHARS = 200
MAX_DESCRIPTION_CHARS = 2000
MAX_SHARED = 100
MAX_GROUP_MEMBERS = 10_000


class CollectionService:
    def __init__(
        self,
        settings: CollectionSettings,
        uploads: UploadSettings,
        *,
        store: Store,
        retriever: Retriever,
        reader: Reader,
        ids: Snowflake,
        indexer: str = "",
    ) -> None:
        self.settings = settings
        self.store = store
        self.retriever = retriever
        self.engine = retriever.engine
        self.ids = ids
        self.imports = Importer(
            settings,
            uploads,
            store=store,
            engine=retriever.engine,
            embedder=retriever.embedder,
            reader=reader,
            ids=ids,
            indexer=indexer,
        )

    async def open(self) -> None:
        """Make the imports' spool folder and start the sweep of documents left
        `indexing`."""
        await self.imports.open()

    async def aclose(self) -> None:
        """Stop the imports still running: each marks its documents `failed` (add them
        again) and takes their passages back, within a moment; what is left is swept."""
        await self.imports.aclose()

    async def sweep(self, grace: float = SWEEP_GRACE) -> int:
        """`Importer.sweep`: fail the documents a dead process left `indexing`."""
        return await self.imports.sweep(grace)

    # -- collections ----------------------------------------------------------------------

    async def create(self, user_id: str, name: Any, description: Any = "") -> CollectionRecord:
        record = CollectionRecord(
            id=self.ids.next_str(),
            owner=user_id,
            name=_text(name, "name", MAX_NAME_CHARS, required=True),
            description=_text(description, "description", MAX_DESCRIPTION_CHARS),
            created_at=time.time(),
        )
        await self.store.add_collection(record)
        return record

    async def readable(self, user_id: str, collection_id: str) -> CollectionRecord:
        """The collection, if `user_id` owns it, or it is shared with them or with a
        group they are in; else `NotFound` (another user's collection is not even said
        to exist)."""
        record = await self.store.get_collection(collection_id)
        if record is None:
            raise NotFound("no such collection")
        if record.owner == user_id or user_id in record.shared:
            return record
        if record.groups and set(record.groups) & {g.id for g in await self.groups(user_id)}:
            return record
        raise NotFound("no such collection")

    async def owned(self, user_id: str, collection_id: str) -> CollectionRecord:
        """The collection, if `user_id` owns it; `Forbidden` for a user it is shared
        with (read-only), `NotFound` for anyone else."""
        record = await self.readable(user_id, collection_id)
        authorize(
            record.owner, user_id, refusal=Forbidden("this collection is shared with you read-only")
        )
        return record

    async def listed(self, user_id: str) -> list[CollectionRecord]:
        return await self.store.list_collections(user_id)

    async def update(
        self, user_id: str, collection_id: str, body: dict[str, Any]
    ) -> CollectionRecord:
        record = await self.owned(user_id, collection_id)
        unknown = set(body) - {"name", "description", "shared", "groups", "userId"}
        if unknown:
            raise BadRequest(f"cannot change {', '.join(sorted(unknown))}")
        changed = record
        if "name" in body:
            changed = replace(changed, name=_text(body["name"], "name", MAX_NAME_CHARS, True))
        if "description" in body:
            changed = replace(
                changed,
                description=_text(body["description"], "description", MAX_DESCRIPTION_CHARS),
            )
        if "shared" in body:
            changed = replace(changed, shared=_users(body["shared"], user_id))
        if "groups" in body:
            changed = replace(changed, groups=await self._group_ids(body["groups"]))
        await self.store.update_collection(changed)
        return await self.owned(user_id, collection_id)

    async def _group_ids(self, value: Any) -> tuple[str, ...]:
        if not isinstance(value, list) or len(value) > MAX_SHARED:
            raise BadRequest(f"groups must be a list of at most {MAX_SHARED} group ids")
        ids = tuple(dict.fromkeys(parse_id(v, "groups[]") for v in value))
        for group_id in ids:
            if await self.store.get_group(group_id) is None:
                raise BadRequest(f"groups: {group_id!r} is not a group")
        return ids

    async def delete(self, user_id: str, collection_id: str) -> None:
        """The store's rows first, then the engine's space: a batch still indexing into
        it finds its collection gone once its passages are in, and drops them."""
        await self.owned(user_id, collection_id)
        await self.store.delete_collection(collection_id)
        await self.engine.drop(collection_id)

    # -- groups -----------------------------------------------------------------------------

    async def groups(self, user_id: str) -> list[GroupRecord]:
        """The groups `user_id` is in."""
        return await self.store.list_groups(user_id)

    async def all_groups(self) -> list[GroupRecord]:
        return await self.store.list_groups()

    async def create_group(self, name: Any, members: Any = None) -> GroupRecord:
        record = GroupRecord(
            id=self.ids.next_str(),
            name=_text(name, "name", MAX_NAME_CHARS, required=True),
            created_at=time.time(),
            members=_members(members if members is not None else []),
        )
        await self.store.add_group(record)
        return record

    async def change_group(self, group_id: str, body: dict[str, Any]) -> GroupRecord:
        record = await self.store.get_group(group_id)
        if record is None:
            raise NotFound("no such group")
        unknown = set(body) - {"name", "members", "userId"}
        if unknown:
            raise BadRequest(f"cannot change {', '.join(sorted(unknown))}")
        if "name" in body:
            record = replace(record, name=_text(body["name"], "name", MAX_NAME_CHARS, True))
        if "members" in body:
            record = replace(record, members=_members(body["members"]))
        if not await self.store.update_group(record):
            raise NotFound("no such group")
        return record

    async def delete_group(self, group_id: str) -> None:
        if not await self.store.delete_group(group_id):
            raise NotFound("no such group")

    async def usable(self, user_id: str, collection_ids: Sequence[str]) -> list[CollectionRecord]:
        """The collections a chat request names, checked: `BadRequest` naming the first
        that does not exist or that the user may not read (PROTOCOL §1)."""
        found = []
        for collection_id in collection_ids:
            try:
                found.append(await self.readable(user_id, collection_id))
            except NotFound as exc:
                raise BadRequest(
                    f"collections: {collection_id!r} is not a collection you can read"
                ) from exc
        return found

    # -- documents --------------------------------------------------------------------------

    async def documents(self, user_id: str, collection_id: str) -> list[DocumentRecord]:
        await self.readable(user_id, collection_id)
        return await self.store.list_documents(collection_id)

    async def delete_document(self, user_id: str, collection_id: str, document_id: str) -> None:
        """The store's row first, then the passages: a batch indexing the document
        meanwhile finds its row gone once its passages are in, and takes them back."""
        await self.owned(user_id, collection_id)
        record = await self.store.get_document(document_id)
        if record is None or record.collection_id != collection_id:
            raise NotFound("no such document in this collection")
        await self.store.delete_document(document_id)
        await self.engine.delete_documents(collection_id, [document_id])

    # -- imports ----------------------------------------------------------------------------

    def importing(self, key: str) -> contextlib.AbstractAsyncContextManager[ImportSlot]:
        """Room for one more import of `key` (`Importer.importing`): 429 or 503 with a
        Retry-After, before the request's body is read."""
        return self.imports.importing(key)

    async def import_files(
        self,
        user_id: str,
        collection_id: str,
        files: Sequence[tuple[str, BinaryIO]],
        slot: ImportSlot,
    ) -> tuple[str, list[DocumentRecord]]:
        """`Importer.import_files` into a collection `user_id` owns."""
        await self.owned(user_id, collection_id)
        return await self.imports.import_files(collection_id, files, slot)

    async def import_urls(
        self, user_id: str, collection_id: str, urls: Any, slot: ImportSlot
    ) -> tuple[str, list[DocumentRecord]]:
        """`Importer.import_urls` into a collection `user_id` owns."""
        await self.owned(user_id, collection_id)
        return await self.imports.import_urls(collection_id, urls, slot)

    async def progress(self, user_id: str, collection_id: str, import_id: str) -> Progress:
        await self.readable(user_id, collection_id)
        return await self.imports.progress(collection_id, import_id)

    async def follow(
        self, user_id: str, collection_id: str, import_id: str
    ) -> AsyncIterator[Progress]:
        """`Importer.follow` of an import of a collection `user_id` may read; closing
        this closes it. Cancelling is safe."""
        await self.readable(user_id, collection_id)
        async with contextlib.aclosing(self.imports.follow(collection_id, import_id)) as changes:
            async for progress in changes:
                yield progress

    # -- search -----------------------------------------------------------------------------

    async def search(self, collections: Sequence[str], query: str, limit: int) -> list[Hit]:
        """The `limit` best passages of these collections for `query` (`Retriever`), of
        `ready` documents only: a document still being indexed, or whose delete is
        under way, answers nothing."""
        hits = await self.retriever.search(collections, query, limit)
        if not hits:
            return hits
        ready = await self.store.ready_documents([h.passage.document_id for h in hits])
        return [h for h in hits if h.passage.document_id in ready]

    def searcher(
        self, collections: Sequence[CollectionRecord], limit: int | None = None
    ) -> CollectionSearch:
        return CollectionSearch(self, [c.id for c in collections], limit or self.settings.passages)


@dataclass(frozen=True, slots=True)
class CollectionSearch:
    """`search_collection(query)` for one request: the passages of its collections as
    sources, best first. Small on purpose: the research loop calls it per
    sub-question, and a research agent's tool can call it as it is."""

    service: CollectionService
    collection_ids: list[str]
    limit: int

    async def __call__(self, query: str, limit: int | None = None) -> list[SearchResult]:
        hits = await self.service.search(self.collection_ids, query, limit or self.limit)
        return [as_source(hit) for hit in hits]


async def with_collections(
    out: Any, search: CollectionSearch, question: str, web: list[SearchResult]
) -> list[SearchResult]:
    """The collections' passages for `question` beside the web results, fused by rank
    (the two rankings are on no common scale): the best of each first, in turn."""
    out.emit("progress", data="searching your collections")
    passages = await search(question)
    if not web:
        return passages
    merged = []
    for i in range(max(len(web), len(passages))):
        merged += passages[i : i + 1] + web[i : i + 1]
    return merged


def as_source(hit: Hit) -> SearchResult:
    p = hit.passage
    return SearchResult(
        title=p.title,
        url=p.url or "File",
        snippet=p.text,
        page=p.page,
        collection_id=hit.space,
        document_id=p.document_id,
        score=hit.score,
    )


def _text(value: Any, name: str, limit: int, required: bool = False) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        raise BadRequest(f"{name} must be a{' non-empty' if required else ''} string")
    text = "".join(ch for ch in value if ch.isprintable()).strip()
    if len(text) > limit:
        raise BadRequest(f"{name} is longer than {limit} characters")
    return text


def _members(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_GROUP_MEMBERS:
        raise BadRequest(f"members must be a list of at most {MAX_GROUP_MEMBERS} user ids")
    return tuple(sorted(dict.fromkeys(parse_id(v, "members[]") for v in value)))


def _users(value: Any, owner: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_SHARED:
        raise BadRequest(f"shared must be a list of at most {MAX_SHARED} user ids")
    return tuple(dict.fromkeys(u for u in (parse_id(v, "shared[]") for v in value) if u != owner))
