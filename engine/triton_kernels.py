"""pdserve's Triton kernels for CUDA: paged decode attention, RMSNorm, silu * mul and in-place RoPE.

Lifecycle: nothing here runs at import. The first call of a kernel decorates it with ``triton.jit`` (once per
process and interpreter mode, see ``_kernels``); Triton then compiles it on its first launch for each
specialisation (dtypes, constexpr shapes) and caches the binary. On CUDA tensors they run on the GPU; on CPU
tensors they run only under Triton's interpreter (``TRITON_INTERPRET=1``, numpy underneath), which is how
tests/engine/test_triton_kernels.py checks them. Serving never calls them on CPU (engine/csrc covers CPU).

``triton`` is optional: without it this module still imports, ``available`` says False and callers keep torch
(``PDSERVE_TRITON_KERNELS=0`` does the same on a GPU: torch's ops and the gather + SDPA decode attention).

The decode kernel is CUDA-graph safe: its grid is a function of tensor shapes only (batch, KV heads), and the
context lengths and block tables are read inside the kernel, so a captured launch replays correctly after the
runner rewrites ``ctx_lens`` / ``block_tables`` in place. Nothing here synchronises with the host.
"""
from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Optional

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module imports, available() is False
    triton = None
    tl = None


def _interpret() -> bool:
    """Whether ``triton.jit`` would build interpreted kernels now (what ``TRITON_INTERPRET`` says)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def available(device: torch.device) -> bool:
    """Whether these kernels can run on ``device``: triton importable, and a CUDA device (or a CPU device with
    Triton's interpreter on)."""
    if triton is None or os.environ.get("PDSERVE_TRITON_KERNELS", "1") == "0":
        return False
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and _interpret())


def _pow2(n: int, lo: int = 2) -> int:
    # >= 2: size-1 block dims are legal in Triton, but not worth a compile risk we cannot test here
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


# -- kernel sources (plain functions; decorated lazily by _kernels) ------------------------------------------

