"""Router replica sync: each router tells the others, through Redis, which blocks it has just placed on which worker.

Why: a worker's KV events confirm a prompt's blocks only after its prefill (a step after the request arrives,
plus the publish and read), so a router placing the next request that shares the prefix a few milliseconds later
does not see them yet. Its own placements it counts at once (``KVIndex.add_pending``); the other routers'
placements reach it here, as NVIDIA Dynamo's routers share theirs (``--router-replica-sync``). Measured in
docs/benchmarks.md ("Prefix routing with several routers").

Lifecycle: the router's ``KVEventConsumer`` builds one ``PlacementPublisher`` (when ``RouterConfig.kv_replica_sync``
is on) and ``start()``s it. For every placement the placer calls ``publish(worker_id, hashes)``, which never
blocks: it puts the entry in a bounded queue, or drops it (counted, ``kv_replica_dropped_total{reason=
"queue_full"}``) when the queue is full. The publisher thread ``XADD``s what is queued to the shared stream
``{ns}:kvplace`` in one pipeline (``MAXLEN ~ stream_maxlen``, the key's TTL refreshed to ``ttl_s``); a failed write
drops those entries (``reason="redis_error"``) and backs off: Redis down costs only the sharing, never a placement.
Every router's consumer thread reads the stream in the same ``XREAD`` as the workers' event streams (from its
newest entry at start: a placement older than the pending window is worth nothing), skips its own entries and
marks the others' blocks pending on that worker for what is left of ``RouterConfig.kv_pending_s`` (the entry's
age by the publisher's clock). ``stop()`` ends the thread and deletes the key (the other routers have read its
seconds-old entries; the next placement creates it again); otherwise it expires ``ttl_s`` after the last write.

An entry: ``r`` (the publishing router's random id), ``w`` (worker id), ``t`` (publish time, Unix seconds),
``h`` (the prompt's block hashes, little-endian unsigned 64-bit, at most ``MAX_HASHES``).
"""
from __future__ import annotations

import logging
import queue
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import redis

log = logging.getLogger(__name__)

PLACE_ROUTER = b"r"
PLACE_WORKER = b"w"
PLACE_TIME = b"t"
PLACE_HASHES = b"h"
MAX_HASHES = 8192
"""Blocks one entry carries (a 128k-token prompt of 16-token blocks); a longer prompt's first ones only."""


def kv_place_key(namespace: str) -> str:
    """The shared stream every router of a deployment appends its placements to."""
    return f"{namespace}:kvplace"


@dataclass(frozen=True)
class PlacedEntry:
    """One decoded ``{ns}:kvplace`` entry."""

    router_id: str
    worker_id: str
    ts: float
    hashes: list[int]


def encode_placement(router_id: str, worker_id: str, hashes: Sequence[int], ts: float) -> dict[bytes, bytes]:
    hs = list(hashes[:MAX_HASHES])
    return {PLACE_ROUTER: router_id.encode(), PLACE_WORKER: worker_id.encode(), PLACE_TIME: repr(ts).encode(),
            PLACE_HASHES: struct.pack(f"<{len(hs)}Q", *hs)}


def decode_placement(fields: dict) -> PlacedEntry:
    """An entry from its stream fields; ValueError naming what is wrong."""
    try:
        raw = fields[PLACE_HASHES]
        if len(raw) % 8 or len(raw) > 8 * MAX_HASHES:
            raise ValueError(f"h: {len(raw)} bytes is not a list of at most {MAX_HASHES} 64-bit hashes")
        ts = float(fields[PLACE_TIME])
        if ts != ts:
            raise ValueError("t: NaN")
        return PlacedEntry(fields[PLACE_ROUTER].decode(), fields[PLACE_WORKER].decode(), ts,
                           list(struct.unpack(f"<{len(raw) // 8}Q", raw)))
    except (KeyError, UnicodeDecodeError, TypeError, struct.error) as e:
        raise ValueError(f"placement entry: {e!r}") from None


_STOP = object()


class PlacementPublisher:
    """Appends this router's placements to ``{ns}:kvplace`` off the request path (see module docstring)."""

    def __init__(self, client: "redis.Redis", namespace: str, metrics: Callable[[], Any] = lambda: None,
                 max_queue: int = 1024, stream_maxlen: int = 4096, ttl_s: float = 10.0,
                 router_id: Optional[str] = None) -> None:
        if max_queue < 1 or stream_maxlen < 1 or not ttl_s > 0:
            raise ValueError("max_queue, stream_maxlen and ttl_s must be positive")
        self.router_id = router_id or uuid.uuid4().hex[:16]
        self.key = kv_place_key(namespace)
        self.stream_maxlen = stream_maxlen
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._redis = client
        self._metrics = metrics
        self._q: "queue.Queue[Any]" = queue.Queue(maxsize=max_queue)
        self._thread: Optional[threading.Thread] = None
        self.published = 0
        """Entries appended (tests and metrics read it)."""
        self.dropped = 0
        """Entries lost (queue full, or Redis unavailable)."""

    def start(self) -> "PlacementPublisher":
        self._thread = threading.Thread(target=self._run, name="kv-replica-sync", daemon=True)
        self._thread.start()
        return self

    def publish(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Share one placement; never blocks (a full queue drops it, counted)."""
        if not hashes:
            return
        try:
            self._q.put_nowait((worker_id, list(hashes), time.time()))
        except queue.Full:
            self._dropped("queue_full", 1)

    def _dropped(self, reason: str, n: int) -> None:
        self.dropped += n
        m = self._metrics()
        if m is not None:
            m.inc_kv_replica_dropped(reason, n)
        if self.dropped == n or self.dropped % 100 < n:
            log.warning("router %s: %d placement(s) not shared with the other routers (%s; %d so far)",
                        self.router_id, n, reason, self.dropped)

    def _run(self) -> None:
        wait = 0.05
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            items = [item]
            while len(items) < 256:  # whatever queued meanwhile goes in the same round trip
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    self._q.put(_STOP)
                    break
                items.append(nxt)
            try:
                pipe = self._redis.pipeline(transaction=False)
                for w, hs, ts in items:
                    pipe.xadd(self.key, encode_placement(self.router_id, w, hs, ts), maxlen=self.stream_maxlen,
                              approximate=True)
                pipe.pexpire(self.key, self.ttl_ms)
                pipe.execute()
                self.published += len(items)
                m = self._metrics()
                if m is not None:
                    m.inc_kv_replica_published(len(items))
                wait = 0.05
            except redis.RedisError:
                self._dropped("redis_error", len(items))
                time.sleep(wait)  # Redis away: what queues meanwhile is dropped as the queue fills (counted)
                wait = min(2 * wait, 1.0)

    def stop(self, delete: bool = True) -> None:
        """End the thread (what is still queued is dropped) and, with ``delete``, remove the shared stream: its
        entries are seconds old, so the other routers have read them, and the next placement creates it again (the
        key would expire ``ttl_s`` later anyway; a stopped deployment leaves no key)."""
        if self._thread is not None:
            self._stop_thread()
        if delete:
            try:
                self._redis.delete(self.key)
            except redis.RedisError as e:
                log.warning("router %s: could not delete %s (it expires by itself): %s", self.router_id, self.key, e)

    def _stop_thread(self) -> None:
        while True:
            try:
                self._q.put_nowait(_STOP)
                break
            except queue.Full:
                try:
                    self._q.get_nowait()
                except queue.Empty:
                    pass
        self._thread.join(timeout=5.0)
        self._thread = None
