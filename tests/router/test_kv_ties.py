"""Cold ties broken through Redis (router/kv/ties.py), against a real Redis and the real placer.

Routers placing new prefixes (cached nowhere) at the same instant, before replica sync can tell them of each
other's placements, must land them on different workers; one router's requests sharing a new prefix must not split
it; Redis away means a local draw (counted), never a failed or stalled placement; the shared state expires and a
stopped router deletes it.
"""
from __future__ import annotations

import socket
import threading

import redis

from metrics import RouterMetrics
from proto.worker_pb2 import WorkerInfo
from router.clients import WorkerClients
from router.config import RouterConfig
from router.kv.index import KVEventConsumer, KVIndex
from router.kv.ties import ColdTies, kv_ties_key
from router.placement import Placer
from router.kv.prefix_index import PrefixIndex
from router.worker_calls import WorkerCalls
from router.scope import RequestScope
from router.selection import WorkerSelector
from router.validation import ValidatedRequest
from router.worker_source import Pool, StaticWorkerSource
from engine import SamplingParams
from tests.router.test_kv_index import _counter, _publisher
from tests.waiting import wait_until

WORKERS = ["w0", "w1", "w2"]


def _scope(tokens: list[int], rid: str) -> RequestScope:
    return RequestScope(ValidatedRequest(rid, None, tokens, SamplingParams(max_tokens=4)), 0.0, 1e12)


def _w(wid: str) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role="colocated", ready=True, block_size=16, num_total_blocks=64,
                      num_free_blocks=64, grpc_address=f"{wid}:1")


