"""router.placement over plain data: the route rule, the retry/migrate rule, whole-request placement and
release (no workers are called here; tests/roles drive placements against real workers)."""
from __future__ import annotations

import threading

import grpc
import pytest

from engine import SamplingParams, TokenLogprob
from proto.worker_pb2 import WorkerInfo
from router.clients import WorkerClients
from router.config import RouterConfig
from router.events import FlowError, FlowEvent, Timings, Usage
from router.placement import Placer
from router.placement_records import Hold, Placement, Recovery, Route, recovery
from router.scope import RequestScope
from router.selection import WorkerSelector
from router.server import render
from router.validation import ValidatedRequest
from router.worker_calls import WorkerCalls
from router.worker_source import Pool, StaticWorkerSource


def _scope(n_tokens: int = 40, rid: str = "r1", deadline: float = 1e12) -> RequestScope:
    vreq = ValidatedRequest(rid, None, list(range(1, n_tokens + 1)), SamplingParams(max_tokens=4))
    return RequestScope(vreq, 0.0, deadline)


def _w(wid: str, role: str, running: int = 0, queued: int = 0, ready: bool = True) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role=role, num_running=running, queued_prompt_tokens=queued, ready=ready,
                      block_size=16, num_total_blocks=64, num_free_blocks=64, grpc_address=f"{wid}:1")


def _placer(workers: list[WorkerInfo], **cfg) -> Placer:
    rcfg = RouterConfig(serve_metrics=False, **cfg)
    return Placer(rcfg, StaticWorkerSource(workers), WorkerSelector(), WorkerCalls(rcfg, WorkerClients()))


@pytest.mark.parametrize("code, final, streamed, left, want", [
    (grpc.StatusCode.UNAVAILABLE, False, 0, 1, Recovery.RETRY),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, False, 0, 1, Recovery.RETRY),
    (grpc.StatusCode.UNAVAILABLE, False, 7, 1, Recovery.MIGRATE),
    (grpc.StatusCode.UNAVAILABLE, False, 7, 0, Recovery.FAIL),        # no attempt left
    (grpc.StatusCode.UNAVAILABLE, True, 0, 3, Recovery.FAIL),         # another worker would not do better
    (grpc.StatusCode.INVALID_ARGUMENT, False, 0, 3, Recovery.FAIL),   # the request itself is wrong
    (grpc.StatusCode.DEADLINE_EXCEEDED, False, 3, 3, Recovery.FAIL),
])
def test_recovery_rule(code, final, streamed, left, want):
    assert recovery(FlowError(code, "x", final=final), _scope(), streamed, left) is want


def test_recovery_never_after_cancel():
    s = _scope()
    s.cancel()
    assert recovery(FlowError(grpc.StatusCode.UNAVAILABLE, "x"), s, 0, 3) is Recovery.FAIL


def test_route_by_mode_and_conditional_disaggregation():
    ws = [_w("p0", "prefill", queued=5000), _w("d0", "decode")]
    assert _placer(ws).route(_scope(40)) is Route.PAIR
    assert _placer(ws, mode="colocated").route(_scope(40)) is Route.COLOCATED
    short = _placer(ws, local_prefill_max_tokens=64)
    assert (short.route(_scope(40)), short.route(_scope(100))) == (Route.DECODE, Route.PAIR)
    backed_up = _placer(ws, prefill_queue_max_tokens=4096)  # p0 has 5000 tokens queued
    assert backed_up.route(_scope(100)) is Route.DECODE
    assert _placer([_w("p0", "prefill", queued=10), _w("d0", "decode")],
                   prefill_queue_max_tokens=4096).route(_scope(100)) is Route.PAIR


def test_place_whole_picks_least_loaded_ready_and_holds_it_until_release():
    ws = [_w("c0", "colocated", running=3), _w("c1", "colocated", running=1), _w("c2", "colocated", ready=False)]
    pl = _placer(ws)
    s = _scope()
    first = pl.place_whole(s, Pool.COLOCATED, set())
    assert (first.decode.worker_id, first.held, first.route) == ("c1", {Hold.DECODE}, Route.COLOCATED)
    assert pl.selector.in_flight("c1") == 1
    # c1 now counts 1 + 1 in flight, c0 3: c1 again; excluded c1 -> c0
    assert pl.place_whole(_scope(rid="r2"), Pool.COLOCATED, {"c1"}).decode.worker_id == "c0"
    pl.release(first, s)
    pl.release(first, s)  # idempotent
    assert pl.selector.in_flight("c1") == 0 and first.held == set()
    with pytest.raises(FlowError) as e:
        pl.place_whole(s, Pool.COLOCATED, {"c0", "c1"})
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "no ready colocated worker" in e.value.message


