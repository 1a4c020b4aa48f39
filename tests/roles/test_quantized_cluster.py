"""Quantized weights and the int8 KV cache through the disaggregated cluster (real gRPC, real gloo).

The prefill worker ships its int8 blocks as they are (values with each row's scale), so a prompt
costs (head_dim + 4) / (4 * head_dim) of the float32 bytes on the wire (68 / 256 for tiny), and the
cluster's greedy output equals the offline engine's with the same settings. A prefill and a decode
pool with different KV dtypes is refused at Reserve with FAILED_PRECONDITION, before any block or
byte moves.
"""
from __future__ import annotations

import grpc
import pytest

from engine import LLM, SamplingParams

from tests.waiting import wait_until

from .harness import collect, counter_values, joined, start_roles

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main(argv):\n",
           "class Stack:\n    def __init__(self):\n        self._items = []\n"]
QUANT = {"quantization": "int8", "kv_cache_dtype": "int8"}


def _transfers(roles) -> float:
    """KV sends the prefill workers recorded as done (their kv_transfer_time_seconds observations)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for w in roles.prefills for fam in text_string_to_metric_families(w.metrics.render().decode())
               if fam.name == "pdserve:kv_transfer_time_seconds" for s in fam.samples if s.name.endswith("_count"))


def _bytes_sent(roles, sends: int) -> float:
    """Bytes the prefill workers sent, once they recorded ``sends`` KV sends: a prefill worker records a send
    when its loop next polls it, which may come after the client has its last token."""
    wait_until(lambda: _transfers(roles) == sends, timeout=10.0, interval=0.01,
               message=lambda: f"{sends} KV sends recorded (recorded: {_transfers(roles)})")
    return sum(counter_values(w.metrics, "pdserve:kv_transfer_bytes").get("", 0.0) for w in roles.prefills)


def _prompt_tokens(prompts) -> int:
    tok = LLM("tiny", num_kv_blocks=16).llm_engine.tokenizer
    return sum(len(tok.encode(p)) for p in prompts)


@pytest.fixture(scope="module")
def fp32_bytes_per_token():
    roles = start_roles(tag="qf", metrics=True)
    try:
        for p in PROMPTS:
            collect(roles.stub, prompt=p, max_tokens=2, temperature=0.0)
        return _bytes_sent(roles, len(PROMPTS)) / _prompt_tokens(PROMPTS)
    finally:
        roles.close()


def test_int8_cluster_equals_offline_and_ships_a_quarter_of_the_bytes(fp32_bytes_per_token):
    ref = LLM("tiny", num_kv_blocks=256, **QUANT).generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0))
    roles = start_roles(engine=QUANT, tag="q8", metrics=True)
    try:
        for p, o in zip(PROMPTS, ref):
            ids, text, reason = joined(collect(roles.stub, prompt=p, max_tokens=16, temperature=0.0))
            assert (ids, text, reason) == (o.token_ids, o.text, o.finish_reason)
        per_token = _bytes_sent(roles, len(PROMPTS)) / _prompt_tokens(PROMPTS)
        # 4 layers x (K + V) x 2 KV heads x 68 bytes = 1088 bytes a token, against 4096 in float32
        assert per_token == pytest.approx(4 * 2 * 2 * 68)
        assert per_token / fp32_bytes_per_token == pytest.approx(68 / 256)
        assert roles.wait_idle(10.0)
    finally:
        roles.close()


def test_prefill_and_decode_with_different_kv_dtypes_fail_at_reserve():
    roles = start_roles(engine={"kv_cache_dtype": "int8"}, decode_engine={"kv_cache_dtype": "auto"}, tag="qm",
                        metrics=True)
    try:
        with pytest.raises(grpc.RpcError) as ei:
            collect(roles.stub, prompt="def f(x):", max_tokens=4, temperature=0.0, timeout=30)
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        msg = ei.value.details()
        assert "kv_cache_dtype mismatch" in msg and "int8" in msg and "float32" in msg
        assert _bytes_sent(roles, 0) == 0
        assert roles.wait_idle(10.0)
    finally:
        roles.close()
