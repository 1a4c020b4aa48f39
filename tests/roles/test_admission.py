"""Admission and availability: empty pools, queue bound, waiting for decode KV capacity, worker death."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2
from router import RouterConfig, RouterServer, StaticWorkerSource
from tests.roles.harness import KV, collect, joined, offline, start_roles
from tests.waiting import wait_until



@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def test_no_workers_is_unavailable_and_health_serving():
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    r = RouterServer(RouterConfig(serve_metrics=False, pool_wait_s=0), StaticWorkerSource()).start()
    try:
        ch = grpc.insecure_channel(r.address)
        from proto import pdserve_pb2_grpc

        stub = pdserve_pb2_grpc.PDServeStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            collect(stub, timeout=10, prompt="hello", max_tokens=2, request_id="req-none")
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "req-none" in ei.value.details() and "decode" in ei.value.details()
        info = stub.GetModelInfo(pdserve_pb2.GetModelInfoRequest())
        assert (info.num_prefill_workers, info.num_decode_workers, info.mode) == (0, 0, "disaggregated")
        assert info.max_context_length == 2048 and info.vocab_size == 8192
        h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
        assert h.status == health_pb2.HealthCheckResponse.SERVING
        ch.close()
    finally:
        r.stop()


@pytest.fixture(scope="module")
def small():
    # decode worker with 8 blocks of 16 tokens: one long prompt fills it
    r = start_roles(kv=KV, decode_engine=dict(num_kv_blocks=8), router=dict(max_num_requests=2), tag="adm-")
    yield r
    r.close()


def _long_stream(roles, n_prompt_tokens=100, **kw):
    return roles.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=[5] * n_prompt_tokens, max_tokens=20,
                                                           ignore_eos=True, temperature=0.0, **kw), timeout=60)


class _Hold:
    """Holds blocks on the decode worker with a bare Reserve (no KV ever sent) until released: a blocker
    that lasts exactly as long as the test wants, unlike a decoding request."""

    def __init__(self, roles, n_tokens, rid="hold"):
        from proto import worker_pb2, worker_pb2_grpc
        from router.wire import params_to_wire

        self.rid = rid
        self.ch = grpc.insecure_channel(roles.decodes[0].address)
        self.stub = worker_pb2_grpc.DecodeWorkerStub(self.ch)
        self.stub.Reserve(worker_pb2.ReserveRequest(request_id=rid, prompt_token_ids=[5] * n_tokens,
                                                    params=params_to_wire(SamplingParams(max_tokens=1)),
                                                    prefill_kv_name=roles.prefills[0].cfg.worker_id,
                                                    kv_timeout_s=30.0), timeout=10)

    def release(self):
        from proto import worker_pb2

        self.stub.Abort(worker_pb2.AbortRequest(request_id=self.rid), timeout=5)
        self.ch.close()


def _gauge(roles, name):
    for line in roles.router.metrics.render().decode().splitlines():
        if line.startswith(f"pdserve:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} gauge")


def _entered_queue(monkeypatch, router) -> list:
    """The request ids that join ``router``'s admission queue from now on: a spy on its ``enter``, so a test
    can say "rejected at once" as "never queued" rather than by a wall clock."""
    adm = router.admission
    real, seen = adm.enter, []

    def enter(seq, request_id, *priority):
        seen.append(request_id)
        return real(seq, request_id, *priority)

    monkeypatch.setattr(adm, "enter", enter)
    return seen


def _in_thread(fn):
    box = {}

    def run():
        try:
            box["out"] = fn()
        except Exception as e:  # re-raised by the caller's checks
            box["err"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, box


def test_decode_worker_full_queues_then_served_equal_offline(small):
    # the old behaviour was RESOURCE_EXHAUSTED at once; now the request waits for s1's blocks
    hold = _Hold(small, 100)   # 7 of 8 blocks on the decode worker
    t, box = _in_thread(lambda: collect(small.stub, timeout=60, token_ids=[7] * 40, max_tokens=3,
                                        temperature=0.0, ignore_eos=True, request_id="req-wait"))
    wait_until(lambda: small.router.num_waiting == 1, timeout=30.0, interval=0.005, message="one request queued")
    t_seen = time.monotonic()   # the router holds it by now: it arrived before this
    assert _gauge(small, "router_requests_waiting") == 1.0
    assert _gauge(small, "router_requests_in_flight") == 1.0  # the waiting one is held by the router too
    time.sleep(0.3)   # still waiting: the blocks are still held
    assert small.router.num_waiting == 1 and t.is_alive()
    t_release = time.monotonic()   # it cannot be placed before the blocks are freed
    hold.release()    # freed behind the router's back: its backoff retries find the room
    t.join(60)
    assert not t.is_alive()
    assert "err" not in box, box.get("err")
    ids, _text, reason = joined(box["out"])
    ref = offline([[7] * 40], [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)])[0]
    assert (ids, reason) == (ref[0], ref[2]) and reason == "length"
    # it was in the router before t_seen and still queued at t_release, so its queue time covers that span
    assert box["out"][-1].timings.queue_s >= t_release - t_seen > 0.3
    assert box["out"][-1].timings.ttft_s >= box["out"][-1].timings.queue_s
    assert small.router.num_waiting == 0 and _gauge(small, "router_requests_waiting") == 0.0
    assert small.wait_idle(30.0)


def test_with_the_priority_policy_a_better_priority_is_placed_first_and_fcfs_refuses_it(small):
    """Decode KV full (a hold of 7 of 8 blocks): "low" (priority 5) queues, then "high" (priority -1) queues ahead
    of it; each needs 7 blocks, so once the hold goes they are served one after the other, "high" first, both equal
    to offline. The fcfs router (the fixture's) refuses a non-zero priority by name."""
    with pytest.raises(grpc.RpcError) as ei:
        collect(small.stub, timeout=30, token_ids=[5] * 4, max_tokens=2, priority=1)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "priority" in ei.value.details()
    r2 = RouterServer(RouterConfig(serve_metrics=False, scheduling_policy="priority"), small.source).start()
    ch = grpc.insecure_channel(r2.address)
    hold = None
    try:
        from proto import pdserve_pb2_grpc

        stub = pdserve_pb2_grpc.PDServeStub(ch)
        hold = _Hold(small, 100)
        done: list[str] = []

        def run(rid, priority):
            out = collect(stub, timeout=60, token_ids=[9] * 100, max_tokens=3, temperature=0.0, ignore_eos=True,
                          request_id=rid, priority=priority)
            done.append(rid)
            return out

        t_low, box_low = _in_thread(lambda: run("req-low", 5))
        wait_until(lambda: r2.num_waiting == 1, timeout=30.0, interval=0.005, message="req-low queued")
        t_high, box_high = _in_thread(lambda: run("req-high", -1))
        wait_until(lambda: r2.num_waiting == 2, timeout=30.0, interval=0.005, message="req-high queued")
        assert r2.admission.head().request_id == "req-high"
        hold.release()
        hold = None
        for t in (t_high, t_low):
            t.join(60)
            assert not t.is_alive()
        assert "err" not in box_low and "err" not in box_high, (box_low.get("err"), box_high.get("err"))
        assert done == ["req-high", "req-low"]
        ref = offline([[9] * 100], [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)])[0]
        for box in (box_high, box_low):
            ids, _text, reason = joined(box["out"])
            assert (ids, reason) == (ref[0], ref[2])
    finally:
        if hold is not None:
            hold.release()
        ch.close()
        r2.stop()
    assert small.wait_idle(30.0)


