"""The router's global KV index: which worker's prefix cache holds which block, built from the workers' KV events.

Lifecycle: ``RouterCore`` builds one ``KVIndex`` and, when its worker list is the Redis registry (it has
``redis_url`` and ``namespace``) and ``RouterConfig.kv_events`` is on, one ``KVEventConsumer`` whose
daemon thread follows every listed worker's stream ``{ns}:kvev:{worker_id}`` (``XREAD`` from its last
entry id; a worker first seen is read from the start of its stream: the replay). Each entry is one
vLLM ``KVEventBatch`` with the publisher's generation and sequence number (``engine.kv_events``):

- the first entry of a new generation (seq 0, ``AllBlocksCleared``) drops what the worker's earlier
  process published; later entries apply in order (stored -> add, removed -> drop, cleared -> forget all);
- a seq that skips ahead (a batch the publisher dropped, or one trimmed from the stream) is a gap: the
  worker's entries are rebuilt from its snapshot ``{ns}:kvsnap:{worker_id}`` and the stream is re-read
  after the snapshot's entry id; until that works the worker is out of sync (placement then uses the
  router-local mirror for it) and the snapshot is retried every ``resync_interval_s``;
- a malformed entry is dropped, counted and logged with the worker's id, and starts a resync; a seq
  already applied (out of order, a duplicate) is dropped and counted;
- a worker the registry no longer lists (drained, killed and expired, suspected) leaves the index at once;
- an entry's ``load`` field (running, waiting, queued prompt tokens at that step; a changed load alone comes as an
  empty batch) is kept per worker (``load``): placement weighs this, a step old, instead of the heartbeat's;
- a failed read (Redis unavailable) marks the consumer disconnected (placement routes by load only,
  counted) and retries with backoff; the positions are kept, so it resumes where it stopped.

- placements: when placement sends a prompt to a worker it calls ``placed``: the prompt's blocks that worker does
  not hold yet are *pending* there for ``pending_s`` (``RouterConfig.kv_pending_s``) or until the worker's
  ``BlockStored`` confirms them; with replica sync (``RouterConfig.kv_replica_sync``) the placement is also shared
  on ``{ns}:kvplace`` (``router.kv.replica``), and this thread reads the other routers' entries in the same ``XREAD``
  and marks their blocks pending too. Pending blocks count as held (``match``) and as queued prefill work
  (``pending_blocks``).

The consumer only reads the workers' keys; the one key a router writes is the shared ``{ns}:kvplace`` (replica
sync, from ``PlacementPublisher``'s thread). ``stop()`` ends both threads. ``KVIndex`` is a plain thread-safe map
(block hash -> workers, worker -> block hashes, plus the pending blocks) that placement asks with ``match_detail``.
"""
from __future__ import annotations

import heapq
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import redis

from engine import (KV_ENTRY_BATCH, KV_ENTRY_GEN, KV_ENTRY_LOAD, KV_ENTRY_SEQ, AllBlocksCleared, BlockRemoved,
                    BlockStored, decode_kv_batch, decode_kv_snapshot, kv_snapshot_key, kv_stream_key)
from router.kv.replica import PlacementPublisher, decode_placement, kv_place_key
from router.kv.ties import ColdTies

log = logging.getLogger(__name__)


