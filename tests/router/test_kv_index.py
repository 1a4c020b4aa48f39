"""The router's KV event index and its consumer, against a real Redis and the workers' real publisher.

The index is a plain map (checked on its own); the consumer is driven with ``poll_once`` (no thread) over
streams that ``worker_common.kv_events.KVEventPublisher`` writes, plus entries the test writes by hand for
the fault cases: a malformed or out-of-order batch is dropped, counted and logged with the publisher's id;
a skipped sequence number resyncs from the snapshot; a new generation drops the old entries; a worker
that leaves the list leaves the index; Redis going away means load-only (``connected`` False), and the
consumer resumes by itself when it is back.
"""
from __future__ import annotations

import logging
import random

import pytest
import redis

from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from engine.block_manager import CLEARED, REMOVED, STORED, block_keys
from engine.kv_events import (KV_ENTRY_BATCH, KV_ENTRY_GEN, KV_ENTRY_SEQ, BlockStored, KVEventBatch, encode_kv_batch,
                              kv_stream_key)
from metrics import RouterMetrics
from proto.worker_pb2 import WorkerInfo
from router.kv.index import KVEventConsumer, KVIndex
from router.selection import ScoreWeights, WorkerSelector
from tests.waiting import wait_until
from worker_common.kv_events import KVEventPublisher

BS = 4


