"""Where a request runs: the ``Placer`` that ranks workers, decides and releases (the records it makes,
``Placement``, ``Route``, ``Hold``, and the ``recovery`` rule, are router.placement_records').

Lifecycle: for each attempt of a request the flow asks the ``Placer`` for a placement:
- ``route(scope)`` chooses how the request runs (a ``Route``): ``Route.PAIR`` (reserve on a
  decode worker D, prefill on a prefill worker P, KV moves P -> D) or whole on one worker of
  a pool (``Route.COLOCATED`` in colocated mode; ``Route.DECODE`` for conditional
  disaggregation);
- ``place_pair`` ranks the decode workers, has the best one that has room reserve the
  prompt's blocks (the RPC is ``WorkerCalls.reserve``'s; waiting in the router's FIFO
  ``AdmissionQueue`` while none has room), and picks P (least queued prompt tokens, then
  prefix-aware routing);
- ``place_whole`` picks the least-loaded worker of a ``Pool`` (prefix-aware too).
Prefix-aware routing (``_by_prefix``) scores candidates on the KV event index (``router.kv.index``: what
every worker's cache really holds, the same whichever router a request enters) while the index follows
all of them, falls back to this router's own mirror (``router.kv.prefix_index``) while one is out of sync,
and to load order while Redis is unavailable; each choice is counted by reason.
A placement records the chosen workers, the reservation and which load counts this router
holds on them (``held``, a set of ``Hold``). ``release(placement)`` gives back whatever is still
held (it is idempotent and thread-safe: the transfer watch releases P early, the flow the rest).
The flow's ``Attempt`` (router/attempt.py) owns a placement while it runs: it aborts it on the
workers (``WorkerCalls.abort``) and releases it here. ``recovery(...)`` decides, in one place,
what a failed attempt leads to: fail, retry elsewhere (nothing streamed yet) or migrate
(tokens streamed: another worker resumes).
"""
from __future__ import annotations

import logging
import random
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import grpc

from proto.worker_pb2 import WorkerInfo
from router.admission import AdmissionQueue, QueueStop
from router.config import RouterConfig
from router.events import FlowError
from router.kv.prefix_index import PrefixIndex
from router.scope import RequestScope
from router.selection import ScoreWeights, WorkerSelector, prefill_locally, shuffle_leading_ties
from router.placement_records import ALL_HOLDS, DEFAULT_BLOCK_SIZE, Hold, Placement, Route
from router.worker_source import Pool, WorkerSource

if TYPE_CHECKING:
    from router.kv.index import KVEventConsumer
    from router.worker_calls import WorkerCalls

log = logging.getLogger(__name__)

# Backoff between reservation retries while queued; capacity freed by this router wakes the head sooner.
_FIRST_BACKOFF_S = 0.01
_MAX_BACKOFF_S = 0.25


