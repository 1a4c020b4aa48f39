"""The fused C++ decode layer (engine/csrc/decode_layer.cpp DecodeLayer) computes exactly what
DecoderLayer.forward computes on the same kernels.

Each case runs one engine with the fused layers (what finalize builds wherever every linear runs on
pdserve's kernels) and one with them removed, on the same prompts, and demands the same tokens and
bit-identical log-probabilities: the fused layer calls the same linear / norm / attention kernels, and
its RoPE and K/V write are compiled to round like the torch ops they replace, so there is no rounding
difference to excuse. A counting wrapper shows the fused path really ran.
"""
from __future__ import annotations

import os

import pytest

from engine import LLM, SamplingParams
from .conftest import make_checkpoint

pytestmark = pytest.mark.skipif(os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0", reason="PDSERVE_CPU_KERNELS=0")

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n", "def binary_search(items, target):\n"]


class Counting:
    """Wraps a DecodeLayer and counts its calls."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def forward(self, *a):
        self.calls += 1
        return self.inner.forward(*a)


def _pair(model: str, **kw) -> tuple[LLM, LLM, list[Counting]]:
    fused, plain = LLM(model, **kw), LLM(model, **kw)
    layers = fused.llm_engine.runner.model.layers
    assert all(layer.fused is not None for layer in layers), "finalize did not build the fused layers"
    counters = []
    for layer in layers:
        layer.fused = Counting(layer.fused)
        counters.append(layer.fused)
    for layer in plain.llm_engine.runner.model.layers:
        layer.fused = None
    return fused, plain, counters


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert [t.logprob for t in x.logprobs] == [t.logprob for t in y.logprobs]
        assert [t.top for t in x.logprobs] == [t.top for t in y.logprobs]


@pytest.mark.parametrize("kw", [
    {}, {"kv_cache_dtype": "int8"},  # the default: fp32 on oneDNN's packed panels
    {"cpu_gemm": "pdserve"}, {"quantization": "int8"}, {"quantization": "int4"}, {"quantization": "w8a8"},
    {"quantization": "w4a8"}, {"quantization": "w8a8", "kv_cache_dtype": "int8"},
    {"cpu_gemm": "pdserve", "kv_cache_dtype": "int8"}],
    ids=lambda kw: "-".join(map(str, kw.values())) or "default")
def test_fused_decode_layers_give_identical_outputs(kw):
    fused, plain, counters = _pair("tiny", **kw)
    p = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=3)
    _same(fused.generate(PROMPTS, p), plain.generate(PROMPTS, p))
    assert all(c.calls == 19 for c in counters)  # every decode step after the prefill, in every layer
    seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True, logprobs=1)
    _same(fused.generate(PROMPTS[:3], seeded), plain.generate(PROMPTS[:3], seeded))
    assert fused.llm_engine.num_free_blocks == fused.llm_engine.num_total_blocks


def test_fused_layers_with_speculation_and_mixed_batches():
    """Speculative verification and prefill steps take the Python path, pure decode steps the fused one:
    the outputs still equal the unfused engine's."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    fused, plain, counters = _pair("tiny", quantization="w8a8", speculative_config=spec, max_num_batched_tokens=24)
    p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    prompts = PROMPTS + ["x = [i * i for i in range(100)]\n" * 3]  # a long prompt: chunked prefill beside decodes
    _same(fused.generate(prompts, p), plain.generate(prompts, p))
    assert sum(c.calls for c in counters) > 0


@pytest.mark.parametrize("arch,over", [("qwen2", {}), ("mistral", {"sliding_window": 8}), ("qwen3", {"head_dim": 32}),
                                      ("gemma3", {"head_dim": 32, "num_hidden_layers": 3, "sliding_window": 8,
                                                  "query_pre_attn_scalar": 20})],
                         ids=["qwen2-bias", "window", "qwen3-qk-norm", "gemma3"])
def test_fused_layers_on_bias_and_sliding_window_checkpoints(tmp_path, arch, over):
    ckpt, _ = make_checkpoint(tmp_path, arch, seed=3, **over)
    fused, plain, counters = _pair(str(ckpt), quantization="int8")
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [[5, 9, 33, 7, 100, 4, 8, 15, 16, 23, 42, 77], [3, 1, 4, 1, 5]]
    a = fused.generate([{"prompt_token_ids": t} for t in prompts], p)
    b = plain.generate([{"prompt_token_ids": t} for t in prompts], p)
    _same(a, b)
    assert all(c.calls == 23 for c in counters)
