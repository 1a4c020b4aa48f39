"""Migration: a worker lost mid-stream does not end the request. Another worker prefills the prompt
plus the tokens already streamed and goes on from there; the client's greedy stream is the offline
engine's output token for token. (Seeded sampling continues with the same draws, the draw for output
i being a function of (seed, i), and tests/engine/test_llm_engine.py checks that at the engine; through
a kill the resume point is not under the test's control, and the recomputed K/V differs from the
incrementally built one by float rounding, which over hundreds of tokens can flip a draw that sits at
a probability boundary, as with any recompute, so only greedy is held to exact equality here.)
Real router, workers and gloo KV; the worker is stopped the way a crash looks to its peers (its
gRPC server goes away with the stream open).
"""
from __future__ import annotations

import time

import torch

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2
from tests.roles.harness import counter_values, offline, start_colocated, start_roles
from tests.waiting import wait_until

PROMPT = "def migrate(worker):"
GREEDY = dict(max_tokens=1000, temperature=0.0, ignore_eos=True)


def _stream_killing(roles, workers, kw: dict, rid: str, after: int) -> tuple[list[int], str]:
    """Stream a request; after ``after`` responses stop the worker holding it. Returns (ids, reason)."""
    s = roles.stub.Generate(pdserve_pb2.GenerateRequest(prompt=PROMPT, request_id=rid, **kw), timeout=60)
    ids, reason = [], ""
    for i, r in enumerate(s):
        ids += list(r.token_ids)
        reason = r.finish_reason or reason
        if i + 1 == after:
            holder = [w for w in workers if rid in w.requests]
            assert len(holder) == 1
            holder[0].stop()
    return ids, reason


def _migrations(roles) -> float:
    """The router's pdserve:request_migrations_total, read from its /metrics text."""
    return counter_values(roles.router.metrics, "pdserve:request_migrations")[""]


def test_decode_worker_lost_midstream_resumes_on_another():
    torch.set_num_threads(1)
    want = offline([PROMPT], [SamplingParams(**GREEDY)])[0]
    roles = start_roles(n_decode=2, tag="mig-", metrics=False)
    try:
        t = time.monotonic()
        ids, reason = _stream_killing(roles, roles.decodes, GREEDY, "mig-d", after=5)
        assert time.monotonic() - t < 30
        assert (ids, reason) == (want[0], want[2])
        assert _migrations(roles) == 1
        live = [w for w in roles.decodes if w.loop is not None and w.loop.alive]
        assert len(live) == 1 and not live[0].requests
        assert roles.prefills[0].requests == {}
    finally:
        roles.close()


def test_colocated_worker_lost_midstream_resumes_on_another():
    torch.set_num_threads(1)
    want = offline([PROMPT], [SamplingParams(**GREEDY)])[0]
    roles = start_colocated(n=2, tag="migc-")
    try:
        assert _migrations(roles) == 0
        ids, reason = _stream_killing(roles, roles.decodes, GREEDY, "mig-colo", after=3)
        assert (ids, reason) == (want[0], want[2])
        assert _migrations(roles) == 1
    finally:
        roles.close()


def test_lone_decode_worker_lost_midstream_resumes_on_its_replacement():
    """One decode worker, killed mid-stream: the migration waits (pool_wait_s) for a replacement to join (here
    started by the test, as the supervisor does in a cluster) and resumes there token-exact."""
    import threading

    from decode_worker import DecodeWorker, DecodeWorkerConfig
    from tests.roles.harness import engine_config

    torch.set_num_threads(1)
    want = offline([PROMPT], [SamplingParams(**GREEDY)])[0]
    roles = start_roles(n_decode=1, tag="migl-", router=dict(pool_wait_s=60.0))

    def replace_when_dead() -> None:
        wait_until(lambda: roles.decodes[0].loop is None or not roles.decodes[0].loop.alive, timeout=60,
                   interval=0.02, message="the lone decode worker died")
        d1 = DecodeWorker(DecodeWorkerConfig("migl-d1", engine=engine_config(), kv_store=roles.store,
                                             kv_backend="gloo", serve_metrics=False)).start()
        roles.extra.append(d1)
        roles.source.add(d1.info)

    joiner = threading.Thread(target=replace_when_dead, daemon=True)
    joiner.start()
    try:
        ids, reason = _stream_killing(roles, roles.decodes, GREEDY, "mig-lone", after=5)
        assert (ids, reason) == (want[0], want[2])
        assert _migrations(roles) == 1
        joiner.join(30)
        assert not roles.extra[0].requests
    finally:
        roles.close()