def _counter(metrics: RouterMetrics, name: str, label: str = "") -> dict[str, float]:
    """A counter's values by ``label`` ("" = summed), read from what /metrics serves."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        if fam.name == name:
            for smp in fam.samples:
                if smp.name.endswith("_total"):
                    k = smp.labels[label] if label else ""
                    out[k] = out.get(k, 0.0) + smp.value
    return out


def _stored(tokens: list[int]) -> list[tuple]:
    return [(STORED, k) for k in block_keys(tokens, BS, len(tokens) // BS)]


def _hashes(tokens: list[int]) -> list[int]:
    return [k[2] for k in block_keys(tokens, BS, len(tokens) // BS)]


# ---- the index -----------------------------------------------------------------------------------------

def test_index_matches_leading_blocks_per_worker_and_forgets():
    idx = KVIndex()
    a, b = _hashes(list(range(12))), _hashes(list(range(8)) + [99, 98, 97, 96])
    idx.store("w0", a)
    idx.store("w1", b[:1])
    assert idx.match(["w0", "w1", "w2"], a) == {"w0": 3, "w1": 1, "w2": 0}
    assert idx.match(["w0"], a[1:]) == {"w0": 2}  # any run of chained hashes, from where the prompt starts
    idx.remove("w0", [a[1]])
    assert idx.match(["w0", "w1"], a) == {"w0": 1, "w1": 1}  # a hole ends the prefix
    idx.replace("w1", b)
    assert idx.match(["w1"], b) == {"w1": 3} and idx.num_blocks("w1") == 3
    idx.clear("w0")
    assert idx.holders(a[0]) == {"w1"} and idx.num_blocks() == 3 and idx.workers() == {"w1"}


def test_score_cached_prefers_the_cache_against_load_and_spreads_ties():
    sel = WorkerSelector()

    def w(wid: str, running: int = 0, queued: int = 0) -> WorkerInfo:
        return WorkerInfo(worker_id=wid, ready=True, block_size=BS, num_running=running, queued_prompt_tokens=queued)

    weights = ScoreWeights(overlap=1.0, load=1.0, request=2.0, tie_blocks=1.0)
    rng = random.Random(0)
    ws = [w("a"), w("b"), w("c")]
    assert sel.score_cached(ws, {"b": 5}, weights, rng)[0].worker_id == "b"
    # 5 cached blocks are worth less than 4 more running requests (4 * 2 = 8 blocks)
    ws = [w("a"), w("b", running=4), w("c", running=1)]
    assert sel.score_cached(ws, {"b": 5}, weights, rng)[0].worker_id == "a"
    # and less than 32 queued prompt tokens (8 blocks of 4)
    ws = [w("a"), w("b", queued=32)]
    assert sel.score_cached(ws, {"b": 5}, weights, rng)[0].worker_id == "a"
    # equal scores: drawn at random, so routers deciding at once on one view spread instead of herding
    firsts = {sel.score_cached([w("a"), w("b"), w("c")], {}, weights, rng)[0].worker_id for _ in range(60)}
    assert firsts == {"a", "b", "c"}
    # a load from the worker's event stream (a step old) replaces the heartbeat's stale record
    stale = [w("a", running=9, queued=400), w("b")]
    assert sel.score_cached(stale, {"a": 5}, weights, rng)[0].worker_id == "b"
    assert sel.score_cached(stale, {"a": 5}, weights, rng, {"a": (0, 0, 0), "b": (1, 0, 0)})[0].worker_id == "a"
    # tie_blocks 0 and equal scores: the load order decides
    firsts = {sel.score_cached([w("a"), w("b")], {}, ScoreWeights(tie_blocks=0.0), rng)[0].worker_id
              for _ in range(20)}
    assert firsts == {"a"}


# ---- the consumer over real streams --------------------------------------------------------------------

@pytest.fixture
def redis_client(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


class _Setup:
    def __init__(self, redis_url: str, ns: str, workers: list[str]) -> None:
        self.workers = list(workers)
        self.index = KVIndex()
        self.metrics = RouterMetrics("tiny", process_collectors=False)
        self.consumer = KVEventConsumer(self.index, redis_url, ns, lambda: list(self.workers), lambda: self.metrics,
                                        block_ms=20, resync_interval_s=0.01)

    def drain(self, rounds: int = 3) -> None:
        for _ in range(rounds):
            self.consumer.poll_once()

    def rejected(self) -> dict[str, float]:
        return _counter(self.metrics, "pdserve:kv_events_rejected", "reason")


def _publisher(redis_url: str, ns: str, wid: str, **kw) -> KVEventPublisher:
    return KVEventPublisher(redis_url, ns, wid, BS, snapshot_interval_s=kw.pop("snapshot_interval_s", 0.05), **kw)


def test_consumer_follows_stores_evictions_and_a_late_router_replays(redis_url, redis_namespace):
    pub = _publisher(redis_url, redis_namespace, "w0").start()
    try:
        toks = list(range(16))
        pub.submit(_stored(toks))
        pub.submit([(REMOVED, _hashes(toks)[3])])
        s = _Setup(redis_url, redis_namespace, ["w0"])
        wait_until(lambda: (s.drain(1), s.index.match(["w0"], _hashes(toks))["w0"] == 3)[1], timeout=5,
                   message="the first router sees 3 blocks")
        assert s.consumer.synced("w0") and s.consumer.connected is True
        # a router started now reads the stream from its start (the replay) and agrees
        late = _Setup(redis_url, redis_namespace, ["w0"])
        late.drain(2)
        assert late.index.match(["w0"], _hashes(toks)) == {"w0": 3} and late.consumer.synced("w0")
        pub.submit([(CLEARED,)])
        wait_until(lambda: (s.drain(1), s.index.num_blocks("w0") == 0)[1], timeout=5, message="cleared")
        # the worker leaves the registry: it leaves the index
        pub.submit(_stored(toks))
        wait_until(lambda: (s.drain(1), s.index.num_blocks("w0") == 4)[1], timeout=5, message="stored again")
        s.workers.remove("w0")
        s.drain(1)
        assert s.index.num_blocks() == 0 and not s.consumer.synced("w0")
        assert s.rejected() == {}
    finally:
        pub.stop()


def test_each_entry_carries_the_workers_load_and_a_changed_load_is_published_alone(redis_url, redis_namespace,
                                                                                     redis_client):
    pub = _publisher(redis_url, redis_namespace, "w0", load_interval_s=0.0).start()
    s = _Setup(redis_url, redis_namespace, ["w0"])
    try:
        pub.submit(_stored(list(range(8))), (1, 2, 30))
        wait_until(lambda: (s.drain(1), s.consumer.load("w0") == (1, 2, 30))[1], timeout=5, message="load with events")
        n = redis_client.xlen(kv_stream_key(redis_namespace, "w0"))
        pub.submit([], (1, 2, 30))  # unchanged, no events: nothing published
        pub.submit([], (0, 0, 0))  # changed: an empty batch carries it
        wait_until(lambda: (s.drain(1), s.consumer.load("w0") == (0, 0, 0))[1], timeout=5, message="load alone")
        assert redis_client.xlen(kv_stream_key(redis_namespace, "w0")) == n + 1
        assert s.index.num_blocks("w0") == 2 and s.consumer.synced("w0") and s.rejected() == {}
    finally:
        pub.stop()


def test_malformed_and_out_of_order_batches_are_dropped_counted_and_logged(redis_url, redis_namespace, redis_client,
                                                                           caplog):
    key = kv_stream_key(redis_namespace, "bad-worker")
    good = encode_kv_batch(KVEventBatch(ts=0.0, events=[BlockStored(_hashes(list(range(8))), None, list(range(8)),
                                                                     BS, None, None)]))
    redis_client.xadd(key, {KV_ENTRY_SEQ: "0", KV_ENTRY_GEN: "g1", KV_ENTRY_BATCH: good})
    redis_client.xadd(key, {KV_ENTRY_SEQ: "1", KV_ENTRY_GEN: "g1", KV_ENTRY_BATCH: b"\xc1not msgpack"})
    redis_client.xadd(key, {KV_ENTRY_SEQ: "x", KV_ENTRY_GEN: "g1", KV_ENTRY_BATCH: good})
    redis_client.xadd(key, {KV_ENTRY_SEQ: "2", KV_ENTRY_GEN: "g1", KV_ENTRY_BATCH: encode_kv_batch(
        KVEventBatch(ts=0.0, events=[BlockStored([123], None, [1, 2, 3, 4], BS, None, None)]))})
    redis_client.xadd(key, {KV_ENTRY_SEQ: "1", KV_ENTRY_GEN: "g1", KV_ENTRY_BATCH: good})  # a replayed old one
    s = _Setup(redis_url, redis_namespace, ["bad-worker"])
    with caplog.at_level(logging.WARNING, logger="router.kv.index"):
        s.drain(2)
    assert s.rejected() == {"malformed": 2.0, "out_of_order": 1.0}
    assert all("bad-worker" in r.getMessage() for r in caplog.records if "dropped" in r.getMessage())
    assert sum("dropped" in r.getMessage() for r in caplog.records) == 3
    # the good batches were applied; the loss put the worker out of sync (no snapshot to resync from)
    assert s.index.match(["bad-worker"], _hashes(list(range(8)))) == {"bad-worker": 2}
    assert s.index.holders(123) == {"bad-worker"} and not s.consumer.synced("bad-worker")


def test_a_gap_resyncs_from_the_snapshot_and_a_new_generation_drops_old_entries(redis_url, redis_namespace,
                                                                                redis_client):
    pub = _publisher(redis_url, redis_namespace, "w0", max_queue=1).start()
    s = _Setup(redis_url, redis_namespace, ["w0"])
    try:
        a, b = list(range(8)), list(range(100, 112))
        wait_until(lambda: (s.drain(1), s.consumer.synced("w0"))[1], timeout=5, message="hello batch read")
        pub._q.put((10**9, 0.0, [], None))  # hold the queue's one slot: the next batch is dropped (seq skipped)
        pub.submit(_stored(a))
        assert pub.dropped == 1
        wait_until(lambda: pub._q.empty(), timeout=5, message="publisher queue drained")
        pub.submit(_stored(b))  # after the gap
        wait_until(lambda: (s.drain(1), s.index.match(["w0"], _hashes(a))["w0"] == 2
                            and s.index.match(["w0"], _hashes(b))["w0"] == 3 and s.consumer.synced("w0"))[1],
                   timeout=5, message="resynced: the dropped batch's blocks are in the index")
        assert _counter(s.metrics, "pdserve:kv_events_resyncs") == {"": 1.0}
        assert s.rejected().get("gap", 0) >= 1
        # the worker restarts (a new publisher under the same id): what the old one published goes
        pub.stop(delete=False)
        pub = _publisher(redis_url, redis_namespace, "w0").start()
        wait_until(lambda: (s.drain(1), s.index.num_blocks("w0") == 0 and s.consumer.synced("w0"))[1], timeout=5,
                   message="new generation: old entries dropped")
    finally:
        pub.stop()
    assert redis_client.exists(kv_stream_key(redis_namespace, "w0")) == 0  # stop deletes its keys


def test_redis_unavailable_is_load_only_and_recovers_by_itself():
    server = EmbeddedRedis(RedisServerConfig()).start()
    port, password = server.port, server.password
    url = server.url
    pub = _publisher(url, "ns", "w0").start()
    s = _Setup(url, "ns", ["w0"])
    try:
        toks = list(range(8))
        pub.submit(_stored(toks))
        wait_until(lambda: (s.drain(1), s.index.num_blocks("w0") == 2)[1], timeout=5, message="stored")
        server.stop()
        with pytest.raises(redis.RedisError):
            s.consumer.poll_once()
        # the thread's view of it: disconnected, counted, and it keeps trying
        s.consumer.start()
        wait_until(lambda: s.consumer.connected is False, timeout=5, message="consumer disconnected")
        assert _counter(s.metrics, "pdserve:kv_events_redis_errors")[""] >= 1
        pub.submit([(REMOVED, _hashes(toks)[1])])  # never blocks, though Redis is away
        server = EmbeddedRedis(RedisServerConfig(port=port, password=password, spawn=True)).start()  # no fork of a threaded process
        pub.submit(_stored(list(range(50, 58))))  # a restarted, empty Redis: seqs went missing -> snapshot
        wait_until(lambda: s.consumer.connected is True and s.consumer.synced("w0")
                   and s.index.num_blocks("w0") == 3, timeout=10,
                   message="consumer back, resynced from the snapshot")
    finally:
        s.consumer.stop()
        pub.stop()
        server.stop()


def test_a_new_generation_invalidates_the_old_entries_by_itself(redis_url, redis_namespace, redis_client):
    """A restarted publisher whose first batches were trimmed away (no AllBlocksCleared reaches the router): its
    new generation alone drops what the old process published."""
    key = kv_stream_key(redis_namespace, "w9")
    old = encode_kv_batch(KVEventBatch(ts=0.0, events=[BlockStored(_hashes(list(range(8))), None, list(range(8)), BS,
                                                                    None, None)]))
    redis_client.xadd(key, {KV_ENTRY_SEQ: "0", KV_ENTRY_GEN: "old", KV_ENTRY_BATCH: old})
    s = _Setup(redis_url, redis_namespace, ["w9"])
    s.drain(1)
    assert s.index.num_blocks("w9") == 2 and s.consumer.synced("w9")
    new = encode_kv_batch(KVEventBatch(ts=0.0, events=[BlockStored([5], None, [1, 2, 3, 4], BS, None, None)]))
    redis_client.xadd(key, {KV_ENTRY_SEQ: "7", KV_ENTRY_GEN: "new", KV_ENTRY_BATCH: new})
    s.drain(1)
    assert s.index.workers() == {"w9"} and s.index.num_blocks("w9") == 1 and s.index.holders(5) == {"w9"}
    assert not s.consumer.synced("w9")  # seq 0..6 of the new generation are missing: no snapshot yet


def test_pending_blocks_expire_on_the_index_clock():
    """The simulator runs the router's index on its virtual clock: a call without ``now`` reads ``clock``."""
    t = [100.0]
    idx = KVIndex(clock=lambda: t[0])
    assert idx.add_pending("w", [1, 2, 3], 2.0) == 3
    t[0] = 101.9
    assert idx.pending_blocks("w") == 3 and idx.match(["w"], [1, 2, 3]) == {"w": 3}
    t[0] = 102.0
    assert idx.pending_blocks("w") == 0 and idx.match(["w"], [1, 2, 3]) == {"w": 0}