def test_release_of_a_pair_is_thread_safe_and_partial():
    pl = _placer([])
    s = _scope(40)
    d, p = _w("d0", "decode"), _w("p0", "prefill")
    pl.selector.acquire("d0")
    pl.selector.acquire("p0", 40)
    pl.selector.acquire("p0", 40)  # another request of this router on p0: its count must survive
    placement = Placement(route=Route.PAIR, decode=d, prefill=p, held={Hold.DECODE, Hold.PREFILL})
    threads = [threading.Thread(target=pl.release, args=(placement, s, (Hold.PREFILL,))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (pl.selector.in_flight("p0"), pl.selector.in_flight("d0"), placement.held) == (1, 1, {Hold.DECODE})
    assert pl.selector.prefill_backlog([p]) == 40  # this request's 40 pending prompt tokens went with it
    pl.release(placement, s)
    assert pl.selector.in_flight("d0") == 0 and not placement.held


def test_scope_deadline_and_cancel_of_tracked_calls():
    class Call:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    s = _scope(deadline=0.0)
    with pytest.raises(FlowError) as e:
        s.remaining(5.0)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "r1" in e.value.message
    live = _scope()
    a = live.track(Call())
    assert live.cancel() and a.cancelled
    assert live.track(Call()).cancelled  # a call made after the cancel is cancelled at once
    done = _scope()
    done.finish()
    b = done.track(Call())
    assert done.cancel() is False and not b.cancelled  # a late callback after a normal end does nothing


def test_render_final_event_as_grpc_response():
    ev = FlowEvent("r9", [5, 6], "ab", [TokenLogprob(5, -0.5, [(5, -0.5), (7, -1.0)]), TokenLogprob(6, -0.1, [])],
                   finish_reason="length", usage=Usage(3, 2, 1), timings=Timings(queue_s=0.1, ttft_s=0.2, total_s=0.4))
    r = render(ev)
    assert (r.request_id, list(r.token_ids), r.text, r.finish_reason) == ("r9", [5, 6], "ab", "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_tokens) == (3, 2, 1)
    assert [(t.token_id, t.logprob) for t in r.logprobs[0].top] == [(5, -0.5), (7, -1.0)]
    assert abs(r.timings.total_s - 0.4) < 1e-6 and abs(r.timings.queue_s - 0.1) < 1e-6
    mid = render(FlowEvent("r9", [1], "x"))
    assert not mid.finish_reason and not mid.HasField("usage") and not mid.HasField("timings")


def test_each_placement_has_its_own_worker_request_id():
    """A retry or migration never reuses the id a worker may still hold (an abort that timed out): the first
    placement uses the client's id, later ones a suffixed one, so a worker never answers ALREADY_EXISTS."""
    ws = [_w("c0", "colocated"), _w("c1", "colocated")]
    pl = _placer(ws)
    s = _scope(rid="req-7")
    first = pl.place_whole(s, Pool.COLOCATED, set())
    second = pl.place_whole(s, Pool.COLOCATED, {first.decode.worker_id})
    third = pl.place_whole(s, Pool.COLOCATED, set())
    assert (first.request_id, second.request_id, third.request_id) == ("req-7", "req-7~2", "req-7~3")


class _Events:
    """The KV event consumer as placement sees it (``router.kv.index.KVEventConsumer``'s read side)."""

    def __init__(self, index, synced: set[str], connected: bool = True, pending_s: float = 0.0) -> None:
        self.index, self._synced, self.connected, self.pending_s = index, synced, connected, pending_s
        self.ties = None  # cold ties drawn locally (router.kv.ties is tested with real Redis in test_kv_ties.py)

    def placed(self, worker_id: str, hashes) -> None:
        self.index.add_pending(worker_id, hashes, self.pending_s)

    def synced(self, worker_id: str) -> bool:
        return worker_id in self._synced

    def load(self, worker_id: str):
        return None


def test_whole_placement_scores_on_the_kv_index_falls_back_to_the_mirror_and_to_load_only():
    from engine import prefix_block_hashes
    from metrics import RouterMetrics
    from router.kv.index import KVIndex
    from router.kv.prefix_index import PrefixIndex

    ws = [_w("c0", "colocated", running=1), _w("c1", "colocated")]
    index, mirror = KVIndex(), PrefixIndex()
    events = _Events(index, {"c0", "c1"})
    metrics = RouterMetrics("tiny", process_collectors=False)
    rcfg = RouterConfig(serve_metrics=False, kv_pending_s=0.0)
    pl = Placer(rcfg, StaticWorkerSource(ws), WorkerSelector(), WorkerCalls(rcfg, WorkerClients()),
                prefixes=mirror, kv_events=events, metrics=lambda: metrics)
    s = _scope(n_tokens=200)  # 12 full blocks looked up
    index.store("c0", prefix_block_hashes(s.prompt_token_ids, 16))
    mirror.record("c1", prefix_block_hashes(s.prompt_token_ids, 16))  # this router's own (stale) belief

    def pick() -> str:
        p = pl.place_whole(s, Pool.COLOCATED, set())
        pl.release(p, s)
        return p.decode.worker_id

    assert pick() == "c0"  # 12 cached blocks on the index beat one running request (2 blocks)
    events._synced = {"c1"}  # c0's stream is out of sync: the mirror decides
    assert pick() == "c1"
    events.connected = False  # Redis unavailable: load only
    assert pick() == "c1"
    from prometheus_client.parser import text_string_to_metric_families

    counts = {smp.labels["reason"]: smp.value for fam in text_string_to_metric_families(metrics.render().decode())
              if fam.name == "pdserve:routing_decisions" for smp in fam.samples if smp.name.endswith("_total")}
    assert counts == {"kv_events": 1.0, "mirror": 1.0, "load_only": 1.0}


class _ReserveAlways:
    """WorkerCalls' reserve, in process: every decode worker has room (only the choice is under test)."""

    def reserve(self, scope, wrid, d, p):
        from proto import worker_pb2

        return worker_pb2.ReserveResponse(block_ids=[0], block_size=16, kv_name=d.worker_id)


def test_routers_choosing_at_once_spread_over_equal_decode_workers():
    """Three routers (own selectors, own draws) place one request each at the same instant on the same view of
    three idle decode workers: tie-by-id sends all three to d0 every time."""
    import random

    ws = [_w("d0", "decode"), _w("d1", "decode"), _w("d2", "decode"), _w("p0", "prefill")]
    rcfg = RouterConfig(serve_metrics=False, prefix_aware_routing=False)
    routers = [Placer(rcfg, StaticWorkerSource(ws), WorkerSelector(), _ReserveAlways(), rng=random.Random(i))
               for i in range(3)]
    herded = 0
    for i in range(60):
        chosen = [pl.try_pair(_scope(rid=f"r{i}-{k}"), set()).decode.worker_id for k, pl in enumerate(routers)]
        herded += len(set(chosen)) == 1
        for pl in routers:  # each request ends before the next round: the views are equal again
            for wid in chosen:
                if pl.selector.in_flight(wid):
                    pl.selector.release(wid)
            pl.selector.release("p0", 40)
    assert herded < 20, herded  # at random: 1 round in 9 (about 7 of 60); by id: 60 of 60
    # whole requests on a decode worker (conditional disaggregation) too
    whole = [Placer(rcfg, StaticWorkerSource(ws), WorkerSelector(), _ReserveAlways(), rng=random.Random(10 + i))
             for i in range(3)]
    herded = 0
    for i in range(60):
        ps = [pl.place_whole(_scope(rid=f"w{i}-{k}"), Pool.DECODE, set()) for k, pl in enumerate(whole)]
        herded += len({p.decode.worker_id for p in ps}) == 1
        for pl, p in zip(whole, ps):
            pl.release(p, _scope())
    assert herded < 20, herded


def test_redis_away_pairs_only_over_kv_pairs_already_up():
    """While Redis is away a new KV pair cannot rendezvous: a pair is placed only over (P, D) whose last transfer
    succeeded, and with none the request is sent whole to the decode pool (fallback reason no_kv_pair)."""
    import router.placement as placement

    class _Source(StaticWorkerSource):
        last_error = None

    class _Calls:
        def reserve(self, scope, wrid, d, p):
            return None

    ws = [_w("p0", "prefill"), _w("p1", "prefill", queued=100), _w("d0", "decode")]
    src = _Source(ws)
    rcfg = RouterConfig(serve_metrics=False)
    pl = Placer(rcfg, src, WorkerSelector(), _Calls())
    assert not pl.store_away() and pl.try_pair(_scope(rid="a"), set()).prefill.worker_id == "p0"
    src.last_error = "ConnectionError: refused"  # the view could not refresh: Redis away
    assert pl.store_away()
    with pytest.raises(FlowError) as e:
        pl.try_pair(_scope(rid="b"), set())
    assert e.value.empty_pool is Pool.PREFILL and e.value.fallback_reason == "no_kv_pair"
    pl.pair_result("p1", "d0", True)  # only the busier prefill worker has a pair up: it is chosen
    assert pl.try_pair(_scope(rid="c"), set()).prefill.worker_id == "p1"
    pl.pair_result("p1", "d0", False)  # its transfer failed since: no pair known again
    with pytest.raises(FlowError):
        pl.try_pair(_scope(rid="d"), set())
    # pairs of workers that left the view are forgotten once many are remembered
    for i in range(placement._MAX_PAIRS + 1):
        pl.pair_result(f"gone-{i}", "d0", True)
    pl.pair_result("p0", "d0", True)
    assert pl._pairs == {("p0", "d0")}


def test_decode_workers_are_ranked_by_the_history_they_hold_on_the_index_then_the_mirror_then_load():
    """Issue 47: a pair's decode worker is the one holding the prompt's blocks (the index while it follows every
    candidate, else this router's mirror of its own reservations) unless its load outweighs them; a reservation
    that finds fewer cached tokens than the index said is counted stale; decode prefix routing off: load only."""
    from engine import prefix_block_hashes
    from metrics import RouterMetrics
    from prometheus_client.parser import text_string_to_metric_families
    from proto import worker_pb2
    from router.kv.index import KVIndex
    from router.kv.prefix_index import PrefixIndex

    class _Calls:
        cached = 0

        def reserve(self, scope, wrid, d, p):
            return worker_pb2.ReserveResponse(block_ids=[0], block_size=16, kv_name=d.worker_id,
                                              num_cached_tokens=self.cached)

    ws = [_w("p0", "prefill"), _w("d0", "decode", running=1), _w("d1", "decode")]
    index, mirror, calls = KVIndex(), PrefixIndex(), _Calls()
    events = _Events(index, {"p0", "d0", "d1"})
    metrics = RouterMetrics("tiny", process_collectors=False)

    def placer(prefixes: PrefixIndex = mirror, **cfg) -> Placer:
        rcfg = RouterConfig(serve_metrics=False, kv_pending_s=0.0, **cfg)
        return Placer(rcfg, StaticWorkerSource(ws), WorkerSelector(), calls, prefixes=prefixes, kv_events=events,
                      metrics=lambda: metrics)

    pl = placer()
    s = _scope(n_tokens=200)  # 12 full blocks looked up

    def pick(p: Placer = pl) -> str:
        got = p.try_pair(s, set())
        p.release(got, s)
        return got.decode.worker_id

    assert pick(placer(PrefixIndex())) == "d1"  # nobody holds a block: load order (d0 runs a request)
    index.store("d0", prefix_block_hashes(s.prompt_token_ids, 16))
    calls.cached = 12 * 16
    assert pick() == "d0"  # 12 held blocks beat one running request (2 blocks)
    calls.cached = 0  # d0 lost them (a restart the index has not seen)
    assert pick() == "d0"
    assert placer(decode_prefix_routing=False).try_pair(_scope(n_tokens=200, rid="off"), set()).decode.worker_id \
        == "d1"
    events._synced = {"p0", "d1"}  # d0's stream out of sync: the mirror, which recorded d0's reservations above
    assert pick() == "d0"
    events.connected = False  # Redis unavailable: load only (over pairs already up)
    pl.pair_result("p0", "d0", True)
    pl.pair_result("p0", "d1", True)
    assert pick() == "d1"
    counts: dict = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for smp in fam.samples:
            if fam.name == "pdserve:decode_routing_decisions" and smp.name.endswith("_total"):
                counts[smp.labels["reason"]] = smp.value
            elif fam.name == "pdserve:decode_prefix_stale" and smp.name.endswith("_total"):
                counts["stale"] = smp.value
    assert counts == {"load": 2.0, "history": 2.0, "mirror": 1.0, "stale": 1.0}


def test_a_decode_worker_too_slow_to_answer_reserve_is_passed_over_while_the_request_has_time():
    """A Reserve that hits its own call timeout (a starved or wedged decode worker) while the request still has time
    is not the request's deadline: the next decode worker is tried and the slow one suspected; a worker call that
    times out in the middle of a flow reads as UNAVAILABLE (retriable), DEADLINE_EXCEEDED only once the request's
    own deadline has passed."""
    from proto import worker_pb2
    from transport.errors import StatusRpcError

    class _Calls:
        def reserve(self, scope, wrid, d, p):
            if d.worker_id == "d0":
                raise StatusRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            return worker_pb2.ReserveResponse(block_ids=[0], block_size=16, kv_name=d.worker_id)

    ws = [_w("p0", "prefill"), _w("d0", "decode"), _w("d1", "decode", running=3)]  # d0 ranks first
    src = StaticWorkerSource(ws)
    rcfg = RouterConfig(serve_metrics=False, prefix_aware_routing=False)
    pl = Placer(rcfg, src, WorkerSelector(), _Calls())
    suspected = []
    pl.suspect = suspected.append
    assert pl.try_pair(_scope(rid="slow"), set()).decode.worker_id == "d1" and suspected == ["d0"]
    live, late = _scope(rid="live"), _scope(rid="late", deadline=0.0)
    err = StatusRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    assert live.rpc_error(err, "decode on d0", "d0").code == grpc.StatusCode.UNAVAILABLE
    assert late.rpc_error(err, "decode on d0", "d0").code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_an_adapters_request_hashes_its_prompt_under_the_adapter():
    """KV-aware routing looks up an adapter's request by the hashes its workers store it under (the adapter's root,
    engine/lora.py), never by the base model's: a base-model prefix on a worker is not a hit for it."""
    from engine import prefix_block_hashes
    from engine.lora import lora_key_root

    ids = list(range(1, 41))
    root = lora_key_root("sql", b"the adapter's files")  # as its workers publish it (WorkerInfo.lora_status)
    lora = RequestScope(ValidatedRequest("a", None, ids, SamplingParams(max_tokens=4, lora_name="sql"),
                                         lora_root=root), 0.0, 1e12)
    assert lora.prefix_hashes(16) == prefix_block_hashes(ids, 16, root)
    assert lora.wire_params.lora_root == root and lora.wire_params.lora_name == "sql"
    assert not set(lora.prefix_hashes(16)) & set(_scope(40).prefix_hashes(16))
    assert _scope(40).prefix_hashes(16) == prefix_block_hashes(ids, 16)


def test_a_salted_requests_hashes_are_those_its_engine_stores_its_blocks_under():
    """vLLM's cache_salt: the router's prefix hashes of a salted request are the hashes an engine's KV events name
    its blocks by (so KV-aware routing finds a tenant's own cached prefix), and none is an unsalted one."""
    import torch

    from engine import LLM

    torch.set_num_threads(1)
    eng = LLM("tiny", num_kv_blocks=32, block_size=16, num_threads=1).llm_engine
    eng.block_manager.enable_events()
    ids = list(range(300, 341))
    params = SamplingParams(max_tokens=1, temperature=0.0, cache_salt="tenant-a")
    eng.add_request("r", ids, params)
    while eng.has_unfinished_requests():
        eng.step()
    stored = [e[1][2] for e in eng.block_manager.take_events() if e[0] == "stored"]
    salted = RequestScope(ValidatedRequest("a", None, ids, params), 0.0, 1e12)
    assert salted.prefix_hashes(16) == stored[:2] and len(stored) >= 2
    assert salted.wire_params.cache_salt == "tenant-a"
    plain = RequestScope(ValidatedRequest("b", None, ids, SamplingParams(max_tokens=1)), 0.0, 1e12)
    assert not set(salted.prefix_hashes(16)) & set(plain.prefix_hashes(16))