def test_prompt_larger_than_any_decode_kv_fails_at_once(small, monkeypatch):
    # "at once": it never joins the queue (where it would wait out queue_timeout_s=300 s or its deadline)
    queued = _entered_queue(monkeypatch, small.router)
    with pytest.raises(grpc.RpcError) as ei:   # 200 tokens = 13 blocks of 16 > the worker's 8
        collect(small.stub, timeout=30, token_ids=[5] * 200, max_tokens=2, request_id="req-huge")
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
    assert "req-huge" in ei.value.details() and "13 KV blocks" in ei.value.details()
    assert queued == []
    assert small.router.num_waiting == 0 and small.wait_idle(30.0)


def test_full_queue_rejects_at_once_and_cancelled_waiter_leaks_nothing(small, monkeypatch):
    # max_num_requests=2: one request decoding + one waiting for KV fill the router
    s1 = _long_stream(small, 4)   # one request in progress (its few blocks are not the point)
    next(s1)
    hold = _Hold(small, 80)       # 5 more blocks held: 40 tokens (3 blocks) cannot fit
    s2 = small.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=[5] * 40, max_tokens=2, request_id="req-q"),
                             timeout=30)
    t2, box2 = _in_thread(lambda: list(s2))
    wait_until(lambda: small.router.num_waiting == 1, timeout=30.0, interval=0.005, message="req-q queued")
    # "at once": refused on arrival, never queued behind req-q (which waits as long as the hold lasts)
    queued = _entered_queue(monkeypatch, small.router)
    with pytest.raises(grpc.RpcError) as ei:
        collect(small.stub, timeout=30, token_ids=[5] * 4, max_tokens=2, request_id="req-over")
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
    assert "req-over" in ei.value.details() and "queue is full" in ei.value.details()
    assert queued == [] and small.router.num_waiting == 1
    # cancel the queued one: it leaves the queue and holds nothing anywhere
    s2.cancel()
    t2.join(30)
    assert not t2.is_alive()
    assert box2["err"].code() == grpc.StatusCode.CANCELLED
    wait_until(lambda: small.router.num_waiting == 0 and small.router.num_in_flight == 1, timeout=30.0,
               interval=0.005, message="the cancelled request left the queue; s1 still in flight")
    assert "req-q" not in small.decodes[0].requests and "req-q" not in small.prefills[0].requests
    assert _gauge(small, "router_requests_waiting") == 0.0
    assert joined(list(s1))[2] == "length"
    hold.release()
    assert small.wait_idle(30.0)
    wait_until(lambda: small.router.num_in_flight == 0, timeout=30.0, interval=0.005, message="nothing in flight")
    assert _gauge(small, "router_requests_in_flight") == 0.0


