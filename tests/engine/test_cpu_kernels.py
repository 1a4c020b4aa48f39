"""pdserve's CPU kernels (engine/csrc) and quantization formats (engine/quant.py) against plain torch.

The kernels must be built here (``scripts/setup`` builds them); a machine where they cannot be built
runs the suite with ``PDSERVE_CPU_KERNELS=0``, which skips the kernel comparisons below and exercises
the torch fallbacks everywhere else.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, gather_decode_attention
from engine.kernels import cpu_isa_flags, cpu_kernels
from engine.onednn_layout import onednn_panels
from engine.quant import (dequantize_int4, dequantize_int8, dequantize_kv, fake_quantize_act, from_panels_int4,
                          from_panels_int8, from_panels_w4a8, from_panels_w8a8, int4_levels, quantize_act,
                          quantize_int4, quantize_int8, quantize_kv, step_order, to_panels_int4, to_panels_int8,
                          to_panels_w4a8, to_panels_w8a8)

DISABLED = os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0"


@pytest.fixture(scope="module")
def kern():
    if DISABLED:
        pytest.skip("PDSERVE_CPU_KERNELS=0")
    k = cpu_kernels()
    assert k is not None, "pdserve's CPU kernels did not build (see the warning logged by engine.kernels)"
    return k


# ---- formats ------------------------------------------------------------------------------------------
def test_int8_weight_round_trip_is_within_half_a_step_per_channel():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 96, generator=g) * torch.logspace(-3, 1, 37)[:, None]  # channels of very different size
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (37,)
    assert torch.equal(q.abs().amax(dim=1), torch.full((37,), 127, dtype=torch.int8))  # each channel uses the range
    err = (dequantize_int8(q, s) - w).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-5)).all()


def test_int4_round_trip_bound_and_the_largest_value_is_exact():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 256, generator=g)
    for group in (32, 64, 128):
        packed, d = quantize_int4(w, group)
        assert packed.shape == (6, 128) and packed.dtype == torch.uint8 and d.shape == (6, 256 // group)
        back = dequantize_int4(packed, d, group)
        err = (back - w).view(6, -1, group).abs()
        assert (err <= d.abs()[..., None] * (1 + 1e-5)).all()
        assert err.mean() < 0.3 * d.abs().mean()  # round to nearest: the mean error is about |d|/4
        grp = w.view(6, -1, group)
        idx = grp.abs().argmax(dim=2, keepdim=True)
        assert torch.allclose(back.view(6, -1, group).gather(2, idx), grp.gather(2, idx), rtol=1e-6)


def test_int4_nibble_layout_is_the_documented_one():
    # one row of 32 known levels: value k (0..31) is level (k % 16) - 8, group max -8 -> d = 1
    levels = torch.tensor([(k % 16) - 8 for k in range(32)], dtype=torch.float32)
    w = levels[None, :].clone()
    packed, d = quantize_int4(w, 32)
    assert d.item() == 1.0
    # byte j: low nibble = value j + 8, high nibble = value j + 16 + 8
    expect = [((j % 16)) | (((j + 16) % 16) << 4) for j in range(16)]
    assert packed[0].tolist() == expect


def test_int8_kv_rows_carry_their_scale_and_round_trip():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, 64, generator=g) * torch.tensor([0.01, 1.0, 30.0])[None, :, None]
    q = quantize_kv(x)
    assert q.dtype == torch.int8 and q.shape == (5, 3, 68)
    s = q[..., 64:].contiguous().view(torch.float32)
    assert torch.allclose(s[..., 0], x.abs().amax(dim=-1) / 127)
    assert ((dequantize_kv(q) - x).abs() <= s / 2 * (1 + 1e-5)).all()


# ---- linear kernels -------------------------------------------------------------------------------------
@pytest.mark.parametrize("K", [256, 272])  # 272: a 16-value tail after the 32-value steps (fp32, int8)
@pytest.mark.parametrize("M", [1, 3, 4, 5, 8, 33])
def test_linear_kernels_match_torch_on_the_dequantized_weight(kern, M, K):
    g = torch.Generator().manual_seed(M)
    N = 70  # not a multiple of the 4-row tile
    w = torch.randn(N, K, generator=g)
    x = torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g)
    for bias in (None, b):
        torch.testing.assert_close(kern.linear_fp32(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
        q, s = quantize_int8(w)
        torch.testing.assert_close(kern.linear_int8(x, q, s, bias), F.linear(x, dequantize_int8(q, s), bias),
                                   rtol=1e-5, atol=1e-4)
        for group in (32, 128) if K % 128 == 0 else ():  # int4 runs are 32 values, groups divide K
            p, d = quantize_int4(w, group)
            torch.testing.assert_close(kern.linear_int4(x, p, d, group, bias),
                                       F.linear(x, dequantize_int4(p, d, group), bias), rtol=1e-5, atol=1e-4)


def test_linear_kernels_refuse_bad_shapes_with_a_message(kern):
    w = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match="x must be"):
        kern.linear_fp32(torch.randn(2, 32), w, None)
    p, d = quantize_int4(w, 32)
    with pytest.raises(RuntimeError, match="group"):
        kern.linear_int4(torch.randn(2, 64), p, d, 48, None)


# ---- fp32 on oneDNN's packed panels ---------------------------------------------------------------------
def _panels(w: torch.Tensor, B: int) -> torch.Tensor:
    """The panel layout written out independently of oneDNN: p[n // B][k][n % B] = w[n, k], zero padding."""
    N, K = w.shape
    NP = -(-N // B)
    pad = torch.zeros(NP * B, K)
    pad[:N] = w
    return pad.view(NP, B, K).transpose(1, 2).contiguous()


@pytest.mark.parametrize("B", [16, 48, 64])  # 48: panels narrower than the 64-wide AVX-512 tile
@pytest.mark.parametrize("N,K", [(70, 48), (64, 256), (200, 272)])
def test_panel_kernel_matches_float64_and_a_row_does_not_depend_on_its_batch(kern, B, N, K):
    g = torch.Generator().manual_seed(N + K + B)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    p = _panels(w, B)
    x = torch.randn(64, K, generator=g)
    for bias in (None, b):
        ref = F.linear(x.double(), w.double(), None if bias is None else bias.double()).float()
        alone = torch.cat([kern.linear_panel(x[i:i + 1].contiguous(), p, N, bias) for i in range(64)])
        torch.testing.assert_close(alone, ref, rtol=1e-5, atol=1e-4)
        for M in (2, 3, 6, 7, 13, 64):  # every row tile size and remainder of both builds
            assert torch.equal(kern.linear_panel(x[:M].contiguous(), p, N, bias), alone[:M])


@pytest.mark.parametrize("N,K", [(70, 48), (200, 272)])
def test_int8_panel_kernel_matches_torch_and_a_row_does_not_depend_on_its_batch(kern, N, K):
    g = torch.Generator().manual_seed(N * K)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    q, s = quantize_int8(w)
    p, ps = to_panels_int8(q, s)
    assert p.shape == (-(-N // 64), K, 64) and torch.equal(from_panels_int8(p, ps, N), dequantize_int8(q, s))
    x = torch.randn(13, K, generator=g)
    for bias in (None, b):
        got = kern.linear_int8_panels(x, p, ps, N, bias)
        torch.testing.assert_close(got, F.linear(x, dequantize_int8(q, s), bias), rtol=1e-5, atol=1e-4)
        alone = torch.cat([kern.linear_int8_panels(x[i:i + 1].contiguous(), p, ps, N, bias) for i in range(13)])
        assert torch.equal(alone, got)
        for M in (2, 3, 6, 7):
            assert torch.equal(kern.linear_int8_panels(x[:M].contiguous(), p, ps, N, bias), got[:M])


@pytest.mark.parametrize("group", [32, 96])  # 96: a group that is not a power of two
def test_int4_panel_kernel_matches_torch_and_a_row_does_not_depend_on_its_batch(kern, group):
    N, K = 90, 288
    g = torch.Generator().manual_seed(group)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    p4, d4 = quantize_int4(w, group)
    p, ps = to_panels_int4(p4, d4, group)
    assert p.shape == (2, K, 32) and ps.shape == (2, K // group, 64)
    assert torch.equal(from_panels_int4(p, ps, N, group), dequantize_int4(p4, d4, group))
    x = torch.randn(13, K, generator=g)
    for bias in (None, b):
        got = kern.linear_int4_panels(x, p, ps, N, group, bias)
        torch.testing.assert_close(got, F.linear(x, dequantize_int4(p4, d4, group), bias), rtol=1e-5, atol=1e-4)
        alone = torch.cat([kern.linear_int4_panels(x[i:i + 1].contiguous(), p, ps, N, group, bias) for i in range(13)])
        assert torch.equal(alone, got)
        for M in (2, 3, 6, 7):
            assert torch.equal(kern.linear_int4_panels(x[:M].contiguous(), p, ps, N, group, bias), got[:M])


def test_panel_kernel_refuses_panels_that_do_not_cover_n(kern):
    p = _panels(torch.randn(70, 32), 16)  # 5 panels: 65..80 outputs
    with pytest.raises(RuntimeError, match="cover N"):
        kern.linear_panel(torch.randn(1, 32), p, 90, None)
    with pytest.raises(RuntimeError, match="x must be"):
        kern.linear_panel(torch.randn(1, 16), p, 70, None)


def test_onednn_panels_reads_the_packed_weight_and_refuses_what_is_not_it(kern):
    g = torch.Generator().manual_seed(5)
    for N, K in ((200, 96), (128, 64)):
        w = torch.randn(N, K, generator=g)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        view = onednn_panels(packed, w)
        if view is None:
            # oneDNN picked another layout; only acceptable off the x86 builds this was measured on
            assert "avx2" not in cpu_isa_flags(), "torch 2.13's oneDNN packs in panels on AVX2/AVX-512"
            continue
        assert torch.equal(view.transpose(1, 2).reshape(-1, K)[:N], w)
        x = torch.randn(5, K, generator=g)
        torch.testing.assert_close(kern.linear_panel(x, view, N, None), F.linear(x, w), rtol=1e-5, atol=1e-4)
        # a dense weight that is not the packed one, its transpose, or a plain tensor: no view
        other = w.clone()
        other[N - 1, K - 1] += 1
        assert onednn_panels(packed, other) is None
        assert onednn_panels(packed, w.t().contiguous()) is None
        assert onednn_panels(w, w) is None


# ---- integer-dot (w8a8 / w4a8) kernels -----------------------------------------------------------------
def test_activation_rounding_is_the_documented_rule():
    # one block whose largest magnitude is 127: the scale is exactly 1, so the ints are x rounded half to even
    x = torch.zeros(2, 64)
    x[0, :8] = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.49, 1.5, -126.6])
    x[0, 32:] = torch.linspace(-3, 1, 32)  # a second block with its own scale; row 1 is all zeros
    a, s = quantize_act(x)
    assert a.dtype == torch.int8 and s.shape == (2, 2)
    assert a[0, :8].tolist() == [127, 2, 4, -2, 0, 0, 2, -127]
    assert s[0, 0].item() == 1.0 and s[0, 1].item() == pytest.approx(3 / 127)
    assert a[0, 32].item() == -127  # each block's largest magnitude maps to 127
    assert (a[1] == 0).all() and (s[1] == 0).all()  # an all-zero block has scale 0, not NaN
    g = torch.Generator().manual_seed(3)
    y = torch.randn(5, 256, generator=g) * torch.logspace(-4, 2, 5)[:, None]
    a, s = quantize_act(y)
    err = (fake_quantize_act(y) - y).abs().view(5, 8, 32)
    assert (err <= s[..., None] / 2 * (1 + 1e-5)).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_act(torch.randn(2, 48))


@pytest.mark.parametrize("M", [1, 3, 4, 5, 33])
def test_integer_dot_kernels_match_torch_on_the_rounded_input(kern, M):
    """y = round(x) (W)^T with exact integer dots: equal to torch's float GEMM on the rounded input up to float
    rounding, and clearly not the unrounded product (the input really is rounded, the same way)."""
    g = torch.Generator().manual_seed(100 + M)
    K, N = 512, 70  # N: not a multiple of any tile
    w = torch.randn(N, K, generator=g)
    x = torch.randn(M, K, generator=g) * torch.logspace(-2, 1, K // 32).repeat_interleave(32)  # blocks differ
    x[0, 64:96] = 0  # an all-zero block
    b = torch.randn(N, generator=g)
    xq = fake_quantize_act(x)
    q, s = quantize_int8(w)
    qs = q[:, step_order(K, kern.qstep())].contiguous()  # w8a8 weights are stored in the kernel's order
    cases = [("w8a8", lambda bias: kern.linear_w8a8(x, qs, s, bias), dequantize_int8(q, s))]
    for group in (64, 128, 512):
        if group % kern.qstep() == 0:
            p, d = quantize_int4(w, group)
            cases.append((f"w4a8 g{group}", lambda bias, p=p, d=d, group=group: kern.linear_w4a8(x, p, d, group, bias),
                          dequantize_int4(p, d, group)))
    for name, run, wd in cases:
        for bias in (None, b):
            got, ref, unrounded = run(bias), F.linear(xq, wd, bias), F.linear(x, wd, bias)
            scale = ref.abs().max().item()
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-5 * scale, msg=name)
            # the activation rounding moves y by ~0.3% of its scale; the kernel must follow the rounded input
            assert (got - ref).abs().max() < 0.05 * (unrounded - ref).abs().max(), name


@pytest.mark.parametrize("K", [96, 512])  # 96: three 32-blocks, not a whole row-kernel step
def test_integer_panel_kernels_match_torch_on_the_rounded_input_in_any_batch(kern, K):
    """The panel formats (engine/quant.py to_panels_*) through linear_w8a8_panels / linear_w4a8_panels: torch's
    float GEMM on the rounded input up to float rounding, not the unrounded product, and a row's bits the
    same alone as in a batch of any size (every tile size and remainder)."""
    pw = kern.qpanel_width()
    if not pw:
        pytest.skip("this build has no integer panel kernels (no AVX2)")
    g = torch.Generator().manual_seed(K)
    N = 70  # not a multiple of the panel width or of a tile
    w = torch.randn(N, K, generator=g)
    x = torch.randn(13, K, generator=g) * torch.logspace(-2, 1, K // 32).repeat_interleave(32)
    x[0, 32:64] = 0  # an all-zero block
    b = torch.randn(N, generator=g)
    q, s = quantize_int8(w)
    pq, ps = to_panels_w8a8(q, s, pw, kern.qpanel_unsigned())
    cases = [("w8a8", lambda xx, bias: kern.linear_w8a8_panels(xx, pq, ps, N, bias), dequantize_int8(q, s))]
    for group in (32, K):
        p4, d4 = quantize_int4(w, group)
        pp, pd = to_panels_w4a8(p4, d4, group, pw)
        cases.append((f"w4a8 g{group}", lambda xx, bias, pp=pp, pd=pd, group=group:
                      kern.linear_w4a8_panels(xx, pp, pd, N, group, bias), dequantize_int4(p4, d4, group)))
    xq = fake_quantize_act(x)
    for name, run, wd in cases:
        for bias in (None, b):
            got, ref, unrounded = run(x, bias), F.linear(xq, wd, bias), F.linear(x, wd, bias)
            scale = ref.abs().max().item()
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-5 * scale, msg=name)
            assert (got - ref).abs().max() < 0.05 * (unrounded - ref).abs().max(), name
            alone = torch.cat([run(x[i:i + 1].contiguous(), bias) for i in range(13)])
            assert torch.equal(alone, got), name
            for M in (2, 3, 4, 7):
                assert torch.equal(run(x[:M].contiguous(), bias), got[:M]), name


def test_integer_panel_formats_round_trip():
    g = torch.Generator().manual_seed(9)
    w = torch.randn(37, 256, generator=g)
    q, s = quantize_int8(w)
    for unsigned in (True, False):
        for pw in (8, 16):
            p, ps = to_panels_w8a8(q, s, pw, unsigned)
            assert p.shape == (-(-37 // pw), 64, pw, 4) and p.dtype == torch.uint8
            assert torch.equal(from_panels_w8a8(p, ps, 37, unsigned), dequantize_int8(q, s))
    p4, d4 = quantize_int4(w, 64)
    p, ps = to_panels_w4a8(p4, d4, 64, 16)
    assert p.shape == (3, 32, 16, 4) and ps.shape == (3, 4, 16)
    assert torch.equal(from_panels_w4a8(p, ps, 37, 64), dequantize_int4(p4, d4, 64))
    # byte (o, t) of octet j: input 8j + t low, 8j + 4 + t high (the documented layout, checked on one byte)
    lv = int4_levels(p4)
    assert p[0, 2, 5, 1].item() == lv[5, 17].item() | (lv[5, 21].item() << 4)


def test_step_order_is_the_int4_nibble_order():
    assert torch.equal(step_order(96, 32), torch.arange(96))  # the scalar build: natural order
    for step in (64, 128):
        order = step_order(256, step)
        assert sorted(order.tolist()) == list(range(256))
        # the first half of a step is the low nibbles of step/2 bytes of the int4 format, the second half the
        # high nibbles (the format's documented packing: byte j of a 32-run holds values j and j + 16)
        w = torch.tensor([[(k * 7) % 16 - 8 for k in range(256)]], dtype=torch.float32)  # value 0 is -8: d = 1
        packed, d = quantize_int4(w, 256)
        assert d.item() == 1.0
        q = w[0].long() + 8  # d = 1: the stored nibbles
        b = packed[0].long()
        for c in range(256 // step):
            chunk = b[c * step // 2:(c + 1) * step // 2]
            assert torch.equal(q[order[c * step:c * step + step // 2]], chunk & 15)
            assert torch.equal(q[order[c * step + step // 2:(c + 1) * step]], chunk >> 4)
    with pytest.raises(ValueError, match="step"):
        step_order(96, 64)


def test_integer_dot_kernels_refuse_bad_shapes_with_a_message(kern):
    qc = kern.qstep()
    assert qc in (32, 64, 128)
    q, s = quantize_int8(torch.randn(8, 96))
    if 96 % qc:
        with pytest.raises(RuntimeError, match="multiple of"):
            kern.linear_w8a8(torch.randn(2, 96), q, s, None)
    p, d = quantize_int4(torch.randn(8, 128), 32)
    if qc > 32:
        with pytest.raises(RuntimeError, match="group"):
            kern.linear_w4a8(torch.randn(2, 128), p, d, 32, None)
    with pytest.raises(RuntimeError, match="x must be"):
        kern.linear_w8a8(torch.randn(2, 64), *quantize_int8(torch.randn(8, 128)), None)


# ---- per-layer small ops -----------------------------------------------------------------------------------
@pytest.mark.parametrize("M", [1, 7, 300])
def test_rms_norm_and_silu_mul_match_torch(kern, M):
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 384, generator=g) * torch.logspace(-3, 2, M)[:, None]  # rows of very different size
    w = torch.randn(384, generator=g)
    torch.testing.assert_close(kern.rms_norm(x, w, 1e-6), F.rms_norm(x, (384,), w, 1e-6), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kern.rms_norm(x, w, 10.0), F.rms_norm(x, (384,), w, 10.0), rtol=1e-5, atol=1e-6)
    gu = torch.randn(M, 2 * 170, generator=g) * 6  # 10 vectors of 16 and a tail of 10
    gu[:, :4] = torch.tensor([-120.0, -90.0, 90.0, 120.0])  # past exp's float range either way
    gate, up = gu.split(170, dim=-1)
    torch.testing.assert_close(kern.silu_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    # Gemma's GeGLU: torch's tanh-approximated gelu (HF's gelu_pytorch_tanh), the same extremes; the kernel's
    # sigmoid form rounds its negative tail better than 0.5 x (1 + tanh) does, so the float64 formula is the reference
    g64, u64 = gate.double(), up.double()
    want = 0.5 * g64 * (1 + torch.tanh(0.7978845608028654 * (g64 + 0.044715 * g64 ** 3))) * u64
    torch.testing.assert_close(kern.gelu_tanh_mul(gu).double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kern.gelu_tanh_mul(gu), F.gelu(gate, approximate="tanh") * up, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="w must be"):
        kern.rms_norm(x, w[:10], 1e-6)


# ---- paged decode attention -----------------------------------------------------------------------------
def _paged_case(seed: int, B: int, H: int, Hkv: int, D: int, bs: int, dtype: torch.dtype, max_ctx: int = 70):
    """A cache with blocks scattered in random order and ragged contexts, and its decode metadata."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, max_ctx, (B,), generator=g)
    nblk = [(-(-int(c) // bs)) for c in ctx]
    N = sum(nblk) + 3
    perm = torch.randperm(N, generator=g).tolist()
    tables, i = [], 0
    for n in nblk:
        tables.append(perm[i:i + n])
        i += n
    width = max(nblk)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    k = torch.randn(N, bs, Hkv, D, generator=g)
    v = torch.randn(N, bs, Hkv, D, generator=g)
    if dtype == torch.int8:
        k, v = quantize_kv(k), quantize_kv(v)
    else:
        k, v = k.to(dtype), v.to(dtype)
    q = torch.randn(B, H, D, generator=g)
    meta = AttentionMetadata(slot_mapping=torch.zeros(B, dtype=torch.long), num_decode=B,
                             decode_block_tables=bt, decode_ctx_lens=ctx.long(), block_size=bs)
    return q, k, v, meta


@pytest.mark.parametrize("H,Hkv", [(4, 4), (8, 2), (12, 4), (8, 1)])
@pytest.mark.parametrize("bs", [1, 16, 5])
@pytest.mark.parametrize("window", [None, 1, 7, 40])
def test_paged_decode_kernel_equals_gather_sdpa_fp32(kern, H, Hkv, bs, window):
    for seed in range(3):
        q, k, v, meta = _paged_case(seed, B=5, H=H, Hkv=Hkv, D=64 if H != 12 else 32, bs=bs, dtype=torch.float32)
        ref = gather_decode_attention(q, k, v, meta, window)
        out = kern.paged_decode_attention(q, k, v, meta.decode_block_tables, meta.decode_ctx_lens, window or 0,
                                          q.shape[-1] ** -0.5)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("D", [32, 80, 128])  # 128: the compiled-in accumulator path; 32 / 80: the general one
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_paged_decode_kernel_head_dims(kern, D, dtype):
    for window in (None, 7):
        q, k, v, meta = _paged_case(11, B=4, H=8, Hkv=2, D=D, bs=16, dtype=dtype, max_ctx=150)
        ref = gather_decode_attention(q, k, v, meta, window)
        out = kern.paged_decode_attention(q, k, v, meta.decode_block_tables, meta.decode_ctx_lens, window or 0,
                                          D ** -0.5)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_paged_decode_kernel_reads_bf16_and_int8_caches(kern, dtype):
    for window in (None, 9):
        q, k, v, meta = _paged_case(7, B=6, H=8, Hkv=2, D=64, bs=16, dtype=dtype, max_ctx=150)
        # the reference attends in float32 over the same stored values (bf16 widened, int8 dequantized)
        kf, vf = (k.float(), v.float()) if dtype == torch.bfloat16 else (k, v)
        ref = gather_decode_attention(q, kf, vf, meta, window)
        out = kern.paged_decode_attention(q, k, v, meta.decode_block_tables, meta.decode_ctx_lens, window or 0,
                                          64 ** -0.5)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_paged_decode_kernel_refuses_out_of_range_tables(kern):
    q, k, v, meta = _paged_case(3, B=2, H=4, Hkv=4, D=64, bs=16, dtype=torch.float32)
    bad = meta.decode_block_tables.clone()
    bad[0, 0] = k.shape[0] + 5
    with pytest.raises(RuntimeError, match="block id out of range"):
        kern.paged_decode_attention(q, k, v, bad, meta.decode_ctx_lens, 0, 0.125)


# ---- panel prefetch (machine-tuned per model, engine/prefetch_tuning.py) ------------------------------------
def test_panel_prefetch_distance_changes_no_result(kern):
    """Every panel kernel (fp32, int8, int4, w8a8, w4a8) gives the same bits at every prefetch distance, at one
    row and at several, including distances far past the end of the weights (a prefetch never faults), and
    the same bits as torch's product on the weights (so a prefetching path cannot be wrong in both)."""
    g = torch.Generator().manual_seed(5)
    N, K, group = 130, 256, 64
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    q8, s8 = quantize_int8(w)
    p4, d4 = quantize_int4(w, group)
    cases = {"fp32": lambda x, pf, p=_panels(w, 64): kern.linear_panel(x, p, N, b, pf),
             "int8": lambda x, pf, pp=to_panels_int8(q8, s8): kern.linear_int8_panels(x, *pp, N, b, pf),
             "int4": lambda x, pf, pp=to_panels_int4(p4, d4, group): kern.linear_int4_panels(x, *pp, N, group, b, pf)}
    pw = kern.qpanel_width()
    if pw:
        pq = to_panels_w8a8(q8, s8, pw, kern.qpanel_unsigned())
        pq4 = to_panels_w4a8(p4, d4, group, pw)
        cases["w8a8"] = lambda x, pf: kern.linear_w8a8_panels(x, *pq, N, b, pf)
        cases["w4a8"] = lambda x, pf: kern.linear_w4a8_panels(x, *pq4, N, group, b, pf)
    x = torch.randn(20, K, generator=g)
    rows = (1, 9, 20)  # 20: several whole row groups, whose later passes also prefetch the next tile (Ahead)
    for name, run in cases.items():
        ref = {m: run(x[:m].contiguous(), kern.PanelPrefetch(0, 0)) for m in rows}
        for pf in (64, 256, 2048, 8192, 1 << 24):
            dist = kern.PanelPrefetch(pf, pf)
            assert tuple(dist.get()) == (pf, pf)
            for m in rows:
                assert torch.equal(run(x[:m].contiguous(), dist), ref[m]), (name, pf, m)
        if name == "fp32":
            torch.testing.assert_close(ref[20], F.linear(x, w, b), rtol=1e-5, atol=1e-4)
            assert torch.equal(kern.linear_panel(x, _panels(w, 64), N, b), ref[20])  # the default: no prefetch


def test_panel_prefetch_refuses_negative_distances(kern):
    with pytest.raises(RuntimeError, match="prefetch distances must be >= 0"):
        kern.PanelPrefetch(-1, 0)
    pf = kern.PanelPrefetch(64, 128)
    with pytest.raises(RuntimeError, match="prefetch distances must be >= 0"):
        pf.set(0, -1)
    assert tuple(pf.get()) == (64, 128)


def test_tune_panel_prefetch_measures_a_candidate_and_the_environment_overrides(kern, monkeypatch):
    from engine.prefetch_tuning import PREFETCH_CANDIDATES, tune_panel_prefetch

    g = torch.Generator().manual_seed(6)
    ws = [torch.randn(256, 512, generator=g) for _ in range(4)]
    dist = kern.PanelPrefetch(12345, 12345)  # not a candidate: tuning must replace it
    other = kern.PanelPrefetch(777, 777)  # another model's: tuning must leave it alone
    products = [(lambda x, p=_panels(w, 64): kern.linear_panel(x, p, 256, None, dist), 512, w.numel() * 4) for w in ws]
    calls = []
    counted = [(lambda x, run=run: calls.append(x.shape[0]) or run(x), k, n) for run, k, n in products]
    monkeypatch.delenv("PDSERVE_PANEL_PREFETCH", raising=False)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    chosen = tune_panel_prefetch(counted, dist, rounds=2)
    assert torch.equal(torch.rand(1), before), "tuning moved the global RNG (seeded user code would change)"

    assert chosen[0] in PREFETCH_CANDIDATES and chosen[1] in PREFETCH_CANDIDATES
    assert tuple(dist.get()) == chosen and tuple(other.get()) == (777, 777)
    # warm-up + 2 rounds, every candidate, every product, at 1 and at 8 rows
    assert sorted(set(calls)) == [1, 8] and len(calls) == 2 * 3 * len(PREFETCH_CANDIDATES) * len(products)
    for text, want in (("4096", (4096, 4096)), ("0,8192", (0, 8192)), (" 64 , 128 ", (64, 128))):
        monkeypatch.setenv("PDSERVE_PANEL_PREFETCH", text)
        calls.clear()
        assert tune_panel_prefetch(counted, dist) == want and tuple(dist.get()) == want
        assert not calls, "a distance set in the environment is not measured"
    for bad in ("fast", "-1", "1,2,3", ""):
        monkeypatch.setenv("PDSERVE_PANEL_PREFETCH", bad)
        with pytest.raises(ValueError, match="PDSERVE_PANEL_PREFETCH"):
            tune_panel_prefetch(counted, dist)
    assert tune_panel_prefetch(counted, None) is None  # no kernels: nothing to tune


def test_loading_a_model_tunes_its_own_prefetch(kern, monkeypatch, tmp_path):
    """finalize measures the distances on the model's own panel linears (fp32 packed panels, quantized panels)
    and keeps them on that model: a second model loaded later (a draft after its target) leaves the first's
    distances alone, and its fused layers read the model's own object."""
    from engine.prefetch_tuning import PREFETCH_CANDIDATES
    from .conftest import make_checkpoint, make_engine

    path, _ = make_checkpoint(tmp_path, "llama")
    monkeypatch.delenv("PDSERVE_PANEL_PREFETCH", raising=False)
    for quant in (None, "int8"):
        model = make_engine(path, quantization=quant).runner.model
        got = tuple(model.panel_prefetch.get())
        assert got[0] in PREFETCH_CANDIDATES and got[1] in PREFETCH_CANDIDATES, (quant, got)
    first = make_engine(path).runner.model
    first.panel_prefetch.set(64, 128)  # as if it had measured these
    monkeypatch.setenv("PDSERVE_PANEL_PREFETCH", "1024,4096")
    second = make_engine(path).runner.model
    assert tuple(second.panel_prefetch.get()) == (1024, 4096)
    assert tuple(first.panel_prefetch.get()) == (64, 128), "loading a second model changed the first's prefetch"
    assert second.panel_prefetch is not first.panel_prefetch


# ---- causal prefill attention ------------------------------------------------------------------------
def _prefill_reference(q, k, v, window):
    """Causal (and windowed: i - window < j <= i) attention in float64 through torch's SDPA with an explicit mask."""
    n, H, D = q.shape
    G = H // k.shape[1]
    qs = q.transpose(0, 1).unsqueeze(0).double()
    ks = k.transpose(0, 1).repeat_interleave(G, 0).unsqueeze(0).double()
    vs = v.transpose(0, 1).repeat_interleave(G, 0).unsqueeze(0).double()
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    m = j <= i
    if window:
        m &= j > i - window
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=m)[0].transpose(0, 1).float()


@pytest.mark.parametrize("n,H,Hkv,D,window", [
    (1, 4, 2, 64, 0), (6, 4, 4, 64, 0), (7, 3, 1, 64, 0),  # one tile, a tile and a row, MQA
    (70, 6, 2, 64, 0), (130, 4, 1, 128, 0), (100, 4, 2, 80, 0),  # block edges, D 128 and a D without a template
    (200, 4, 2, 64, 5), (200, 4, 2, 64, 70), (333, 8, 2, 32, 100),  # windows shorter than a tile, than a block
    (150, 4, 2, 64, 150)])  # a window as long as the prompt
def test_prefill_attention_kernel_matches_float64_sdpa(kern, n, H, Hkv, D, window):
    g = torch.Generator().manual_seed(n * 7 + D + window)
    q, k, v = (torch.randn(n, h, D, generator=g) * 2 for h in (H, Hkv, Hkv))
    got = kern.prefill_attention(q, k, v, window, D ** -0.5)
    torch.testing.assert_close(got, _prefill_reference(q, k, v, window), rtol=1e-5, atol=1e-5)


def _paged_prefill_case(seed, off, n, H, Hkv, D, bs, dtype):
    """A paged cache holding off + n tokens' K/V in shuffled blocks (plus spare ones), the block table, the
    queries of the last n tokens (as a strided view, like the engine's), and the K/V the cache holds as float."""
    g = torch.Generator().manual_seed(seed)
    nk = off + n
    nblk = -(-nk // bs)
    N = nblk + 3
    table = torch.randperm(N, generator=g)[:nblk]
    k, v = (torch.randn(nk, Hkv, D, generator=g) * 2 for _ in range(2))
    Dp = D + 4 if dtype == torch.int8 else D
    kc = torch.randn(N, bs, Hkv, Dp, generator=g).to(dtype)  # garbage outside the sequence's slots
    vc = torch.randn(N, bs, Hkv, Dp, generator=g).to(dtype)
    slots = table[torch.arange(nk) // bs] * bs + torch.arange(nk) % bs
    enc = quantize_kv if dtype == torch.int8 else (lambda x: x.to(dtype))
    kc.view(N * bs, Hkv, Dp)[slots] = enc(k)
    vc.view(N * bs, Hkv, Dp)[slots] = enc(v)
    dec = (lambda x: dequantize_kv(x)) if dtype == torch.int8 else (lambda x: x.float())
    kf, vf = dec(kc.view(N * bs, Hkv, Dp)[slots]), dec(vc.view(N * bs, Hkv, Dp)[slots])
    qkv = torch.randn(n, H + 2, D, generator=g) * 2
    return qkv[:, :H], kc, vc, table, kf, vf


def _prefill_reference_at(q, k, v, window):
    """The last n = len(q) positions of a len(k)-token context over all its keys, in float64 (SDPA, explicit mask)."""
    n, H, D = q.shape
    nk, G = k.shape[0], H // k.shape[1]
    qs = q.transpose(0, 1).unsqueeze(0).double()
    ks = k.transpose(0, 1).repeat_interleave(G, 0).unsqueeze(0).double()
    vs = v.transpose(0, 1).repeat_interleave(G, 0).unsqueeze(0).double()
    i, j = torch.arange(nk - n, nk)[:, None], torch.arange(nk)[None, :]
    m = j <= i
    if window:
        m &= j > i - window
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=m)[0].transpose(0, 1).float()


@pytest.mark.parametrize("off,n,H,Hkv,D,bs,window,dtype", [
    (70, 30, 4, 2, 64, 16, 0, torch.float32), (1, 1, 4, 1, 64, 16, 0, torch.float32),  # one new token
    (0, 40, 4, 2, 64, 16, 0, torch.float32),  # no cached context, through the cache
    (128, 64, 6, 2, 128, 16, 0, torch.bfloat16), (100, 37, 4, 4, 80, 7, 50, torch.int8),  # odd blocks, a window
    (250, 50, 8, 2, 64, 32, 90, torch.int8), (190, 6, 3, 1, 32, 16, 3, torch.float32)])  # MQA, a tiny window
def test_paged_prefill_attention_matches_float64_over_the_cached_context(kern, off, n, H, Hkv, D, bs, window, dtype):
    """A later chunk / prefix-cache hit: the kernel reads the context through the block table (dequantizing
    int8 rows as engine/quant.py does) and equals attention over the same values within 1e-5."""
    q, kc, vc, table, kf, vf = _paged_prefill_case(off * 31 + n, off, n, H, Hkv, D, bs, dtype)
    got = kern.prefill_attention_paged(q, kc, vc, table, off + n, window, D ** -0.5)
    torch.testing.assert_close(got, _prefill_reference_at(q, kf, vf, window), rtol=1e-5, atol=1e-5)
    if off == 0 and dtype == torch.float32:  # the same numbers as the fresh-K/V entry point
        k3, v3 = kf.contiguous(), vf.contiguous()
        assert torch.equal(got, kern.prefill_attention(q, k3, v3, window, D ** -0.5))


def test_paged_prefill_attention_refuses_bad_metadata_with_a_message(kern):
    q, kc, vc, table, _, _ = _paged_prefill_case(1, 20, 10, 4, 2, 64, 16, torch.float32)
    for args, msg in (((q, kc, vc, table, 9), "at least q's tokens"),
                      ((q, kc, vc, table[:1], 30), "cover ctx_len"),
                      ((q, kc, vc, table.clone().fill_(99), 30), "block id out of range"),
                      ((q, kc, vc, table.int(), 30), "block_table must be contiguous int64"),
                      ((q, kc, vc.half(), table, 30), "one dtype"),
                      ((q, kc[..., :32].contiguous(), vc[..., :32].contiguous(), table, 30), "D wide"),
                      ((q, kc.half(), vc.half(), table, 30), "unsupported KV cache dtype")):
        with pytest.raises(RuntimeError, match=msg):
            kern.prefill_attention_paged(*args, 0, 0.125)


def test_prefill_attention_kernel_reads_strided_views_of_one_qkv_output(kern):
    """The engine passes q, k and v as views into the qkv projection's rows (row stride (H + 2 Hkv) D): the
    same numbers as contiguous copies, for the whole prompt and for a slice of it (a later prompt in a batch)."""
    g = torch.Generator().manual_seed(5)
    T, H, Hkv, D = 150, 6, 2, 64
    qkv = torch.randn(T, H + 2 * Hkv, D, generator=g)
    q, k, v = qkv[:, :H], qkv[:, H:H + Hkv], qkv[:, H + Hkv:]
    assert not q.is_contiguous()
    for s, e in ((0, T), (37, 120)):
        got = kern.prefill_attention(q[s:e], k[s:e], v[s:e], 0, D ** -0.5)
        want = kern.prefill_attention(q[s:e].contiguous(), k[s:e].contiguous(), v[s:e].contiguous(), 0, D ** -0.5)
        assert torch.equal(got, want)
        torch.testing.assert_close(got, _prefill_reference(q[s:e], k[s:e], v[s:e], 0), rtol=1e-5, atol=1e-5)


def test_rope_kernel_matches_apply_rope_in_place_on_the_leading_heads(kern):
    from engine.attention import apply_rope

    g = torch.Generator().manual_seed(3)
    T, Hq, Hkv, D = 33, 6, 2, 80
    qkv = torch.randn(T, Hq + 2 * Hkv, D, generator=g) * 3
    ang = torch.rand(T, 1, D // 2, generator=g) * 100
    cos, sin = ang.cos(), ang.sin()
    want = torch.cat((apply_rope(qkv[:, :Hq + Hkv], cos, sin), qkv[:, Hq + Hkv:]), dim=1)
    x = qkv.clone()
    assert kern.rope_(x, cos, sin, Hq + Hkv) is None
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)  # FMA contraction may move the last bit
    assert torch.equal(x[:, Hq + Hkv:], qkv[:, Hq + Hkv:])  # V untouched
    for args, msg in (((qkv[:, :4], cos, sin, 2), "contiguous"), ((qkv, cos[:5], sin, 2), "cos/sin"),
                      ((qkv, cos, sin, Hq + 2 * Hkv + 1), "heads must be")):
        with pytest.raises(RuntimeError, match=msg):
            kern.rope_(*args)


@pytest.mark.parametrize("window", [0, 90])
def test_prefill_attention_kernel_when_scores_climb_along_the_keys(kern, window):
    """Keys grow along the prompt, so each row's maximum score rises block after block by more than the
    kernel's lazy-rescale margin (8): the running sum and output must be rescaled mid-row each time, and the
    rise over a row (~100) would overflow e^x if the reference maximum never moved. With random scores (the
    test above) the first block's maximum is almost never beaten by that much."""
    g = torch.Generator().manual_seed(11)
    n, H, Hkv, D = 300, 4, 2, 64
    q = torch.randn(n, H, D, generator=g).abs() + 0.5
    k = (torch.randn(n, Hkv, D, generator=g).abs() + 0.5) * torch.linspace(0.05, 1.0, n)[:, None, None]
    v = torch.randn(n, Hkv, D, generator=g)
    scale = 8.0 * D ** -0.5  # scores reach ~110, rising ~23 per 64-key block
    got = kern.prefill_attention(q, k, v, window, scale)
    ref = _prefill_reference(q * 8, k, v, window)
    # Scores this large lose ~1e-5 to float32 rounding in any kernel: the bound is what torch's float32 SDPA
    # reaches on the same input (3.5e-5 here), with a factor 2 of slack.
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = (j <= i) & ((j > i - window) if window else True)
    sdpa = F.scaled_dot_product_attention((q * 8).transpose(0, 1).unsqueeze(0),
                                          k.transpose(0, 1).repeat_interleave(2, 0).unsqueeze(0),
                                          v.transpose(0, 1).repeat_interleave(2, 0).unsqueeze(0),
                                          attn_mask=mask)[0].transpose(0, 1)
    bound = 2 * (sdpa - ref).abs().max().item()
    assert 1e-6 < bound < 1e-4
    assert (got - ref).abs().max().item() <= bound


def test_prefill_attention_kernel_refuses_bad_shapes_with_a_message(kern):
    q, k = torch.randn(8, 4, 64), torch.randn(8, 2, 64)
    for args, msg in (((q, k, k[:, :1].expand(8, 2, 64), 0), "k and v must be CPU float32"),
                      ((q, k.transpose(0, 1).contiguous().transpose(0, 1), k, 0), "heads contiguous"),
                      ((q[:, :, ::2], k, k, 0), "q must be CPU float32"),
                      ((q, torch.randn(8, 3, 64), torch.randn(8, 3, 64), 0), "multiple of KV heads"),
                      ((torch.randn(8, 4, 40), torch.randn(8, 2, 40), torch.randn(8, 2, 40), 0), "multiple of 16"),
                      ((q, torch.randn(9, 2, 64), torch.randn(9, 2, 64), 0), "q's tokens"),
                      ((q.double(), k, k, 0), "q must be CPU float32"),
                      ((q, k, k, -1), "window must be >= 0")):
        with pytest.raises(RuntimeError, match=msg):
            kern.prefill_attention(*args, 0.125)
    assert kern.prefill_attention(q[:0], k[:0], k[:0], 0, 0.125).shape == (0, 4, 64)


# ---- the build ------------------------------------------------------------------------------------------
def test_the_build_compiles_every_source_and_its_name_hashes_every_source_and_header(monkeypatch, tmp_path):
    """A change to any .cpp or .h of engine/csrc must give a new build name (else a stale cached module would
    load), and every .cpp there is compiled."""
    import shutil

    import engine.kernels as kernels

    src = tmp_path / "csrc"
    shutil.copytree(kernels._CSRC, src)
    monkeypatch.setattr(kernels, "_CSRC", src)
    assert [p.name for p in kernels.kernel_sources()] == sorted(p.name for p in src.glob("*.cpp"))
    assert {"simd.h", "kernels.h"} <= {p.name for p in src.glob("*.h")}
    names = {kernels._build_name()}
    for f in sorted([*src.glob("*.cpp"), *src.glob("*.h")]):
        f.write_bytes(f.read_bytes() + b"\n// edited\n")
        names.add(kernels._build_name())
    assert len(names) == 1 + len(list(src.glob("*.cpp"))) + len(list(src.glob("*.h")))
    (src / "extra_op.cpp").write_text("// a new op file\n")
    assert kernels._build_name() not in names and "extra_op.cpp" in [p.name for p in kernels.kernel_sources()]
