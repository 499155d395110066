"""The collections engine contract, the same tests on every engine, each run for real:
the embedded one (Tantivy); Milvus Lite in-process (`milvus:///file.db`); and Milvus
Lite started as a server process on loopback (`milvus://127.0.0.1:<port>`: the network
path a Milvus server or cluster is reached by, through the same client). BM25 uses the
statistics of the whole space, is close to a reference BM25 (bm25s, same tokens and
parameters), filters by document, and what is deleted is gone."""

from __future__ import annotations

import asyncio
import contextlib
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import bm25s
import numpy as np
import pytest

from app.collections import open_engine
from app.collections.base import Engine, Passage
from app.collections.retrieval import reembed
from app.extract import chunk_pages
from app.scoring import terms
from bench.corpus import generate
from tests.servers import free_port, wait_for_port

pytestmark = pytest.mark.anyio

ENGINES = ["tantivy", "milvus", "milvus-server"]


@contextlib.contextmanager
def milvus_server(folder: Path) -> Iterator[str]:
    """Milvus Lite's gRPC server (`python -m milvus_lite server`) as its own process on
    127.0.0.1; its `milvus://` URL."""
    for _ in range(5):  # a port taken between choosing and binding: choose again
        port = free_port()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "milvus_lite",
                "server",
                "--data-dir",
                str(folder),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--max-workers",
                "4",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for_port(port, timeout=30)
        except RuntimeError:
            process.kill()
            process.wait(10)
            continue
        try:
            yield f"milvus://127.0.0.1:{port}"
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        return
    raise RuntimeError("the Milvus Lite server did not start")


@contextlib.contextmanager
def engine_url(kind: str, folder: Path) -> Iterator[str]:
    if kind == "tantivy":
        yield f"tantivy:///{folder}/index"
    elif kind == "milvus":
        yield f"milvus:///{folder}/milvus.db"
    else:
        with milvus_server(folder / "milvus-server") as url:
            yield url


@pytest.fixture(params=ENGINES)
async def engine(request, tmp_path):
    with engine_url(request.param, tmp_path) as url:
        async with open_engine(url) as opened:
            yield opened


def passage(document: str, text: str, n: int = 0, page: int = 1) -> Passage:
    return Passage(document, n, page, f"{document}.txt", "File", text)


def test_an_unknown_engine_url_is_refused():
    with pytest.raises(ValueError, match="unsupported collections URL"):
        open_engine("elastic://somewhere")


async def test_bm25_weighs_a_term_by_its_rarity_in_the_whole_space(engine: Engine):
    common = [passage(f"c{i}", f"turbine notes {i}, the turbine was checked") for i in range(20)]
    repeats = passage("repeats", "turbine turbine turbine turbine turbine turbine blades")
    rare = passage("rare", "the zephyrine coating was applied to one blade")
    await engine.add("space", [*common, repeats, rare])
    hits = await engine.lexical("space", "turbine zephyrine", 5)
    assert hits[0].passage.document_id == "rare"
    assert hits[0].passage == rare and hits[0].space == "space"
    assert await engine.lexical("other-space", "turbine", 5) == []


async def test_spaces_keep_their_own_statistics_and_passages(engine: Engine):
    await engine.add("a", [passage("x", "alpha beta"), passage("y", "alpha gamma")])
    await engine.add("b", [passage("z", "beta delta")])
    assert [h.passage.document_id for h in await engine.lexical("b", "alpha beta", 5)] == ["z"]
    assert await engine.spaces() == ["a", "b"]
    assert await engine.has_document("a", "x") and not await engine.has_document("b", "x")
    await engine.drop("a")
    assert await engine.lexical("a", "alpha", 5) == []
    assert [p.document_id for p in await engine.passages("b")] == ["z"]
    assert await engine.spaces() == ["b"]


async def test_a_search_kept_to_some_documents_and_deletes(engine: Engine):
    await engine.add(
        "s", [passage("d1", "red apples"), passage("d2", "red cherries"), passage("d3", "green")]
    )
    only = await engine.lexical("s", "red", 5, documents=["d2", "d3"])
    assert [h.passage.document_id for h in only] == ["d2"]
    assert await engine.lexical("s", "red", 5, documents=[]) == []
    await engine.delete_documents("s", ["d1"])
    assert [h.passage.document_id for h in await engine.lexical("s", "red", 5)] == ["d2"]
    assert [p.document_id for p in await engine.passages("s")] == ["d2", "d3"]
    await engine.add("s", [passage("d2", "blue cherries", n=0), passage("d2", "more", n=1)])
    assert await engine.lexical("s", "red", 5) == []  # a document added again is replaced
    assert [(p.document_id, p.n) for p in await engine.passages("s")] == [
        ("d2", 0),
        ("d2", 1),
        ("d3", 0),
    ]