def test_queue_timeout_and_deadline_while_queued(small, monkeypatch):
    r2 = RouterServer(RouterConfig(serve_metrics=False, queue_timeout_s=0.4), small.source).start()
    ch = grpc.insecure_channel(r2.address)
    try:
        from proto import pdserve_pb2_grpc

        hold = _Hold(small, 100)
        queued = _entered_queue(monkeypatch, small.router)
        t = time.monotonic()
        with pytest.raises(grpc.RpcError) as ei:   # the queue timeout, not the client's 30 s deadline, ends it
            collect(pdserve_pb2_grpc.PDServeStub(ch), timeout=30, token_ids=[5] * 40, max_tokens=2,
                    request_id="req-qto")
        assert time.monotonic() - t >= 0.4   # it did wait out the queue timeout
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
        assert "req-qto" in ei.value.details() and "queue_timeout_s=0.4" in ei.value.details()
        # the client's deadline ends the wait too: long before small's queue_timeout_s (300 s) would, and the
        # request was really queued (the deadline did not pass before it reached the router)
        assert small.router.cfg.queue_timeout_s >= 300
        with pytest.raises(grpc.RpcError) as ei:
            collect(small.stub, timeout=5, token_ids=[5] * 40, max_tokens=2, request_id="req-dl")
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert queued == ["req-dl"]
        wait_until(lambda: small.router.num_waiting == 0 and r2.num_waiting == 0, timeout=30.0, interval=0.005,
                   message="both routers' queues empty")
        assert "req-qto" not in small.decodes[0].requests and "req-dl" not in small.decodes[0].requests
        hold.release()
        assert small.wait_idle(30.0)
    finally:
        ch.close()
        r2.stop()


@pytest.fixture(scope="module")
def two_fit():
    # 8 blocks of 16 tokens; each request below needs 3-4 blocks over its life: about 2 fit at once
    r = start_roles(kv=KV, decode_engine=dict(num_kv_blocks=8), tag="fit2-")
    yield r
    r.close()


def test_many_concurrent_requests_on_small_decode_kv_all_equal_offline(two_fit, monkeypatch):
    prompts = [("# item %d: " % i) + "alpha beta gamma delta " * (3 + i % 3) for i in range(8)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True) for _ in prompts]
    ref = offline(prompts, params)
    queued = _entered_queue(monkeypatch, two_fit.router)   # every request that had to wait, however briefly
    threads = [_in_thread(lambda p=p: collect(two_fit.stub, timeout=60, prompt=p, max_tokens=12,
                                              temperature=0.0, ignore_eos=True)) for p in prompts]
    for t, _ in threads:
        t.join(60)
    for (t, box), (ids, text, reason, _lp) in zip(threads, ref):
        assert not t.is_alive()
        assert "err" not in box, box.get("err")
        assert joined(box["out"]) == (ids, text, reason)
    assert queued   # the KV really was too small for all at once
    assert two_fit.wait_idle(30.0) and two_fit.router.num_waiting == 0


