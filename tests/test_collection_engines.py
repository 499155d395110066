"""The collections engine contract, the same tests on every engine: the embedded one
(Tantivy) and Milvus (Milvus Lite, the same client code as a Milvus server), both run
for real. BM25 uses the statistics of the whole space, is close to a reference BM25
(bm25s, same tokens and parameters), filters by document, and what is deleted is gone."""

from __future__ import annotations

import math

import bm25s
import numpy as np
import pytest

from app.collections.base import Engine, Passage, open_engine, terms
from app.files.extract import chunk_pages
from bench.corpus import generate

pytestmark = pytest.mark.anyio

ENGINES = ["tantivy", "milvus"]


@pytest.fixture(params=ENGINES)
async def engine(request, tmp_path):
    url = (
        f"tantivy:///{tmp_path}/index"
        if request.param == "tantivy"
        else f"milvus:///{tmp_path}/milvus.db"
    )
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
    from app.collections import tantivy_engine

    monkeypatch.setattr(tantivy_engine, "QUANTIZE_ROWS", 1000)
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
