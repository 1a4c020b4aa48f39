"""Async scheduling in the workers that decode: a router in front of a decode worker fed by a prefill worker (KV
over gloo), and of a colocated worker, each engine running its decode steps ahead of the one in flight
(``async_scheduling`` through the decode graphs' static buffers, the CPU stand-in for captured graphs). Real gRPC
servers and engines on ``tiny``; the reference is the offline engine, which runs every step synchronously.
"""
from __future__ import annotations

import threading

import pytest
import torch

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2
from tests.roles.harness import KV, collect, joined, offline, start_colocated, start_roles
from tests.waiting import wait_until

AHEAD = {"static_decode_buffers": True, "async_scheduling": True}
PROMPTS = ["def add(a, b):", "x", "# " + "the quick brown fox jumps over the lazy dog " * 12, "return None",
           "for i in range(10):\n    print(i)"]


@pytest.fixture(scope="module", params=["disaggregated", "colocated", "colocated-engine-process"])
def cluster(request):
    torch.set_num_threads(1)
    if request.param == "disaggregated":
        r = start_roles(kv=KV, decode_engine=AHEAD, tag="ahead-")
    else:
        r = start_colocated(engine=AHEAD, tag="ahead-c-",
                            worker={"engine_process": request.param == "colocated-engine-process"})
    yield r
    r.close()


def _ahead_steps(cluster) -> int:
    """Steps the decoding worker's engine ran ahead (an engine in a process of its own reports them in its stats)."""
    w = cluster.decodes[0]
    if hasattr(w.engine, "ahead_steps"):
        return w.engine.ahead_steps
    return w.engine.make_stats().ahead_steps


def test_concurrent_greedy_and_seeded_streams_equal_offline(cluster):
    before = _ahead_steps(cluster)
    kinds = [dict(max_tokens=24, temperature=0.0, logprobs=1), dict(max_tokens=20, temperature=0.9, seed=5),
             dict(max_tokens=16, temperature=0.0), dict(max_tokens=22, temperature=0.7, top_p=0.9, seed=9),
             dict(max_tokens=18, temperature=0.0, ignore_eos=True)]
    ref = offline(PROMPTS, [SamplingParams(**k) for k in kinds])
    got: list = [None] * len(PROMPTS)

    def run(i: int) -> None:
        got[i] = collect(cluster.stub, prompt=PROMPTS[i], **kinds[i])

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
        assert not t.is_alive()
    for (ids, text, reason, lps), resps in zip(ref, got):
        assert joined(resps) == (ids, text, reason)
        if lps:  # (a prompt batched otherwise than offline: the last float bits may differ, as in test_disaggregated)
            assert [lp.logprob for r in resps for lp in r.logprobs] == pytest.approx([lp.logprob for lp in lps],
                                                                                     abs=1e-4)
    assert _ahead_steps(cluster) - before >= 5  # the worker's engine really ran steps ahead
    assert cluster.wait_idle(30.0)


def test_a_cancel_mid_stream_frees_every_block(cluster):
    w = cluster.decodes[0]
    s = cluster.stub.Generate(pdserve_pb2.GenerateRequest(prompt="a", max_tokens=2000, ignore_eos=True,
                                                          temperature=0.0), timeout=60)
    before = _ahead_steps(cluster)
    for _ in range(4):
        next(s)
    wait_until(lambda: _ahead_steps(cluster) > before, timeout=30.0, message="a step run ahead")
    s.cancel()
    assert cluster.wait_idle(30.0)  # (every block free, as the worker reports its engine)
    info = w.info()
    assert info.num_free_blocks == info.num_total_blocks


def test_a_stop_string_ends_the_stream_as_offline_and_frees_the_worker(cluster):
    """The router matches stop strings and ends the request on the worker, usually while a step that computes it
    runs ahead: the text is offline's and its blocks come back once that step is done."""
    full = offline([PROMPTS[2]], [SamplingParams(max_tokens=24, temperature=0.0)])[0][1]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    ref = offline([PROMPTS[2]], [SamplingParams(max_tokens=24, temperature=0.0, stop=[stop])])[0]
    got = joined(collect(cluster.stub, prompt=PROMPTS[2], max_tokens=24, temperature=0.0, stop=[stop]))
    assert got[1:] == (ref[1], "stop")
    assert cluster.wait_idle(30.0)
