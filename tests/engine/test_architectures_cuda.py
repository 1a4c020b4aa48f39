"""The newer architectures on a GPU (Qwen3's q/k norms as Triton ops, YaRN's scaled tables, Phi-3's fused weights
and window under decode graphs, a Qwen3-MoE layer's experts eagerly): a float32 engine on CUDA gives transformers'
greedy tokens (the CPU model's), batched. Skipped without a GPU; benchmarks/device_session.sh's tests phase runs
it. The same checks run on CPU in test_model_parity.py."""
from __future__ import annotations

import pytest
import torch

from .conftest import hf_greedy, make_checkpoint, make_engine, prompts_of, greedy, run_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device_session.sh)")

CASES = {
    "qwen3": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
    "qwen3_yarn": ("qwen3", {"head_dim": 32, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 16}}),
    "phi3_window": ("phi3", {"sliding_window": 8}),
    "gemma3": ("gemma3", {"head_dim": 32, "num_hidden_layers": 3, "sliding_window": 8, "query_pre_attn_scalar": 20,
                          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "qwen3_moe": ("qwen3_moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "mlp_only_layers": [1]}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cuda_engine_matches_transformers(tmp_path, name):
    arch, over = CASES[name]
    d, hf = make_checkpoint(tmp_path, arch, seed=4, **over)
    prompts = prompts_of([5, 17, 30], seed=9)
    want = {f"r{i}": hf_greedy(hf, p, 24) for i, p in enumerate(prompts)}
    eng = make_engine(d, device="cuda", block_size=16, max_num_seqs=4)  # (the Triton kernels' usual block)
    assert run_engine(eng, {f"r{i}": p for i, p in enumerate(prompts)}, greedy(24)) == want
    assert eng.num_free_blocks == eng.num_total_blocks
