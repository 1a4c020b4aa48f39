"""The router streams decode tokens without waiting for the prefill worker's TransferDone.

A prefill worker reports TransferDone only between engine steps; a busy one (a long
prompt in its current step) used to hold every other request's second token for up
to a whole step. Here the prefill worker's poll is held (as if stuck in one long
step) right after the first token: the request must still complete, equal to the
offline engine, and once the hold ends the prefill worker frees everything.
Real workers, gRPC and gloo KV transfer.
"""
from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2
from tests.roles.harness import KV, collect, counter_values, joined, offline, start_roles
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def roles():
    torch.set_num_threads(1)
    r = start_roles(kv=KV, tag="tw-", transfer_timeout_s=5.0, metrics=True)
    yield r
    r.close()


def _hold_poll(worker):
    """While the returned event is set, the worker's loop does not poll (no TransferDone, no deadlines)."""
    real = worker.poll
    hold = threading.Event()
    hold.set()
    worker.poll = lambda: True if hold.is_set() else real()
    return hold, real


def test_tokens_flow_while_prefill_worker_withholds_transfer_done(roles):
    prompt = "def fib(n):\n    if n < 2:"
    ref = offline([prompt], [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)])[0]
    p = roles.prefills[0]
    hold, real = _hold_poll(p)
    try:
        t = time.monotonic()
        resps = collect(roles.stub, timeout=4.0, prompt=prompt, max_tokens=10, temperature=0.0, ignore_eos=True,
                        request_id="req-tw")
        assert time.monotonic() - t < 4.0
        assert joined(resps) == (ref[0], ref[1], "length")
        time.sleep(0.3)   # the router's end-of-RPC callback must not cancel the still-open prefill stream
        assert "req-tw" in p.requests, "the prefill worker should still hold the request (TransferDone withheld)"
    finally:
        hold.clear()
        p.poll = real
    assert roles.wait_idle(3.0)   # TransferDone after all: the prefill worker frees its blocks
    wait_until(lambda: roles.router.selector.in_flight(p.cfg.worker_id) == 0, timeout=2, interval=0.01,
               message="the router counts nothing in flight on the prefill worker")


def test_failed_transfer_is_resumed_by_the_decode_worker_itself(roles):
    # the KV send cannot find its peer (wrong peer name for the prefill worker): the decode call, started before
    # TransferDone, is cancelled by the failed transfer rather than waiting for its KV, and the request goes on
    # whole on the decode worker (prompt + the first token already streamed), equal to the offline engine
    prompt = "x = 1"
    want = offline([prompt], [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])[0]
    p = roles.prefills[0]
    bad = p.info()
    bad.kv_name = "ghost"
    roles.source.remove_where(p.cfg.worker_id)
    roles.source.add(bad)
    before = counter_values(roles.router.metrics, "pdserve:degraded_requests", "reason").get("kv_transfer_failed", 0)
    try:
        got = collect(roles.stub, timeout=60, prompt=prompt, max_tokens=6, temperature=0.0, ignore_eos=True,
                      request_id="req-twf")
        assert joined(got) == (want[0], want[1], "length")
        assert got[-1].timings.kv_transfer_s == 0  # no KV arrived: the decode worker prefilled it
        after = counter_values(roles.router.metrics, "pdserve:degraded_requests", "reason")
        assert after.get("kv_transfer_failed", 0) == before + 1, after
        # the decode worker was not blamed: it is still in routing
        assert [w.worker_id for w in roles.router.core.view.list("decode")] == [roles.decodes[0].cfg.worker_id]
    finally:
        roles.source.remove_where(p.cfg.worker_id)
        roles.source.add(p.info)
    assert roles.wait_idle(4.0)


def _hist(metrics, name: str) -> dict[tuple, tuple[float, float]]:
    """A histogram's (count, sum) per label set (identity labels dropped), from what /metrics serves."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple, list[float]] = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        if fam.name != name:
            continue
        for smp in fam.samples:
            key = tuple(sorted((k, v) for k, v in smp.labels.items() if k not in ("model_name", "role", "worker",
                                                                                  "le")))
            if smp.name.endswith("_count"):
                out.setdefault(key, [0.0, 0.0])[0] = smp.value
            elif smp.name.endswith("_sum"):
                out.setdefault(key, [0.0, 0.0])[1] = smp.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def test_transfer_time_is_broken_into_phases_on_both_workers(roles):
    """Each finished transfer is observed once per phase on the prefill worker (send) and the decode worker
    (recv), and the send side's phases add up to the transfer's total time."""
    p, d = roles.prefills[0], roles.decodes[0]
    before_p = _hist(p.metrics, "pdserve:kv_transfer_phase_seconds")
    before_d = _hist(d.metrics, "pdserve:kv_transfer_phase_seconds")
    before_t = _hist(p.metrics, "pdserve:kv_transfer_time_seconds").get((), (0.0, 0.0))
    got = collect(roles.stub, timeout=60, prompt="def phases(t):", max_tokens=4, temperature=0.0, ignore_eos=True)
    assert got[-1].timings.kv_transfer_s > 0  # it went over the pair
    phases = ("ack", "pair_wait", "queue", "wire")

    def delta(now, before, direction):
        return {ph: tuple(a - b for a, b in zip(now.get((("direction", direction), ("phase", ph)), (0.0, 0.0)),
                                                 before.get((("direction", direction), ("phase", ph)), (0.0, 0.0))))
                for ph in phases}

    wait_until(lambda: all(c == 1 for c, _ in delta(_hist(d.metrics, "pdserve:kv_transfer_phase_seconds"),
                                                    before_d, "recv").values()),
               timeout=30, interval=0.05, message="the decode worker did not observe the transfer's phases")
    wait_until(lambda: all(c == 1 for c, _ in delta(_hist(p.metrics, "pdserve:kv_transfer_phase_seconds"),
                                                    before_p, "send").values()),
               timeout=30, interval=0.05, message="the prefill worker did not observe the transfer's phases")
    sent = delta(_hist(p.metrics, "pdserve:kv_transfer_phase_seconds"), before_p, "send")
    total = _hist(p.metrics, "pdserve:kv_transfer_time_seconds")[()]
    assert total[0] - before_t[0] == 1
    assert sum(s for _, s in sent.values()) == pytest.approx(total[1] - before_t[1], abs=1e-6), sent
    assert sent["wire"][1] > 0, sent  # bytes moved
