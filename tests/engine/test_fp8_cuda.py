"""FP8 on a GPU (compute capability 8.9+): the fp8 weight format's scaled GEMM and an engine with fp8 weights and an
fp8 KV cache, decode graphs on. Skipped without such a GPU; benchmarks/device_session.sh's engine phase runs it.
The same formats are checked on CPU in test_quantized_engine.py."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA GPU with FP8 (device_session.sh)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_fp8_weights_compute_the_scaled_product_of_what_they_store(dtype):
    # CUDA's row-wise scaled GEMM writes bfloat16 only: a float16 or float32 model gets its dtype back after it
    from engine.quant_formats import FP8, Fp8

    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(256, 512, generator=g), torch.randn(256, generator=g)
    x = torch.randn(5, 512, generator=g)
    fmt = Fp8.pack(w.t().contiguous().cuda().t(), b.cuda())  # transposed, as a Linear hands its weight over
    xr = x.to(dtype).float()  # what the format rounds to float8 is the model-dtype input
    sx = xr.abs().amax(-1, keepdim=True) / 448
    want = ((xr / sx).to(FP8).float() * sx) @ fmt.dense().cpu().t() + b
    got = fmt(x.cuda().to(dtype))  # 5 rows: padded to 16 for the GEMM
    assert got.shape == (5, 256) and got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2)


def test_cuda_engine_with_fp8_weights_and_kv_cache_decodes_through_graphs():
    from engine import LLM, SamplingParams

    llm = LLM("tiny", device="cuda", dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8", max_num_seqs=8)
    eng = llm.llm_engine
    assert eng.kv_caches[0][0].dtype == torch.float8_e4m3fn and eng.runner.graphs is not None
    outs = llm.generate(["def fibonacci(n):", "import os\n"] * 3, SamplingParams(max_tokens=16, temperature=0.0))
    assert all(len(o.token_ids) == 16 for o in outs) and eng.runner.graphs.replays > 0
