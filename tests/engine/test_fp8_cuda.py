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
    # the reference's float8 inputs rounded on the GPU too, from the model-dtype input: CUDA divides by a scalar
    # as a product with its reciprocal, so a scale can be an ulp off the CPU's, and bfloat16 inputs (8-bit
    # mantissas) put many quotients on float8 rounding ties that an ulp tips (the 1 Dec H200 run: 126 of 1280
    # products off with the scales taken on CPU); the product and the sums stay on the CPU in float32
    xr = x.cuda().to(dtype).float()
    sx = xr.abs().amax(-1, keepdim=True) / 448
    x8 = (xr / sx).to(FP8)
    want = (x8.float() * sx).cpu() @ fmt.dense().cpu().t() + b
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
