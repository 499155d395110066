"""Scoring text against a question: the terms BM25 counts, BM25 over texts held in
memory, and unit rows, whose dot products are cosine similarities.

A leaf below search ranking, uploads and collections alike. The collections engines
score BM25 themselves (Tantivy, Milvus) with the same `k1` and `b`, over the same
`terms`; `Bm25Index` scores what no engine holds (a request's web results beside its
file passages, when no embeddings model is configured). Brute force is fast enough
for that: 10,000 texts in a few milliseconds (measured in `bench/files.py`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

#: what BM25 counts as a term: runs of letters and digits, lower-cased (the tokeniser of
#: the embedded engine, and of the bench's reference BM25)
TERM = re.compile(r"[^\W_]+")
MAX_TERM_CHARS = 40
BM25_K1, BM25_B = 1.2, 0.75


def terms(text: str) -> list[str]:
    """The BM25 terms of `text`, in order (repeats kept)."""
    return [t for t in TERM.findall(text.lower()) if len(t) <= MAX_TERM_CHARS]


class Bm25Index:
    """Texts as an inverted index: term → (text numbers, counts)."""

    __slots__ = ("lengths", "postings", "df")

    def __init__(self, texts: Sequence[str]) -> None:
        self.lengths = np.zeros(len(texts), dtype=np.float32)
        postings: dict[str, tuple[list[int], list[int]]] = {}
        for n, text in enumerate(texts):
            counts = Counter(terms(text))
            self.lengths[n] = sum(counts.values())
            for term, count in counts.items():
                docs, tfs = postings.setdefault(term, ([], []))
                docs.append(n)
                tfs.append(count)
        self.postings = {
            term: (np.array(docs, dtype=np.int32), np.array(tfs, dtype=np.float32))
            for term, (docs, tfs) in postings.items()
        }
        self.df = {term: len(docs) for term, (docs, _) in self.postings.items()}


def bm25_scores(indexes: Sequence[Bm25Index], query: str) -> list[np.ndarray]:
    """BM25 scores of every text of every index (one array per index) for `query`,
    with document frequencies taken over all of them together."""
    wanted = set(terms(query))
    total = sum(len(ix.lengths) for ix in indexes)
    mean_length = sum(float(ix.lengths.sum()) for ix in indexes) / max(total, 1)
    df = {t: sum(ix.df.get(t, 0) for ix in indexes) for t in wanted}
    out = []
    for ix in indexes:
        scores = np.zeros(len(ix.lengths), dtype=np.float32)
        norm = BM25_K1 * (1 - BM25_B + BM25_B * ix.lengths / max(mean_length, 1e-9))
        for term in wanted:
            posting = ix.postings.get(term)
            if posting is None:
                continue
            docs, tfs = posting
            idf = math.log(1 + (total - df[term] + 0.5) / (df[term] + 0.5))
            scores[docs] += idf * tfs * (BM25_K1 + 1) / (tfs + norm[docs])
        out.append(scores)
    return out


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1 (zero rows stay zero), as float32; one vector is one row."""
    vectors = np.asarray(vectors, dtype=np.float32)
    if vectors.ndim == 1:
        vectors = vectors[None, :]
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    out: np.ndarray = np.divide(vectors, norms, out=np.zeros_like(vectors), where=norms > 0)
    return out


def cosines(question: np.ndarray, rows: np.ndarray) -> list[float]:
    """The cosine similarity of each of `rows` with `question`."""
    scores: list[float] = (unit_rows(rows) @ unit_rows(question)[0]).tolist()
    return scores


def top(scores: np.ndarray, k: int) -> np.ndarray:
    """Indexes of the `k` best scores, best first (ties in index order)."""
    if len(scores) <= k:
        return np.argsort(-scores, kind="stable")
    best = np.argpartition(-scores, k - 1)[:k]
    return best[np.argsort(-scores[best], kind="stable")]
