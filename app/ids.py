"""Snowflake ids: 41 bits of milliseconds, 10 bits of worker, 12 bits of sequence.

Ids are 64-bit integers, ordered by time, unique across processes as long as
each process has its own worker number (derived from the pid by default).
They travel as decimal strings (JavaScript cannot hold them as numbers).
"""

from __future__ import annotations

import os
import threading
import time

EPOCH_MS = 1_288_834_974_657  # the Twitter epoch, as the original used


class Snowflake:
    def __init__(self, worker: int | None = None) -> None:
        self.worker = (os.getpid() if worker is None else worker) & 0x3FF
        self._lock = threading.Lock()
        self._last_ms = -1
        self._sequence = 0

    def next(self) -> int:
        with self._lock:
            now = int(time.time() * 1000)
            if now < self._last_ms:  # the clock stepped back: keep counting from the last
                now = self._last_ms
            if now == self._last_ms:
                self._sequence = (self._sequence + 1) & 0xFFF
                if self._sequence == 0:
                    now = self._last_ms + 1
            else:
                self._sequence = 0
            self._last_ms = now
            return ((now - EPOCH_MS) << 22) | (self.worker << 12) | self._sequence

    def next_str(self) -> str:
        return str(self.next())