class Placer:
    """Chooses, holds and releases workers for requests (see module docstring). One per router."""

    def __init__(self, cfg: RouterConfig, source: WorkerSource, selector: WorkerSelector, calls: "WorkerCalls",
                 admission: Optional[AdmissionQueue] = None, prefixes: Optional[PrefixIndex] = None,
                 kv_events: Optional["KVEventConsumer"] = None, metrics: Callable[[], Any] = lambda: None,
                 rng: Optional[random.Random] = None) -> None:
        """``calls``: who sends the Reserve RPC (``WorkerCalls``); the Placer only ranks and decides.
        ``kv_events``: the consumer of the workers' KV events (its ``index`` scores candidates while it is in
        sync with them); ``metrics``: the router's metrics once built (decisions are counted by reason)."""
        self.cfg = cfg
        self.source = source
        self.selector = selector
        self.calls = calls
        self.admission = admission
        """The wait queue for decode KV capacity; None: RESOURCE_EXHAUSTED at once when no decode worker has room."""
        self.prefixes = prefixes
        """Which worker was sent which prompt prefix; None: route by load only."""
        self.kv_events = kv_events
        self.weights = ScoreWeights(cfg.kv_overlap_weight, cfg.kv_load_weight, cfg.kv_request_weight,
                                    cfg.kv_tie_blocks)
        self._metrics = metrics
        self._rng = rng if rng is not None else random.Random()
        self._lock = threading.Lock()
        self._cold_lock = threading.Lock()
        """One cold placement at a time (``_cold``)."""
        self._pairs: set[tuple[str, str]] = set()
        """(prefill id, decode id) pairs whose last KV transfer for this router succeeded: their pair group is up,
        so they need no rendezvous through Redis (``pair_result``)."""

    # ---- route ---------------------------------------------------------------------------------
    def route(self, scope: RequestScope) -> Route:
        """How this request runs: colocated mode runs it whole; conditional disaggregation may run a
        short prompt (or any while the prefill pool is backed up) whole on a decode worker."""
        cfg, n = self.cfg, scope.num_prompt_tokens
        if cfg.mode == "colocated":
            return Route.COLOCATED
        if cfg.local_prefill_max_tokens == 0 and cfg.prefill_queue_max_tokens is None:
            return Route.PAIR
        if n > cfg.local_prefill_max_tokens > 0:
            n -= self._held_on_decode(scope)  # only what the best-placed decode worker lacks would be prefilled there
        backlog = None
        if cfg.prefill_queue_max_tokens is not None and n > cfg.local_prefill_max_tokens:
            backlog = self.selector.prefill_backlog(self.source.list(Pool.PREFILL.value))
        return Route.DECODE if prefill_locally(cfg.local_prefill_max_tokens, cfg.prefill_queue_max_tokens, n,
                                               backlog) else Route.PAIR

    def _held_on_decode(self, scope: RequestScope) -> int:
        """The most leading prompt tokens a ready decode worker holds, on the KV event index (0 while decode prefix
        routing is off or the index does not follow every decode worker): conditional disaggregation weighs what a
        local prefill would compute, so a conversation's next turn whose history the decode worker holds is
        prefilled there, with no transfer (place_whole's prefix scoring then picks that worker)."""
        kv = self.kv_events
        if not self.cfg.decode_prefix_routing or kv is None or not kv.connected:
            return 0
        ready = [w for w in self.source.list(Pool.DECODE.value) if w.ready]
        if not ready:
            return 0
        reason, matches, _shared = self._matches(scope, ready)
        if reason != "kv_events":
            return 0
        return max(matches.get(w.worker_id, 0) * (w.block_size or DEFAULT_BLOCK_SIZE) for w in ready)

    # ---- prefix-aware routing --------------------------------------------------------------------
    def _by_prefix(self, scope: RequestScope, ranked: list[WorkerInfo]) -> list[WorkerInfo]:
        """``ranked`` (best first by load) reordered by what the candidates cache: scored on the KV event index
        while it follows every candidate, else the router-local mirror's longest match moved first within the
        slack; load order alone when prefix routing is off or Redis is unavailable. Counted by reason."""
        if not ranked:
            return ranked
        reason, matches, shared = self._matches(scope, ranked)
        m = self._metrics()
        if m is not None:
            m.inc_routing_decision(reason)
        kv = self.kv_events
        if reason == "kv_events" and kv is not None:
            if kv.ties is not None and len(ranked) > 1 and not any(matches.values()):
                return self._cold(scope, ranked, kv)
            return self._score(ranked, matches, shared, kv)
        if reason == "mirror" and len(ranked) > 1:
            return self.selector.prefer_cached(ranked, matches, self.cfg.prefix_balance_tokens)
        return ranked

    def _score(self, ranked: list[WorkerInfo], matches: dict[str, int], shared: dict[str, int],
               kv: "KVEventConsumer", choose: Optional[Callable[[list[WorkerInfo]], Optional[WorkerInfo]]] = None
               ) -> list[WorkerInfo]:
        fresh = {w.worker_id: kv.load(w.worker_id) for w in ranked}
        queued = None
        if kv.pending_s > 0:  # prefill work placed on each, less the blocks this request would wait for anyway
            queued = {w.worker_id: max(0, kv.index.pending_blocks(w.worker_id) - shared.get(w.worker_id, 0))
                      for w in ranked}
        return self.selector.score_cached(ranked, matches, self.weights, self._rng, fresh, queued, choose)

    def _cold(self, scope: RequestScope, ranked: list[WorkerInfo], kv: "KVEventConsumer") -> list[WorkerInfo]:
        """A prefix no candidate caches: a tie among the best goes to ``router.kv.ties`` (shared with the other
        routers, so a burst of new prefixes through several routers spreads). One cold decision at a time in this
        router, each made pending at once: a second request of this router with the same new prefix, decided while
        the first waited on Redis, follows it instead of splitting the prefix over two workers."""
        ties = kv.ties
        with self._cold_lock:
            reason, matches, shared = self._matches(scope, ranked)  # placed meanwhile by this router's other threads?
            if reason != "kv_events" or any(matches.values()):
                return self._score(ranked, matches, shared, kv)

            def choose(near: list[WorkerInfo]) -> Optional[WorkerInfo]:
                wid = ties.choose([w.worker_id for w in near])
                return next((w for w in near if w.worker_id == wid), None)

            order = self._score(ranked, matches, shared, kv, choose)
            w = order[0]  # pending here before the lock goes (kv.ties exists only with kv_pending_s > 0)
            kv.index.add_pending(w.worker_id, scope.prefix_hashes(w.block_size or DEFAULT_BLOCK_SIZE), kv.pending_s)
            return order

    def _matches(self, scope: RequestScope, ranked: list[WorkerInfo]) -> tuple[str, dict[str, int], dict[str, int]]:
        """(reason, worker id -> leading prompt blocks it caches, worker id -> how many of those are pending there:
        placed by a router, not yet confirmed by the worker's events) for the candidates."""
        if self.prefixes is None or not self.cfg.prefix_aware_routing:
            return "load_only", {}, {}
        kv = self.kv_events
        if kv is not None:
            if kv.connected is False:
                m = self._metrics()
                if m is not None:
                    m.inc_redis_fallback("routing")
                return "load_only", {}, {}  # Redis unavailable: neither the index nor the registry is current
            if kv.connected and all(kv.synced(w.worker_id) for w in ranked):
                by_bs: dict[int, list[str]] = {}
                for w in ranked:
                    by_bs.setdefault(w.block_size or DEFAULT_BLOCK_SIZE, []).append(w.worker_id)
                out: dict[str, int] = {}
                shared: dict[str, int] = {}
                for bs, ids in by_bs.items():
                    for wid, (n, pend) in kv.index.match_detail(ids, scope.prefix_hashes(bs)).items():
                        out[wid], shared[wid] = n, pend
                return "kv_events", out, shared
        if len(ranked) < 2:
            return "mirror", {}, {}
        return "mirror", {w.worker_id: self.prefixes.match(w.worker_id, scope.prefix_hashes(w.block_size))
                          for w in ranked}, {}

    def _record_prefix(self, scope: RequestScope, w: WorkerInfo) -> None:
        """``w`` is about to prefill this prompt, so its prefix cache will hold the prompt's blocks."""
        if self.prefixes is not None and self.cfg.prefix_aware_routing:
            hashes = scope.prefix_hashes(w.block_size or DEFAULT_BLOCK_SIZE)
            self.prefixes.record(w.worker_id, hashes)
            if self.kv_events is not None:  # pending there at once; the other routers hear of it (replica sync)
                self.kv_events.placed(w.worker_id, hashes)

    # ---- whole requests on one worker --------------------------------------------------------------
    def place_whole(self, scope: RequestScope, pool: Pool, excluded: set[str]) -> Placement:
        """The least-loaded ready worker of ``pool`` (prefix-aware), with its load count held."""
        route = Route.whole(Pool(pool))
        ws = [w for w in self.source.list(route.pool.value) if w.ready and w.worker_id not in excluded]
        if not ws:
            raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {scope.rid}: no ready {route.pool} worker",
                            empty_pool=None if excluded else route.pool)
        sel = self.selector
        def load(w: WorkerInfo) -> tuple[int, int]:
            return w.num_running + w.num_waiting + sel.in_flight(w.worker_id), w.queued_prompt_tokens

        ranked = shuffle_leading_ties(sorted(ws, key=lambda w: (*load(w), w.worker_id)), load, self._rng)
        w = self._by_prefix(scope, ranked)[0]
        self._record_prefix(scope, w)
        sel.acquire(w.worker_id)
        return Placement(route=route, request_id=scope.next_worker_request_id(), decode=w, held={Hold.DECODE})

    # ---- pairs -----------------------------------------------------------------------------------
    def place_pair(self, scope: RequestScope, excluded: set[str]) -> Placement:
        """Reserve the prompt's blocks on a decode worker (queueing while none has room), pick the
        prefill worker; both load counts held."""
        adm = self.admission
        priority = scope.params.priority
        if adm is None or not adm.has_waiters(priority):  # nobody ahead (of its priority): try at once
            p = self.try_pair(scope, excluded)
            if p is not None:
                return p
            if adm is None:
                raise FlowError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request {scope.rid}: no decode worker can "
                                                                    f"hold {scope.num_prompt_tokens} prompt tokens")
        ticket = adm.enter(scope.seq, scope.rid, priority)
        log.info("request %s: queued for decode KV capacity (%d waiting)", scope.rid, len(adm))
        until = min(ticket.entered_at + self.cfg.queue_timeout_s, scope.deadline)
        backoff = _FIRST_BACKOFF_S
        try:
            while True:
                adm.wait_turn(ticket, until, scope.stop_reason)
                epoch = adm.epoch
                p = self.try_pair(scope, excluded)
                if p is not None:
                    log.info("request %s: left the queue after %.3f s", scope.rid, time.monotonic() - ticket.entered_at)
                    return p
                adm.wait_capacity(epoch, backoff, until, scope.stop_reason)
                backoff = min(2 * backoff, _MAX_BACKOFF_S)
        except QueueStop as e:
            raise self._queue_error(scope, e.reason, time.monotonic() - ticket.entered_at) from None
        finally:
            adm.leave(ticket)

    def _queue_error(self, scope: RequestScope, reason: str, waited: float) -> FlowError:
        what = f"{waited:.2f} s queued for decode KV capacity"
        if reason == "cancelled":
            return FlowError(grpc.StatusCode.CANCELLED, f"request {scope.rid} cancelled after {what}", final=True)
        if time.monotonic() >= scope.deadline:
            return FlowError(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {scope.rid}: deadline exceeded after "
                                                                f"{what}", final=True)
        return FlowError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"request {scope.rid}: waited {waited:.2f} s in the router queue for decode KV capacity "
                         f"(queue_timeout_s={self.cfg.queue_timeout_s:g}); no decode worker freed "
                         f"{scope.num_prompt_tokens} prompt tokens' blocks", final=True)

    def try_pair(self, scope: RequestScope, excluded: set[str]) -> Optional[Placement]:
        """One pass over the decode workers: a placement, or None if every reachable one is full."""
        n, sel = scope.num_prompt_tokens, self.selector
        ready = [w for w in self.source.list(Pool.DECODE.value) if w.ready and w.worker_id not in excluded]
        if not ready:
            raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {scope.rid}: no ready decode worker",
                            final=True, empty_pool=Pool.DECODE)
        needed = -(-n // max(1, ready[0].block_size or DEFAULT_BLOCK_SIZE))
        totals = [w.num_total_blocks for w in ready]
        if all(t > 0 for t in totals) and needed > max(totals):  # waiting would never help
            raise FlowError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"request {scope.rid}: prompt of {n} tokens needs {needed} KV blocks, more than any "
                            f"decode worker holds in total (largest: {max(totals)})", final=True)
        prefills = [w for w in self.source.list(Pool.PREFILL.value) if w.worker_id not in excluded]
        ranked_p = self._by_prefix(scope, sel.ranked_prefill(prefills))
        if not ranked_p:
            raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {scope.rid}: no ready prefill worker",
                            final=True, empty_pool=Pool.PREFILL)
        p = ranked_p[0]
        away = self.store_away()
        unpaired = 0
        exhausted = 0
        wrid = scope.next_worker_request_id()
        ranked_d, held = self._decode_by_history(scope, sel.ranked_decode(ready, needed, self._rng))
        for d in ranked_d:
            if away:
                # Redis away: a pair whose group is not up could not rendezvous (it would fail after a store
                # timeout); use a prefill worker already paired with d, in rank order, or skip d
                with self._lock:
                    p = next((q for q in ranked_p if (q.worker_id, d.worker_id) in self._pairs), None)
                if p is None:
                    unpaired += 1
                    continue
            # count the request against d before the call, so concurrent requests rank d as busier now
            sel.acquire(d.worker_id)
            try:
                resv = self.calls.reserve(scope, wrid, d, p)
            except grpc.RpcError as e:
                sel.release(d.worker_id)
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    exhausted += 1
                elif e.code() == grpc.StatusCode.UNAVAILABLE or (e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                                                                 and time.monotonic() < scope.deadline):
                    # gone, or too slow to answer a Reserve within its own timeout: try the next decode worker
                    self.suspect(d.worker_id)
                else:
                    raise scope.rpc_error(e, f"reserve on decode worker {d.worker_id}") from None
                log.debug("request %s: decode worker %s refused reserve: %s", scope.rid, d.worker_id, e.details())
                continue
            expected = held.get(d.worker_id, 0) * (d.block_size or DEFAULT_BLOCK_SIZE)
            if expected and self.cfg.kv_delta_transfers and resv.num_cached_tokens < expected:
                m = self._metrics()
                if m is not None:  # stale events, a restarted worker: the KV it lacks is transferred instead
                    m.inc_decode_prefix_stale()
                log.info("request %s: decode worker %s held %d cached prompt tokens, its KV events said %d",
                         scope.rid, d.worker_id, resv.num_cached_tokens, expected)
            if self.prefixes is not None and self.cfg.prefix_aware_routing and self.cfg.decode_prefix_routing:
                # the mirror's guess of what d holds once the KV lands (the index's is d's own events)
                self.prefixes.record(d.worker_id, scope.prefix_hashes(d.block_size or DEFAULT_BLOCK_SIZE))
            self._record_prefix(scope, p)
            sel.acquire(p.worker_id, n)
            return Placement(route=Route.PAIR, request_id=wrid, decode=d, prefill=p, reservation=resv,
                             held={Hold.DECODE, Hold.PREFILL})
        if exhausted:
            return None
        if unpaired:
            m = self._metrics()
            if m is not None:
                m.inc_redis_fallback("kv_pair")
            raise FlowError(grpc.StatusCode.UNAVAILABLE,
                            f"request {scope.rid}: Redis is unavailable and no prefill worker has a KV pair up with "
                            f"a ready decode worker (new pairs rendezvous through Redis)", final=True,
                            empty_pool=Pool.PREFILL, fallback_reason="no_kv_pair")
        raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {scope.rid}: no decode worker reachable")

    def _decode_by_history(self, scope: RequestScope, ranked: list[WorkerInfo]
                           ) -> tuple[list[WorkerInfo], dict[str, int]]:
        """Decode candidates (``ranked``: by load and room) reordered by the prompt blocks each holds (a
        conversation's earlier turns, decoded or received there) against its load, with the prefill pool's score
        (``score_cached``; no prefill queue term) and its random draw among near ties (no herding); and worker id ->
        blocks the KV event index says it holds ({} when the mirror guessed). The blocks come from the KV event index
        while it follows every candidate, else from this router's mirror of what it reserved where; load order while
        decode prefix routing is off, Redis is unavailable, or no candidate holds a block. Counted by reason."""
        if not (self.cfg.decode_prefix_routing and self.cfg.prefix_aware_routing) or self.prefixes is None \
                or len(ranked) < 2:
            return ranked, {}
        kv = self.kv_events
        reason, matches = "load", {}
        if kv is None or kv.connected is not False:  # Redis away: counted once, by the prefill pool's ranking
            source, matches, _shared = self._matches(scope, ranked)
            if any(matches.values()):
                reason = "history" if source == "kv_events" else "mirror"
        m = self._metrics()
        if m is not None:
            m.inc_decode_routing_decision(reason)
        if reason == "load":
            return ranked, {}
        fresh = {w.worker_id: kv.load(w.worker_id) for w in ranked} if reason == "history" else None
        order = self.selector.score_cached(ranked, matches, self.weights, self._rng, fresh, {})
        return order, (matches if reason == "history" else {})

    # ---- pairs known to work -----------------------------------------------------------------------
    def store_away(self) -> bool:
        """Whether Redis looks unavailable right now: the KV event consumer lost it, or the worker view could not
        read the registry on its last refresh (the view then routes from its last good snapshot)."""
        kv = self.kv_events
        if kv is not None and kv.connected is False:
            return True
        return getattr(self.source, "last_error", None) is not None

    def pair_result(self, prefill_id: str, decode_id: str, ok: bool) -> None:
        """A KV transfer between the two ended: ``ok`` marks their pair group as up, a failure as unknown."""
        with self._lock:
            if ok:
                self._pairs.add((prefill_id, decode_id))
            else:
                self._pairs.discard((prefill_id, decode_id))
            crowded = len(self._pairs) > _MAX_PAIRS
        if crowded:  # workers come and go (ids are never reused): forget pairs of workers no longer listed
            live = {w.worker_id for pool in (Pool.PREFILL, Pool.DECODE) for w in self.source.list(pool.value)}
            with self._lock:
                self._pairs = {(p, d) for p, d in self._pairs if p in live and d in live}

    # ---- failures ----------------------------------------------------------------------------------
    def suspect(self, worker_id: str) -> None:
        """A call to ``worker_id`` failed as if it were gone: out of routing until it heartbeats again."""
        self.source.suspect(worker_id)

    def failed(self, err: FlowError) -> None:
        """Note a failed attempt: a worker that looked gone leaves routing at once."""
        if err.code == grpc.StatusCode.UNAVAILABLE and err.worker_id:
            self.suspect(err.worker_id)

    def fallback(self, empty: Pool) -> Optional[Route]:
        """The whole route that can serve a request when pool ``empty`` has no live worker, or None:
        no prefill worker -> decode workers prefill themselves; no decode worker -> colocated workers."""
        pool = _FALLBACK.get(empty)
        if pool is None or not any(w.ready for w in self.source.list(pool.value)):
            return None
        return Route.whole(pool)

    def wait_for_pool(self, scope: RequestScope, pool: Pool, excluded: frozenset[str] = frozenset()) -> bool:
        """Wait (up to ``pool_wait_s``, or a cancel) for ``pool`` to have a ready worker (not in ``excluded``) again. The wait ends a
        little before the request's deadline, so the client hears why (UNAVAILABLE) rather than its own timeout."""
        now = time.monotonic()
        until = min(now + self.cfg.pool_wait_s, scope.deadline - min(1.0, 0.2 * max(0.0, scope.deadline - now)))
        pause = 0.02
        def ready() -> bool:
            return any(w.ready and w.worker_id not in excluded for w in self.source.list(Pool(pool).value))

        while time.monotonic() < until and not scope.cancelled:
            if ready():
                return True
            time.sleep(pause)
            pause = min(2 * pause, 0.25)
        return ready() and not scope.cancelled

    # ---- release ---------------------------------------------------------------------------------
    def release(self, p: Optional[Placement], scope: RequestScope, what: tuple[Hold, ...] = ALL_HOLDS) -> None:
        """Give back the load counts ``p`` still holds among ``what`` (idempotent, any thread)."""
        if p is None:
            return
        with self._lock:
            gone = [h for h in what if h in p.held]
            p.held.difference_update(gone)
        if Hold.DECODE in gone and p.decode is not None:
            self.selector.release(p.decode.worker_id)
            if self.admission is not None and p.route is Route.PAIR:
                self.admission.capacity_freed()  # its blocks are free (or being freed) on the decode worker
        if Hold.PREFILL in gone and p.prefill is not None:
            self.selector.release(p.prefill.worker_id, scope.num_prompt_tokens)


_MAX_PAIRS = 1024
"""Past this many remembered KV pairs, those of workers that left the view are forgotten."""
_FALLBACK = {Pool.PREFILL: Pool.DECODE, Pool.DECODE: Pool.COLOCATED}
"""The pool that serves a request whole when the key pool has no live worker."""
