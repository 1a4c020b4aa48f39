"""A worker whose engine has work but schedules nothing leaves routing (and comes back when it schedules again).

A TensorRT-LLM prefill worker once held 2,048 requests, scheduled none and still answered healthy. Here a real
decode worker's engine (real router, prefill worker, gRPC and gloo) is made to stall two ways while it holds a
request: a step that hangs (the loop thread blocked inside ``engine.step``) and steps that schedule nothing
(they return at once, the scheduled-token total never moves). In both, the worker reports not ready once
``stall_timeout_s`` passes, the router's view drops it (a request sent meanwhile gets UNAVAILABLE naming no
ready decode worker instead of queueing behind the stall), and once the engine schedules again it is ready, the
held request completes equal to the offline engine's output, and nothing stays held.
"""
from __future__ import annotations

import threading

import grpc
import pytest
import torch

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2_grpc
from tests.roles.harness import collect, engine_config, joined, make_store, offline
from tests.waiting import wait_until

STALL_S = 1.0


@pytest.fixture
def roles():
    from prefill_worker import PrefillWorker, PrefillWorkerConfig
    from router import RouterConfig, RouterServer
    from router.worker_source import StaticWorkerSource

    torch.set_num_threads(1)
    store = make_store("gloo")
    p = PrefillWorker(PrefillWorkerConfig("stall-p0", engine=engine_config(), kv_store=store, kv_backend="gloo",
                                          serve_metrics=False)).start()
    d = DecodeWorker(DecodeWorkerConfig("stall-d0", engine=engine_config(), kv_store=store, kv_backend="gloo",
                                        serve_metrics=False, stall_timeout_s=STALL_S)).start()
    router = RouterServer(RouterConfig(serve_metrics=False, pool_wait_s=0.5, worker_view_refresh_s=0.05),
                          StaticWorkerSource([p.info, d.info])).start()
    ch = grpc.insecure_channel(router.address)
    try:
        yield p, d, router, pdserve_pb2_grpc.PDServeStub(ch)
    finally:
        ch.close()
        router.stop()
        d.stop()
        p.stop()


@pytest.mark.parametrize("how", ["hung_step", "schedules_nothing"])
def test_stalled_engine_reports_not_ready_and_leaves_routing(roles, how):
    p, d, router, stub = roles
    prompt, kw = "def stall(engine):", dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = offline([prompt], [SamplingParams(**kw)])[0]
    eng = d.engine
    real_step = eng.step
    release = threading.Event()
    entered = threading.Event()

    def stalled_step():
        if release.is_set():
            return real_step()
        entered.set()
        if how == "hung_step":
            release.wait(120)  # blocked inside the step, as a hung kernel or collective would be
            return real_step()
        release.wait(0.01)   # a step that schedules nothing
        return []

    eng.step = stalled_step
    result: dict = {}

    def send():
        try:
            result["resps"] = collect(stub, timeout=120, prompt=prompt, **kw)
        except grpc.RpcError as e:  # pragma: no cover - reported below
            result["error"] = e

    th = threading.Thread(target=send)
    try:
        th.start()
        wait_until(entered.is_set, timeout=60, interval=0.01, message="the held request never reached a step")
        assert d.info().ready or d.stalled(), "not ready before any stall"
        wait_until(lambda: not d.info().ready, timeout=60, interval=0.02,
                   message=f"the worker still reports ready with its engine stalled ({how})")
        assert d.stalled() > STALL_S
        wait_until(lambda: not [w for w in router.core.view.list("decode") if w.ready], timeout=60, interval=0.02,
                   message="the router still routes to the stalled worker")
        with pytest.raises(grpc.RpcError) as ei:
            collect(stub, timeout=60, prompt="another", max_tokens=2, temperature=0.0)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "no ready decode worker" in ei.value.details()
    finally:
        release.set()
        eng.step = real_step
    th.join(120)
    assert "error" not in result, result.get("error")
    assert joined(result["resps"]) == want[:3]
    wait_until(lambda: d.info().ready and d.stalled() == 0, timeout=60, interval=0.02,
               message="the worker did not come back once its engine scheduled again")
    wait_until(lambda: not d.requests and not p.requests
               and d.info().num_free_blocks == d.info().num_total_blocks, timeout=60, interval=0.05,
               message="blocks or requests still held")
