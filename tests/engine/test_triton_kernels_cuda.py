"""pdserve's Triton kernels compiled for a GPU (the interpreter tests in test_triton_kernels.py run the same kernel
bodies on CPU). Skipped without CUDA; benchmarks/device_session.sh's engine phase runs this module in a pytest
process of its own, since the interpreter tests import triton in interpreter mode for their whole process.

Decode attention: checked against the float64 reference (triton_cases._naive) and the gather + SDPA path on the same
GPU tensors; then captured in a real CUDA graph, the block tables and lengths rewritten in place, and replayed.
Prefill attention: against the float64 reference (triton_cases._naive_prefill), up to 300 query rows over 1000
context tokens, and attention._prefill's dispatch against its SDPA path.
"""
from __future__ import annotations

import pytest
import torch

from .triton_cases import _case, _naive, _naive_prefill, _prefill_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device_session.sh)")
DEVICE = torch.device("cuda")  # the prefill kernel test also runs on CPU in the interpreter if this is changed


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


PREFILL_CASES = {  # num_computed, n, H, Hkv, D, block_size, window
    "later-chunk-gqa4": (21, 37, 8, 2, 64, 16, None),
    "first-chunk-window-under-chunk": (0, 100, 8, 2, 64, 16, 20),
    "300-rows-over-1000-gqa4": (700, 300, 32, 8, 128, 16, None),
    "300-rows-over-1000-window-bs8": (700, 300, 32, 8, 128, 8, 256),
    "d256-short-chunk-window": (50, 40, 4, 1, 256, 16, 33),
}


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_cuda_prefill_attention_against_reference(name, dtype, tol):
    from engine import triton_kernels as tk

    nc, n, H, Hkv, D, bs, window = PREFILL_CASES[name]
    q, kc, vc, bt = _prefill_case(nc, n, H, Hkv, D, bs, dtype, extra=2, seed=7)
    ref = _naive_prefill(q, kc, vc, bt, nc, window)
    out = tk.paged_prefill_attention(*(t.to(DEVICE) for t in (q, kc, vc, bt)), nc, window, D ** -0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("nc, window, kernel", [(0, None, False), (0, 6, True), (21, None, True), (21, 6, True)])
def test_cuda_prefill_dispatch_against_sdpa(monkeypatch, dtype, tol, nc, window, kernel):
    # attention._prefill on CUDA: the kernel where SDPA would need the explicit mask (a later chunk, or a window
    # shorter than the chunk), SDPA is_causal for a first chunk without one; q a view of a qkv batch, the chunk
    # at rows 3.. of it
    from engine import attention, triton_kernels as tk
    from engine.attention import PrefillSpan

    n, H, Hkv, D = 37, 8, 2, 64
    q, kc, vc, bt = (t.cuda() for t in _prefill_case(nc, n, H, Hkv, D, 16, dtype, extra=1, seed=8))
    qkv = torch.randn(3 + n, H + 2 * Hkv, D, device="cuda").to(dtype)
    qkv[3:, :H] = q
    fresh = [torch.cat([c.new_zeros(3, Hkv, D), c[bt].reshape(-1, Hkv, D)[nc:nc + n]]) for c in (kc, vc)]
    span = PrefillSpan(start=3, end=3 + n, num_computed=nc, block_table=bt)
    calls = []
    real = tk.paged_prefill_attention
    monkeypatch.setattr(tk, "paged_prefill_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = attention._prefill(qkv[:, :H], *fresh, kc, vc, span, window, H // Hkv)
    assert len(calls) == int(kernel)
    monkeypatch.setattr(attention, "_triton_kernels", lambda device: None)
    want = attention._prefill(qkv[:, :H], *fresh, kc, vc, span, window, H // Hkv)
    torch.testing.assert_close(got.float(), want.float(), atol=2 * tol, rtol=2 * tol)
    torch.testing.assert_close(got.double().cpu(), _naive_prefill(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), nc, window),
                               atol=tol, rtol=tol)


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


def test_cuda_decode_attention_reads_an_fp8_cache():
    from engine import triton_kernels as tk

    q, kc, vc, bt, ctx = _case([1, 17, 40, 129], 8, 2, 64, 16, torch.float32, extra_cols=2, seed=9)
    kc8, vc8 = kc.clamp(-448, 448).to(torch.float8_e4m3fn), vc.clamp(-448, 448).to(torch.float8_e4m3fn)
    ref = _naive(q, kc8.float(), vc8.float(), bt, ctx, None)
    out = tk.paged_decode_attention(q.bfloat16().cuda(), kc8.cuda(), vc8.cuda(), bt.cuda(), ctx.cuda(), None,
                                    64 ** -0.5)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)
