"""A worker's KV event publisher: its prefix cache's changes, appended to its own Redis stream off the step path.

Lifecycle: ``WorkerBase.load`` builds one ``KVEventPublisher`` when the worker has an events URL
(``WorkerConfig.kv_events_url``), turns on its engine's ``BlockManager.enable_events()`` and ``start()``s
it: a new random generation, and a first batch (seq 0, ``AllBlocksCleared``) that tells every consumer
to forget what an earlier process under this worker id published. After each engine-loop pass the loop
thread hands the step's raw events to ``submit``, which never blocks: it numbers the batch, updates the
publisher's shadow of the cache and puts it in a bounded queue; a full queue drops the batch (counted,
``kv_events_dropped_total{reason="queue_full"}``) and its number is skipped, so consumers see the gap and
resync. Each entry also carries the worker's load at that step (``load``: running, waiting, queued prompt
tokens), and a changed load is published alone (an empty batch; at most every ``load_interval_s``, by default
on every change), so routers see a worker's load a step old rather than a heartbeat old. The publisher thread
encodes each batch (vLLM's msgpack, ``engine.kv_events``) and ``XADD``s it to ``{ns}:kvev:{worker_id}`` with
``MAXLEN ~ stream_maxlen`` (the stream is the replay buffer), and, while the cache changes, every
``snapshot_interval_s`` (at once after a drop or a failed append) writes ``{ns}:kvsnap:{worker_id}``:
the whole cache after batch S and the stream id to replay after. Both keys expire after ``ttl_s``
unless refreshed (the thread refreshes them while the worker lives), so a killed worker leaves nothing;
``stop()`` deletes them. Redis down costs only dropped batches (``reason="redis_error"``) and a snapshot
once it answers again: the step path never waits on Redis.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import Any, Optional

import redis

from engine.block_manager import CLEARED, REMOVED, STORED
from engine.kv_events import (KV_ENTRY_BATCH, KV_ENTRY_GEN, KV_ENTRY_LOAD, KV_ENTRY_SEQ, KVSnapshot, encode_kv_batch,
                              encode_kv_snapshot, kv_batch_from_raw, kv_snapshot_key, kv_stream_key)

log = logging.getLogger(__name__)

_STOP = object()


class KVEventPublisher:
    """Publishes one worker's KV events (see module docstring). ``submit`` is for the engine-loop thread only."""

    def __init__(self, redis_url: str, namespace: str, worker_id: str, block_size: int, *, medium: str = "CPU",
                 max_queue: int = 1024, stream_maxlen: int = 10000, ttl_s: float = 10.0,
                 snapshot_interval_s: float = 2.0, load_interval_s: float = 0.0, metrics: Any = None,
                 lora_roots: Optional[dict[int, int]] = None) -> None:
        if not isinstance(redis_url, str) or not redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("kv_events_url must be a redis://, rediss:// or unix:// URL")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        for name, v in (("max_queue", max_queue), ("stream_maxlen", stream_maxlen)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not ttl_s > 0 or not snapshot_interval_s > 0:
            raise ValueError(f"ttl_s and snapshot_interval_s must be > 0, got {ttl_s!r}, {snapshot_interval_s!r}")
        self.worker_id = worker_id
        self.block_size = block_size
        self.medium = medium
        self.lora_roots = dict(lora_roots or {})
        """Each LoRA adapter's prefix-cache root -> its ``lora_id`` (``LLMEngine.lora_event_ids``): replaced whole
        when adapters are loaded at run time (worker_common/lora_sync.py)."""
        self.stream = kv_stream_key(namespace, worker_id)
        self.snapshot = kv_snapshot_key(namespace, worker_id)
        self.stream_maxlen = stream_maxlen
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.snapshot_interval_s = snapshot_interval_s
        self.load_interval_s = load_interval_s
        self._last_load: Optional[tuple[int, int, int]] = None
        self._last_load_t = 0.0
        self.metrics = metrics
        self.generation = ""
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._q: "queue.Queue[Any]" = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()  # guards the shadow and the sequence numbers (loop thread vs publisher)
        self._shadow: set[int] = set()
        self._next_seq = 0
        self._changed_seq = -1
        self._need_snapshot = False
        self._thread: Optional[threading.Thread] = None
        self.published = 0
        """Batches appended to the stream."""
        self.dropped = 0
        """Batches lost (queue full or append failed)."""

    # ---- loop thread --------------------------------------------------------------------------
    def start(self) -> "KVEventPublisher":
        self.generation = uuid.uuid4().hex[:16]
        self._submit([(CLEARED,)])  # seq 0: consumers drop whatever this worker id published before
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{self.worker_id}", daemon=True)
        self._thread.start()
        return self

    def submit(self, raw: list[tuple], load: Optional[tuple[int, int, int]] = None) -> None:
        """One step's raw events (``BlockManager.take_events()``) and the worker's load then (running, waiting,
        queued prompt tokens); never blocks. With no events, a changed load alone is published, at most every
        ``load_interval_s`` (the loop polls again soon, so the last change is never lost)."""
        now = time.monotonic()
        if not raw:
            if load is None or load == self._last_load or now - self._last_load_t < self.load_interval_s:
                return
        if load is not None:
            self._last_load, self._last_load_t = load, now
        self._submit(raw, load)

    def _submit(self, raw: list[tuple], load: Optional[tuple[int, int, int]] = None) -> None:
        with self._lock:
            shadow = self._shadow
            for ev in raw:
                if ev[0] == STORED:
                    shadow.add(ev[1][2])
                elif ev[0] == REMOVED:
                    shadow.discard(ev[1])
                else:
                    shadow.clear()
            seq = self._next_seq
            self._next_seq += 1
            if raw:
                self._changed_seq = seq  # the cache changed (a load-only batch needs no new snapshot)
            try:
                self._q.put_nowait((seq, time.time(), raw, load))
                return
            except queue.Full:
                self._need_snapshot = True
        self._dropped("queue_full")

    def _dropped(self, reason: str) -> None:
        self.dropped += 1
        if self.metrics is not None:
            self.metrics.inc_kv_events_dropped(reason)

    # ---- publisher thread ---------------------------------------------------------------------
    def _run(self) -> None:
        last_id = "0-0"
        published_seq = -1  # the newest seq this thread has handled (appended or lost)
        snap_seq = -1
        last_snap = last_refresh = 0.0
        fresh = True  # nothing written yet: delete what an earlier process left under this id first
        wait = 0.05
        while True:
            try:
                item = self._q.get(timeout=min(1.0, self.snapshot_interval_s))
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            try:
                if fresh:
                    self._redis.delete(self.stream, self.snapshot)
                    fresh = False
                if item is not None:
                    seq, ts, raw, load = item
                    published_seq = seq
                    fields = {KV_ENTRY_SEQ: str(seq), KV_ENTRY_GEN: self.generation,
                              KV_ENTRY_BATCH: encode_kv_batch(kv_batch_from_raw(raw, self.block_size, self.medium, ts,
                                                                         self.lora_roots))}
                    if load is not None:
                        fields[KV_ENTRY_LOAD] = ",".join(map(str, load))
                    pipe = self._redis.pipeline(transaction=False)
                    pipe.xadd(self.stream, fields, maxlen=self.stream_maxlen, approximate=True)
                    pipe.pexpire(self.stream, self.ttl_ms)
                    entry_id = pipe.execute()[0]
                    last_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                    self.published += 1
                    if self.metrics is not None:
                        self.metrics.inc_kv_events_published()
                now = time.monotonic()
                changed = min(published_seq, self._changed_seq) > snap_seq
                due = self._need_snapshot or (changed and now - last_snap >= self.snapshot_interval_s)
                if due and self._q.empty():
                    written = self._write_snapshot(last_id)
                    if written is not None:
                        snap_seq, last_snap = written, now
                if now - last_refresh >= self.ttl_ms / 3000:
                    pipe = self._redis.pipeline(transaction=False)
                    pipe.pexpire(self.stream, self.ttl_ms)
                    pipe.pexpire(self.snapshot, self.ttl_ms)
                    pipe.execute()
                    last_refresh = now
                wait = 0.05
            except redis.RedisError as e:
                if item is not None:
                    self._dropped("redis_error")
                    self._need_snapshot = True
                if self.dropped == 1 or self.dropped % 100 == 0:
                    log.warning("worker %s: KV events not published (%d dropped so far): %s", self.worker_id,
                                self.dropped, e)
                time.sleep(wait)  # Redis away: back off a little, batches keep dropping (counted) meanwhile
                wait = min(2 * wait, 1.0)

    def _write_snapshot(self, last_id: str) -> Optional[int]:
        """Write the cache as of the newest numbered batch, if every numbered batch has been handled; its seq."""
        with self._lock:
            if not self._q.empty():  # the loop thread queued more meanwhile: the shadow is ahead of the stream
                return None
            seq = self._next_seq - 1
            hashes = list(self._shadow)
            self._need_snapshot = False
        snap = KVSnapshot(self.generation, seq, last_id, self.block_size, hashes)
        try:
            self._redis.set(self.snapshot, encode_kv_snapshot(snap), px=self.ttl_ms)
        except redis.RedisError:
            self._need_snapshot = True
            raise
        return seq

    def stop(self, delete: bool = True) -> None:
        """Stop the thread (what is queued is dropped) and, with ``delete``, remove this worker's keys."""
        if self._thread is not None:
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
        if delete:
            try:
                self._redis.delete(self.stream, self.snapshot)
            except redis.RedisError as e:  # they expire after ttl_s anyway
                log.warning("worker %s: could not delete its KV event keys: %s", self.worker_id, e)
        self._redis.close()