class KVIndex:
    """Block hash -> workers whose prefix cache holds it (and the reverse, to drop a worker at once), plus blocks
    *pending* on a worker: placed there by a router (this one, or another one's ``{ns}:kvplace`` entry) and being
    computed, not yet confirmed by the worker's events. A pending block counts as held by ``match`` and as queued
    prefill work by ``pending_blocks`` until a ``BlockStored`` of it on that worker confirms it, or it expires."""

    def __init__(self, max_pending_per_worker: int = 65536, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: what pending blocks' expiries are measured on when a call passes no ``now`` (the simulator
        passes its virtual clock)."""
        if max_pending_per_worker < 1:
            raise ValueError(f"max_pending_per_worker must be >= 1, got {max_pending_per_worker}")
        self.max_pending_per_worker = max_pending_per_worker
        self._clock = clock
        self._lock = threading.Lock()
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, set[int]] = {}
        self._pending: dict[str, dict[int, float]] = {}  # worker -> block hash -> expiry (monotonic)
        self._pending_holders: dict[int, dict[str, float]] = {}  # block hash -> worker -> expiry
        self._expiries: list[tuple[float, str, int]] = []  # heap: (expiry, worker, hash), stale items skipped

    def store(self, worker_id: str, hashes: Iterable[int]) -> None:
        with self._lock:
            mine = self._blocks.setdefault(worker_id, set())
            for h in hashes:
                mine.add(h)
                self._holders.setdefault(h, set()).add(worker_id)
                self._unpend(h, worker_id)  # confirmed

    def remove(self, worker_id: str, hashes: Iterable[int]) -> None:
        with self._lock:
            mine = self._blocks.get(worker_id)
            if mine is None:
                return
            for h in hashes:
                mine.discard(h)
                self._unhold(h, worker_id)

    def clear(self, worker_id: str) -> None:
        """Forget everything ``worker_id`` holds, pending blocks included."""
        with self._lock:
            for h in self._blocks.pop(worker_id, ()):
                self._unhold(h, worker_id)
            for h in list(self._pending.get(worker_id, ())):
                self._unpend(h, worker_id)
            self._pending.pop(worker_id, None)

    def replace(self, worker_id: str, hashes: Iterable[int]) -> None:
        """``worker_id`` holds exactly ``hashes`` (a snapshot)."""
        with self._lock:
            for h in self._blocks.pop(worker_id, ()):
                self._unhold(h, worker_id)
            mine = self._blocks[worker_id] = set(hashes)
            for h in mine:
                self._holders.setdefault(h, set()).add(worker_id)
                self._unpend(h, worker_id)

    def _unhold(self, h: int, worker_id: str) -> None:
        held = self._holders.get(h)
        if held is not None:
            held.discard(worker_id)
            if not held:
                del self._holders[h]

    # ---- pending (placed, not yet confirmed) ---------------------------------------------------------
    def add_pending(self, worker_id: str, hashes: Sequence[int], ttl_s: float, now: Optional[float] = None) -> int:
        """``worker_id`` was just sent a prompt with these block hashes: the ones it does not hold yet are pending
        there for ``ttl_s`` (or until its events confirm them). Returns how many were marked; past
        ``max_pending_per_worker`` the rest are not (a bound, not an expected case)."""
        if ttl_s <= 0 or not hashes:
            return 0
        now = self._clock() if now is None else now
        until = now + ttl_s
        n = 0
        with self._lock:
            self._expire(now)
            held = self._blocks.get(worker_id, ())
            mine = self._pending.setdefault(worker_id, {})
            for h in hashes:
                if h in held:
                    continue
                if h not in mine and len(mine) >= self.max_pending_per_worker:
                    break
                if mine.get(h, 0.0) >= until:
                    continue
                mine[h] = until
                self._pending_holders.setdefault(h, {})[worker_id] = until
                heapq.heappush(self._expiries, (until, worker_id, h))
                n += 1
        return n

    def pending_blocks(self, worker_id: str, now: Optional[float] = None) -> int:
        """Blocks pending on ``worker_id`` (prefill work placed there, not yet confirmed)."""
        with self._lock:
            self._expire(self._clock() if now is None else now)
            return len(self._pending.get(worker_id, ()))

    def _unpend(self, h: int, worker_id: str) -> None:
        mine = self._pending.get(worker_id)
        if mine is not None and mine.pop(h, None) is not None:
            pw = self._pending_holders.get(h)
            if pw is not None:
                pw.pop(worker_id, None)
                if not pw:
                    del self._pending_holders[h]

    def _expire(self, now: float) -> None:
        heap = self._expiries
        while heap and heap[0][0] <= now:
            until, w, h = heapq.heappop(heap)
            if self._pending.get(w, {}).get(h) == until:  # not refreshed or confirmed since
                self._unpend(h, w)
        if not heap:
            for w in [w for w, m in self._pending.items() if not m]:
                del self._pending[w]

    def expire(self, now: Optional[float] = None) -> None:
        """Drop pending blocks whose time is up (``match`` and ``pending_blocks`` do it too)."""
        with self._lock:
            self._expire(self._clock() if now is None else now)

    def match(self, worker_ids: Iterable[str], hashes: Sequence[int]) -> dict[str, int]:
        """For each worker, how many leading blocks of ``hashes`` (a prompt's chained block hashes) it holds or
        has pending."""
        return {w: n for w, (n, _p) in self.match_detail(worker_ids, hashes).items()}

    def match_detail(self, worker_ids: Iterable[str], hashes: Sequence[int],
                     now: Optional[float] = None) -> dict[str, tuple[int, int]]:
        """For each worker (leading blocks of ``hashes`` it holds or has pending, how many of those are pending):
        a pending block is prefill work the request would wait for there, not add."""
        out = {w: (0, 0) for w in worker_ids}
        live = set(out)
        pend = dict.fromkeys(out, 0)
        with self._lock:
            self._expire(self._clock() if now is None else now)
            for n, h in enumerate(hashes):
                holders = self._holders.get(h, set())
                pending = self._pending_holders.get(h)
                live = {w for w in live if w in holders or (pending is not None and w in pending)}
                if not live:
                    break
                for w in live:
                    if w not in holders:
                        pend[w] += 1
                    out[w] = (n + 1, pend[w])
        return out

    def holders(self, h: int) -> set[str]:
        with self._lock:
            return set(self._holders.get(h, ()))

    def num_blocks(self, worker_id: Optional[str] = None) -> int:
        """(block, worker) pairs held (of one worker, or all); pending blocks not included."""
        with self._lock:
            if worker_id is not None:
                return len(self._blocks.get(worker_id, ()))
            return sum(len(b) for b in self._blocks.values())

    def workers(self) -> set[str]:
        with self._lock:
            return set(self._blocks)


@dataclass
class _Stream:
    """Where the consumer is in one worker's stream."""

    last_id: str = "0-0"
    generation: Optional[str] = None
    seq: int = -1
    synced: bool = False
    next_resync: float = 0.0
    load: Optional[tuple[int, int, int]] = None
    """(running, waiting, queued prompt tokens) from the newest entry that carried it."""


class KVEventConsumer:
    """Follows the KV event streams of the listed workers into a ``KVIndex`` (see module docstring)."""

    def __init__(self, index: KVIndex, redis_url: str, namespace: str, worker_ids: Callable[[], Iterable[str]],
                 metrics: Callable[[], Any] = lambda: None, block_ms: int = 100, resync_interval_s: float = 0.25,
                 batch_entries: int = 512, pending_s: float = 2.0, replica_sync: bool = True,
                 ties_timeout_s: float = 0.05) -> None:
        """``worker_ids``: the workers to follow now (the router's view of the registry); ``metrics``: the
        router's ``RouterMetrics`` once it exists (None before); ``pending_s``: how long a placed prompt's blocks
        count as pending on its worker before its events confirm them (``RouterConfig.kv_pending_s``; 0: never);
        ``replica_sync``: share this router's placements with the other routers and read theirs
        (``router.kv.replica``; ``RouterConfig.kv_replica_sync``), and break cold placements' ties through Redis
        (``router.kv.ties``, with a socket timeout of ``ties_timeout_s``)."""
        if block_ms < 1 or not resync_interval_s > 0 or batch_entries < 1 or not pending_s >= 0:
            raise ValueError("block_ms, resync_interval_s and batch_entries must be positive, pending_s >= 0")
        self.index = index
        self.namespace = namespace
        self._worker_ids = worker_ids
        self._metrics = metrics
        self.block_ms = block_ms
        self.resync_interval_s = resync_interval_s
        self.batch_entries = batch_entries
        # a blocking XREAD waits block_ms: the socket must wait longer
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=max(2.0, 3 * block_ms / 1000),
                                           socket_connect_timeout=2.0)
        self._streams: dict[str, _Stream] = {}
        self.pending_s = pending_s
        self.replica: Optional[PlacementPublisher] = (
            PlacementPublisher(self._redis, namespace, metrics) if replica_sync and pending_s > 0 else None)
        """Shares this router's placements (None: replica sync off)."""
        self.ties: Optional[ColdTies] = (
            ColdTies(redis_url, namespace, pending_s / 2, metrics, timeout_s=ties_timeout_s)
            if replica_sync and pending_s > 0 else None)
        """Breaks cold placements' ties through Redis, shared with the other routers (``router.kv.ties``; None:
        replica sync off: each router draws alone)."""
        self._place_key = kv_place_key(namespace)
        self._place_last_id: Optional[str] = None  # None: not read yet (starts at the newest entry)
        self.placements_applied = 0
        """Other routers' placements marked pending here (tests and the metrics read it)."""
        self._lock = threading.Lock()  # guards _streams' sync flags for readers on request threads
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.connected: Optional[bool] = None
        """None before the first read; then whether the last read of the streams succeeded."""
        self.redis_errors = 0
        """Reads of the streams that Redis failed (each routes by load only until one succeeds; the metric
        ``kv_events_redis_errors_total`` counts the same)."""
        self.applied = 0
        """Batches applied (tests and the metrics read it)."""

    # ---- what placement asks ---------------------------------------------------------------------
    def synced(self, worker_id: str) -> bool:
        """Whether the index follows ``worker_id``'s cache in order (its stream read from a known state)."""
        with self._lock:
            st = self._streams.get(worker_id)
            return st is not None and st.synced

    def load(self, worker_id: str) -> Optional[tuple[int, int, int]]:
        """``worker_id``'s (running, waiting, queued prompt tokens) as of its newest entry (a step old, not a
        heartbeat old), or None when none carried it."""
        with self._lock:
            st = self._streams.get(worker_id)
            return None if st is None else st.load

    def placed(self, worker_id: str, hashes: Sequence[int]) -> None:
        """This router just sent a prompt with these block hashes to ``worker_id``: they count as pending there
        at once, and (replica sync) the other routers hear of it. Never blocks on Redis."""
        if self.pending_s <= 0:
            return
        self.index.add_pending(worker_id, hashes, self.pending_s)
        if self.replica is not None:
            self.replica.publish(worker_id, hashes)

    def num_synced(self) -> int:
        with self._lock:
            return sum(1 for st in self._streams.values() if st.synced)

    # ---- thread ---------------------------------------------------------------------------------------
    def start(self) -> "KVEventConsumer":
        self._thread = threading.Thread(target=self._run, name="kv-events-consumer", daemon=True)
        self._thread.start()
        if self.replica is not None:
            self.replica.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.replica is not None:
            self.replica.stop()
        if self.ties is not None:
            self.ties.stop()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        self._redis.close()

    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            try:
                self.poll_once()
                backoff = 0.05
            except redis.RedisError as e:
                if self.connected is not False:
                    log.warning("KV events: Redis unavailable (%s); routing by load only until it answers", e)
                self.connected = False
                self.redis_errors += 1
                m = self._metrics()
                if m is not None:
                    m.inc_kv_events_redis_error()
                self._stop.wait(backoff)
                backoff = min(2 * backoff, 1.0)
            except Exception:  # never let one bad entry end the thread
                log.exception("KV events: consumer error")
                self._stop.wait(0.1)

    def poll_once(self) -> int:
        """One round: follow the current worker list, read what is new (waiting up to ``block_ms``), retry
        due resyncs. Returns the entries read. Raises redis errors (the thread backs off on them)."""
        live = set(self._worker_ids())
        with self._lock:
            for gone in [w for w in self._streams if w not in live]:
                del self._streams[gone]
                self.index.clear(gone)
            for w in live:
                if w not in self._streams:
                    self._streams[w] = _Stream()
            positions = {kv_stream_key(self.namespace, w): st.last_id for w, st in self._streams.items()}
        now = time.monotonic()
        for w in [w for w, st in list(self._streams.items()) if not st.synced and st.generation is not None
                  and st.next_resync <= now]:
            self._resync(w)
        self.index.expire()
        if not positions:
            self.connected = True if self._redis.ping() else False
            self._stop.wait(self.block_ms / 1000)
            return 0
        if self.replica is not None:
            if self._place_last_id is None:  # start at the newest placement: older ones are past their window
                newest = self._redis.xrevrange(self._place_key, count=1)
                self._place_last_id = newest[0][0].decode() if newest else "0-0"
            positions[self._place_key] = self._place_last_id
        resp = self._redis.xread(positions, count=self.batch_entries, block=self.block_ms)
        self.connected = True
        n = 0
        prefix = kv_stream_key(self.namespace, "")
        for key, entries in resp or ():
            key = key.decode() if isinstance(key, bytes) else key
            if key == self._place_key:
                self._apply_placements(entries)
                continue
            w = key[len(prefix):]
            for entry_id, fields in entries:
                if w not in self._streams:
                    break
                n += 1
                eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                if not self._handle(w, eid, fields):
                    break  # rewound to a snapshot: the rest of this reply is re-read from there
        self._update_gauges()
        return n

    # ---- one entry ------------------------------------------------------------------------------------
    def _handle(self, w: str, eid: str, fields: dict) -> bool:
        """Apply one stream entry; False when the stream position was rewound (the caller stops this reply)."""
        st = self._streams[w]
        st.last_id = eid
        raw_load = fields.get(KV_ENTRY_LOAD)
        if raw_load is not None:  # the worker's load then, whatever becomes of the batch itself
            try:
                r, q, t = (int(x) for x in raw_load.decode().split(","))
                if min(r, q, t) < 0:
                    raise ValueError("negative")
                st.load = (r, q, t)
            except (ValueError, UnicodeDecodeError) as e:
                self._reject(w, "malformed", f"entry {eid}: bad load {raw_load!r}: {e}")
        try:
            seq = int(fields[KV_ENTRY_SEQ])
            gen = fields[KV_ENTRY_GEN].decode()
            if seq < 0 or not gen:
                raise ValueError("seq must be >= 0 and gen non-empty")
        except (KeyError, ValueError, UnicodeDecodeError, AttributeError) as e:
            self._reject(w, "malformed", f"entry {eid}: bad header: {e!r}")
            self._lost(w, st)
            return True
        if gen != st.generation:  # a new publisher process under this worker id: its old entries go
            self.index.clear(w)
            with self._lock:
                st.generation, st.seq, st.synced = gen, -1, False
        if seq <= st.seq:
            self._reject(w, "out_of_order", f"entry {eid}: seq {seq} after {st.seq}")
            return True
        if seq != st.seq + 1:
            self._reject(w, "gap", f"entry {eid}: seq {seq} after {st.seq}: resync from its snapshot")
            st.seq = seq
            self._lost(w, st)
            if time.monotonic() >= st.next_resync and self._resync(w):
                return False  # rewound: a snapshot older than the stream's start retries at most every interval
        try:
            batch = decode_kv_batch(fields[KV_ENTRY_BATCH])
        except (KeyError, ValueError) as e:
            self._reject(w, "malformed", f"entry {eid} (seq {seq}): {e}")
            st.seq = seq
            self._lost(w, st)
            return True
        self._apply(w, batch)
        st.seq = seq
        if seq == 0:
            with self._lock:
                st.synced = True  # the publisher's first batch: the index holds exactly what it published
        m = self._metrics()
        self.applied += 1
        if m is not None:
            m.inc_kv_events_consumed()
            m.set_kv_events_lag(max(0.0, time.time() - batch.ts))
        return True

    def _apply_placements(self, entries: list) -> None:
        """Other routers' placements: their blocks pending on the worker for what is left of the window."""
        now = time.time()
        me = self.replica.router_id if self.replica is not None else None
        applied = 0
        for entry_id, fields in entries:
            self._place_last_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            try:
                p = decode_placement(fields)
            except ValueError as e:
                log.warning("KV replica sync: entry %s dropped: %s", self._place_last_id, e)
                m = self._metrics()
                if m is not None:
                    m.inc_kv_events_rejected("malformed")
                continue
            if p.router_id == me or p.worker_id not in self._streams:
                continue
            left = self.pending_s - max(0.0, now - p.ts)
            if left > 0:
                self.index.add_pending(p.worker_id, p.hashes, left)
                applied += 1
        if applied:
            self.placements_applied += applied
            m = self._metrics()
            if m is not None:
                m.inc_kv_replica_applied(applied)

    def _apply(self, w: str, batch: Any) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.index.store(w, ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.index.remove(w, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.index.clear(w)

    def _lost(self, w: str, st: _Stream) -> None:
        """Events of ``w`` were lost: out of sync until a snapshot rebuilds it."""
        with self._lock:
            st.synced = False

    def _resync(self, w: str) -> bool:
        """Rebuild ``w`` from its snapshot and rewind its stream there; False (retry later) when there is none
        of its current generation."""
        st = self._streams.get(w)
        if st is None:
            return False
        st.next_resync = time.monotonic() + self.resync_interval_s
        raw = self._redis.get(kv_snapshot_key(self.namespace, w))
        if raw is None:
            return False
        try:
            snap = decode_kv_snapshot(raw)
        except ValueError as e:
            self._reject(w, "malformed", f"snapshot: {e}")
            return False
        if snap.generation != st.generation:
            return False
        self.index.replace(w, snap.block_hashes)
        with self._lock:
            st.seq, st.last_id, st.synced = snap.seq, snap.stream_id, True
        m = self._metrics()
        if m is not None:
            m.inc_kv_events_resync()
        log.info("KV events: worker %s resynced from its snapshot (seq %d, %d blocks)", w, snap.seq,
                 len(snap.block_hashes))
        return True

    def _reject(self, w: str, reason: str, what: str) -> None:
        log.warning("KV events from worker %s dropped (%s): %s", w, reason, what)
        m = self._metrics()
        if m is not None:
            m.inc_kv_events_rejected(reason)

    def _update_gauges(self) -> None:
        m = self._metrics()
        if m is not None:
            m.set_kv_index_size(self.index.num_blocks(), self.num_synced())
