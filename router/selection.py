"""Worker selection: which decode and prefill worker serve a request.

Lifecycle: one ``WorkerSelector`` per router. For each admitted request the
router asks ``ranked_decode`` / ``ranked_prefill`` for candidates (best first),
calls ``acquire`` on the ones it uses and ``release`` when the request ends.
Registry load fields lag by up to one heartbeat, so the selector adds its own
count of in-flight requests per worker: a burst spreads over the pool at once.
"""
from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional

from proto.worker_pb2 import WorkerInfo

DECODE_TIE_FREE_FRAC = 0.1
"""Decode workers with the same load whose free-block fractions differ by at most this are a tie (drawn at random):
the registry's free blocks lag a heartbeat, so a smaller difference says little."""


@dataclass(frozen=True)
class ScoreWeights:
    """The weights of ``WorkerSelector.score_cached`` (``RouterConfig.kv_*``), in blocks."""

    overlap: float = 1.0
    load: float = 1.0
    request: float = 2.0
    tie_blocks: float = 1.0


class WorkerSelector:
    """Scores ready workers by reported load plus this router's in-flight count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: Counter[str] = Counter()
        # prompt tokens this router sent to each prefill worker that are not yet prefilled
        self._pending_tokens: Counter[str] = Counter()

    def in_flight(self, worker_id: str) -> int:
        with self._lock:
            return self._in_flight[worker_id]

    def acquire(self, worker_id: str, prompt_tokens: int = 0) -> None:
        with self._lock:
            self._in_flight[worker_id] += 1
            self._pending_tokens[worker_id] += prompt_tokens

    def release(self, worker_id: str, prompt_tokens: int = 0) -> None:
        with self._lock:
            self._in_flight[worker_id] -= 1
            self._pending_tokens[worker_id] -= prompt_tokens
            if self._in_flight[worker_id] <= 0:
                del self._in_flight[worker_id]
                self._pending_tokens.pop(worker_id, None)

    def ranked_decode(self, workers: list[WorkerInfo], needed_blocks: int, rng: Optional[random.Random] = None,
                      tie_free_frac: float = DECODE_TIE_FREE_FRAC) -> list[WorkerInfo]:
        """Ready decode workers likely to fit ``needed_blocks``; least load, then most free blocks, first. With
        ``rng``, the workers tied with the best (same load, free fraction within ``tie_free_frac`` of the best's)
        come first in random order: routers ranking the same view at the same instant spread over them instead
        of all reserving on the one that sorts first (herding); without it ties go by worker id."""
        with self._lock:
            inflight = dict(self._in_flight)
        ready = [w for w in workers if w.ready]

        def load(w: WorkerInfo) -> int:
            return w.num_running + w.num_waiting + inflight.get(w.worker_id, 0)

        def free_frac(w: WorkerInfo) -> float:
            return w.num_free_blocks / max(1, w.num_total_blocks)

        def key(w: WorkerInfo) -> tuple:
            # load first: free blocks in the registry lag a heartbeat, while this router's own
            # in-flight count moves at once, so a burst spreads instead of piling on one worker
            return (load(w), -free_frac(w), w.worker_id)

        # a stale record may under-report free blocks; keep those last rather than dropping them
        fits = sorted((w for w in ready if w.num_free_blocks >= needed_blocks), key=key)
        rest = sorted((w for w in ready if w.num_free_blocks < needed_blocks), key=key)
        if rng is not None and len(fits) > 1:
            best = fits[0]
            n_tied = 1
            while (n_tied < len(fits) and load(fits[n_tied]) == load(best)
                   and free_frac(best) - free_frac(fits[n_tied]) <= tie_free_frac):
                n_tied += 1
            tied = fits[:n_tied]
            rng.shuffle(tied)
            fits = tied + fits[n_tied:]
        return fits + rest

    def ranked_prefill(self, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        """Ready prefill workers, fewest queued prompt tokens (reported + ours in flight) first."""
        with self._lock:
            pending = dict(self._pending_tokens)
            inflight = dict(self._in_flight)
        ready = [w for w in workers if w.ready]
        return sorted(ready, key=lambda w: (w.queued_prompt_tokens + pending.get(w.worker_id, 0),
                                            inflight.get(w.worker_id, 0), w.worker_id))

    def prefer_cached(self, ranked: list[WorkerInfo], matches: dict[str, int], slack_tokens: int) -> list[WorkerInfo]:
        """Prefix-aware routing: move the worker with the longest cached prefix (``matches``: worker id ->
        leading blocks it holds) to the front of ``ranked`` (best first, by load), unless its queue is more
        than ``slack_tokens`` prompt tokens longer than the front worker's. Ties keep the load order."""
        if not ranked:
            return ranked
        best = max(ranked, key=lambda w: matches.get(w.worker_id, 0))
        if matches.get(best.worker_id, 0) == 0 or best is ranked[0]:
            return ranked
        with self._lock:
            pending = dict(self._pending_tokens)

        def queued(w: WorkerInfo) -> int:
            return w.queued_prompt_tokens + pending.get(w.worker_id, 0)

        if queued(best) - queued(ranked[0]) > slack_tokens:
            return ranked
        return [best] + [w for w in ranked if w is not best]

    def score_cached(self, ranked: list[WorkerInfo], matches: dict[str, int], weights: "ScoreWeights",
                     rng: random.Random, fresh: Optional[dict[str, Optional[tuple[int, int, int]]]] = None,
                     queued_blocks: Optional[dict[str, float]] = None,
                     choose: Optional[Callable[[list[WorkerInfo]], Optional[WorkerInfo]]] = None) -> list[WorkerInfo]:
        """Cache-aware routing on the KV event index (the anchors' form): each candidate scores
        ``overlap * matched blocks - load * queued prompt blocks - request * requests``, with the load from
        ``fresh`` (worker id -> (running, waiting, queued tokens) from its KV event stream, a step old; at least
        this router's own in flight) or else from the heartbeat's record plus this router's own not yet reported
        requests and tokens; with ``queued_blocks`` (worker id -> prefill blocks placed there and not yet confirmed,
        less those this request shares: ``KVIndex.pending_blocks``) that is the queued term instead of the worker's
        reported queue, which counts every queued prompt whole though most of a conversation's is a cache hit; the
        best goes first, drawn at random
        among those within ``weights.tie_blocks`` of it (no herding: routers deciding at the same instant on
        the same view spread; with ``choose``, the tied candidates in that random order go to it, and its pick,
        if any, goes first: ``router.kv.ties`` shares the draw between routers), the rest follow by score (ties keep
        ``ranked``'s load order)."""
        if not ranked:
            return ranked
        with self._lock:
            pending = dict(self._pending_tokens)
            inflight = dict(self._in_flight)

        def score(w: WorkerInfo) -> float:
            bs = max(1, w.block_size or 16)
            load = (fresh or {}).get(w.worker_id)
            if load is None:  # the heartbeat's record, plus what this router sent since (it lags a heartbeat)
                queued = (w.queued_prompt_tokens + pending.get(w.worker_id, 0)) / bs
                requests = w.num_running + w.num_waiting + inflight.get(w.worker_id, 0)
            else:  # a step old: it already counts what this router sent that reached the worker
                if queued_blocks is not None:
                    queued = queued_blocks.get(w.worker_id, 0)
                else:
                    queued = max(load[2], pending.get(w.worker_id, 0)) / bs
                requests = max(load[0] + load[1], inflight.get(w.worker_id, 0))
            return (weights.overlap * matches.get(w.worker_id, 0) - weights.load * queued
                    - weights.request * requests)

        scored = sorted(((score(w), i, w) for i, w in enumerate(ranked)), key=lambda t: (-t[0], t[1]))
        best = scored[0][0]
        near = [w for sc, _i, w in scored if sc >= best - weights.tie_blocks] if weights.tie_blocks > 0 else []
        if len(near) > 1 and choose is not None:
            rng.shuffle(near)
            pick = choose(near) or near[0]
        else:
            pick = rng.choice(near) if len(near) > 1 else scored[0][2]
        return [pick] + [w for _sc, _i, w in scored if w is not pick]

    def prefill_backlog(self, workers: list[WorkerInfo]) -> Optional[int]:
        """Queued prompt tokens (reported + ours in flight) of the least-loaded ready prefill worker;
        None when there is none."""
        with self._lock:
            pending = dict(self._pending_tokens)
        backlog = [w.queued_prompt_tokens + pending.get(w.worker_id, 0) for w in workers if w.ready]
        return min(backlog) if backlog else None


def shuffle_leading_ties(ranked: list[WorkerInfo], key: Callable[[WorkerInfo], Any],
                         rng: Optional[random.Random]) -> list[WorkerInfo]:
    """``ranked`` (sorted by ``key``) with the workers whose ``key`` equals the first's in random order (no herding
    of routers deciding at the same instant on the same view); unchanged without ``rng``."""
    if rng is None or len(ranked) < 2:
        return ranked
    first = key(ranked[0])
    n = 1
    while n < len(ranked) and key(ranked[n]) == first:
        n += 1
    tied = ranked[:n]
    rng.shuffle(tied)
    return tied + ranked[n:]


def prefill_locally(local_max_tokens: int, queue_max_tokens: Optional[int], prompt_tokens: int,
                    backlog: Optional[int]) -> bool:
    """Conditional disaggregation: prefill on the decode worker when the prompt is short enough to
    cost the decode batch little, or when the prefill pool is backed up past ``queue_max_tokens``.
    (Dynamo disaggregates when the prompt is long AND the prefill queue is short; this is its negation.)"""
    if prompt_tokens <= local_max_tokens:
        return True
    return queue_max_tokens is not None and backlog is not None and backlog >= queue_max_tokens