if triton is not None:

    def _decode_attention_kernel(Q, K, V, BT, CTX, O, scale, window,
                                 sq_b, sq_h, sq_d, sk_n, sk_t, sk_h, sk_d, sv_n, sv_t, sv_h, sv_d,
                                 sbt_b, sbt_w, so_b, so_h, so_d,
                                 G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr,
                                 BS: tl.constexpr, BS_P: tl.constexpr):
        # one program per (sequence, KV head); the G query heads of the group are the rows of one tile
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        offs_g = tl.arange(0, G_P)
        offs_d = tl.arange(0, D)
        offs_t = tl.arange(0, BS_P)
        g_ok = offs_g < G
        heads = kvh * G + offs_g
        q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + offs_d[None, :] * sq_d,
                    mask=g_ok[:, None], other=0.0).to(tl.float32)
        ctx = tl.load(CTX + b)
        # keys lo .. ctx-1: the new token sits at ctx-1 and HF keeps keys with q - k < window (no window: huge)
        lo = tl.maximum(ctx - window, 0)
        m_i = tl.full([G_P], float("-inf"), tl.float32)
        l_i = tl.zeros([G_P], tl.float32)
        acc = tl.zeros([G_P, D], tl.float32)
        # a while loop, not range(): Triton 3.6's interpreter turns tensor range() bounds into ints with int() of a
        # 1-element array, which numpy >= 2.4 refuses (the compiled loop is the same, minus software pipelining)
        i = lo // BS
        end = (ctx + BS - 1) // BS
        while i < end:
            blk = tl.load(BT + b * sbt_b + i * sbt_w).to(tl.int64)
            pos = i * BS + offs_t
            ok = (offs_t < BS) & (pos < ctx) & (pos >= lo)
            rows = blk * sk_n + offs_t[:, None] * sk_t + kvh * sk_h + offs_d[None, :] * sk_d
            k = tl.load(K + rows, mask=ok[:, None], other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G_P, BS_P]
            s = tl.where(ok[None, :], s, float("-inf"))
            # every visited block holds >= 1 live key, so m_new is finite from the first block on
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            rows = blk * sv_n + offs_t[:, None] * sv_t + kvh * sv_h + offs_d[None, :] * sv_d
            v = tl.load(V + rows, mask=ok[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
            i += 1
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(O + b * so_b + heads[:, None] * so_h + offs_d[None, :] * so_d,
                 out.to(O.dtype.element_ty), mask=g_ok[:, None])

    def _rms_norm_kernel(X, W, Y, sx, sy, h, eps, BLOCK: tl.constexpr, FP32: tl.constexpr):
        r = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        ok = offs < h
        x = tl.load(X + r * sx + offs, mask=ok, other=0.0).to(tl.float32)
        n = x * tl.rsqrt(tl.sum(x * x, axis=0) / h + eps)
        w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
        if not FP32:  # HF: the normalised value rounded to the model dtype, then scaled in it
            n = n.to(Y.dtype.element_ty).to(tl.float32)
        tl.store(Y + r * sy + offs, (n * w).to(Y.dtype.element_ty), mask=ok)

    def _silu_mul_kernel(X, Y, sx, sy, inter, BLOCK: tl.constexpr, FP32: tl.constexpr):
        r = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < inter
        g = tl.load(X + r * sx + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(X + r * sx + inter + offs, mask=ok, other=0.0).to(tl.float32)
        a = g / (1.0 + tl.exp(-g))
        if not FP32:  # torch rounds silu's output before the product
            a = a.to(Y.dtype.element_ty).to(tl.float32)
        tl.store(Y + r * sy + offs, (a * u).to(Y.dtype.element_ty), mask=ok)

    def _rope_kernel(X, COS, SIN, sx_t, sx_h, sc, ss, half, HALF_P: tl.constexpr, FP32: tl.constexpr):
        # one program per (token, head); every product and difference rounded to x's dtype as torch does
        t = tl.program_id(0)
        h = tl.program_id(1)
        offs = tl.arange(0, HALF_P)
        ok = offs < half
        base = X + t * sx_t + h * sx_h
        x1 = tl.load(base + offs, mask=ok, other=0.0)
        x2 = tl.load(base + half + offs, mask=ok, other=0.0)
        c = tl.load(COS + t * sc + offs, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(SIN + t * ss + offs, mask=ok, other=0.0).to(tl.float32)
        dt = X.dtype.element_ty
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        a, b, e, f = x1 * c, x2 * s, x2 * c, x1 * s
        if not FP32:
            a, b = a.to(dt).to(tl.float32), b.to(dt).to(tl.float32)
            e, f = e.to(dt).to(tl.float32), f.to(dt).to(tl.float32)
        tl.store(base + offs, (a - b).to(dt), mask=ok)
        tl.store(base + half + offs, (e + f).to(dt), mask=ok)


_BUILT: dict[bool, SimpleNamespace] = {}


def _kernels() -> SimpleNamespace:
    """The jitted kernels for the current interpreter mode. ``triton.jit`` reads ``TRITON_INTERPRET`` when it
    decorates, so decorating lazily (and once per mode) lets a test switch the interpreter on after import,
    and never hands a GPU-compiled kernel to CPU tensors or the reverse. (The interpreter also needs triton itself
    imported with ``TRITON_INTERPRET=1``: tl.sum, tl.max, tl.zeros are jitted when triton is imported.)"""
    if triton is None:
        raise RuntimeError("triton is not installed")
    mode = _interpret()
    k = _BUILT.get(mode)
    if k is None:
        k = _BUILT[mode] = SimpleNamespace(
            decode=triton.jit(_decode_attention_kernel), rms_norm=triton.jit(_rms_norm_kernel),
            silu_mul=triton.jit(_silu_mul_kernel), rope=triton.jit(_rope_kernel))
    return k


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_NO_WINDOW = 1 << 62


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, ctx_lens: Tensor,
                           window: Optional[int], scale: float) -> Tensor:
    """One query per sequence over its paged context, K/V read in place through the block table.

    q [B, H, D]; k_cache / v_cache [N, block_size, Hkv, D] in q's float dtype; block_tables [B, W] int64
    (padded with any block id: only the first ceil(ctx / block_size) entries are read); ctx_lens [B] int64,
    the context including the new token (>= 1). Same semantics as attention.gather_decode_attention: key k is
    attended iff k < ctx and (no window or k > ctx - 1 - window); query head h reads KV head h // (H / Hkv).
    Returns [B, H, D] in q's dtype. Raises ValueError for a head_dim that is not a power of 2 in 16..256.

    The G query heads of a KV group are one [G, D] tile scored against a [block_size, D] block by broadcast
    products and sums rather than ``tl.dot``: decode is bandwidth-bound, tl.dot would need G and block_size
    padded to 16 (4-16x wasted lanes at G = 1..4, and block_size 8 would not fit), and fp32 tl.dot rounds
    through TF32, which would break the float32 parity with the gather + SDPA path."""
    B, H, D = q.shape
    N, BS, Hkv, Dk = k_cache.shape
    if D & (D - 1) or not 16 <= D <= 256:
        raise ValueError(f"paged_decode_attention needs a power-of-2 head_dim in 16..256, got head_dim={D}")
    if Dk != D or v_cache.shape != k_cache.shape or H % Hkv:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    if q.dtype not in _FLOATS or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q and the cache must share a float dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if block_tables.shape[0] != B or ctx_lens.shape != (B,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / ctx_lens {tuple(ctx_lens.shape)} vs batch {B}")
    G = H // Hkv
    out = torch.empty_like(q)
    if B == 0:
        return out
    G_P, BS_P = _pow2(G), _pow2(BS)
    _kernels().decode[(B, Hkv)](
        q, k_cache, v_cache, block_tables, ctx_lens, out, float(scale), int(window or _NO_WINDOW),
        *q.stride(), *k_cache.stride()[:3], k_cache.stride(3), *v_cache.stride(), *block_tables.stride(),
        *out.stride(), G=G, G_P=G_P, D=D, BS=BS, BS_P=BS_P,
        num_warps=4 if G_P * BS_P * D <= 8192 else 8)
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [T, h] with HF's numerics (layer_ops.TorchOps.rms_norm): normalised in float32, and for a
    16-bit x rounded to x's dtype before the scale, which is applied in x's dtype."""
    T, h = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if T:
        BLOCK = _pow2(h)
        _kernels().rms_norm[(T,)](x, weight.contiguous(), y, x.stride(0), y.stride(0), h, float(eps),
                                  BLOCK=BLOCK, FP32=x.dtype == torch.float32,
                                  num_warps=min(16, max(1, BLOCK // 512)), enable_fp_fusion=False)
    return y


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of gate_up [T, 2I] (gate first, as the fused gate_up projection lays it out) -> [T, I],
    silu's output rounded to the dtype before the product as torch does."""
    T, two_i = gate_up.shape
    inter = two_i // 2
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    y = gate_up.new_empty(T, inter)
    if T and inter:
        BLOCK = min(1024, _pow2(inter))
        _kernels().silu_mul[(T, triton.cdiv(inter, BLOCK))](
            gate_up, y, gate_up.stride(0), y.stride(0), inter, BLOCK=BLOCK, FP32=gate_up.dtype == torch.float32,
            num_warps=4, enable_fp_fusion=False)
    return y


def rope_(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int) -> Tensor:
    """Rotate-half RoPE (HF layout, attention.apply_rope's arithmetic) in place on the first ``heads`` heads of
    qkv [T, heads_total, D]; cos / sin [T, 1, D/2] in qkv's dtype. Returns qkv (like layer_ops.KernelOps.rope)."""
    T, total, D = qkv.shape
    if not 0 <= heads <= total or D % 2:
        raise ValueError(f"rope_: heads={heads} of {total}, head_dim={D} (must be even)")
    if qkv.stride(2) != 1:
        raise ValueError("rope_ rotates in place: qkv's last dim must be contiguous")
    half = D // 2
    cos, sin = cos.reshape(T, half), sin.reshape(T, half)
    if cos.stride(1) != 1:
        cos = cos.contiguous()
    if sin.stride(1) != 1:
        sin = sin.contiguous()
    if T and heads:
        _kernels().rope[(T, heads)](qkv, cos, sin, qkv.stride(0), qkv.stride(1), cos.stride(0), sin.stride(0),
                                    half, HALF_P=_pow2(half), FP32=qkv.dtype == torch.float32,
                                    num_warps=1 if half <= 64 else 2, enable_fp_fusion=False)
    return qkv
