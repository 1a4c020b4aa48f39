"""Admission and availability: empty pools, queue bound, decode capacity, worker death."""
from __future__ import annotations

import time

import grpc
import pytest
import torch

from proto import pdserve_pb2
from router import RouterConfig, RouterServer, StaticWorkerSource
from tests.roles.harness import KV, collect, joined, start_roles



@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def test_no_workers_is_unavailable_and_health_serving():
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    r = RouterServer(RouterConfig(serve_metrics=False), StaticWorkerSource()).start()
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
    r = start_roles(kv=KV, decode_engine=dict(num_kv_blocks=8), router=dict(max_queue=2), tag="adm-")
    yield r
    r.close()


def _long_stream(roles, n_prompt_tokens=100, **kw):
    return roles.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=[5] * n_prompt_tokens, max_tokens=20,
                                                           ignore_eos=True, temperature=0.0, **kw), timeout=60)


def test_decode_worker_full_is_resource_exhausted_then_served(small):
    s1 = _long_stream(small, 100)   # 7 of 8 blocks on the decode worker
    next(s1)
    with pytest.raises(grpc.RpcError) as ei:
        collect(small.stub, timeout=10, token_ids=[5] * 40, max_tokens=2, request_id="req-full")
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "req-full" in ei.value.details()
    assert joined(list(s1))[2] == "length"
    assert small.wait_idle(1.0)
    assert joined(collect(small.stub, token_ids=[5] * 40, max_tokens=2))[2] == "length"


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
    assert small.wait_idle(1.0)
    end = time.monotonic() + 1
    while small.router.num_in_flight and time.monotonic() < end:
        time.sleep(0.01)
    assert small.router.num_in_flight == 0
    assert joined(collect(small.stub, prompt="b", max_tokens=2))[2] == "length"


def test_decode_worker_dies_midstream_gives_unavailable_not_hang():
    roles = start_roles(kv=KV, tag="die-")
    try:
        s = roles.stub.Generate(pdserve_pb2.GenerateRequest(prompt="a", max_tokens=1500, ignore_eos=True,
                                                            temperature=0.0, request_id="req-die"), timeout=30)
        next(s)
        next(s)
        t = time.monotonic()
        roles.decodes[0].stop()
        with pytest.raises(grpc.RpcError) as ei:
            list(s)
        assert time.monotonic() - t < 5
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
        assert roles.wait_idle(1.0) or all(not w.requests for w in roles.decodes)
        assert roles.decodes[0].info().num_free_blocks == roles.decodes[0].info().num_total_blocks
    finally:
        roles.close()


def test_kv_transfer_failure_after_first_token_is_unavailable_and_frees():
    # the registry names the wrong KV endpoint for the prefill worker: the decode worker waits for
    # KV from "ghost", the prefill worker's send is rejected -> an error, never a hang
    roles = start_roles(kv=KV, tag="kvfail-", transfer_timeout_s=3.0)
    try:
        p = roles.prefills[0]
        bad = p.info()
        bad.kv_name = "ghost"
        roles.source.remove_where(p.cfg.worker_id)
        roles.source.add(bad)
        t = time.monotonic()
        s = roles.stub.Generate(pdserve_pb2.GenerateRequest(prompt="def f(x):", max_tokens=8, temperature=0.0,
                                                            request_id="req-kv"), timeout=30)
        got = []
        with pytest.raises(grpc.RpcError) as ei:
            for r in s:
                got.append(r)
        assert time.monotonic() - t < 8
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value
        assert "req-kv" in ei.value.details()
        assert sum(len(r.token_ids) for r in got) <= 1  # at most the first token reached the client
        assert roles.wait_idle(4.0), [w.info() for w in roles.prefills + roles.decodes]
    finally:
        roles.close()
