"""A space's embeddings in memory, for the embedded engine (`tantivy_engine.py`): unit
rows with room to append to, and for a large space one bit per dimension, so that its
nearest passages are found in two steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

GROWTH = 1.5  # a matrix's room grows by this factor when rows are appended
#: from this many passages on, the nearest are found in two steps (see `Vectors`)
QUANTIZE_ROWS = 20_000
RESCORE_PER_RESULT = 10


@dataclass
class Vectors:
    """A space's embeddings as unit rows, and which passage each row is.

    `version` and `removed` are the space's when it was read, `last_rowid` the last
    row read: rows added since are appended (into spare room of `buffer`, shared
    with the older copy, which never looks past its own `count`).

    A large space also keeps one bit per dimension (the sign of the row minus the
    space's mean row): its nearest passages are the best by cosine among the
    `RESCORE_PER_RESULT` × limit whose bits differ least from the query's. Reading
    100k rows of 384 floats takes ~90 ms on one core here (memory bandwidth); their
    bits are 32 times less to read."""

    version: int
    removed: int = 0
    last_rowid: int = 0
    keys: list[tuple[str, int]] = field(default_factory=list)
    buffer: np.ndarray | None = None
    count: int = 0
    mean: np.ndarray | None = None
    codes: np.ndarray | None = None

    @property
    def matrix(self) -> np.ndarray | None:
        return None if self.buffer is None else self.buffer[: self.count]

    @property
    def nbytes(self) -> int:
        size = 0 if self.buffer is None else self.buffer.nbytes
        return size + (0 if self.codes is None else self.codes.nbytes) + 64 * len(self.keys)

    def appended(
        self, version: int, last_rowid: int, keys: list[tuple[str, int]], rows: np.ndarray
    ) -> Vectors:
        """A newer copy with `rows` (unit, of this width) after this one's."""
        fresh = replace(self, version=version, last_rowid=last_rowid)
        if not keys:
            return fresh
        buffer = self.buffer
        total = self.count + len(rows)
        if buffer is None or len(buffer) < total:
            room = max(total, int(self.count * GROWTH))
            grown = np.empty((room, rows.shape[1]), dtype=np.float32)
            if buffer is not None:
                grown[: self.count] = buffer[: self.count]
            buffer = grown
        buffer[self.count : total] = rows
        fresh.buffer, fresh.count, fresh.keys = buffer, total, [*self.keys, *keys]
        if self.codes is not None and self.mean is not None:
            fresh.codes = np.concatenate([self.codes, _bits(rows - self.mean)])
        else:
            fresh.quantize()
        return fresh

    def quantize(self) -> None:
        matrix = self.matrix
        if matrix is None or len(matrix) < QUANTIZE_ROWS:
            return
        self.mean = matrix.mean(axis=0)
        self.codes = _bits(matrix - self.mean)

    def scores(self, query: np.ndarray, limit: int, mask: np.ndarray | None) -> np.ndarray:
        """Every row's cosine with `query` (-inf where `mask` is False); in a large
        space -inf too for the rows that were not candidates."""
        matrix = self.matrix
        assert matrix is not None
        if self.codes is None or self.mean is None:
            exact: np.ndarray = matrix @ query
            return np.where(mask, exact, -np.inf) if mask is not None else exact
        distance = np.bitwise_count(self.codes ^ _bits(query - self.mean)).sum(
            axis=1, dtype=np.uint32
        )
        if mask is not None:
            distance = np.where(mask, distance, np.iinfo(np.uint32).max)
        wanted = min(len(distance), RESCORE_PER_RESULT * limit)
        rows = (
            np.argpartition(distance, wanted - 1)[:wanted]
            if wanted < len(distance)
            else np.arange(len(distance))
        )
        scores = np.full(len(matrix), -np.inf, dtype=np.float32)
        scores[rows] = matrix[rows] @ query
        if mask is not None:
            scores = np.where(mask, scores, -np.inf)
        return scores


def _bits(rows: np.ndarray) -> np.ndarray:
    """Signs as packed bits (a view of 64-bit words when the width allows)."""
    packed = np.packbits(rows > 0, axis=-1)
    return packed.view(np.uint64) if packed.shape[-1] % 8 == 0 else packed