def test_queue_bound_is_resource_exhausted(small):
    streams = [small.stub.Generate(pdserve_pb2.GenerateRequest(prompt="a", max_tokens=400, ignore_eos=True,
                                                               temperature=0.0), timeout=60) for _ in range(2)]
    for s in streams:
        next(s)
    assert small.router.num_in_flight == 2
    with pytest.raises(grpc.RpcError) as ei:
        collect(small.stub, timeout=10, prompt="b", max_tokens=2)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue" in ei.value.details()
    for s in streams:
        s.cancel()
    assert small.wait_idle(30.0)
    wait_until(lambda: small.router.num_in_flight == 0, timeout=30.0, interval=0.01, message="nothing in flight")
    assert joined(collect(small.stub, prompt="b", max_tokens=2))[2] == "length"


def test_decode_worker_dies_midstream_gives_unavailable_not_hang():
    roles = start_roles(kv=KV, tag="die-", router=dict(pool_wait_s=0))  # no replacement comes here
    try:
        s = roles.stub.Generate(pdserve_pb2.GenerateRequest(prompt="a", max_tokens=1500, ignore_eos=True,
                                                            temperature=0.0, request_id="req-die"), timeout=30)
        next(s)
        next(s)
        roles.decodes[0].stop()
        with pytest.raises(grpc.RpcError) as ei:   # before the 30 s deadline: a hang ends DEADLINE_EXCEEDED
            list(s)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value
        assert "req-die" in ei.value.details()
        # the dead worker is gone from routing: no ready decode worker left
        roles.source.remove_where(roles.decodes[0].cfg.worker_id)
        with pytest.raises(grpc.RpcError) as ei:
            collect(roles.stub, timeout=10, prompt="a", max_tokens=2)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert roles.prefills[0].requests == {}
    finally:
        roles.close()


def test_dead_prefill_worker_before_first_token_retries_on_another():
    roles = start_roles(kv=KV, n_prefill=2, tag="retry-")
    try:
        dead = roles.prefills[0]
        stale = dead.info()  # the registry still lists it (heartbeat TTL not yet expired)
        roles.source.remove_where(dead.cfg.worker_id)
        roles.source.add(stale)
        dead.stop()
        want = joined(collect(roles.stub, prompt="def g(x):", max_tokens=6, temperature=0.0))
        assert len(want[0]) == 6 and want[2] == "length"
        assert roles.router.selector.ranked_prefill(roles.source.list("prefill"))[0].worker_id == stale.worker_id
        assert roles.wait_idle(30.0)   # the first attempt's reservation on the decode worker was given back
        assert roles.decodes[0].info().num_free_blocks == roles.decodes[0].info().num_total_blocks
    finally:
        roles.close()


def test_kv_transfer_failure_after_first_token_is_unavailable_and_frees():
    # the registry names the wrong KV endpoint for the prefill worker: the decode worker waits for
    # KV from "ghost", the prefill worker's send is rejected -> an error, never a hang. With one attempt
    # only: otherwise the decode worker resumes the request itself (tests/roles/test_transfer_watch.py)
    roles = start_roles(kv=KV, tag="kvfail-", transfer_timeout_s=3.0, router=dict(max_attempts=1))
    try:
        p = roles.prefills[0]
        bad = p.info()
        bad.kv_name = "ghost"
        roles.source.remove_where(p.cfg.worker_id)
        roles.source.add(bad)
        # the decode worker waits for the KV up to the request's 60 s deadline; the prefill worker's send
        # fails after its 3 s transfer timeout, and that failure (not the decode worker's wait, nor the
        # deadline) must end the request: the router cancels the decode call
        t = time.monotonic()
        s = roles.stub.Generate(pdserve_pb2.GenerateRequest(prompt="def f(x):", max_tokens=8, temperature=0.0,
                                                            request_id="req-kv"), timeout=60)
        got = []
        with pytest.raises(grpc.RpcError) as ei:
            for r in s:
                got.append(r)
        assert time.monotonic() - t < 30, "ended by the decode worker's KV wait or the deadline, not the failure"
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value
        assert "req-kv" in ei.value.details() and "KV transfer from" in ei.value.details(), ei.value.details()
        assert sum(len(r.token_ids) for r in got) <= 1  # at most the first token reached the client
        assert roles.wait_idle(30.0)
    finally:
        roles.close()
