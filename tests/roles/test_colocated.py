"""Router in colocated mode + ColocatedWorker equal the offline engine; cancel frees blocks (the engine in the
worker's process, and in a process of its own)."""
from __future__ import annotations

import threading

import grpc
import pytest
import torch

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2
from tests.roles.harness import collect, joined, offline, start_colocated
from tests.waiting import wait_until

PROMPTS = ["def add(a, b):", "x", "# " + "the quick brown fox jumps over the lazy dog " * 12, "return None"]


@pytest.fixture(scope="module", params=[False, True], ids=["engine-in-process", "engine-process"])
def colo(request):
    """One colocated worker behind a router; its engine in the worker's process, or in one of its own
    (``WorkerConfig.engine_process``): every test here holds for both."""
    torch.set_num_threads(1)
    r = start_colocated(n=1, tag="colo-", worker={"engine_process": request.param})
    yield r
    r.close()


def test_greedy_concurrent_equal_offline(colo):
    ref = offline(PROMPTS, [SamplingParams(max_tokens=10, temperature=0.0)] * len(PROMPTS))
    got = [None] * len(PROMPTS)

    def run(i):
        got[i] = collect(colo.stub, prompt=PROMPTS[i], max_tokens=10, temperature=0.0)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
        assert not t.is_alive()
    for (ids, text, reason, _), resps in zip(ref, got):
        assert joined(resps) == (ids, text, reason)
        assert resps[-1].usage.completion_tokens == len(ids) and resps[-1].timings.ttft_s > 0
    assert colo.wait_idle(30.0)


def test_seeded_and_stop_string_equal_offline(colo):
    sp = SamplingParams(max_tokens=12, temperature=0.9, seed=11)
    ref = offline([PROMPTS[0]], [sp])[0]
    assert joined(collect(colo.stub, prompt=PROMPTS[0], max_tokens=12, temperature=0.9, seed=11))[:2] == ref[:2]
    full = offline([PROMPTS[3]], [SamplingParams(max_tokens=20, temperature=0.0)])[0][1]
    stop = full[len(full) // 2: len(full) // 2 + 2]
    ref = offline([PROMPTS[3]], [SamplingParams(max_tokens=20, temperature=0.0, stop=[stop])])[0]
    got = joined(collect(colo.stub, prompt=PROMPTS[3], max_tokens=20, temperature=0.0, stop=[stop]))
    assert got[1:] == (ref[1], "stop")
    assert colo.wait_idle(30.0)


def test_cancel_frees_blocks_and_info(colo):
    w = colo.decodes[0]
    tokens_before = w.info().output_tokens_total
    s = colo.stub.Generate(pdserve_pb2.GenerateRequest(prompt="a", max_tokens=2000, ignore_eos=True,
                                                       temperature=0.0), timeout=60)
    next(s)
    next(s)
    # the load the worker reports follows its engine (a step behind when the engine has a process of its own)
    wait_until(lambda: w.info().num_running == 1, timeout=30.0, message=lambda: f"one running: {w.info()}")
    assert w.info().role == "colocated"
    s.cancel()
    assert colo.wait_idle(30.0)
    # idle because the cancel aborted it on the worker, not because its 2000 tokens ran out meanwhile
    assert w.info().output_tokens_total - tokens_before < 2000
    info = colo.stub.GetModelInfo(pdserve_pb2.GetModelInfoRequest())
    assert info.mode == "colocated" and info.num_prefill_workers == 1


def test_no_colocated_worker_is_unavailable():
    from router import RouterConfig, RouterServer, StaticWorkerSource
    from proto import pdserve_pb2_grpc

    # pool_wait_s=0: no wait for a replacement (else the answer comes 1 s before the client's deadline)
    r = RouterServer(RouterConfig(serve_metrics=False, mode="colocated", pool_wait_s=0), StaticWorkerSource()).start()
    try:
        with grpc.insecure_channel(r.address) as ch:
            with pytest.raises(grpc.RpcError) as ei:
                collect(pdserve_pb2_grpc.PDServeStub(ch), timeout=30, prompt="a")
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "colocated" in ei.value.details()
    finally:
        r.stop()
