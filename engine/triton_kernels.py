"""pdserve's Triton kernels for CUDA: paged decode and prefill attention, RMSNorm, silu * mul and in-place RoPE.

Lifecycle: nothing here runs at import. The first call of a kernel decorates it with ``triton.jit`` (once per
process and interpreter mode, see ``_kernels``); Triton then compiles it on its first launch for each
specialisation (dtypes, constexpr shapes) and caches the binary. On CUDA tensors they run on the GPU; on CPU
tensors they run only under Triton's interpreter (``TRITON_INTERPRET=1``, numpy underneath), which is how
tests/engine/test_triton_kernels.py checks them. Serving never calls them on CPU (engine/csrc covers CPU).

``triton`` is optional: without it this module still imports, ``available`` says False and callers keep torch
(``PDSERVE_TRITON_KERNELS=0`` does the same on a GPU: torch's ops and the gather + SDPA decode attention).

The decode kernel is CUDA-graph safe: its grid is a function of tensor shapes only (batch, KV heads), and the
context lengths and block tables are read inside the kernel, so a captured launch replays correctly after the
runner rewrites ``ctx_lens`` / ``block_tables`` in place. Nothing here synchronises with the host. The prefill
kernel takes its chunk's ``num_computed`` as a host int (prefill metadata, never captured in a graph).
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

    def _prefill_attention_kernel(Q, K, V, BT, O, qk_scale, nc, n, window,
                                  sq_t, sq_h, sq_d, sk_n, sk_t, sk_h, sk_d, sv_n, sv_t, sv_h, sv_d, sbt,
                                  so_t, so_h, so_d,
                                  G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr,
                                  UPCAST: tl.constexpr):
        # one program per (query tile, query head): BLOCK_M rows of the chunk against the context's keys, BLOCK_N
        # at a time, each key's row found through the block table (so a tile may span several cache blocks or part
        # of one: any block size); the KV head h // G read in place, no GQA copies. Scores in log2 units (qk_scale
        # folds log2(e) in), online softmax in fp32. UPCAST (bfloat16 in the interpreter only): Triton 3.6's
        # interpreter holds bfloat16 as its uint16 bits and its tl.dot multiplies those bits, so the operands go in
        # as exact float32 there; the GPU's bfloat16 MMA also multiplies exactly and sums in fp32, so the numerics
        # tested are the GPU's.
        mt = tl.num_programs(0) - 1 - tl.program_id(0)  # the last (longest) query tiles launched first
        h = tl.program_id(1)
        kvh = h // G
        offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        m_ok = offs_m < n
        q = tl.load(Q + offs_m[:, None] * sq_t + h * sq_h + offs_d[None, :] * sq_d, mask=m_ok[:, None], other=0.0)
        pos = nc + offs_m  # the queries' positions in the sequence
        p_first = nc + mt * BLOCK_M
        p_last = tl.minimum(p_first + BLOCK_M, nc + n) - 1
        # query p sees keys p - window < k <= p (window <= ctx: the host clamps "no window" to ctx). The tile's rows
        # see keys lo .. p_last; keys in [full_lo, full_hi) are seen by every row, so tiles inside it skip the mask
        lo = tl.maximum(p_first - window + 1, 0)
        full_lo = p_last - window + 1
        full_hi = p_first + 1
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        # a while loop, not range(): see _decode_attention_kernel (this also forgoes software pipelining)
        start = (lo // BLOCK_N) * BLOCK_N
        while start <= p_last:
            kpos = start + offs_n
            k_ok = kpos <= p_last  # <= ctx - 1: no block-table entry past the context is read
            blk = tl.load(BT + (kpos // BS) * sbt, mask=k_ok, other=0).to(tl.int64)
            off = kpos % BS
            kt = tl.load(K + blk[None, :] * sk_n + off[None, :] * sk_t + kvh * sk_h + offs_d[:, None] * sk_d,
                         mask=k_ok[None, :], other=0.0)  # [D, BLOCK_N]
            if FP32:  # IEEE, not TF32: float32 matches the SDPA path to ~1e-6
                s = tl.dot(q, kt, input_precision="ieee")
            elif UPCAST:
                s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = s * qk_scale
            if (start < full_lo) | (start + BLOCK_N > full_hi):  # some key outside some row's causal window
                keep = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - window)
                s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # a row may see no key in a tile before its first live one (a window's lower edge): keep it at 0, not NaN
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_use)
            p = tl.math.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(V + blk[:, None] * sv_n + off[:, None] * sv_t + kvh * sv_h + offs_d[None, :] * sv_d,
                        mask=k_ok[:, None], other=0.0)  # [BLOCK_N, D]
            if FP32:
                acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
            elif UPCAST:
                acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc * alpha[:, None],
                             input_precision="ieee")
            else:  # P rounded to the cache dtype for the tensor cores, as flash attention does
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
            start += BLOCK_N
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i > 0 on every live row (it sees its own key)
        tl.store(O + offs_m[:, None] * so_t + h * so_h + offs_d[None, :] * so_d, out.to(O.dtype.element_ty),
                 mask=m_ok[:, None])

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

    def _rope_kernel(X, COS, SIN, sx_t, sx_h, sc, ss, half, heads, HB: tl.constexpr, HALF_P: tl.constexpr,
                     FP32: tl.constexpr):
        # one program per (token, group of HB heads), as vLLM's rotary kernel takes a token a block: the token's
        # cos / sin row loaded once for its heads; every product and difference rounded to x's dtype as torch does
        t = tl.program_id(0)
        hs = tl.program_id(1) * HB + tl.arange(0, HB)
        offs = tl.arange(0, HALF_P)
        ok_d = offs < half
        ok = (hs < heads)[:, None] & ok_d[None, :]
        base = X + t * sx_t + hs[:, None] * sx_h + offs[None, :]
        x1 = tl.load(base, mask=ok, other=0.0)
        x2 = tl.load(base + half, mask=ok, other=0.0)
        c = tl.load(COS + t * sc + offs, mask=ok_d, other=0.0).to(tl.float32)[None, :]
        s = tl.load(SIN + t * ss + offs, mask=ok_d, other=0.0).to(tl.float32)[None, :]
        dt = X.dtype.element_ty
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        a, b, e, f = x1 * c, x2 * s, x2 * c, x1 * s
        if not FP32:
            a, b = a.to(dt).to(tl.float32), b.to(dt).to(tl.float32)
            e, f = e.to(dt).to(tl.float32), f.to(dt).to(tl.float32)
        tl.store(base, (a - b).to(dt), mask=ok)
        tl.store(base + half, (e + f).to(dt), mask=ok)

    def _matmul_kernel(X, W, B, Y, M, N, K, sx_m, sx_k, sw_k, sw_n, sy_m, sy_n,
                       HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       FP32: tl.constexpr, UPCAST: tl.constexpr):
        # y = x @ w (+ b): one program per [BM, BN] output tile, K walked in BK steps from 0 in order, fp32
        # accumulation, no split-K. A row's result never depends on the other rows (they share only the tile),
        # nor on M: what makes this GEMM batch-invariant. UPCAST: bfloat16 under the interpreter (see the prefill
        # kernel).
        offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros([BM, BN], tl.float32)
        k = 0
        while k < K:  # a while loop, not range(): see _decode_attention_kernel
            kk = k + offs_k
            k_ok = kk < K
            x = tl.load(X + offs_m[:, None].to(tl.int64) * sx_m + kk[None, :] * sx_k,
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(W + kk[:, None].to(tl.int64) * sw_k + offs_n[None, :] * sw_n,
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP32:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            elif UPCAST:
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
            k += BK
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m[:, None].to(tl.int64) * sy_m + offs_n[None, :] * sy_n, acc.to(Y.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


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
            # the ints that change from step to step unspecialised (Triton compiles a variant per value class of an
            # int: 1, a multiple of 16, other): a chunk's start, length and window, a step's block-table width.
            # Each variant compiled mid-request stalls that step (the H200 verdict runs of 1 Dec queued prompts
            # for tens of ms at 4 req/s); with these, one compile per tile config, done by ``warm_up`` at start
            decode=triton.jit(_decode_attention_kernel, do_not_specialize=["sbt_b"]),
            prefill=triton.jit(_prefill_attention_kernel, do_not_specialize=["nc", "n", "window"]),
            rms_norm=triton.jit(_rms_norm_kernel),
            silu_mul=triton.jit(_silu_mul_kernel), rope=triton.jit(_rope_kernel),
            # M unspecialised: a launch of one row compiles the same code as one of many (batch invariance)
            matmul=triton.jit(_matmul_kernel, do_not_specialize=["M"]))
    return k


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_NO_WINDOW = 1 << 62


def _check_attention(kind: str, q: Tensor, k_cache: Tensor, v_cache: Tensor, fp8_cache: bool = False) -> None:
    """ValueError unless q [.., H, D] and the caches [N, block_size, Hkv, D] fit the attention kernels
    (``fp8_cache``: the cache may also be float8 e4m3, widened as it is loaded)."""
    H, D = q.shape[-2:]
    Hkv, Dk = k_cache.shape[2], k_cache.shape[3]
    if D & (D - 1) or not 16 <= D <= 256:
        raise ValueError(f"paged_{kind}_attention needs a power-of-2 head_dim in 16..256, got head_dim={D}")
    if Dk != D or v_cache.shape != k_cache.shape or H % Hkv:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    cache_ok = (q.dtype, torch.float8_e4m3fn) if fp8_cache else (q.dtype,)
    if q.dtype not in _FLOATS or k_cache.dtype not in cache_ok or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q and the cache must share a float dtype{' (or an fp8 cache)' if fp8_cache else ''}, "
                         f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, ctx_lens: Tensor,
                           window: Optional[int], scale: float, out: Optional[Tensor] = None) -> Tensor:
    """One query per sequence over its paged context, K/V read in place through the block table.

    q [B, H, D]; k_cache / v_cache [N, block_size, Hkv, D] in q's float dtype or float8 e4m3 (an fp8 cache,
    widened to float32 as it is loaded); block_tables [B, W] int64
    (padded with any block id: only the first ceil(ctx / block_size) entries are read); ctx_lens [B] int64,
    the context including the new token (>= 1). Same semantics as attention.gather_decode_attention: key k is
    attended iff k < ctx and (no window or k > ctx - 1 - window); query head h reads KV head h // (H / Hkv).
    Returns [B, H, D] in q's dtype: ``out`` where given (any strides; a view of a step's output buffer), written in
    place. Raises ValueError for a head_dim that is not a power of 2 in 16..256.

    The G query heads of a KV group are one [G, D] tile scored against a [block_size, D] block by broadcast
    products and sums rather than ``tl.dot``: decode is bandwidth-bound, tl.dot would need G and block_size
    padded to 16 (4-16x wasted lanes at G = 1..4, and block_size 8 would not fit), and fp32 tl.dot rounds
    through TF32, which would break the float32 parity with the gather + SDPA path."""
    B, H, D = q.shape
    N, BS, Hkv, Dk = k_cache.shape
    _check_attention("decode", q, k_cache, v_cache, fp8_cache=True)
    if block_tables.shape[0] != B or ctx_lens.shape != (B,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / ctx_lens {tuple(ctx_lens.shape)} vs batch {B}")
    G = H // Hkv
    out = _out(out, q, (B, H, D))
    if B == 0:
        return out
    G_P, BS_P = _pow2(G), _pow2(BS)
    _kernels().decode[(B, Hkv)](
        q, k_cache, v_cache, block_tables, ctx_lens, out, float(scale), int(window or _NO_WINDOW),
        *q.stride(), *k_cache.stride()[:3], k_cache.stride(3), *v_cache.stride(), *block_tables.stride(),
        *out.stride(), G=G, G_P=G_P, D=D, BS=BS, BS_P=BS_P,
        num_warps=_decode_warps(G_P * BS_P * D, D))
    return out


def warm_up(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype, heads: int, kv_heads: int,
            head_dim: int, block_size: int, max_tokens: int, invariant: bool = False) -> int:
    """Launch the attention kernels once per variant an engine of this shape can launch, on scratch tensors, so
    that each is compiled (or loaded from Triton's cache) at start, never while a request waits: the decode kernel,
    and the prefill kernel at every tile config (``_prefill_config``) a chunk of 1..``max_tokens`` rows takes (one
    under ``invariant``). Where the prefill kernel never runs (a cache in another dtype: gather + SDPA) it is
    skipped. Returns the number of launches."""
    H, Hkv, D, BS = heads, kv_heads, head_dim, block_size
    scale = D ** -0.5
    cap = _capability(device)
    configs: dict[tuple[int, int, int], int] = {}
    if cache_dtype == dtype:
        for n in range(1, max_tokens + 1):  # the fewest rows that take each tile config
            configs.setdefault(_prefill_config(1 << 20 if invariant else n, D, dtype, cap), n)
    width = -(-max(configs.values(), default=1) // BS) + 1
    k_cache = torch.zeros(width, BS, Hkv, D, dtype=cache_dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    table = torch.arange(width, device=device)
    launches = 0
    for n in configs.values():
        # q as the engine passes it: the first H heads of a step's [T, H + 2 Hkv, D] projection, a chunk after
        # one block of context (nc > 0: the path a later chunk takes)
        qkv = torch.zeros(n, H + 2 * Hkv, D, dtype=dtype, device=device)
        paged_prefill_attention(qkv[:, :H], k_cache, v_cache, table, BS, None, scale, invariant=invariant)
        launches += 1
    if cache_dtype in (dtype, torch.float8_e4m3fn):  # (an int8 cache decodes by gather + SDPA)
        q = torch.zeros(1, H + 2 * Hkv, D, dtype=dtype, device=device)[:, :H]
        paged_decode_attention(q, k_cache, v_cache, table[None, :1], torch.ones(1, dtype=torch.long, device=device),
                               None, scale)
        launches += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return launches


def _out(out: Optional[Tensor], q: Tensor, shape: tuple[int, int, int]) -> Tensor:
    """An attention kernel's output: a new tensor, or the caller's ``out`` once its shape, dtype and device are
    checked (a kernel writes through its strides)."""
    if out is None:
        return q.new_empty(shape)
    if tuple(out.shape) != shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} on {out.device} is not {shape} {q.dtype} on {q.device}")
    return out


def _decode_warps(tile: int, D: int) -> int:
    """Warps of the decode kernel for a [G_P, BS_P, D] product tile of ``tile`` elements: enough threads that its
    fp32 registers fit. Chosen from ptxas -v on sm_90a (tests/engine/triton_aot.py, no GPU needed): 4 warps hold
    4,096 elements (D 64, G 4, 16-token blocks: 168 registers), 8,192 need 8 (D 128, G 4: 171; at 4 warps 255 and
    a spill), 16,384 need 16 at D <= 128 (D 128, G 4, 32-token blocks: 127; at 8 warps 255); at D 256, 16 warps
    spill more than 8, which keep a few bytes' spill at 32-token blocks in 16-bit. Not yet timed on a GPU."""
    if tile <= 4096:
        return 4
    if tile <= 8192 or D > 128:
        return 8
    return 16


def _capability(device: torch.device) -> tuple[int, int]:
    """The compute capability the kernels are built for: the CUDA device's; elsewhere (the interpreter) Hopper's."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)
    return 9, 0


def _prefill_config(n: int, D: int, dtype: torch.dtype,
                    capability: tuple[int, int] = (9, 0)) -> tuple[int, int, int]:
    """BLOCK_M, BLOCK_N, num_warps of ``paged_prefill_attention`` for a chunk of n rows on a GPU of ``capability``.

    The loop is not software-pipelined (a while loop), so K/V pass through registers on their way to shared memory,
    which bounds the tiles. Chosen from ptxas -v (tests/engine/triton_aot.py compiles them for sm_90a and sm_80
    without a GPU); none of the 16-bit tiles at D <= 128 spills. Not yet timed on a GPU.

    16-bit on Hopper (wgmma): a warpgroup (4 warps) issues 64-row MMAs, so BLOCK_M = 128 on 8 warps is two
    warpgroups sharing each K/V tile (half the K/V reads per query row of 64 rows): [128, 64], 230 registers at
    D = 128. A chunk of <= 64 rows (a short suffix after a prefix-cache hit) takes one warpgroup's 64 rows, wasting
    less, with 32-key tiles ([64, 64] on 4 warps spills 284 bytes at D = 128; [64, 32]: 189 registers). D = 256:
    [64, 32] on 8 warps (237; [64, 64] spills 164 bytes). Before Hopper (mma.sync, more registers per tile):
    [64, 32] on 8 warps (216 at D = 128; Hopper's [128, 64] spills 208 bytes, its [64, 32] on 4 warps 264); at
    D = 256 every tile spills, this one least (208 bytes). float32 runs IEEE FMA dots (no tensor cores: parity, not
    speed): [32, 32] tiles to D = 64, [16, 16] above, 8 warps (every float32 tile spills at D = 256, [16, 16] least:
    444 bytes)."""
    if dtype == torch.float32:
        return (32, 32, 8) if D <= 64 else (16, 16, 8)
    if capability < (9, 0):
        return 64, 32, 8
    if D > 128:
        return 64, 32, 8
    if n <= 64:
        return 64, 32, 4
    return 128, 64, 8


def paged_prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, num_computed: int,
                            window: Optional[int], scale: float, invariant: bool = False,
                            out: Optional[Tensor] = None) -> Tensor:
    """One prefill chunk's causal attention over its whole context, K/V read in place through the block table.

    q [n, H, D] (any strides: a view of the qkv projection does); k_cache / v_cache [N, block_size, Hkv, D] in q's
    float dtype, holding the context's K/V including the chunk's own (written before); block_table [nb] int64
    covering ctx = num_computed + n tokens (entries past that are never read); num_computed a host int (prefill
    metadata; never captured in a CUDA graph). Same semantics as attention.prefill_mask: the query at position
    p = num_computed + i attends key k iff k <= p and (no window or k > p - window; window 0 or None is no window);
    query head h reads KV head h // (H / Hkv). Returns [n, H, D] in q's dtype (``out`` where given, written in
    place). Raises ValueError for a head_dim that is not a power of 2 in 16..256.

    Flash attention over the paged cache (after vLLM's / SGLang's Triton prefix-prefill / extend kernels): query
    tiles of BLOCK_M rows per head, key tiles of BLOCK_N tokens gathered through the block table, both matmuls on
    ``tl.dot`` (fp32 at IEEE precision), no [n, ctx] mask and no K/V copies (tile sizes: ``_prefill_config``)."""
    n, H, D = q.shape
    N, BS, Hkv, Dk = k_cache.shape
    _check_attention("prefill", q, k_cache, v_cache)
    nc = int(num_computed)
    ctx = nc + n
    if nc < 0 or block_table.dim() != 1 or block_table.shape[0] * BS < ctx:
        raise ValueError(f"block_table {tuple(block_table.shape)} of {BS}-token blocks does not cover "
                         f"num_computed={nc} + {n} tokens")
    out = _out(out, q, (n, H, D))
    if n == 0:
        return out
    # no window (or one as long as the context) is the same mask as a window of ctx: keeps the arithmetic in int32
    w = min(int(window), ctx) if window else ctx
    # invariant: one tile shape for any chunk length (a long chunk's), so a row's bits do not depend on its chunk
    BM, BN, warps = _prefill_config(1 << 20 if invariant else n, D, q.dtype, _capability(q.device))
    _kernels().prefill[(triton.cdiv(n, BM), H)](
        q, k_cache, v_cache, block_table, out, float(scale) * 1.4426950408889634, nc, n, w,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0), *out.stride(),
        G=H // Hkv, D=D, BS=BS, BLOCK_M=BM, BLOCK_N=BN, FP32=q.dtype == torch.float32,
        UPCAST=q.dtype == torch.bfloat16 and _interpret(), num_warps=warps)
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
        HB, HALF_P, warps = _rope_config(heads, half)
        _kernels().rope[(T, triton.cdiv(heads, HB))](
            qkv, cos, sin, qkv.stride(0), qkv.stride(1), cos.stride(0), sin.stride(0), half, heads, HB=HB,
            HALF_P=HALF_P, FP32=qkv.dtype == torch.float32, num_warps=warps, enable_fp_fusion=False)
    return qkv


def _rope_config(heads: int, half: int) -> tuple[int, int, int]:
    """HB (heads a program rotates), HALF_P, num_warps of ``rope_``: up to 1024 elements a program, 8 a thread (no
    spills at any head_dim, tests/engine/triton_aot.py). A Llama-3 8B token (40 heads of 128) takes 3 programs."""
    HALF_P = _pow2(half)
    HB = min(_pow2(heads), max(2, 1024 // HALF_P))
    return HB, HALF_P, max(1, min(4, HB * HALF_P // 256))


def _matmul_config(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """BM, BN, BK, num_warps of ``matmul``: fixed per dtype, never by shape, so a row gets the same bits in any
    batch. 16-bit: [64, 64] tiles over 64-wide K steps on 4 warps (one Hopper warpgroup; no spills on sm_90a or
    sm_80, tests/engine/triton_aot.py); float32: IEEE FMA dots on [32, 32] tiles, 32-wide K steps. Not yet timed
    on a GPU (a small batch wastes most of a 64-row tile: invariance, not speed)."""
    if dtype == torch.float32:
        return 32, 32, 32, 4
    return 64, 64, 64, 4


def matmul(x: Tensor, w: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x [M, K] @ w [K, N] (+ bias [N]) -> [M, N] in x's dtype, batch-invariant: row i of the result has the
    same bits whatever the other rows and however many there are (fixed tiles, K in order, no split-K; cuBLAS picks
    its algorithm, split-K included, by M). Any strides; w is a linear layer's weight transposed (``Dense.weight_t``)."""
    M, K = x.shape
    K2, N = w.shape
    if K2 != K or x.dtype != w.dtype or x.dtype not in _FLOATS or (bias is not None and bias.shape != (N,)):
        raise ValueError(f"matmul: x {tuple(x.shape)} {x.dtype} @ w {tuple(w.shape)} {w.dtype}"
                         + (f" + bias {tuple(bias.shape)}" if bias is not None else ""))
    y = x.new_empty(M, N)
    if M == 0 or N == 0:
        return y
    BM, BN, BK, warps = _matmul_config(x.dtype)
    b = bias if bias is not None else y  # (never read without HAS_BIAS)
    _kernels().matmul[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        x, w, b, y, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, BM=BM, BN=BN, BK=BK, FP32=x.dtype == torch.float32,
        UPCAST=x.dtype == torch.bfloat16 and _interpret(), num_warps=warps)
    return y
