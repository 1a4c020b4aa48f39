"""pdserve's Triton kernels (engine/triton_kernels.py), run on CPU in Triton's interpreter.

The kernels are the CUDA path; here ``TRITON_INTERPRET=1`` runs the same kernel bodies on CPU tensors through
numpy, checked against independent references: attention.gather_decode_attention and attention._prefill's SDPA path
(the gather + SDPA paths), float64 softmax(q k^T) v references (triton_cases.py), and layer_ops.TorchOps for the
norm, RoPE and silu * mul.

Tolerances: float32 to ~1e-5. float16 elementwise ops to the last bit (numpy rounds to nearest even as the GPU
does), so they check that every intermediate is rounded where torch rounds it. bfloat16 only loosely: the
interpreter casts float32 -> bfloat16 by truncation, not round-to-nearest as the GPU does, so each rounding
step may be one bfloat16 ulp (2^-8 relative) off torch's.
"""
from __future__ import annotations

import os
from typing import Optional

import pytest
import torch
from torch import Tensor


def _set_interpret(value: Optional[str]) -> Optional[str]:
    old = os.environ.get("TRITON_INTERPRET")
    if value is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = value
    return old


# Triton jits its own language functions (tl.sum, tl.max, tl.zeros, ...) when it is first imported, and the
# interpreter can only call interpreted ones: so triton is imported here with the interpreter on (it stays
# imported so for this process; nothing else in the suite uses triton), and the variable put back at once so no
# other test module in this xdist worker sees it.
_old = _set_interpret("1")
try:
    triton = pytest.importorskip("triton")
finally:
    _set_interpret(_old)
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if not isinstance(triton.language.sum, InterpretedFunction):
    raise RuntimeError("triton was imported in this process without TRITON_INTERPRET=1 before this module: its "
                       "language functions cannot run in the interpreter (import triton after this module)")

from engine import triton_kernels as tk  # noqa: E402
from engine import SamplingParams, attention  # noqa: E402
from engine.attention import AttentionMetadata, PrefillSpan, apply_rope, gather_decode_attention  # noqa: E402
from engine.layer_ops import TorchOps, TritonOps  # noqa: E402

from .triton_cases import _case, _naive, _naive_prefill, _prefill_case  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    # our kernels are jitted per interpreter mode on first use (engine/triton_kernels.py _kernels), so the
    # interpreter on while this module runs is enough, whatever another module built before
    old = _set_interpret("1")
    yield
    _set_interpret(old)


TORCH = TorchOps()


def test_available_and_kernels_built_per_interpreter_mode(monkeypatch):
    assert tk.available(torch.device("cpu"))
    assert isinstance(tk._kernels().decode, InterpretedFunction)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not tk.available(torch.device("cpu"))
    assert tk.available(torch.device("cuda"))
    compiled = tk._kernels()  # decorating needs no GPU
    assert not isinstance(compiled.decode, InterpretedFunction)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(tk._kernels().decode, InterpretedFunction)


# -- paged decode attention ----------------------------------------------------------------------------------

def _gather(q: Tensor, kc: Tensor, vc: Tensor, bt: Tensor, ctx: Tensor, window: Optional[int]) -> Tensor:
    meta = AttentionMetadata(slot_mapping=torch.zeros(q.shape[0], dtype=torch.int64), num_decode=q.shape[0],
                             decode_block_tables=bt, decode_ctx_lens=ctx, block_size=kc.shape[1])
    return gather_decode_attention(q, kc, vc, meta, window)


def _decode(q: Tensor, kc: Tensor, vc: Tensor, bt: Tensor, ctx: Tensor, window: Optional[int]) -> Tensor:
    return tk.paged_decode_attention(q, kc, vc, bt, ctx, window, q.shape[-1] ** -0.5)


