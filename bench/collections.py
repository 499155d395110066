"""Knowledge collections: indexing rate, query latency, memory, retrieval quality, BM25
against a reference, and streams while an import runs.

    python -m bench.collections                  # everything (10,000 documents, ~100k chunks)
    python -m bench.collections --docs 2000 --skip-milvus --streams 0   # a quick look

What it does, on a corpus it writes (`bench/corpus.py`: reports of several pages of
Zipf-distributed made-up words, one known fact each, and a question per document):

1. engines  the embedded engine (Tantivy) builds one space of the first documents up to
            ~10k chunks and one of all of them (~100k chunks), chunked as an import chunks;
            indexing rate per core (CPU seconds of this process, pinned to one core).
            Milvus Lite (and SQLite FTS5, as a third reference) on the 10k-chunk corpus.
2. latency  p50/p99 of BM25 alone and of hybrid (BM25 + nearest of 384-wide vectors,
            fused), one core, 10k and 100k chunks; the query's embedding is not timed (it
            is the model's).
3. memory   the process's peak RSS and the index folder on disk.
4. quality  recall@10 and nDCG@10 (per document) on the labelled questions: BM25, dense
            and hybrid. The dense ranking uses the test suite's fake embeddings (bag of
            words hashed into 64 buckets), which make it meaningless: read dense and hybrid
            as a check of the plumbing unless `--embeddings-url` names a real endpoint.
            Twice: on the corpus as generated (each question's words together in one
            document: easy), and with three distractors per question added
            (`corpus.with_distractors`: the same entity with another attribute, the
            same attribute with half the entity), where rankings differ.
5. reference  bm25s (Lucene's idf, k1 = 1.2, b = 0.75, as Tantivy) on the same chunks and
            tokens: nDCG@10 of both and how much their top 10 agree.
   writes   hybrid query latency on the 10k space while batches of documents are added
            to it (an import into the collection being searched).
6. streams  the server under `mixed_load`, idle and while 1,000 documents are imported
            through the API (a zip), pinned to one core with its import's child processes:
            p99 of the gaps between tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import math
import os
import resource
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from app.collections import open_engine
from app.collections.base import Engine, Hit, Passage
from app.collections.retrieval import fuse
from app.extract import chunk_pages
from app.scoring import terms
from bench.corpus import Document, Question, generate, with_distractors
from bench.load import mixed_load, percentile
from bench.run import app_server, fast_model
from tests.fakes.model import embed as fake_embed

CHUNK_TOKENS, OVERLAP = 300, 50  # as [uploads]
BATCH_DOCUMENTS = 32  # as an import commits
LATENCY_DIMS = 384


def chunks_of(documents: Sequence[Document]) -> list[Passage]:
    return [
        Passage(str(d.number), c.n, c.page, d.title, "File", c.text)
        for d in documents
        for c in chunk_pages(d.pages, CHUNK_TOKENS, OVERLAP)
    ]


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def folder_mb(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6, 1)


def latency_vectors(passages: Sequence[Passage]) -> np.ndarray:
    rng = np.random.default_rng(3)
    return rng.standard_normal((len(passages), LATENCY_DIMS), dtype=np.float32)


async def build(
    engine: Engine, space: str, passages: Sequence[Passage], vectors: np.ndarray | None
) -> dict[str, float]:
    """Index in batches as an import does; wall and CPU time per chunk."""
    started, cpu_started = time.monotonic(), cpu()
    by_document: dict[str, list[int]] = {}
    for i, p in enumerate(passages):
        by_document.setdefault(p.document_id, []).append(i)
    groups = list(by_document.values())
    for start in range(0, len(groups), BATCH_DOCUMENTS):
        rows = [i for group in groups[start : start + BATCH_DOCUMENTS] for i in group]
        await engine.add(
            space, [passages[i] for i in rows], vectors[rows] if vectors is not None else None
        )
    wall, used = time.monotonic() - started, cpu() - cpu_started
    return {
        "chunks": len(passages),
        "documents": len(groups),
        "seconds": round(wall, 1),
        "chunks_per_cpu_second": round(len(passages) / max(used, 1e-9)),
        "documents_per_cpu_second": round(len(groups) / max(used, 1e-9), 1),
    }


async def timed(call: Callable[[], Any], runs: Sequence[Any]) -> dict[str, float]:
    times = []
    for item in runs:
        started = time.perf_counter()
        await call(item)
        times.append((time.perf_counter() - started) * 1000)
    return {
        "p50_ms": round(statistics.median(times), 2),
        "p99_ms": round(percentile(times, 0.99), 2),
    }


async def latency(
    engine: Engine, space: str, questions: Sequence[Question], dims: bool
) -> dict[str, Any]:
    texts = [q.text for q in questions]
    rng = np.random.default_rng(5)
    queries = [(t, rng.standard_normal(LATENCY_DIMS, dtype=np.float32)) for t in texts]
    await engine.lexical(space, "warm up", 10)
    out: dict[str, Any] = {
        "bm25": await timed(lambda q: engine.lexical(space, q[0], 50), queries),
    }
    if dims:

        async def hybrid(q: tuple[str, np.ndarray]) -> list[Hit]:
            lexical, dense = await asyncio.gather(
                engine.lexical(space, q[0], 50), engine.nearest(space, q[1], 50)
            )
            return fuse([lexical, dense])[:10]

        await engine.nearest(space, queries[0][1], 10)  # loads the matrix
        out["hybrid"] = await timed(hybrid, queries)
    return out


async def latency_during_writes(
    engine: Engine, space: str, questions: Sequence[Question], seed: int
) -> dict[str, Any]:
    """Hybrid query latency while another task adds batches of 32 new documents (with
    vectors) to the space being searched, as an import into it does; and how many
    batches went in meanwhile."""
    extra, _ = generate(640, pages=4, words_per_page=600, seed=seed + 100)
    added = [replace(p, document_id=f"w{p.document_id}") for p in chunks_of(extra)]
    vectors = latency_vectors(added)
    rng = np.random.default_rng(7)
    queries = [(q.text, rng.standard_normal(LATENCY_DIMS, dtype=np.float32)) for q in questions]
    batches = 0

    async def writing() -> None:
        nonlocal batches
        by_document: dict[str, list[int]] = {}
        for i, p in enumerate(added):
            by_document.setdefault(p.document_id, []).append(i)
        groups = list(by_document.values())
        for start in range(0, len(groups), BATCH_DOCUMENTS):
            rows = [i for group in groups[start : start + BATCH_DOCUMENTS] for i in group]
            await engine.add(space, [added[i] for i in rows], vectors[rows])
            batches += 1

    async def hybrid(q: tuple[str, np.ndarray]) -> list[Hit]:
        lexical, dense = await asyncio.gather(
            engine.lexical(space, q[0], 50), engine.nearest(space, q[1], 50)
        )
        return fuse([lexical, dense])[:10]

    writer = asyncio.create_task(writing())
    times = []
    while not writer.done():
        for q in queries:
            started = time.perf_counter()
            await hybrid(q)
            times.append((time.perf_counter() - started) * 1000)
            if writer.done():
                break
    await writer
    await engine.delete_documents(space, sorted({p.document_id for p in added}))
    return {
        "queries": len(times),
        "batches_added": batches,
        "p50_ms": round(statistics.median(times), 2),
        "p99_ms": round(percentile(times, 0.99), 2),
    }


def ndcg_recall(ranked: Sequence[str], answer: str) -> tuple[float, float]:
    """nDCG@10 and recall@10 of one question with one relevant document."""
    top = list(dict.fromkeys(ranked))[:10]
    if answer not in top:
        return 0.0, 0.0
    return 1 / math.log2(top.index(answer) + 2), 1.0


def averaged(pairs: list[tuple[float, float]]) -> dict[str, float]:
    return {
        "ndcg@10": round(sum(p[0] for p in pairs) / len(pairs), 4),
        "recall@10": round(sum(p[1] for p in pairs) / len(pairs), 4),
    }


async def quality(
    engine: Engine,
    space: str,
    passages: Sequence[Passage],
    questions: Sequence[Question],
    embed: Callable[[list[str]], np.ndarray],
) -> dict[str, Any]:
    """BM25, dense and hybrid on the labelled questions, and bm25s on the same chunks."""
    import bm25s

    reference = bm25s.BM25(method="lucene", k1=1.2, b=0.75)
    reference.index([terms(p.text) for p in passages], show_progress=False)
    query_vectors = embed([q.text for q in questions])
    bm25, dense, hybrid, ref, overlap = [], [], [], [], []
    for q, vector in zip(questions, query_vectors, strict=True):
        answer = str(q.answer)
        lexical = await engine.lexical(space, q.text, 50)
        near = await engine.nearest(space, vector, 50)
        ids, _ = reference.retrieve([terms(q.text)], k=50, show_progress=False)
        theirs = [passages[i].document_id for i in ids[0]]
        ours = [h.passage.document_id for h in lexical]
        bm25.append(ndcg_recall(ours, answer))
        dense.append(ndcg_recall([h.passage.document_id for h in near], answer))
        hybrid.append(ndcg_recall([h.passage.document_id for h in fuse([lexical, near])], answer))
        ref.append(ndcg_recall(theirs, answer))
        a, b = set(list(dict.fromkeys(ours))[:10]), set(list(dict.fromkeys(theirs))[:10])
        overlap.append(len(a & b) / max(1, len(a | b)))
    out = {
        "questions": len(questions),
        "bm25": averaged(bm25),
        "dense": averaged(dense),
        "hybrid": averaged(hybrid),
        "bm25s_reference": averaged(ref),
        "top10_jaccard_with_reference": round(sum(overlap) / len(overlap), 3),
    }
    out["bm25_minus_reference_ndcg"] = round(
        out["bm25"]["ndcg@10"] - out["bm25s_reference"]["ndcg@10"], 4
    )
    return out


def fts5(
    passages: Sequence[Passage], questions: Sequence[Question], folder: Path
) -> dict[str, Any]:
    """SQLite FTS5's own BM25 on the same chunks (OR of the query's terms, top 50)."""
    db = sqlite3.connect(folder / "fts.db")
    db.execute("CREATE VIRTUAL TABLE c USING fts5(doc UNINDEXED, text)")
    started = cpu()
    db.executemany("INSERT INTO c VALUES (?, ?)", [(p.document_id, p.text) for p in passages])
    db.commit()
    rate = len(passages) / max(cpu() - started, 1e-9)
    times, pairs = [], []
    for q in questions:
        match = " OR ".join(f'"{t}"' for t in dict.fromkeys(terms(q.text)))
        t0 = time.perf_counter()
        rows = db.execute(
            "SELECT doc FROM c WHERE c MATCH ? ORDER BY rank LIMIT 50", (match,)
        ).fetchall()
        times.append((time.perf_counter() - t0) * 1000)
        pairs.append(ndcg_recall([r[0] for r in rows], str(q.answer)))
    db.close()
    return {
        "chunks": len(passages),
        "chunks_per_cpu_second": round(rate),
        "bm25": {
            "p50_ms": round(statistics.median(times), 2),
            "p99_ms": round(percentile(times, 0.99), 2),
        },
        "quality": averaged(pairs),
    }


def fake_embeddings(texts: list[str]) -> np.ndarray:
    return np.array([fake_embed(t, 64) for t in texts], dtype=np.float32)


def remote_embeddings(url: str, model: str, key: str) -> Callable[[list[str]], np.ndarray]:
    def call(texts: list[str]) -> np.ndarray:
        out = []
        with httpx.Client(timeout=120, headers={"authorization": f"Bearer {key}"}) as http:
            for start in range(0, len(texts), 64):
                body = {"model": model, "input": texts[start : start + 64]}
                data = http.post(url.rstrip("/") + "/embeddings", json=body).json()["data"]
                out += [row["embedding"] for row in sorted(data, key=lambda r: r["index"])]
        return np.array(out, dtype=np.float32)

    return call


async def engines(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    documents, questions = generate(
        args.docs, pages=args.pages, words_per_page=args.words, seed=args.seed
    )
    print(f"corpus: {len(documents)} documents, generated", flush=True)
    passages = chunks_of(documents)
    per_doc = len(passages) / len(documents)
    small_docs = max(1, int(10_000 / per_doc))
    small = [p for p in passages if int(p.document_id) < small_docs]
    asked = questions[: args.queries]
    small_asked = [q for q in questions if q.answer < small_docs][: args.queries]
    embed = (
        remote_embeddings(args.embeddings_url, args.embeddings_model, args.embeddings_key)
        if args.embeddings_url
        else fake_embeddings
    )
    results: dict[str, Any] = {
        "corpus": {
            "documents": len(documents),
            "pages_per_document": args.pages,
            "chunks": len(passages),
            "chunks_per_document": round(per_doc, 1),
            "dense": "fake (meaningless)" if not args.embeddings_url else args.embeddings_model,
        }
    }
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tantivy = open_engine(f"tantivy:///{folder}/tantivy")
    async with tantivy:
        results["tantivy_index_10k"] = await build(tantivy, "small", small, latency_vectors(small))
        print("tantivy 10k", results["tantivy_index_10k"], flush=True)
        results["tantivy_index_all"] = await build(
            tantivy, "all", passages, latency_vectors(passages)
        )
        print("tantivy all", results["tantivy_index_all"], flush=True)
        results["tantivy_latency_10k"] = await latency(tantivy, "small", small_asked, True)
        results["tantivy_latency_all"] = await latency(tantivy, "all", asked, True)
        print("tantivy latency", results["tantivy_latency_10k"], results["tantivy_latency_all"])
        results["tantivy_memory"] = {
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "rss_before_mb": round(rss_before / 1024),
            "disk_mb": folder_mb(folder / "tantivy"),
        }
        results["tantivy_latency_10k_during_writes"] = await latency_during_writes(
            tantivy, "small", small_asked, args.seed
        )
        print("tantivy latency during writes", results["tantivy_latency_10k_during_writes"])
        vectors = embed([p.text for p in passages])
        await build(tantivy, "quality", passages, vectors)
        results["tantivy_quality"] = await quality(tantivy, "quality", passages, asked, embed)
        print("tantivy quality", results["tantivy_quality"], flush=True)
        hard = passages + chunks_of(with_distractors(documents, asked))
        await build(tantivy, "hard", hard, embed([p.text for p in hard]))
        results["tantivy_quality_hard"] = await quality(tantivy, "hard", hard, asked, embed)
        results["tantivy_quality_hard"]["chunks"] = len(hard)
        print("tantivy quality, with distractors", results["tantivy_quality_hard"], flush=True)
    if not args.skip_milvus:
        milvus = open_engine(f"milvus:///{folder}/milvus.db")
        async with milvus:
            results["milvus_index_10k"] = await build(
                milvus, "small", small, embed([p.text for p in small])
            )
            print("milvus 10k", results["milvus_index_10k"], flush=True)
            few = small_asked[: args.milvus_queries]
            results["milvus_latency_10k"] = await latency(milvus, "small", few, False)
            results["milvus_quality_10k"] = await quality(milvus, "small", small, few, embed)
            print("milvus", results["milvus_latency_10k"], results["milvus_quality_10k"])
            results["milvus_disk_mb"] = folder_mb(folder) - results["tantivy_memory"]["disk_mb"]
    for name, chunks, asking in (("10k", small, small_asked), ("all", passages, asked[:100])):
        (folder / f"fts5-{name}").mkdir()
        results[f"fts5_{name}"] = fts5(chunks, asking, folder / f"fts5-{name}")
    print("fts5", results["fts5_10k"], results["fts5_all"], flush=True)
    return results


def zipped(documents: Sequence[Document]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for d in documents:
            archive.writestr(d.title, d.text)
    return out.getvalue()


async def streams_while_importing(
    model: str, folder: Path, streams: int, count: int
) -> dict[str, Any]:
    documents, _ = generate(count, pages=4, words_per_page=600, seed=21)
    data = zipped(documents)
    env = {
        "COLLECTIONS_URL": f"tantivy:///{folder}/server",
        "EMBEDDINGS_MODEL": "fast-embed",
        "EMBEDDINGS_BASE_URL": model + "/v1",
    }

    def p99(results: list[Any]) -> float:
        return round(percentile([ms for r in results for ms in r.latencies_ms], 0.99), 1)

    with app_server(model, str(folder), **env) as (url, _pid):
        idle = await mixed_load(url, streams, 200, 20)
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            made = await http.post("/api/collections", json={"name": "bench"})
            cid = made.json()["collection"]["id"]

            async def load() -> list[Any]:
                await asyncio.sleep(1.0)
                return await mixed_load(url, streams, 200, 20)

            async def importing() -> float:
                started = time.monotonic()
                answer = await http.post(
                    f"/api/collections/{cid}/documents", files={"files": ("bench.zip", data)}
                )
                import_id = answer.json()["import"]["id"]
                while True:
                    progress = (
                        await http.get(f"/api/collections/{cid}/imports/{import_id}")
                    ).json()
                    if progress["done"] == progress["total"]:
                        return time.monotonic() - started
                    await asyncio.sleep(0.5)

            during, took = await asyncio.gather(load(), importing())
            got = (await http.get(f"/api/collections/{cid}")).json()["collection"]
    return {
        "streams": streams,
        "p99_ms_idle": p99(idle),
        "p99_ms_during_import": p99(during),
        "import_documents": got["documents"],
        "import_chunks": got["chunks"],
        "import_seconds": round(took, 1),
        "import_documents_per_second": round(got["documents"] / took, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", type=int, default=10_000)
    parser.add_argument("--pages", type=int, default=4)
    parser.add_argument("--words", type=int, default=600, help="words per page")
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--skip-milvus", action="store_true")
    parser.add_argument("--milvus-queries", type=int, default=30, help="Milvus Lite is slow")
    parser.add_argument("--streams", type=int, default=100, help="0: skip the streams part")
    parser.add_argument("--import-docs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=7, help="of the generated corpus")
    parser.add_argument("--embeddings-url", default="")
    parser.add_argument("--embeddings-model", default="")
    parser.add_argument("--embeddings-key", default="")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-collections-"))
    try:
        if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
            os.sched_setaffinity(0, {1})  # one core (the server's core is 0)
        results = asyncio.run(engines(args, folder))
        for key, value in results.items():
            print(key, value, flush=True)
        if args.streams:
            with fast_model() as model:
                streams = asyncio.run(
                    streams_while_importing(model, folder, args.streams, args.import_docs)
                )
            print("streams", streams, flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
