"""Pending placements in the KV index and router replica sync (router/kv/replica.py), against a real Redis.

The index counts a placed prompt's blocks as pending on its worker until the worker's events confirm them or the
window ends; placement scores a pending block as held and as queued prefill work, less the blocks the request
itself shares; routers share their placements on ``{ns}:kvplace`` so another router's next decision sees them;
the sharing never blocks and drops (counted) while Redis is away.
"""
from __future__ import annotations

import random
import time

import redis

from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from engine.block_manager import block_keys
from metrics import RouterMetrics
from proto.worker_pb2 import WorkerInfo
from router.kv.index import KVEventConsumer, KVIndex
from router.kv.replica import PlacementPublisher, decode_placement, encode_placement, kv_place_key
from router.selection import ScoreWeights, WorkerSelector
from tests.router.test_kv_index import _counter, _publisher
from tests.waiting import wait_until

BS = 4


def _hashes(tokens: list[int]) -> list[int]:
    return [k[2] for k in block_keys(tokens, BS, len(tokens) // BS)]


def test_pending_blocks_count_until_confirmed_or_expired():
    idx = KVIndex()
    a = _hashes(list(range(16)))  # 4 blocks
    t = time.monotonic()
    idx.store("w0", a[:1])
    assert idx.add_pending("w0", a, ttl_s=2.0, now=t) == 3  # the held block is not pending
    assert idx.match_detail(["w0", "w1"], a, now=t + 0.5) == {"w0": (4, 3), "w1": (0, 0)}
    assert idx.match(["w0"], a) == {"w0": 4} and idx.pending_blocks("w0", now=t + 0.5) == 3
    idx.store("w0", a[1:3])  # the worker's events confirm two of them
    assert idx.match_detail(["w0"], a, now=t + 1.0) == {"w0": (4, 1)} and idx.pending_blocks("w0", now=t + 1.0) == 1
    assert idx.pending_blocks("w0", now=t + 2.1) == 0  # the last one's window ended
    assert idx.match_detail(["w0"], a, now=t + 2.1) == {"w0": (3, 0)}
    idx.add_pending("w1", a, ttl_s=60.0)
    idx.clear("w1")  # a worker that leaves takes its pending blocks along
    assert idx.pending_blocks("w1") == 0 and idx.match(["w1"], a) == {"w1": 0}
    small = KVIndex(max_pending_per_worker=2)
    assert small.add_pending("w0", a, ttl_s=1.0) == 2  # bounded


def test_a_burst_on_one_prefix_follows_the_first_request_while_its_prefill_is_queued():
    """The first request of a shared prefix is queued on a: its worker reports 18 blocks of prompt queued. The
    second request shares 16 of them: it waits for those anyway, so only the 2 it adds count as load; the worker's
    reported queue (every queued prompt whole, cached part included) sent it to an idle worker to compute the
    prefix again."""
    idx = KVIndex()
    prompt = list(range(72))  # 18 blocks of 4
    idx.add_pending("a", _hashes(prompt), ttl_s=5.0)
    second = _hashes(prompt[:64] + list(range(500, 508)))
    detail = idx.match_detail(["a", "b"], second)
    assert detail == {"a": (16, 16), "b": (0, 0)}
    queued = {w: max(0, idx.pending_blocks(w) - detail[w][1]) for w in ("a", "b")}
    assert queued == {"a": 2, "b": 0}
    ws = [WorkerInfo(worker_id=w, ready=True, block_size=BS) for w in ("a", "b")]
    fresh = {"a": (0, 1, 72), "b": (0, 0, 0)}
    sel, rng = WorkerSelector(), random.Random(0)
    matches = {w: n for w, (n, _p) in detail.items()}
    assert all(sel.score_cached(ws, matches, ScoreWeights(), rng, fresh, queued)[0].worker_id == "a"
               for _ in range(20))
    assert sel.score_cached(ws, matches, ScoreWeights(), rng, fresh)[0].worker_id == "b"  # the old load term


def test_placement_entries_round_trip_and_bad_ones_are_refused():
    e = decode_placement(encode_placement("r1", "w0", [1, 2**64 - 1], 12.5))
    assert (e.router_id, e.worker_id, e.hashes, e.ts) == ("r1", "w0", [1, 2**64 - 1], 12.5)
    for bad in ({}, {b"r": b"r", b"w": b"w", b"t": b"1", b"h": b"123"}, {b"r": b"r", b"w": b"w", b"t": b"x", b"h": b""}):
        try:
            decode_placement(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")


class _Router:
    """One router's consumer (no thread: ``poll_once``) following worker w0, with or without replica sync."""

    def __init__(self, redis_url: str, ns: str, sync: bool = True) -> None:
        self.index = KVIndex()
        self.metrics = RouterMetrics("tiny", process_collectors=False)
        self.consumer = KVEventConsumer(self.index, redis_url, ns, lambda: ["w0"], lambda: self.metrics, block_ms=20,
                                        pending_s=5.0, replica_sync=sync)


def test_replica_sync_shows_one_routers_placement_to_the_others(redis_url, redis_namespace):
    pub = _publisher(redis_url, redis_namespace, "w0").start()
    routers = [_Router(redis_url, redis_namespace) for _ in range(3)]
    try:
        for r in routers:
            r.consumer.start()
        wait_until(lambda: all(r.consumer.synced("w0") for r in routers), timeout=30, message="routers follow w0")
        prompt = _hashes(list(range(40)))
        routers[0].consumer.placed("w0", prompt)
        assert routers[0].index.match(["w0"], prompt) == {"w0": 10}  # its own placement counts at once
        wait_until(lambda: all(r.index.match(["w0"], prompt) == {"w0": 10} for r in routers[1:]), timeout=30,
                   message="the other routers see the placement as pending on w0")
        assert all(r.index.pending_blocks("w0") == 10 for r in routers)
        assert routers[0].consumer.placements_applied == 0  # its own entry is skipped
        assert _counter(routers[0].metrics, "pdserve:kv_replica_published") == {"": 1.0}
        assert _counter(routers[1].metrics, "pdserve:kv_replica_applied") == {"": 1.0}
        # the worker's events confirm the blocks: no longer pending, still held
        from engine.block_manager import STORED

        pub.submit([(STORED, k) for k in block_keys(list(range(40)), BS, 10)])
        wait_until(lambda: all(r.index.pending_blocks("w0") == 0 and r.index.num_blocks("w0") == 10
                               for r in routers), timeout=30, message="events confirm the pending blocks")
    finally:
        for r in routers:
            r.consumer.stop()
        pub.stop()
    assert redis.Redis.from_url(redis_url).exists(kv_place_key(redis_namespace)) == 0  # a stopped router deletes it


def test_without_replica_sync_a_router_knows_only_its_own_placements(redis_url, redis_namespace):
    pub = _publisher(redis_url, redis_namespace, "w0").start()
    a, b = _Router(redis_url, redis_namespace, sync=False), _Router(redis_url, redis_namespace, sync=False)
    try:
        wait_until(lambda: (a.consumer.poll_once() >= 0 and b.consumer.poll_once() >= 0
                            and a.consumer.synced("w0") and b.consumer.synced("w0")), timeout=30,
                   message="both follow w0")
        prompt = _hashes(list(range(40)))
        a.consumer.placed("w0", prompt)
        from engine.block_manager import STORED

        pub.submit([(STORED, k) for k in block_keys(list(range(100, 104)), BS, 1)])  # a later event on w0
        wait_until(lambda: b.consumer.poll_once() >= 0 and b.index.num_blocks("w0") == 1, timeout=30,
                   message="b read past the placement's time")
        assert a.index.pending_blocks("w0") == 10 and b.index.pending_blocks("w0") == 0
        assert redis.Redis.from_url(redis_url).exists(kv_place_key(redis_namespace)) == 0  # nothing written
    finally:
        a.consumer.stop()
        b.consumer.stop()
        pub.stop()


def test_sharing_never_blocks_and_drops_counted_while_redis_is_away():
    server = EmbeddedRedis(RedisServerConfig()).start()
    client = redis.Redis.from_url(server.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    metrics = RouterMetrics("tiny", process_collectors=False)
    pub = PlacementPublisher(client, "ns", lambda: metrics, max_queue=8).start()
    try:
        pub.publish("w0", [1, 2, 3])
        wait_until(lambda: pub.published == 1, timeout=30, message="published while Redis is up")
        server.stop()
        for _ in range(200):  # the placer's calls return at once; past the queue's bound they drop
            pub.publish("w0", [1, 2, 3])
        def dropped() -> dict[str, float]:
            return _counter(metrics, "pdserve:kv_replica_dropped", "reason")

        wait_until(lambda: dropped().get("queue_full", 0) > 0 and dropped().get("redis_error", 0) > 0, timeout=30,
                   message="drops counted: past the queue's bound, and the failed writes")
        pub.stop()
        assert pub.dropped >= 200 - 8 and sum(dropped().values()) == pub.dropped
    finally:
        pub.stop()
        client.close()
        server.stop()
