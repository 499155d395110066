"""What your own documents cost: indexing, retrieval, memory, and the streams meanwhile.

    python -m bench.files                  # ~1 minute
    python -m bench.files --chunks 10000 --pages 300 --streams 200

* index: a text PDF of `--pages` pages (about 350 words each) uploaded to `python -m
  app` (pinned to core 0) with the fast fake model answering embeddings at once
  (1,024 dimensions); time per page, from the upload's start to its answer.
* retrieval: `--chunks` chunks over 10 files of one request (1,024-dimension
  vectors), ranked for a question by the server's own code (`FileService`):
  p50/p99 of ranking alone, and with the question's embedding asked of the fake
  over loopback; memory per 10,000 chunks (matrix + text, as kept in memory).
* streams: `--streams` streams at 20 tokens/s (half SSE, half WebSocket); added
  token latency p99 without an upload, then while the PDF is indexed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace

import httpx
import numpy as np

from app.collections import open_engine
from app.collections.retrieval import Retriever
from app.config import CollectionSettings, EmbeddingsSettings, UploadSettings
from app.files.service import FileService
from app.ids import Snowflake
from app.model import Embedder
from app.scoring import top, unit_rows
from app.store import FileRecord, StoredChunk, open_store
from bench.load import mixed_load, percentile
from bench.run import app_server, fast_model

WORDS = (
    "the river valley orchard kiln glaze storm harbour lantern market bridge copper "
    "winter ledger map tower garden forest salt iron road mill bell clock field"
).split()


def pdf_bytes(pages: int) -> bytes:
    from fpdf import FPDF

    rng = random.Random(7)
    pdf = FPDF()
    pdf.set_font("Helvetica", size=9)
    for n in range(pages):
        pdf.add_page()
        text = f"Page {n}. " + " ".join(rng.choice(WORDS) for _ in range(350))
        pdf.multi_cell(0, 5, text)
    return bytes(pdf.output())


async def index_time(url: str, data: bytes, pages: int) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=600) as http:
        started = time.monotonic()
        response = await http.post(url + "/api/uploads", files={"files": ("tome.pdf", data)})
        took = time.monotonic() - started
    response.raise_for_status()
    record = response.json()["files"][0]
    return {
        "pages": record["pages"],
        "chunks": record["chunks"],
        "seconds": round(took, 2),
        "ms_per_page": round(took * 1000 / pages, 2),
    }


async def retrieval(model_url: str, chunks: int, runs: int) -> dict[str, float]:
    dims = 1024
    rng = np.random.default_rng(7)
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(f"sqlite:///{tmp}/bench.db")
        async with store:
            ids = Snowflake()
            records, matrices = [], []
            per_file = chunks // 10
            for f in range(10):
                record = FileRecord(ids.next_str(), "1", f"f{f}.pdf", "pdf", 1, time.time())
                await store.add_file(record)
                vectors = rng.standard_normal((per_file, dims), dtype=np.float32)
                text = " ".join(WORDS[k % len(WORDS)] for k in range(200))
                stored = [
                    StoredChunk(n, n // 3 + 1, text, vectors[n].tobytes()) for n in range(per_file)
                ]
                ready = replace(record, status="ready", chunks=per_file)
                await store.finish_file(ready, stored)
                records.append(ready)
                matrices.append(unit_rows(vectors))
            embedder = Embedder(
                EmbeddingsSettings(base_url=model_url + "/v1", api_key="bench", model="fast-embed")
            )
            engine = open_engine(f"tantivy:///{tmp}/collections")
            await engine.open()
            retriever = Retriever(CollectionSettings(), engine=engine, embedder=embedder)
            files = FileService(
                UploadSettings(), store=store, embedder=embedder, ids=ids, retriever=retriever
            )
            loaded_at = time.monotonic()
            await files.passages(records, "warm the cache", 8)
            first_ms = (time.monotonic() - loaded_at) * 1000
            full, ranking = [], []
            for i in range(runs):
                started = time.perf_counter()
                await files.passages(records, f"river orchard {i}", 8)
                full.append((time.perf_counter() - started) * 1000)
            # ranking alone, as FileService does it once the question is embedded
            query = unit_rows(rng.standard_normal((1, dims), dtype=np.float32))[0]
            for _ in range(runs):
                started = time.perf_counter()
                top(np.concatenate([m @ query for m in matrices]), 8)
                ranking.append((time.perf_counter() - started) * 1000)
            memory = sum(m.nbytes for m in matrices) + chunks * len(text)
            await engine.close()
            await embedder.aclose()
    return {
        "chunks": chunks,
        "first_ms": round(first_ms, 1),
        "rank_p50_ms": round(statistics.median(ranking), 2),
        "rank_p99_ms": round(percentile(ranking, 0.99), 2),
        "with_query_embedding_p50_ms": round(statistics.median(full), 2),
        "with_query_embedding_p99_ms": round(percentile(full, 0.99), 2),
        "memory_mb_per_10k": round(memory / 1e6 * 10_000 / chunks, 1),
    }


async def streams_meanwhile(url: str, data: bytes, streams: int) -> dict[str, float]:
    def p99(results) -> float:
        latencies = [ms for r in results for ms in r.latencies_ms]
        return round(percentile(latencies, 0.99), 1)

    quiet = await mixed_load(url, streams, 200, 20)

    async def upload_later() -> float:
        await asyncio.sleep(2.0)
        async with httpx.AsyncClient(timeout=600) as http:
            started = time.monotonic()
            await http.post(url + "/api/uploads", files={"files": ("tome.pdf", data)})
            return time.monotonic() - started

    loaded, took = await asyncio.gather(mixed_load(url, streams, 200, 20), upload_later())
    return {
        "streams": streams,
        "p99_ms_before": p99(quiet),
        "p99_ms_during": p99(loaded),
        "upload_seconds_meanwhile": round(took, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pages", type=int, default=300)
    parser.add_argument("--chunks", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--streams", type=int, default=200)
    args = parser.parse_args()
    data = pdf_bytes(args.pages)
    with fast_model() as model, tempfile.TemporaryDirectory() as tmp:
        env = {
            "EMBEDDINGS_MODEL": "fast-embed",
            "EMBEDDINGS_BASE_URL": model + "/v1",
            "UPLOADS_MAX_FILE_BYTES": str(200 * 1024 * 1024),
        }
        with app_server(model, tmp, **env) as (url, _pid):
            print("index", asyncio.run(index_time(url, data, args.pages)), flush=True)
        print("retrieval", asyncio.run(retrieval(model, args.chunks, args.runs)), flush=True)
        with app_server(model, tmp, **env) as (url, _pid):
            print("streams", asyncio.run(streams_meanwhile(url, data, args.streams)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
