"""Prefill and decode workers at different tensor-parallel sizes (real gRPC, real gloo, real rank processes).

A prefill worker at TP=p hands its KV to a decode worker at TP=d: each piece moves a run of KV heads from the
source rank's cache to the destination rank's (kvtransfer/sharding.py), over the pair's one channel. The
reference is the offline engine at one rank (the split changes no greedy token of ``tiny``: tests/engine); the
bytes shipped are the same as between two unsplit workers (no head crosses twice, none is missed), and every
block is free again afterwards.
"""
from __future__ import annotations

import grpc
import pytest

from engine import LLM, SamplingParams

from .harness import collect, counter_values, joined, start_roles
from tests.waiting import wait_until

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main(argv):\n",
           "class Stack:\n    def __init__(self):\n        self._items = []\n"]


def _sent_bytes(roles) -> float:
    return sum(counter_values(w.metrics, "pdserve:kv_transfer_bytes").get("", 0.0) for w in roles.prefills)


def _ranks_up(worker) -> dict[str, float]:
    """``pdserve:tensor_parallel_rank_up`` by rank, as the worker's /metrics serves it."""
    from prometheus_client.parser import text_string_to_metric_families

    return {smp.labels["rank"]: smp.value for fam in text_string_to_metric_families(worker.metrics.render().decode())
            if fam.name == "pdserve:tensor_parallel_rank_up" for smp in fam.samples}


def _recv_bytes_match(roles, want: float) -> bool:
    return _sent_bytes(roles) == want


@pytest.fixture(scope="module")
def reference():
    llms = {}

    def ref(kv_cache_dtype: str = "auto") -> list:
        """The offline results of PROMPTS, then of a second turn of the last one's conversation (its prompt, its
        answer, a new line): (prompt, (token ids, text, finish reason)) each."""
        if kv_cache_dtype not in llms:
            llm = LLM("tiny", num_kv_blocks=256, num_threads=1, kv_cache_dtype=kv_cache_dtype)
            sp = SamplingParams(max_tokens=16, temperature=0.0)
            outs = [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(PROMPTS, sp)]
            turn2 = PROMPTS[-1] + outs[-1][1] + "\n    def push(self, item):\n"
            o = llm.generate([turn2], sp)[0]
            llms[kv_cache_dtype] = list(zip(PROMPTS, outs)) + [(turn2, (o.token_ids, o.text, o.finish_reason))]
        return llms[kv_cache_dtype]

    return ref


@pytest.mark.parametrize("p,d,kv", [(2, 1, "auto"), (1, 2, "auto"), (2, 2, "auto"), (1, 2, "int8")],
                         ids=["tp2-to-tp1", "tp1-to-tp2", "tp2-to-tp2", "tp1-to-tp2-int8"])
def test_prefill_and_decode_at_different_tp_serve_the_offline_tokens(reference, p, d, kv):
    roles = start_roles(engine={"tensor_parallel_size": p, "kv_cache_dtype": kv},
                        decode_engine={"tensor_parallel_size": d, "kv_cache_dtype": kv}, tag=f"tp{p}{d}{kv[0]}",
                        metrics=True)
    try:
        assert roles.prefills[0].info().tensor_parallel_size == p
        assert roles.decodes[0].info().tensor_parallel_size == d
        for prompt, want in reference(kv):
            got = joined(collect(roles.stub, prompt=prompt, max_tokens=16, temperature=0.0))
            assert got == want, (p, d, prompt)
        # every head of every prompt token crossed once (4 layers x (K + V) x 2 KV heads x row bytes a token), but
        # the second turn's leading blocks the decode worker held from the first (a delta transfer): its cache
        # holds the first turn's prompt and answer but the last token, in full blocks of 16
        tok = LLM("tiny", num_kv_blocks=16).llm_engine.tokenizer
        row = 68 if kv == "int8" else 64 * 4
        (turn1, (ids1, _t, _r)), (turn2, _w) = reference(kv)[-2:]
        had, now = tok.encode(turn1) + ids1[:-1], tok.encode(turn2)
        common = next((i for i, (a, b) in enumerate(zip(had, now)) if a != b), min(len(had), len(now)))
        cached = min(common // 16, (len(now) - 1) // 16) * 16
        assert cached >= 16  # the check below would not see a whole transfer otherwise
        want_bytes = (sum(len(tok.encode(x)) for x, _w in reference(kv)) - cached) * 4 * 2 * 2 * row
        wait_until(lambda: _sent_bytes(roles) == want_bytes, timeout=10.0, interval=0.02,
                   message=lambda: f"{want_bytes} KV bytes sent (sent {_sent_bytes(roles)})")
        assert roles.wait_idle(10.0)
        # rank liveness per worker: every rank of each split engine reported up
        for w, n in ((roles.prefills[0], p), (roles.decodes[0], d)):
            wait_until(lambda: _ranks_up(w) == {str(r): 1.0 for r in range(n)}, timeout=10.0,
                       message=lambda: f"{n} ranks up on {w.info().worker_id} (got {_ranks_up(w)})")
    finally:
        roles.close()


def test_a_peer_layout_that_cannot_be_mapped_is_refused_at_reserve_naming_the_field():
    from proto import worker_pb2, worker_pb2_grpc
    from router.wire import params_to_wire

    roles = start_roles(tag="tpbad")
    try:
        with grpc.insecure_channel(roles.decodes[0].address) as ch:
            stub = worker_pb2_grpc.DecodeWorkerStub(ch)
            with pytest.raises(grpc.RpcError) as ei:
                stub.Reserve(worker_pb2.ReserveRequest(
                    request_id="bad-tp", prompt_token_ids=[5] * 8, params=params_to_wire(SamplingParams(max_tokens=1)),
                    prefill_kv_name=roles.prefills[0].cfg.worker_id, kv_timeout_s=5.0,
                    prefill_tensor_parallel_size=3), timeout=10)
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "prefill_tensor_parallel_size" in ei.value.details()
            assert "tensor_parallel_size=3 and num_kv_heads=2 must divide one another" in ei.value.details()
        assert roles.wait_idle(5.0)  # no block was taken
    finally:
        roles.close()
