"""Ranking a file's chunks (made in `extract.py`, with the text).

Ranking is brute force over the chunks of one request's files, which is fast
enough (10,000 chunks in a few milliseconds, measured in `bench/files.py`):
cosine similarity of embeddings with numpy when an embeddings model is
configured, else BM25 over an inverted index kept per file.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

WORD = re.compile(r"\w+")
BM25_K1, BM25_B = 1.2, 0.75


def words(text: str) -> list[str]:
    return [w.lower() for w in WORD.findall(text)]


class Bm25Index:
    """One file's chunks as an inverted index: term → (chunk numbers, counts)."""

    __slots__ = ("lengths", "postings", "df")

    def __init__(self, texts: Sequence[str]) -> None:
        self.lengths = np.zeros(len(texts), dtype=np.float32)
        postings: dict[str, tuple[list[int], list[int]]] = {}
        for n, text in enumerate(texts):
            counts = Counter(words(text))
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
    """BM25 scores of every chunk of every index (one array per index) for `query`,
    with document frequencies taken over all of them together."""
    terms = set(words(query))
    total = sum(len(ix.lengths) for ix in indexes)
    mean_length = sum(float(ix.lengths.sum()) for ix in indexes) / max(total, 1)
    df = {t: sum(ix.df.get(t, 0) for ix in indexes) for t in terms}
    out = []
    for ix in indexes:
        scores = np.zeros(len(ix.lengths), dtype=np.float32)
        norm = BM25_K1 * (1 - BM25_B + BM25_B * ix.lengths / max(mean_length, 1e-9))
        for term in terms:
            posting = ix.postings.get(term)
            if posting is None:
                continue
            docs, tfs = posting
            idf = math.log(1 + (total - df[term] + 0.5) / (df[term] + 0.5))
            scores[docs] += idf * tfs * (BM25_K1 + 1) / (tfs + norm[docs])
        out.append(scores)
    return out


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1 (zero rows stay zero)."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    out: np.ndarray = np.divide(vectors, norms, out=np.zeros_like(vectors), where=norms > 0)
    return out


def top(scores: np.ndarray, k: int) -> np.ndarray:
    """Indexes of the `k` best scores, best first."""
    if len(scores) <= k:
        return np.argsort(-scores, kind="stable")
    best = np.argpartition(-scores, k)[:k]
    return best[np.argsort(-scores[best], kind="stable")]