CASES = {  # lens, H, Hkv, D, block_size, window, extra block-table columns
    "gqa4-d16-bs16": ([1, 17, 40], 8, 2, 16, 16, None, 0),
    "mha-d64-bs8-padded": ([5, 33, 16], 4, 4, 64, 8, None, 2),
    "gqa4-window-inside-block": ([1, 6, 7, 8, 40], 8, 2, 16, 8, 7, 1),
    "gqa2-window-spans-blocks": ([3, 20, 45], 4, 2, 32, 16, 20, 0),
    "gqa4-bs12-not-pow2": ([11, 30], 8, 2, 16, 12, None, 1),
    "gqa3-padded-group": ([4, 19], 6, 2, 16, 8, 5, 0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_decode_attention_float32(name):
    lens, H, Hkv, D, bs, window, extra = CASES[name]
    q, kc, vc, bt, ctx = _case(lens, H, Hkv, D, bs, torch.float32, extra)
    out = _decode(q, kc, vc, bt, ctx, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), _naive(q, kc, vc, bt, ctx, window), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, _gather(q, kc, vc, bt, ctx, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_16bit(dtype, window):
    # fp32 accumulation in the kernel, one rounding of the output: within ~2 ulps of the exact answer on the
    # 16-bit inputs (the bf16 interpreter rounding truncates, hence 2^-7), and close to torch's 16-bit SDPA
    q, kc, vc, bt, ctx = _case([1, 17, 40], 8, 2, 64, 16, dtype, 1, seed=1)
    out = _decode(q, kc, vc, bt, ctx, window)
    assert out.dtype == dtype
    tol = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -9
    torch.testing.assert_close(out.double(), _naive(q, kc, vc, bt, ctx, window), atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), _gather(q, kc, vc, bt, ctx, window).float(), atol=2 * tol, rtol=2 * tol)


def test_decode_attention_large_logits_stay_finite():
    # scores in the hundreds: exp without the running-max subtraction would overflow float32
    q, kc, vc, bt, ctx = _case([3, 25, 40], 8, 2, 16, 8, torch.float32, seed=2)
    q *= 60
    out = _decode(q, kc, vc, bt, ctx, None)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _naive(q, kc, vc, bt, ctx, None), atol=1e-5, rtol=1e-5)


def test_decode_attention_strided_q():
    # the model hands q as a view of the qkv projection ([T, H + 2 Hkv, D], query heads first)
    _, kc, vc, bt, ctx = _case([9, 31], 4, 2, 16, 8, torch.float32, seed=3)
    qkv = torch.randn(2, 8, 16)
    q = qkv[:, :4]
    torch.testing.assert_close(_decode(q, kc, vc, bt, ctx, None).double(), _naive(q, kc, vc, bt, ctx, None),
                               atol=1e-5, rtol=1e-5)


def test_decode_attention_replays_after_in_place_metadata_updates():
    # a CUDA graph replays the launch with the same tensors: the kernel must read the new lengths and tables
    q, kc, vc, bt, ctx = _case([5, 17, 24], 8, 2, 16, 8, torch.float32, extra_cols=3, seed=4)
    first = _decode(q, kc, vc, bt, ctx, 6)
    torch.testing.assert_close(first.double(), _naive(q, kc, vc, bt, ctx, 6), atol=1e-5, rtol=1e-5)
    ptrs = (bt.data_ptr(), ctx.data_ptr())
    # one token more; a fourth block (a padding column filled); a longer context over a rewritten table
    ctx.copy_(torch.tensor([6, 31, 47]))
    bt[1, 3] = bt[0, 0]
    bt[2].copy_(torch.cat([bt[1, :3], bt[2, :3]]).flip(0))
    assert (bt.data_ptr(), ctx.data_ptr()) == ptrs
    second = _decode(q, kc, vc, bt, ctx, 6)
    torch.testing.assert_close(second.double(), _naive(q, kc, vc, bt, ctx, 6), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second, _gather(q, kc, vc, bt, ctx, 6), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(first[1:], second[1:])


def test_decode_attention_never_reads_tensors_on_host():
    # on CUDA a host read (.item(), .tolist(), int(t), a branch on a tensor) is a sync, illegal while capturing a
    # graph, and its value would be frozen into the graph (_CaptureGuard, below, fails on each)
    q, kc, vc, bt, ctx = _case([5, 17], 8, 2, 16, 8, torch.float32, extra_cols=1, seed=10)
    with _CaptureGuard():
        out = _decode(q, kc, vc, bt, ctx, 4)
    torch.testing.assert_close(out.double(), _naive(q, kc, vc, bt, ctx, 4), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("D", [8, 48, 512])
def test_decode_attention_rejects_head_dim(D):
    q, kc, vc, bt, ctx = _case([3], 2, 1, D, 4, torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        _decode(q, kc, vc, bt, ctx, None)


# -- paged prefill attention ---------------------------------------------------------------------------------

def _prefill(q: Tensor, kc: Tensor, vc: Tensor, bt: Tensor, nc: int, window: Optional[int]) -> Tensor:
    return tk.paged_prefill_attention(q, kc, vc, bt, nc, window, q.shape[-1] ** -0.5)


def _sdpa_prefill(monkeypatch, q: Tensor, kc: Tensor, vc: Tensor, bt: Tensor, nc: int, window: Optional[int],
                  start: int = 0) -> Tensor:
    """attention._prefill's SDPA path for the span q[start:start + n] (the CPU C++ kernel patched away): the gather +
    SDPA with the explicit mask for a later chunk, SDPA is_causal on the chunk's own K/V for a first one."""
    monkeypatch.setattr(attention, "cpu_kernels", lambda: None)
    n, Hkv, D = q.shape[0] - start, kc.shape[2], q.shape[2]
    fresh = lambda c: c[bt].reshape(-1, Hkv, D)[nc:nc + n]  # the chunk's K/V as write_kv wrote them  # noqa: E731
    pad = lambda t: torch.cat([t.new_zeros(start, *t.shape[1:]), t])  # noqa: E731
    span = PrefillSpan(start=start, end=start + n, num_computed=nc, block_table=bt)
    return attention._prefill(q, pad(fresh(kc)), pad(fresh(vc)), kc, vc, span, window, q.shape[1] // Hkv)


PREFILL_CASES = {  # num_computed, n, H, Hkv, D, block_size, window, tiles (BLOCK_M, BLOCK_N; None: _prefill_config's)
    "first-chunk-mha-d16": (0, 37, 4, 4, 16, 16, None, None),
    "later-chunk-gqa4-d64-bs8": (21, 37, 8, 2, 64, 8, None, None),
    "one-row-gqa4": (45, 1, 8, 2, 16, 16, None, None),
    "five-rows-gqa4-window-bs8": (13, 5, 4, 1, 16, 8, 7, None),
    "window-spans-blocks-16-tiles": (21, 37, 8, 2, 16, 8, 20, (16, 16)),
    "first-chunk-window-under-chunk": (0, 37, 4, 1, 16, 16, 5, (16, 16)),
    "bs12-not-pow2-16-tiles": (50, 70, 4, 2, 32, 12, None, (16, 16)),
    "bs32-key-tiles-inside-a-block": (40, 30, 4, 2, 16, 32, 25, (16, 16)),
    "query-tiles-over-blocks-window": (9, 70, 2, 1, 16, 16, 19, (16, 32)),
}


def _tiles(monkeypatch, tiles: Optional[tuple[int, int]]) -> None:
    # small tiles: several query tiles and key tiles (fully masked for some rows) at an interpreter-sized cost
    if tiles is not None:
        monkeypatch.setattr(tk, "_prefill_config", lambda n, D, dtype, *cap: (*tiles, 4))


@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_prefill_attention_float32(monkeypatch, name):
    nc, n, H, Hkv, D, bs, window, tiles = PREFILL_CASES[name]
    q, kc, vc, bt = _prefill_case(nc, n, H, Hkv, D, bs, torch.float32, extra=1, seed=20)
    _tiles(monkeypatch, tiles)
    out = _prefill(q, kc, vc, bt, nc, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), _naive_prefill(q, kc, vc, bt, nc, window), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, _sdpa_prefill(monkeypatch, q, kc, vc, bt, nc, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_attention_16bit(monkeypatch, dtype, window):
    # fp32 scores and accumulator; P rounded to the dtype for the second matmul (as on the tensor cores) and the
    # output once: a few 16-bit ulps of the exact answer (bf16 truncated in the interpreter), and of torch's SDPA.
    # n = 70 takes the 128-row tile; with 16 x 16 tiles several query and key tiles
    q, kc, vc, bt = _prefill_case(29, 70, 8, 2, 64, 16, dtype, seed=21)
    ref = _naive_prefill(q, kc, vc, bt, 29, window)
    tol = 2 ** -6 if dtype == torch.bfloat16 else 2 ** -8
    for tiles in (None, (16, 16)):
        _tiles(monkeypatch, tiles)
        out = _prefill(q, kc, vc, bt, 29, window)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), _sdpa_prefill(monkeypatch, q, kc, vc, bt, 29, window).float(),
                               atol=2 * tol, rtol=2 * tol)


@pytest.mark.parametrize("window", [None, 7])
def test_prefill_attention_every_tile_alignment(monkeypatch, window):
    # num_computed 0..15 against 16 x 16 tiles (two query tiles of a 21-row chunk): every offset of the diagonal,
    # the window's lower edge and the context's end within a key tile, where an off-by-one in the tile bounds or
    # in which tiles skip the mask would show
    _tiles(monkeypatch, (16, 16))
    for nc in range(16):
        q, kc, vc, bt = _prefill_case(nc, 21, 2, 1, 16, 8, torch.float32, seed=30 + nc)
        torch.testing.assert_close(_prefill(q, kc, vc, bt, nc, window).double(),
                                   _naive_prefill(q, kc, vc, bt, nc, window), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"num_computed={nc}: {m}")


def test_prefill_attention_large_logits_stay_finite(monkeypatch):
    # scores in the hundreds, the running max rising from key tile to key tile: the rescale of the accumulator and
    # the sum by exp(m_old - m_new) must happen, and exp without the max subtracted would overflow
    q, kc, vc, bt = _prefill_case(40, 20, 4, 2, 16, 8, torch.float32, seed=22)
    kc *= torch.linspace(1, 3, kc.shape[0] * kc.shape[1]).view(kc.shape[0], kc.shape[1], 1, 1)
    q *= 30
    _tiles(monkeypatch, (16, 16))
    out = _prefill(q, kc, vc, bt, 40, None)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _naive_prefill(q, kc, vc, bt, 40, None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("nc, window", [(0, None), (0, 6), (19, None), (19, 6)])
def test_prefill_attention_strided_q_in_a_batch(monkeypatch, nc, window):
    # the engine hands q as a view of the qkv projection ([T, H + 2 Hkv, D], query heads first) and the chunk at
    # rows start..end of the flat batch; _prefill slices it and the kernel reads it through its strides
    _, kc, vc, bt = _prefill_case(nc, 23, 4, 2, 16, 8, torch.float32, seed=23)
    qkv = torch.randn(3 + 23, 8, 16, generator=torch.Generator().manual_seed(24))
    q = qkv[:, :4]
    assert not q.is_contiguous()
    out = _prefill(q[3:], kc, vc, bt, nc, window)
    torch.testing.assert_close(out.double(), _naive_prefill(q[3:], kc, vc, bt, nc, window), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, _sdpa_prefill(monkeypatch, q, kc, vc, bt, nc, window, start=3),
                               atol=1e-5, rtol=1e-5)


def test_both_kernels_write_a_given_output_buffer_in_place_and_check_it(monkeypatch):
    """``out`` (the piecewise graphs' attention buffer): the kernels write the caller's rows through their strides,
    touch nothing else of the buffer, return that very tensor, and refuse a buffer of another shape or dtype."""
    q, kc, vc, bt, ctx = _case([3, 20], 4, 2, 16, 8, torch.float32, 1, seed=3)
    buf = torch.full((5, 4, 16), 7.0)
    got = tk.paged_decode_attention(q, kc, vc, bt, ctx, None, 0.25, out=buf[1:3])
    assert got.data_ptr() == buf[1:3].data_ptr()
    assert torch.equal(buf[1:3], tk.paged_decode_attention(q, kc, vc, bt, ctx, None, 0.25))
    assert (buf[0] == 7).all() and (buf[3:] == 7).all()
    pq, pkc, pvc, pbt = _prefill_case(5, 6, 4, 2, 16, 8, torch.float32, seed=4)
    _tiles(monkeypatch, (16, 16))
    pbuf = torch.full((8, 4, 16), 7.0)
    got = tk.paged_prefill_attention(pq, pkc, pvc, pbt, 5, None, 0.25, out=pbuf[2:])
    assert got.data_ptr() == pbuf[2:].data_ptr() and (pbuf[:2] == 7).all()
    assert torch.equal(pbuf[2:], tk.paged_prefill_attention(pq, pkc, pvc, pbt, 5, None, 0.25))
    with pytest.raises(ValueError, match=r"out \(2, 4, 16\) torch.bfloat16"):
        tk.paged_decode_attention(q, kc, vc, bt, ctx, None, 0.25, out=buf[:2].bfloat16())
    with pytest.raises(ValueError, match=r"is not \(6, 4, 16\)"):
        tk.paged_prefill_attention(pq, pkc, pvc, pbt, 5, None, 0.25, out=pbuf[:5])


@pytest.mark.parametrize("D", [8, 48, 512])
def test_prefill_attention_rejects_head_dim(D):
    q, kc, vc, bt = _prefill_case(2, 3, 2, 1, D, 4, torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        _prefill(q, kc, vc, bt, 2, None)


def test_prefill_attention_edges():
    q, kc, vc, bt = _prefill_case(5, 4, 2, 1, 16, 4, torch.float32)
    assert _prefill(q[:0], kc, vc, bt, 5, None).shape == (0, 2, 16)
    with pytest.raises(ValueError, match="does not cover"):  # 3 blocks of 4 for 9 tokens
        _prefill(q, kc, vc, bt[:2], 5, None)
    with pytest.raises(ValueError, match="dtype"):
        _prefill(q.double(), kc, vc, bt, 5, None)
    # a window as long as the context is no window
    torch.testing.assert_close(_prefill(q, kc, vc, bt, 5, 9), _prefill(q, kc, vc, bt, 5, None), atol=0, rtol=0)


# -- RMSNorm, silu * mul, RoPE -------------------------------------------------------------------------------

def _ulps_off(a: Tensor, b: Tensor) -> Tensor:
    """|a - b| in units of the spacing of b's 16-bit dtype at b."""
    fi = torch.finfo(b.dtype)
    mag = b.double().abs().clamp_min(fi.smallest_normal)
    return (a.double() - b.double()).abs() / (torch.exp2(torch.floor(torch.log2(mag))) * fi.eps)


def test_rms_norm_float32():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 2 * 40, generator=g)[:, :40] * 3  # rows strided; h not a power of 2
    w = torch.randn(40, generator=g)
    y = tk.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y, TORCH.rms_norm(x, w, 1e-6), atol=1e-6, rtol=1e-6)
    x64 = x.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(y.double(), ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_16bit(dtype):
    # the normalised value rounded to the dtype, then scaled in it (twice rounded, like TorchOps): float16 at most
    # one ulp off (where the reduction order tips the first rounding), almost always exact
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(6, 96, generator=g) * 2).to(dtype)
    w = (1 + 0.3 * torch.randn(96, generator=g)).to(dtype)
    y, ref = tk.rms_norm(x, w, 1e-5), TORCH.rms_norm(x, w, 1e-5)
    assert y.dtype == dtype
    off = _ulps_off(y, ref)
    if dtype == torch.float16:
        assert off.max() <= 1 and (y == ref).float().mean() > 0.97
    else:
        assert off.max() <= 3


@pytest.mark.parametrize("inter", [24, 1500])
def test_silu_mul(inter):
    g = torch.Generator().manual_seed(7)
    gu = torch.randn(3, 2 * inter, generator=g) * 3
    torch.testing.assert_close(tk.silu_mul(gu), TORCH.silu_mul(gu, inter), atol=1e-6, rtol=1e-6)
    h16 = gu.half()
    y = tk.silu_mul(h16)
    ref = TORCH.silu_mul(h16, inter)
    # silu rounded to float16 before the product, as torch does: exact but where numpy's exp and torch's differ
    # in float32's last bit and tip that rounding (then <= 2 ulps of the product)
    assert y.shape == (3, inter) and _ulps_off(y, ref).max() <= 2 and (y == ref).float().mean() > 0.99
    b16 = gu.bfloat16()
    assert _ulps_off(tk.silu_mul(b16), TORCH.silu_mul(b16, inter)).max() <= 3


def _rope_inputs(T: int, total: int, D: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(T, total, D, generator=g).to(dtype)
    ang = torch.arange(T)[:, None] * (10000.0 ** (-torch.arange(D // 2) / (D // 2)))[None, :] + 0.3
    return qkv, ang.cos().to(dtype)[:, None, :], ang.sin().to(dtype)[:, None, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D,total,heads", [(16, 7, 5), (40, 7, 5), (256, 24, 19)])
def test_rope_in_place(dtype, D, total, heads):
    # 3 query + 2 KV heads rotated, the 2 V heads left alone; at head_dim 256 a program takes 8 heads (_rope_config),
    # so 19 of 24 are three programs a token, the last one with 3 heads
    assert tk._rope_config(heads, D // 2)[0] < heads or D < 256
    qkv, cos, sin = _rope_inputs(5, total, D, dtype)
    before = qkv.clone()
    out = tk.rope_(qkv, cos, sin, heads)
    assert out is qkv
    assert torch.equal(qkv[:, heads:], before[:, heads:])
    ref = apply_rope(before[:, :heads], cos, sin)
    torch.testing.assert_close(TORCH.rope(before, cos, sin, heads), ref, atol=0, rtol=0)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(qkv[:, :heads].float(), ref.float(), atol=2 ** -6, rtol=2 ** -6)
    else:  # the same roundings as torch's products and sums: bit for bit
        assert torch.equal(qkv[:, :heads], ref)


def test_triton_ops_matches_torch_ops(monkeypatch):
    # TritonOps' plumbing (it takes the kernels on CUDA only; made to take them here)
    ops = TritonOps()
    monkeypatch.setattr(TritonOps, "_runs_on", lambda self, t: True)
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(4, 32, generator=g), torch.randn(32, generator=g)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), TORCH.rms_norm(x, w, 1e-6), atol=1e-6, rtol=1e-6)
    gu = torch.randn(4, 2 * 48, generator=g)
    torch.testing.assert_close(ops.silu_mul(gu, 48), TORCH.silu_mul(gu, 48), atol=1e-6, rtol=1e-6)
    qkv, cos, sin = _rope_inputs(4, 8, 16, torch.float32)
    ref = TORCH.rope(qkv.clone(), cos, sin, 6)
    out = ops.rope(qkv, cos, sin, 6)
    assert out is qkv and torch.equal(out[:, :6], ref)  # the model slices q and k out of what rope returns


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_an_fp8_cache(qdtype):
    """kv_cache_dtype="fp8": the kernel widens each float8 e4m3 value as it loads it, so it computes what the
    float64 reference computes over the widened cache (and the engine's gather path over the same cache)."""
    q, kc, vc, bt, ctx = _case([1, 17, 40], 8, 2, 64, 16, torch.float32, extra_cols=1, seed=21)
    kc8, vc8 = kc.clamp(-448, 448).to(torch.float8_e4m3fn), vc.clamp(-448, 448).to(torch.float8_e4m3fn)
    q = q.to(qdtype)
    out = _decode(q, kc8, vc8, bt, ctx, None)
    assert out.dtype == qdtype
    tol = 1e-5 if qdtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), _naive(q.float(), kc8.float(), vc8.float(), bt, ctx, None),
                               atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), _gather(q, kc8, vc8, bt, ctx, None).float(), atol=2 * tol, rtol=2 * tol)


# -- the GPU path composed: a whole engine on the kernels, eager and through the static decode buffers ---------

FORBIDDEN_IN_A_GRAPH = {
    # a host read of a tensor value (.item(), .tolist(), int(t), a branch on a tensor): a sync, illegal while
    # capturing, and its value would be frozen into the graph
    torch.ops.aten._local_scalar_dense.default: "a host read of a tensor value",
    torch.ops.aten.item.default: "a host read of a tensor value (.item() under inference_mode)",
    # ops whose output size depends on the data: they sync to learn it
    torch.ops.aten.nonzero.default: "nonzero (a data-dependent size)",
    torch.ops.aten.masked_select.default: "masked_select (a data-dependent size)",
    torch.ops.aten._unique2.default: "unique (a data-dependent size)",
    torch.ops.aten.repeat_interleave.Tensor: "repeat_interleave by a tensor (a data-dependent size)",
    # torch.tensor(python data) inside the step: a host-to-device copy from pageable memory, refused while capturing
    torch.ops.aten.lift_fresh.default: "a tensor made from host data",
}


class _CaptureGuard(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on every op a CUDA graph cannot capture (FORBIDDEN_IN_A_GRAPH, indexing by a bool mask, and
    ``Tensor.tolist``, which reads the values without dispatching an op); counts the ops it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __enter__(self):
        self._tolist = torch.Tensor.tolist

        def tolist(t):
            raise AssertionError("Tensor.tolist: a host read of tensor values")
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        assert func not in FORBIDDEN_IN_A_GRAPH, FORBIDDEN_IN_A_GRAPH.get(func)
        if func is torch.ops.aten.index.Tensor:
            assert all(i is None or i.dtype != torch.bool for i in args[1]), "indexing by a bool mask (nonzero)"
        return func(*args, **(kwargs or {}))


GPU_PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
               "def fibonacci(n):\n    if n < 2:"]


def _gpu_path_outputs(llm, short: bool = False) -> list:
    """Greedy tokens and logprobs of GPU_PROMPTS (``short``: the two sharing a prefix, 4 tokens: the
    interpreter's bfloat16 is slow)."""
    prompts = [GPU_PROMPTS[0], GPU_PROMPTS[3]] if short else GPU_PROMPTS
    params = [SamplingParams(max_tokens=4 if short else 6, temperature=0.0, logprobs=1) for _ in prompts]
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in llm.generate(prompts, params)]


@pytest.fixture
def gpu_path(monkeypatch):
    """From here on the engines this test builds run on CPU the code a CUDA engine runs: pdserve's CPU kernels off
    (dense torch GEMMs), TritonOps for the norms, RoPE and silu * mul, the Triton paged decode and prefill
    attention, all through the interpreter. Returns the calls each kernel got."""
    from engine import kernels

    monkeypatch.setattr(attention, "TRITON_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setitem(kernels._state, "mod", None)
    calls: dict[str, int] = {}
    for name in ("paged_decode_attention", "paged_prefill_attention", "rms_norm", "rope_", "silu_mul", "matmul"):
        def counted(*a, _f=getattr(tk, name), _n=name, **kw):
            calls[_n] = calls.get(_n, 0) + 1
            return _f(*a, **kw)
        monkeypatch.setattr(tk, name, counted)
    return calls


@pytest.mark.parametrize("dtype,kv", [("float32", None), ("float32", "fp8"), ("bfloat16", None)])
def test_the_gpu_path_composed_on_cpu_gives_the_torch_tokens_and_its_static_decode_step_is_capturable(
        dtype, kv, monkeypatch, request):
    """What the GPU session would otherwise find first: the kernels wired into the model (TritonOps installed by
    ``finalize``, the attention dispatch), chunked prefill and prefix hits through the paged prefill kernel, and a
    static decode step (what ``DecodeGraphs`` captures) that holds no op a CUDA graph refuses. With an fp8 cache
    the decode kernel widens it as it loads; later prefill chunks gather it for SDPA (no fp8 prefill kernel).
    bfloat16: the static path gives the eager GPU path's tokens; not compared with the CPU path, since the
    interpreter truncates where a GPU rounds (the module docstring), which moves near-ties (4 of 32 tokens here)."""
    from engine import LLM

    kw = dict(cpu_gemm="torch", max_num_seqs=4, block_size=8, max_num_batched_tokens=16, enable_prefix_caching=True,
              kv_cache_dtype=kv or "auto", dtype=dtype)
    # pdserve's CPU path (its kernels where built); bfloat16 is not compared with it (the docstring says why)
    ref = _gpu_path_outputs(LLM("tiny", **kw)) if dtype == "float32" else None
    calls = request.getfixturevalue("gpu_path")
    eager_llm = LLM("tiny", **kw)
    assert isinstance(eager_llm.llm_engine.runner.model.layers[0].ops, TritonOps)
    eager = _gpu_path_outputs(eager_llm, short=dtype != "float32")
    # every kernel ran; a 16-token step budget splits the prompts, so later chunks read the cache in place
    kernels = {"paged_decode_attention", "paged_prefill_attention", "rms_norm", "rope_", "silu_mul"}
    assert set(calls) == (kernels - {"paged_prefill_attention"} if kv else kernels), calls
    # (one piecewise bucket: the interpreter warms up every bucket's pieces at start)
    static_llm = LLM("tiny", static_decode_buffers=True, cuda_graph_token_sizes=[16], **kw)
    static = _gpu_path_outputs(static_llm, short=dtype != "float32")
    graphs = static_llm.llm_engine.runner.graphs
    assert graphs.replays > 0
    tol = 1e-4 if dtype == "float32" else 5e-2
    for i, (b, c) in enumerate(zip(eager, static, strict=True)):
        assert b[0] == c[0]
        # torch's GEMMs are not batch-invariant (a padded bucket is another batch shape)
        torch.testing.assert_close(torch.tensor(c[1]), torch.tensor(b[1]), atol=tol, rtol=0)
        if ref is not None:
            assert ref[i][0] == b[0]
            torch.testing.assert_close(torch.tensor(b[1]), torch.tensor(ref[i][1]), atol=1e-4, rtol=0)
    guard = _CaptureGuard()
    before = calls["paged_decode_attention"]
    with guard:
        graphs._forward(graphs.bucket_for(3))
    assert guard.ops > 50 and calls["paged_decode_attention"] == before + 4  # one launch per layer
    # the steps with a prefill chunk went through the piecewise graphs' static buffers, and each piece (what
    # PiecewiseGraphs captures: a layer's MLP, the next one's norm, projection and RoPE) holds nothing a graph refuses
    pw = static_llm.llm_engine.runner.piecewise
    assert pw.replays > 0 and pw.sizes == [16]
    norms = calls["rms_norm"]
    with _CaptureGuard() as guard:
        for i in range(len(static_llm.llm_engine.runner.model.layers)):
            pw._piece(i, 16)
    assert guard.ops > 40 and calls["rms_norm"] == norms + 7  # two norms a layer but the first's post-attention


# -- batch invariance (EngineConfig.batch_invariant) -------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_is_a_gemm_and_gives_a_row_the_same_bits_in_any_batch(dtype):
    g = torch.Generator().manual_seed(12)
    x = torch.randn(100, 200, generator=g).to(dtype)
    w = torch.randn(200, 130, generator=g).to(dtype)
    b = torch.randn(130, generator=g).to(dtype)
    y = tk.matmul(x, w, b)
    assert y.shape == (100, 130) and y.dtype == dtype
    ref = x.double() @ w.double() + b.double()
    tol = 1e-4 if dtype == torch.float32 else 2 ** -6 * ref.abs().max().item()  # bf16: the output's rounding
    torch.testing.assert_close(y.double(), ref, atol=tol, rtol=0)
    for m in (1, 3, 64, 65):  # other batch sizes, other tile splits: the shared rows to the bit
        assert torch.equal(tk.matmul(x[:m].contiguous(), w, b), y[:m])
    assert torch.equal(tk.matmul(x[37:90], w, b), y[37:90])  # a row in another place of its tile
    assert torch.equal(tk.matmul(x.t().contiguous().t(), w, b), y)  # any strides
    assert torch.equal(tk.matmul(x, w), tk.matmul(x, w, None))
    with pytest.raises(ValueError, match="matmul"):
        tk.matmul(x, w[:50])


def _invariant_outputs(llm, prompts, one_by_one: bool = False) -> list:
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2)
    outs = [o for p in prompts for o in llm.generate([p], params)] if one_by_one else llm.generate(prompts, params)
    return [(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs]) for o in outs]


def test_batch_invariant_gpu_path_gives_a_request_the_same_bits_alone_batched_and_padded(monkeypatch, request):
    """EngineConfig.batch_invariant on the GPU path (kernels through the interpreter), float32: each prompt alone,
    then all of them in one batch, then through the static decode and piecewise buckets (padding rows): the same
    tokens, and logprobs and alternatives to the bit. Chunked (a 16-token step budget, chunks beside decodes): the same tokens,
    logprobs within 1e-6, not to the bit: the interpreter's tl.dot is numpy's matmul, whose rounding of a row
    depends on its place in the query tile, which chunking moves; a GPU's MMA rounds a row the same in any place,
    which tests/engine/test_batch_invariant_cuda.py demands to the bit."""
    from engine import LLM

    calls = request.getfixturevalue("gpu_path")
    # the GEMM's own invariance is the test above; here (the interpreter runs it ~100x slower than the rest of the
    # step) a stand-in with the same property, each row its own product, checks that every linear goes through it
    def rowwise(x, w, b=None):
        calls["matmul"] = calls.get("matmul", 0) + 1
        return torch.cat([r @ w if b is None else torch.addmm(b, r, w) for r in x.split(1)])

    monkeypatch.setattr(tk, "matmul", rowwise)
    kw = dict(cpu_gemm="torch", max_num_seqs=4, block_size=8, enable_prefix_caching=False, batch_invariant=True)
    prompts = GPU_PROMPTS[:3]
    llm = LLM("tiny", **kw)
    alone = _invariant_outputs(llm, prompts, one_by_one=True)
    # every step sampled here, so each ran all 17 linears (4 a layer, the LM head) through the GEMM, and every
    # prompt's one chunk went through the paged prefill kernel (not SDPA, as it would without the flag)
    assert calls["matmul"] == 17 * llm.llm_engine._num_steps and calls.get("paged_prefill_attention", 0) > 0
    batched = _invariant_outputs(LLM("tiny", **kw), prompts)
    # (the prompts' prefill step padded in the piecewise graphs' 64-token bucket, decodes in the decode buckets; small
    # buckets: the interpreter would take minutes to warm up the default ones, up to 512 tokens)
    static = LLM("tiny", static_decode_buffers=True, cuda_graph_token_sizes=[8, 64], **kw)
    padded = _invariant_outputs(static, prompts)
    assert alone == batched == padded
    assert static.llm_engine.piecewise_steps > 0 and static.llm_engine.graph_steps > 0
    chunked = _invariant_outputs(LLM("tiny", max_num_batched_tokens=16, **kw), prompts)
    for a, c in zip(alone, chunked, strict=True):
        assert a[0] == c[0]
        for (lp_a, top_a), (lp_c, top_c) in zip(a[1], c[1], strict=True):
            assert abs(lp_a - lp_c) <= 1e-6 and [t for t, _ in top_a] == [t for t, _ in top_c]


def test_batch_invariant_prefill_tiles_do_not_depend_on_the_chunk_and_bad_combinations_are_refused(monkeypatch):
    from cluster.cli import build_parser
    from cluster.up_flags import engine_overrides
    from engine import EngineConfig

    seen = []
    real = tk._prefill_config
    monkeypatch.setattr(tk, "_prefill_config", lambda n, *a: seen.append(real(n, *a)) or real(n, *a))
    for n in (5, 40, 300):
        q, kc, vc, bt = _prefill_case(0, n, 4, 2, 64, 16, torch.bfloat16)[:4]
        tk.paged_prefill_attention(q, kc, vc, bt, 0, None, 0.125, invariant=True)
        tk.paged_prefill_attention(q, kc, vc, bt, 0, None, 0.125)
    assert seen[0] == seen[2] == seen[4] and seen[1] != seen[5]  # invariant: one tile shape; otherwise by length
    for bad in ({"quantization": "fp8"}, {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "int8"}):
        with pytest.raises(ValueError, match="batch_invariant covers float weights"):
            EngineConfig(device="cuda", batch_invariant=True, **bad)
    EngineConfig(device="cpu", batch_invariant=True, kv_cache_dtype="int8")  # CPU: the kernels already are
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        EngineConfig(batch_invariant=1)
    assert engine_overrides(build_parser().parse_args(["up", "--batch-invariant"])) == {"batch_invariant": True}
    from cluster.up_checks import check_up_args

    with pytest.raises(ValueError, match="--batch-invariant covers float weights"):  # at `pdserve up`, not in a worker
        check_up_args(build_parser().parse_args(["up", "--device", "cuda", "--batch-invariant", "--kv-cache-dtype",
                                                 "int8"]))


@pytest.mark.parametrize("dtype, cache, invariant, want_prefill", [
    (torch.bfloat16, torch.bfloat16, False, 2),  # chunks of <= 64 rows and of more take two tile configs
    (torch.bfloat16, torch.bfloat16, True, 1),   # batch-invariant: one tile config for any chunk
    (torch.float32, torch.float32, False, 1),    # float32: one config
    (torch.bfloat16, torch.float8_e4m3fn, False, 0),  # an fp8 cache prefills through gather + SDPA
])
def test_warm_up_launches_every_kernel_variant_a_step_can_take(monkeypatch, dtype, cache, invariant, want_prefill):
    """triton_kernels.warm_up (run by a CUDA engine at start): the prefill kernel once per tile config a chunk of
    1..max_tokens rows can take, and the decode kernel, so no request's step waits for a Triton compile (the
    H200 verdict runs of 1 Dec queued prompts behind compiles at 4 req/s)."""
    cpu = torch.device("cpu")
    seen = []
    real_prefill, real_decode = tk.paged_prefill_attention, tk.paged_decode_attention

    def prefill(q, *a, **kw):
        seen.append(tk._prefill_config(1 << 20 if kw.get("invariant") else q.shape[0], 16, dtype, tk._capability(cpu)))
        return real_prefill(q, *a, **kw)

    decodes = []
    monkeypatch.setattr(tk, "paged_prefill_attention", prefill)
    monkeypatch.setattr(tk, "paged_decode_attention", lambda *a, **kw: decodes.append(1) or real_decode(*a, **kw))
    n = tk.warm_up(cpu, dtype, cache, 4, 2, 16, 8, max_tokens=80, invariant=invariant)
    want = {tk._prefill_config(1 << 20 if invariant else m, 16, dtype, tk._capability(cpu)) for m in range(1, 81)}
    assert len(seen) == want_prefill and (set(seen) == want if want_prefill else not seen)
    assert decodes == [1] and n == want_prefill + 1


def test_an_engine_warms_its_attention_kernels_up_at_its_own_shape(monkeypatch):
    """LLMEngine._warm_up_kernels (a CUDA engine runs it before capturing its graphs): triton_kernels.warm_up with
    the model's heads, head_dim, block size, dtypes, step budget and batch invariance; nothing where the kernels
    cannot run (PDSERVE_TRITON_KERNELS=0 here)."""
    from engine import LLM

    calls = []
    monkeypatch.setattr(tk, "warm_up", lambda *a, **kw: calls.append((a, kw)) or 0)
    eng = LLM("tiny", max_num_batched_tokens=32, batch_invariant=False).llm_engine
    mc, cfg = eng.model_config, eng.config
    eng._warm_up_kernels(cfg, mc, cfg.cache_dtype)
    assert calls == [((torch.device("cpu"), cfg.torch_dtype, cfg.cache_dtype, mc.num_attention_heads,
                       mc.num_key_value_heads, mc.head_dim, eng.block_size, 32), {"invariant": False})]
    monkeypatch.setenv("PDSERVE_TRITON_KERNELS", "0")
    eng._warm_up_kernels(cfg, mc, cfg.cache_dtype)
    assert len(calls) == 1