def test_routers_deciding_at_once_get_different_workers(redis_url, redis_namespace):
    """Three routers break the same three-way tie at the same instant: Redis serialises the draws, so each gets a
    different worker (a local draw from the same order gives all three the first); then the counts are even and the
    first in order wins."""
    metrics = RouterMetrics("tiny", process_collectors=False)
    ties = [ColdTies(redis_url, redis_namespace, window_s=30.0, metrics=lambda: metrics, timeout_s=10.0)
            for _ in range(3)]
    try:
        start = threading.Barrier(3)
        got: list = [None] * 3

        def draw(i: int) -> None:
            start.wait(timeout=30)
            got[i] = ties[i].choose(WORKERS)

        threads = [threading.Thread(target=draw, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert sorted(got) == WORKERS
        assert ties[0].choose(["w2", "w1", "w0"]) == "w2"  # one each: the first of the caller's order
        assert ties[1].choose(["w0", "w1", "w2"]) == "w0"
        assert ties[2].choose(["w1", "w2"]) == "w1"  # w1 1 tie, w2 2
        assert _counter(metrics, "pdserve:kv_cold_ties", "result") == {"shared": 6.0}
    finally:
        for t in ties:
            t.stop()
    assert redis.Redis.from_url(redis_url).exists(kv_ties_key(redis_namespace)) == 0  # stop deletes it


def test_old_windows_are_forgotten_and_the_key_expires(redis_url, redis_namespace):
    r = redis.Redis.from_url(redis_url)
    ties = ColdTies(redis_url, redis_namespace, window_s=0.05, timeout_s=10.0)
    key = kv_ties_key(redis_namespace)
    try:
        # two draws in one 50 ms window spread (w0, then w1); beside other work a window may pass between them,
        # so the pair is tried until both fall in one (draws that never count would give w0, w0 every time)
        wait_until(lambda: [ties.choose(["w0", "w1"]) for _ in range(2)] == ["w0", "w1"], timeout=30,
                   interval=0.01, message="two draws within one window spread over both workers")
        # two windows on, the early draws no longer count (w0 wins again) and their fields are gone
        wait_until(lambda: ties.choose(["w0", "w1"]) == "w0" and ties.choose(["w0", "w1"]) == "w1"
                   and len(r.hkeys(key)) <= 5, timeout=30, message="old windows forgotten")
        fields = {f.decode() for f in r.hkeys(key)}
        window = int(r.hget(key, "_b"))
        assert all(f == "_b" or int(f.split(":")[0]) >= window - 1 for f in fields), fields
        wait_until(lambda: r.exists(key) == 0, timeout=30, message="the key expires two windows after the last draw")
    finally:
        ties.stop()
        r.close()


def test_redis_away_draws_locally_and_counts_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    metrics = RouterMetrics("tiny", process_collectors=False)
    ties = ColdTies(f"redis://127.0.0.1:{port}/0", "gone", window_s=1.0, metrics=lambda: metrics, backoff_s=60.0)
    try:
        assert ties.choose(WORKERS) is None
        tried = []
        script = ties._script
        ties._script = lambda **kw: tried.append(kw) or script(**kw)
        assert ties.choose(WORKERS) is None
        assert tried == []  # within the backoff: Redis not even tried
        assert (ties.local, ties.shared) == (2, 0)
        assert _counter(metrics, "pdserve:kv_cold_ties", "result") == {"local": 2.0}
    finally:
        ties.stop()


class _Router:
    """A router's placer over w0..w2 with a real KV event consumer (no thread after sync: other routers'
    placements never reach it, as when they decide within replica sync's latency)."""

    def __init__(self, redis_url: str, ns: str) -> None:
        self.index = KVIndex()
        self.consumer = KVEventConsumer(self.index, redis_url, ns, lambda: WORKERS, block_ms=20, pending_s=5.0,
                                        ties_timeout_s=10.0)  # a loaded CI host must not turn a draw local
        rcfg = RouterConfig(serve_metrics=False)
        self.placer = Placer(rcfg, StaticWorkerSource([_w(w) for w in WORKERS]), WorkerSelector(),
                             WorkerCalls(rcfg, WorkerClients()), prefixes=PrefixIndex(), kv_events=self.consumer)

    def place(self, tokens: list[int], rid: str) -> str:
        s = _scope(tokens, rid)
        p = self.placer.place_whole(s, Pool.COLOCATED, set())
        return p.decode.worker_id


def _synced(routers: list[_Router]) -> None:
    wait_until(lambda: all(r.consumer.poll_once() >= 0 and all(r.consumer.synced(w) for w in WORKERS)
                           for r in routers), timeout=30, message="every router follows w0..w2")


def test_new_prefixes_through_three_routers_spread_and_stay(redis_url, redis_namespace):
    """Three routers each open a different system prompt on idle workers without hearing of each other: the three
    prompts go to three workers; each router's next request with its prompt follows it there (pending at once)."""
    pubs = [_publisher(redis_url, redis_namespace, w).start() for w in WORKERS]
    routers = [_Router(redis_url, redis_namespace) for _ in range(3)]
    try:
        _synced(routers)
        systems = [[1000 * (i + 1) + j for j in range(64)] for i in range(3)]  # 4 blocks each
        first = [r.place(systems[i] + [7, 8, 9], f"a{i}") for i, r in enumerate(routers)]
        assert sorted(first) == WORKERS
        again = [r.place(systems[i] + [5, 6], f"b{i}") for i, r in enumerate(routers)]
        assert again == first
        assert sum(r.consumer.ties.shared for r in routers) == 3  # only the cold ones asked Redis
    finally:
        for r in routers:
            r.consumer.stop()
        for p in pubs:
            p.stop()


class _ArrivalLock:
    """Stands in for the placer's cold lock and sets ``arrived`` once a second decision comes to take it (the
    test then knows the second request reached the cold path while the first one held it)."""

    def __init__(self, lock, arrived: threading.Event) -> None:
        self._lock, self._arrived, self._entries = lock, arrived, 0

    def __enter__(self):
        self._entries += 1
        if self._entries >= 2:
            self._arrived.set()
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


def test_one_routers_requests_on_a_new_prefix_do_not_split_it(redis_url, redis_namespace):
    """Two requests of one router share a new prefix; the second is decided while the first waits on Redis: it
    waits for the first's decision and follows it (without the router's cold lock it would draw from Redis too,
    after the first's draw was counted or before it, and go to another worker)."""
    pubs = [_publisher(redis_url, redis_namespace, w).start() for w in WORKERS]
    r = _Router(redis_url, redis_namespace)
    try:
        _synced([r])
        ties = r.consumer.ties
        real = ties.choose
        entered, second = threading.Event(), threading.Event()
        # the second decision "arrives" when it comes to take the cold lock, or (no lock) when it draws itself
        r.placer._cold_lock = _ArrivalLock(r.placer._cold_lock, second)

        def slow_choose(ids):
            if not entered.is_set():
                entered.set()
                # the first decision waits on "Redis" until the second request has come to its own decision: an
                # ordering, not a time window a loaded host could miss
                assert second.wait(timeout=30), "the second request never reached its cold decision"
            else:
                second.set()
            return real(ids)

        ties.choose = slow_choose
        prompt = [3000 + j for j in range(64)]
        got: dict[str, str] = {}
        t1 = threading.Thread(target=lambda: got.__setitem__("a", r.place(prompt + [1], "a")))
        t1.start()
        assert entered.wait(timeout=30)
        t2 = threading.Thread(target=lambda: got.__setitem__("b", r.place(prompt + [2], "b")))
        t2.start()
        t1.join(timeout=30)
        t2.join(timeout=30)
        assert second.is_set() and set(got) == {"a", "b"}, got
        assert got["a"] == got["b"]
        assert ties.shared == 1
    finally:
        r.consumer.stop()
        for p in pubs:
            p.stop()