async def test_nearest_by_cosine_and_spaces_without_vectors(engine: Engine):
    vectors = np.array([[1, 0, 0], [0.9, 0.1, 0], [0, 0, 1]], dtype=np.float32)
    await engine.add(
        "v", [passage("a", "one"), passage("b", "two"), passage("c", "three")], vectors
    )
    near = await engine.nearest("v", np.array([1, 0, 0], dtype=np.float32), 2)
    assert [h.passage.document_id for h in near] == ["a", "b"]
    assert near[0].score == pytest.approx(1.0, abs=1e-5)
    kept = await engine.nearest("v", np.array([1, 0, 0], dtype=np.float32), 2, documents=["c"])
    assert [h.passage.document_id for h in kept] == ["c"]
    assert await engine.has_vectors("v")
    await engine.add("plain", [passage("a", "one")])
    assert not await engine.has_vectors("plain")
    assert await engine.nearest("plain", np.array([1, 0, 0], dtype=np.float32), 2) == []


def ndcg_at_10(ranked: list[str], answer: str) -> float:
    return next((1 / math.log2(i + 2) for i, d in enumerate(ranked[:10]) if d == answer), 0.0)


async def test_bm25_ranks_as_the_reference_implementation_does(engine: Engine):
    documents, questions = generate(150, pages=2, words_per_page=150, seed=11)
    passages = [
        Passage(str(d.number), c.n, c.page, d.title, "File", c.text)
        for d in documents
        for c in chunk_pages(d.pages, 120, 20)
    ]
    await engine.add("corpus", passages)
    reference = bm25s.BM25(method="lucene", k1=1.2, b=0.75)
    reference.index([terms(p.text) for p in passages], show_progress=False)
    ours, theirs = [], []
    for q in questions[:80]:
        got = [h.passage.document_id for h in await engine.lexical("corpus", q.text, 30)]
        ids, _ = reference.retrieve([terms(q.text)], k=30, show_progress=False)
        want = [passages[i].document_id for i in ids[0]]
        ours.append(ndcg_at_10(list(dict.fromkeys(got)), str(q.answer)))
        theirs.append(ndcg_at_10(list(dict.fromkeys(want)), str(q.answer)))
    assert abs(sum(ours) / len(ours) - sum(theirs) / len(theirs)) <= 0.01
    assert sum(ours) / len(ours) > 0.8


async def test_a_large_space_finds_the_nearest_through_its_bits(tmp_path, monkeypatch):
    """Past `QUANTIZE_ROWS` passages the embedded engine takes candidates by the signs of
    the vectors and rescores them exactly: the same ten nearest as brute force."""
    from app.collections import vectors as memory

    monkeypatch.setattr(memory, "QUANTIZE_ROWS", 1000)
    rng = np.random.default_rng(1)
    centers = rng.standard_normal((40, 128)).astype(np.float32)
    vectors = centers[rng.integers(0, 40, 3000)] + 0.6 * rng.standard_normal((3000, 128))
    passages = [passage(f"d{i}", f"text {i}") for i in range(3000)]
    async with open_engine(f"tantivy:///{tmp_path}/q") as engine:
        await engine.add("big", passages, vectors.astype(np.float32))
        queries = centers[:10] + 0.6 * rng.standard_normal((10, 128))
        unit_rows = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
        agree = 0
        for q in queries.astype(np.float32):
            got = [h.passage.document_id for h in await engine.nearest("big", q, 10)]
            exact = np.argsort(-(unit_rows @ (q / np.linalg.norm(q))))[:10]
            agree += len(set(got) & {f"d{i}" for i in exact})
            kept = await engine.nearest("big", q, 3, documents=["d5", "d7"])
            assert {h.passage.document_id for h in kept} <= {"d5", "d7"} and kept
        assert engine._vectors["big"].codes is not None  # the two-step path ran
        assert agree >= 95  # of 100


async def test_new_vectors_are_swapped_in_at_once_and_a_failure_changes_nothing(engine: Engine):
    """`set_vectors` (what `reembed` calls): a new width, then none; passages and BM25
    stay as they were; one that raises leaves the space as it was."""
    passages = [passage("a", "red apples"), passage("b", "green pears"), passage("c", "blue")]
    await engine.add("v", passages, np.eye(3, dtype=np.float32))
    wider = np.zeros((3, 5), dtype=np.float32)
    wider[0, 4] = wider[1, 0] = wider[2, 1] = 1.0
    with pytest.raises(ValueError):  # fewer vectors than passages: refused whole
        await engine.set_vectors("v", await engine.passages("v"), wider[:2])
    near = await engine.nearest("v", np.array([0, 1, 0], dtype=np.float32), 1)
    assert [h.passage.document_id for h in near] == ["b"]  # the old vectors still answer
    await engine.set_vectors("v", await engine.passages("v"), wider)
    near = await engine.nearest("v", np.array([0, 0, 0, 0, 1], dtype=np.float32), 1)
    assert [h.passage.document_id for h in near] == ["a"]
    assert await engine.nearest("v", np.array([0, 1, 0], dtype=np.float32), 1) == []
    assert await engine.passages("v") == passages
    assert [h.passage.document_id for h in await engine.lexical("v", "pears", 5)] == ["b"]
    await engine.set_vectors("v", await engine.passages("v"), None)
    assert not await engine.has_vectors("v")
    assert await engine.passages("v") == passages
    assert await engine.spaces() == ["v"]


