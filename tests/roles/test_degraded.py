"""Degrade instead of failing: with no live prefill worker the decode workers prefill requests themselves;
with no live decode worker a colocated worker serves them whole. Output equals the offline engine's and
``pdserve:degraded_requests_total{reason}`` counts each. Real router, workers and gloo KV."""
from __future__ import annotations

import grpc
import pytest
import torch

from engine import SamplingParams
from tests.roles.harness import collect, counter_values, engine_config, joined, offline, start_roles
from tests.waiting import wait_until

PROMPT = "def degrade(pool):"
KW = dict(max_tokens=12, temperature=0.0, ignore_eos=True)


def _degraded(roles) -> dict[str, float]:
    return counter_values(roles.router.metrics, "pdserve:degraded_requests", "reason")


def test_no_prefill_worker_decode_workers_prefill_themselves():
    torch.set_num_threads(1)
    want = offline([PROMPT], [SamplingParams(**KW)])[0]
    roles = start_roles(tag="deg-p-")
    try:
        assert joined(collect(roles.stub, prompt=PROMPT, **KW)) == want[:3]
        assert _degraded(roles) == {}
        roles.prefills[0].stop()  # the whole prefill pool is gone
        got = collect(roles.stub, prompt=PROMPT, **KW)
        assert joined(got) == want[:3]
        assert got[-1].timings.kv_transfer_s == 0  # no KV moved: prefilled where it decoded
        assert _degraded(roles) == {"no_prefill": 1.0}
        assert roles.wait_idle(5.0)
    finally:
        roles.close()


def test_no_decode_worker_colocated_worker_serves_it_whole():
    from decode_worker import ColocatedWorker, ColocatedWorkerConfig

    torch.set_num_threads(1)
    want = offline([PROMPT], [SamplingParams(**KW)])[0]
    roles = start_roles(tag="deg-d-", router=dict(pool_wait_s=0.5))
    colo = ColocatedWorker(ColocatedWorkerConfig("deg-d-c0", engine=engine_config(), serve_metrics=False)).start()
    roles.extra.append(colo)
    roles.source.add(colo.info)
    try:
        roles.decodes[0].stop()
        got = collect(roles.stub, prompt=PROMPT, **KW)
        assert joined(got) == want[:3]
        assert _degraded(roles) == {"no_decode": 1.0}
        # and with nothing that can decode at all (past pool_wait_s), the client gets UNAVAILABLE, not a hang
        colo.stop()
        with pytest.raises(grpc.RpcError) as e:
            collect(roles.stub, prompt=PROMPT, **KW)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no ready decode worker" in e.value.details()
    finally:
        roles.close()


def test_a_request_waits_for_an_empty_decode_pool_to_come_back():
    """With no decode worker and no fallback, a request waits (pool_wait_s) for the supervisor's replacement
    instead of failing; here a new decode worker joins while it waits, and it is served equal to offline."""
    import threading

    from decode_worker import DecodeWorker, DecodeWorkerConfig

    torch.set_num_threads(1)
    want = offline([PROMPT], [SamplingParams(**KW)])[0]
    roles = start_roles(tag="deg-w-", router=dict(pool_wait_s=60.0))
    try:
        roles.decodes[0].stop()
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(out=collect(roles.stub, timeout=90, prompt=PROMPT, **KW)))
        t.start()
        wait_until(lambda: roles.router.num_in_flight == 1, timeout=20, interval=0.02,
                   message="the request waits in the router")
        assert roles.router.num_in_flight == 1 and t.is_alive()  # waiting, not failed
        d1 = DecodeWorker(DecodeWorkerConfig("deg-w-d1", engine=engine_config(), kv_store=roles.store,
                                             kv_backend="gloo", serve_metrics=False)).start()
        roles.extra.append(d1)
        roles.source.add(d1.info)
        t.join(90)
        assert joined(box["out"]) == want[:3]
    finally:
        roles.close()
