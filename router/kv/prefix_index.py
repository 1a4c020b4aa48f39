"""The router's picture of which worker has which prompt prefix in its KV cache (prefix-aware routing).

Lifecycle: one ``PrefixIndex`` per router. For every request the router sends to a prefill (or
colocated) worker it ``record``s the prompt's full-block keys under that worker; before choosing
a worker it asks ``match`` how many leading blocks of the new prompt each candidate was sent
before. Like SGLang's cache-aware router this is an approximate mirror, not a query of the
workers: it forgets least recently used keys past ``capacity_blocks`` per worker, and a worker's
own eviction is not seen, so a match is a hint for ranking, never a correctness input (a wrong
hint costs a recompute, never a wrong token). Since the KV event index (``router.kv.index``) this mirror is only the
fallback while a worker's events are not in sync (blocks a worker is computing now, before its events confirm them,
are the index's pending blocks: ``KVIndex.add_pending``).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Sequence


class PrefixIndex:
    """Per worker, an LRU set of block-key hashes this router sent there."""

    def __init__(self, capacity_blocks: int = 65536) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._lock = threading.Lock()
        self._by_worker: dict[str, OrderedDict[int, float]] = {}  # block hash -> when it was last sent

    def match(self, worker_id: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` were sent to ``worker_id`` (and not forgotten)."""
        with self._lock:
            seen = self._by_worker.get(worker_id)
            if not seen:
                return 0
            n = 0
            for h in hashes:
                if h not in seen:
                    break
                n += 1
            return n

    def record(self, worker_id: str, hashes: Sequence[int]) -> None:
        """``worker_id`` is about to hold these blocks: mark them most recently used."""
        if not hashes:
            return
        now = time.monotonic()
        with self._lock:
            seen = self._by_worker.setdefault(worker_id, OrderedDict())
            for h in hashes:
                seen[h] = now
                seen.move_to_end(h)
            while len(seen) > self.capacity_blocks:
                seen.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        with self._lock:
            self._by_worker.pop(worker_id, None)