async def test_searches_find_every_passage_while_a_space_is_reembedded(tmp_path):
    """Re-embedding swaps the vectors in at once: a search meanwhile never meets a
    space emptied for rewriting."""
    from app.config import EmbeddingsSettings
    from app.model import Embedder

    async with open_engine(f"tantivy:///{tmp_path}/r") as engine:
        many = [passage(f"d{i:03d}", f"harbour report {i}") for i in range(200)]
        await engine.add("s", many, np.ones((200, 4), dtype=np.float32))
        embedder = Embedder(EmbeddingsSettings(model=""))  # no model: vectors removed
        seen: list[int] = []
        running = asyncio.create_task(reembed(engine, embedder, ["s"], 16))
        while not running.done():
            seen.append(len(await engine.lexical("s", "harbour", 500)))
            await asyncio.sleep(0)
        assert await running == 200
        await embedder.aclose()
        assert seen and set(seen) == {200}
        assert len(await engine.passages("s")) == 200 and not await engine.has_vectors("s")


async def test_every_passage_is_read_past_milvus_query_window(tmp_path, monkeypatch):
    """A Milvus server refuses a query whose offset + limit passes 16,384
    (`max_query_result_window`); Milvus Lite does not check it, so the test makes its
    server refuse as Milvus does (at a smaller window, to stay quick)."""
    from milvus_lite.adapter.grpc import servicer

    window = 2500
    query = servicer.MilvusServicer.Query

    def refusing(self, request, context):
        params = {kv.key: kv.value for kv in request.query_params}
        if int(params.get("offset", 0) or 0) + int(params.get("limit", 0) or 0) > window:
            raise ValueError(f"invalid max query result window, (offset+limit) > {window}")
        return query(self, request, context)

    monkeypatch.setattr(servicer.MilvusServicer, "Query", refusing)
    async with open_engine(f"milvus:///{tmp_path}/window.db") as engine:
        many = [passage(f"d{i:04d}", f"note {i}") for i in range(3200)]
        for start in range(0, len(many), 800):
            await engine.add("big", many[start : start + 800])
        got = await engine.passages("big")
    assert [p.document_id for p in got] == [p.document_id for p in many]


async def test_the_embedded_engine_keeps_a_bounded_cache_and_appends_new_rows(tmp_path):
    """Vectors of the spaces searched last, at most `vector_cache_bytes` together; a
    write has the next search read only the rows added since, one read at a time."""
    from app.collections.tantivy_engine import TantivyEngine

    rng = np.random.default_rng(2)
    budget = 3 * 100 * 32 * 4 + 3 * 64 * 100  # about three spaces of 100 rows × 32
    async with open_engine(f"tantivy:///{tmp_path}/c", vector_cache_bytes=budget) as engine:
        assert isinstance(engine, TantivyEngine)
        for space in ("a", "b", "c", "d"):
            rows = [passage(f"{space}{i}", f"text {i}") for i in range(100)]
            await engine.add(space, rows, rng.standard_normal((100, 32), dtype=np.float32))
            await engine.nearest(space, rng.standard_normal(32, dtype=np.float32), 3)
        assert list(engine._vectors) == ["b", "c", "d"]  # "a", searched first, let go
        assert engine._cached_bytes <= budget

        loads: list[int] = []
        running = 0
        load = engine._load

        def counted(space, cached):
            nonlocal running
            running += 1
            loads.append(running)
            try:
                return load(space, cached)
            finally:
                running -= 1

        engine._load = counted  # type: ignore[method-assign]
        before = engine._vectors["d"]
        await engine.add(
            "d", [passage("d-new", "fresh")], rng.standard_normal((1, 32), dtype=np.float32)
        )
        query = rng.standard_normal(32, dtype=np.float32)
        await asyncio.gather(*(engine.nearest("d", query, 3) for _ in range(8)))
        after = engine._vectors["d"]
        assert loads == [1]  # eight searches, one read
        assert after.count == 101 and after.keys[-1] == ("d-new", 0)
        assert np.shares_memory(after.buffer, before.buffer) or after.buffer is not None
        assert np.array_equal(after.matrix[:100], before.matrix)
        hits = await engine.nearest("d", rng.standard_normal(32, dtype=np.float32), 200)
        assert len(hits) == 101
        await engine.delete_documents("d", ["d0"])  # a delete: read whole again
        assert len(await engine.nearest("d", query, 200)) == 100
        assert loads == [1, 1]


def test_engines_opening_one_new_folder_at_once_all_open(tmp_path):
    """Workers starting together on one collections folder: each finds the schema made
    (and brought up to date) once, and none fails on another's half of it."""
    import threading

    from app.collections.tantivy_engine import TantivyEngine

    for attempt in range(10):
        engines = [TantivyEngine(f"tantivy:///{tmp_path}/c{attempt}") for _ in range(6)]
        start = threading.Barrier(len(engines))
        failures: list[BaseException] = []

        def open_one(
            engine: TantivyEngine, start: threading.Barrier, failures: list[BaseException]
        ) -> None:
            start.wait()
            try:
                engine._open()
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=open_one, args=(e, start, failures)) for e in engines]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert failures == []
        for engine in engines:
            asyncio.run(engine.close())
