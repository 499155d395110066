"""Knowledge collections (their shares and documents) and groups of accounts: the
tables and their SQL. The collections' passages are in the collections engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..errors import NotFound
from .records import CollectionRecord, DocumentRecord, GroupRecord
from .sql import Connection, Database, mapped

COLLECTION_COLUMNS = "id, owner, name, description, created_at"
DOCUMENT_COLUMNS = (
    "id, collection_id, import_id, title, kind, size, created_at, url, status, pages, chunks,"
    " error, code"
)
GROUP_COLUMNS = "id, name, created_at"
COLLECTION_COUNTS = (
    "(SELECT count(*) FROM collection_documents d WHERE d.collection_id = c.id),"
    " (SELECT coalesce(sum(d.chunks), 0) FROM collection_documents d"
    " WHERE d.collection_id = c.id)"
)
SELECT_COLLECTION = f"SELECT {COLLECTION_COLUMNS}, {COLLECTION_COUNTS} FROM collections c"
SELECT_DOCUMENTS = f"SELECT {DOCUMENT_COLUMNS} FROM collection_documents"

MIGRATIONS: dict[int, str | dict[str, str]] = {
    # 8: knowledge collections (their passages are in the collections engine)
    8: """
    CREATE TABLE collections (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        name TEXT NOT NULL,
        description TEXT NOT NULL,
        created_at {real} NOT NULL
    );
    CREATE INDEX collections_by_owner ON collections (owner, created_at);
    CREATE TABLE collection_shares (
        collection_id TEXT NOT NULL REFERENCES collections (id) ON DELETE CASCADE,
        user_id TEXT NOT NULL,
        PRIMARY KEY (collection_id, user_id)
    );
    CREATE INDEX collection_shares_by_user ON collection_shares (user_id);
    CREATE TABLE collection_documents (
        id TEXT PRIMARY KEY,
        collection_id TEXT NOT NULL REFERENCES collections (id) ON DELETE CASCADE,
        import_id TEXT NOT NULL,
        title TEXT NOT NULL,
        kind TEXT NOT NULL,
        size {bigint} NOT NULL,
        created_at {real} NOT NULL,
        url TEXT NOT NULL DEFAULT '',
        status TEXT NOT NULL,
        pages INTEGER NOT NULL DEFAULT 0,
        chunks INTEGER NOT NULL DEFAULT 0,
        error TEXT NOT NULL DEFAULT '',
        code INTEGER NOT NULL DEFAULT 0,
        indexer TEXT
    );
    CREATE INDEX collection_documents_indexing ON collection_documents (created_at)
        WHERE status = 'indexing';
    CREATE INDEX collection_documents_by_collection ON collection_documents (collection_id, created_at);
    CREATE INDEX collection_documents_by_import ON collection_documents (import_id);
    """,
    # 11: groups of accounts, made by the admin; a collection shared with a group is
    # readable by its members
    11: """
    CREATE TABLE user_groups (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        created_at {real} NOT NULL
    );
    CREATE TABLE user_group_members (
        group_id TEXT NOT NULL REFERENCES user_groups (id) ON DELETE CASCADE,
        user_id TEXT NOT NULL,
        PRIMARY KEY (group_id, user_id)
    );
    CREATE INDEX user_group_members_by_user ON user_group_members (user_id);
    CREATE TABLE collection_group_shares (
        collection_id TEXT NOT NULL REFERENCES collections (id) ON DELETE CASCADE,
        group_id TEXT NOT NULL REFERENCES user_groups (id) ON DELETE CASCADE,
        PRIMARY KEY (collection_id, group_id)
    );
    CREATE INDEX collection_group_shares_by_group ON collection_group_shares (group_id);
    """,
}


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


async def _write_shares(tx: Connection, record: CollectionRecord) -> None:
    await tx.executemany(
        "INSERT INTO collection_shares (collection_id, user_id) VALUES (?, ?)",
        [(record.id, user) for user in record.shared],
    )
    await tx.executemany(
        "INSERT INTO collection_group_shares (collection_id, group_id) VALUES (?, ?)",
        [(record.id, group) for group in record.groups],
    )


async def _write_members(tx: Connection, record: GroupRecord) -> None:
    await tx.executemany(
        "INSERT INTO user_group_members (group_id, user_id) VALUES (?, ?)",
        [(record.id, user) for user in record.members],
    )


class CollectionTables:
    """The collections' and groups' part of a `Store` (see `Store` for each method's
    contract)."""

    db: Database

    async def _children(
        self, table: str, parent: str, child: str, rows: list[Any]
    ) -> dict[str, list[str]]:
        """`child` of `table` by `parent`, for the parents of `rows` (their first column),
        each list in order."""
        among, ids = self.db.dialect.any_of([row[0] for row in rows])
        found: dict[str, list[str]] = {}
        for of, value in await self.db.fetch(
            f"SELECT {parent}, {child} FROM {table} WHERE {parent} {among} ORDER BY 2", *ids
        ):
            found.setdefault(of, []).append(value)
        return found

    async def _with_shares(self, rows: list[Any]) -> list[CollectionRecord]:
        if not rows:
            return []
        shares = await self._children("collection_shares", "collection_id", "user_id", rows)
        groups = await self._children("collection_group_shares", "collection_id", "group_id", rows)
        return [
            collection_from_row(tuple(r), shares.get(r[0], ()), groups.get(r[0], ())) for r in rows
        ]

    @mapped
    async def add_collection(self, record: CollectionRecord) -> None:
        async with self.db.transaction() as tx:
            await tx.execute(
                f"INSERT INTO collections ({COLLECTION_COLUMNS}) VALUES (?, ?, ?, ?, ?)",
                record.id,
                record.owner,
                record.name,
                record.description,
                record.created_at,
            )
            await _write_shares(tx, record)

    @mapped
    async def get_collection(self, collection_id: str) -> CollectionRecord | None:
        rows = await self.db.fetch(f"{SELECT_COLLECTION} WHERE c.id = ?", collection_id)
        found = await self._with_shares(rows)
        return found[0] if found else None

    @mapped
    async def list_collections(self, user_id: str) -> list[CollectionRecord]:
        rows = await self.db.fetch(
            f"{SELECT_COLLECTION} WHERE c.owner = ? OR c.id IN"
            " (SELECT collection_id FROM collection_shares WHERE user_id = ?) OR c.id IN"
            " (SELECT s.collection_id FROM collection_group_shares s JOIN user_group_members m"
            " ON m.group_id = s.group_id WHERE m.user_id = ?)"
            " ORDER BY c.created_at DESC, c.id",
            user_id,
            user_id,
            user_id,
        )
        return await self._with_shares(rows)

    @mapped
    async def update_collection(self, record: CollectionRecord) -> None:
        async with self.db.transaction() as tx:
            await tx.execute(
                "UPDATE collections SET name = ?, description = ? WHERE id = ?",
                record.name,
                record.description,
                record.id,
            )
            for table in ("collection_shares", "collection_group_shares"):
                await tx.execute(f"DELETE FROM {table} WHERE collection_id = ?", record.id)
            await _write_shares(tx, record)

    @mapped
    async def delete_collection(self, collection_id: str) -> bool:
        # shares and documents go with it (ON DELETE CASCADE)
        return await self.db.execute("DELETE FROM collections WHERE id = ?", collection_id) == 1

    @mapped
    async def add_documents(
        self,
        records: Sequence[DocumentRecord],
        indexer: str = "",
        max_documents: int | None = None,
    ) -> list[DocumentRecord]:
        if not records:
            return []
        collection_id = records[0].collection_id
        async with self.db.transaction() as tx:
            # the collection's row locked (SQLite's writer holds the whole file):
            # concurrent imports into it count in turn
            found = await tx.fetchval(
                "SELECT 1 FROM collections WHERE id = ?{for_update}", collection_id
            )
            if found is None:
                raise NotFound("no such collection")
            # documents that count against `max_documents` (a failed one has nothing)
            counted = await tx.fetchval(
                "SELECT count(*) FROM collection_documents WHERE collection_id = ?"
                " AND status != 'failed'",
                collection_id,
            )
            stored = limit_documents(records, int(counted or 0), max_documents)
            await tx.executemany(
                f"INSERT INTO collection_documents ({DOCUMENT_COLUMNS}, indexer)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(*document_params(d), indexer or None) for d in stored],
            )
        return stored

    @mapped
    async def fail_orphaned_documents(
        self, error: str, created_before: float
    ) -> list[tuple[str, str]]:
        async with self.db.transaction() as tx:
            rows = await tx.fetch(
                "UPDATE collection_documents SET status = 'failed', error = ?, code = 500"
                " WHERE status = 'indexing' AND created_at < ? AND (indexer IS NULL OR indexer"
                " NOT IN (SELECT token FROM workers WHERE expires_at > {now}))"
                " RETURNING collection_id, id",
                error,
                created_before,
            )
        return [(row[0], row[1]) for row in rows]

    @mapped
    async def ready_documents(self, document_ids: Sequence[str]) -> set[str]:
        if not document_ids:
            return set()
        among, ids = self.db.dialect.any_of(list(dict.fromkeys(document_ids)))
        rows = await self.db.fetch(
            f"SELECT id FROM collection_documents WHERE id {among} AND status = 'ready'", *ids
        )
        return {row[0] for row in rows}

    @mapped
    async def finish_document(self, record: DocumentRecord) -> None:
        d = record
        await self.db.execute(
            "UPDATE collection_documents SET status = ?, pages = ?, chunks = ?, error = ?,"
            " code = ? WHERE id = ?",
            *(d.status, d.pages, d.chunks, d.error, d.code, d.id),
        )

    @mapped
    async def get_document(self, document_id: str) -> DocumentRecord | None:
        row = await self.db.fetchrow(f"{SELECT_DOCUMENTS} WHERE id = ?", document_id)
        return document_from_row(tuple(row)) if row else None

    @mapped
    async def list_documents(
        self, collection_id: str, import_id: str | None = None
    ) -> list[DocumentRecord]:
        if import_id is None:
            rows = await self.db.fetch(
                f"{SELECT_DOCUMENTS} WHERE collection_id = ? ORDER BY created_at, id",
                collection_id,
            )
        else:
            rows = await self.db.fetch(
                f"{SELECT_DOCUMENTS} WHERE collection_id = ? AND import_id = ?"
                " ORDER BY created_at, id",
                collection_id,
                import_id,
            )
        return [document_from_row(tuple(row)) for row in rows]

    @mapped
    async def import_progress(
        self, collection_id: str, import_id: str
    ) -> tuple[int, int, list[DocumentRecord]]:
        counts = await self.db.fetchrow(
            "SELECT count(*), coalesce(sum(CASE WHEN status = 'indexing' THEN 0 ELSE 1 END), 0)"
            " FROM collection_documents WHERE collection_id = ? AND import_id = ?",
            collection_id,
            import_id,
        )
        total, done = (int(counts[0]), int(counts[1])) if counts else (0, 0)
        if not total:
            return 0, 0, []
        failed = await self.db.fetch(
            f"{SELECT_DOCUMENTS} WHERE collection_id = ? AND import_id = ? AND status = 'failed'"
            " ORDER BY created_at, id",
            collection_id,
            import_id,
        )
        return total, done, [document_from_row(tuple(row)) for row in failed]

    @mapped
    async def delete_document(self, document_id: str) -> bool:
        return (
            await self.db.execute("DELETE FROM collection_documents WHERE id = ?", document_id) == 1
        )

    # -- groups -------------------------------------------------------------------------------

    async def _with_members(self, rows: list[Any]) -> list[GroupRecord]:
        if not rows:
            return []
        members = await self._children("user_group_members", "group_id", "user_id", rows)
        return [GroupRecord(r[0], r[1], r[2], tuple(members.get(r[0], ()))) for r in rows]

    @mapped
    async def add_group(self, record: GroupRecord) -> None:
        async with self.db.transaction() as tx:
            await tx.execute(
                f"INSERT INTO user_groups ({GROUP_COLUMNS}) VALUES (?, ?, ?)",
                record.id,
                record.name,
                record.created_at,
            )
            await _write_members(tx, record)

    @mapped
    async def get_group(self, group_id: str) -> GroupRecord | None:
        rows = await self.db.fetch(
            f"SELECT {GROUP_COLUMNS} FROM user_groups WHERE id = ?", group_id
        )
        found = await self._with_members(rows)
        return found[0] if found else None

    @mapped
    async def list_groups(self, member: str | None = None) -> list[GroupRecord]:
        if member is None:
            rows = await self.db.fetch(f"SELECT {GROUP_COLUMNS} FROM user_groups ORDER BY name")
        else:
            rows = await self.db.fetch(
                f"SELECT {GROUP_COLUMNS} FROM user_groups WHERE id IN"
                " (SELECT group_id FROM user_group_members WHERE user_id = ?) ORDER BY name",
                member,
            )
        return await self._with_members(rows)

    @mapped
    async def update_group(self, record: GroupRecord) -> bool:
        async with self.db.transaction() as tx:
            if (
                await tx.execute(
                    "UPDATE user_groups SET name = ? WHERE id = ?", record.name, record.id
                )
                != 1
            ):
                return False
            await tx.execute("DELETE FROM user_group_members WHERE group_id = ?", record.id)
            await _write_members(tx, record)
            return True

    @mapped
    async def delete_group(self, group_id: str) -> bool:
        # members and the collections' shares with it go with it (ON DELETE CASCADE)
        return await self.db.execute("DELETE FROM user_groups WHERE id = ?", group_id) == 1
