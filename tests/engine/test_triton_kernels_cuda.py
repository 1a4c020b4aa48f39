"""pdserve's Triton kernels compiled for a GPU (the interpreter tests in test_triton_kernels.py run the same kernel
bodies on CPU). Skipped without CUDA; benchmarks/device_session.sh's engine phase runs this module in a pytest
process of its own, since the interpreter tests import triton in interpreter mode for their whole process.

Checked against the float64 reference (triton_cases._naive) and the gather + SDPA path on the same GPU tensors;
then captured in a real CUDA graph, the block tables and lengths rewritten in place, and replayed.
"""
from __future__ import annotations

import pytest
import torch

from .triton_cases import _case, _naive

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device_session.sh)")


def _meta(q, kc, bt, ctx):
    from engine.attention import AttentionMetadata

    return AttentionMetadata(slot_mapping=torch.zeros(q.shape[0], dtype=torch.int64, device=q.device),
                             num_decode=q.shape[0], decode_block_tables=bt, decode_ctx_lens=ctx,
                             block_size=kc.shape[1])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("window", [None, 6])
def test_cuda_decode_attention_against_references(dtype, tol, window):
    from engine import triton_kernels as tk
    from engine.attention import decode_attention, gather_decode_attention

    assert tk.available(torch.device("cuda"))
    q, kc, vc, bt, ctx = _case([1, 17, 40, 129], 8, 2, 64, 16, dtype, extra_cols=2, seed=5)
    ref = _naive(q, kc, vc, bt, ctx, window)
    q, kc, vc, bt, ctx = (t.cuda() for t in (q, kc, vc, bt, ctx))
    out = tk.paged_decode_attention(q, kc, vc, bt, ctx, window, 64 ** -0.5)
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)
    meta = _meta(q, kc, bt, ctx)
    torch.testing.assert_close(decode_attention(q, kc, vc, meta, window).float(),  # the engine's dispatch
                               gather_decode_attention(q, kc, vc, meta, window).float(), atol=2 * tol, rtol=2 * tol)


def test_cuda_decode_attention_replays_in_a_cuda_graph():
    from engine import triton_kernels as tk

    q, kc, vc, bt, ctx = (t.cuda() for t in _case([5, 17, 24], 8, 2, 64, 16, torch.bfloat16, extra_cols=3, seed=6))
    tk.paged_decode_attention(q, kc, vc, bt, ctx, None, 0.125)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = tk.paged_decode_attention(q, kc, vc, bt, ctx, None, 0.125)
    ctx.copy_(torch.tensor([40, 3, 50], device="cuda"))
    bt.copy_(torch.roll(bt, 1, dims=1))  # other blocks, same tensor
    g.replay()
    torch.cuda.synchronize()
    ref = _naive(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), ctx.cpu(), None)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_layer_ops_match_torch_ops(dtype):
    from engine.layer_ops import TorchOps, TritonOps

    torch.manual_seed(0)
    t, tr = TorchOps(), TritonOps()
    x = torch.randn(7, 2048, device="cuda", dtype=dtype)
    w = torch.randn(2048, device="cuda", dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(tr.rms_norm(x, w, 1e-5), t.rms_norm(x, w, 1e-5), atol=tol, rtol=tol)
    gu = torch.randn(7, 2 * 1500, device="cuda", dtype=dtype)
    torch.testing.assert_close(tr.silu_mul(gu, 1500), t.silu_mul(gu, 1500), atol=tol, rtol=tol)
    qkv = torch.randn(7, 12, 64, device="cuda", dtype=dtype)
    cos, sin = torch.randn(7, 1, 32, device="cuda", dtype=dtype), torch.randn(7, 1, 32, device="cuda", dtype=dtype)
    want = t.rope(qkv.clone(), cos, sin, 10)
    got = tr.rope(qkv, cos, sin, 10)
    torch.testing.assert_close(got[:, :10], want, atol=tol, rtol=tol)
