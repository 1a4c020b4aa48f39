"""Decode- and prefill-attention cases for pdserve's Triton kernels and the float64 references they are checked
against, shared by the interpreter tests (test_triton_kernels.py) and the GPU ones (test_triton_kernels_cuda.py).
Torch only: importing this never imports triton (which the interpreter tests must import first, in interpreter
mode)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def _case(lens: list[int], H: int, Hkv: int, D: int, bs: int, dtype: torch.dtype, extra_cols: int = 0,
          seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q, k_cache, v_cache, block_tables, ctx_lens: each sequence's blocks scattered over the cache, block 0 left
    to the padding (random data there, so a read past the context shows)."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / bs) for n in lens]
    W = max(need) + extra_cols
    N = sum(need) + 3
    ids = (torch.randperm(N - 1, generator=g) + 1).tolist()
    bt = torch.zeros(len(lens), W, dtype=torch.int64)
    for b, nb in enumerate(need):
        bt[b, :nb] = torch.tensor([ids.pop() for _ in range(nb)])
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    kc = torch.randn(N, bs, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(N, bs, Hkv, D, generator=g).to(dtype)
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int64)


def _naive(q: Tensor, kc: Tensor, vc: Tensor, bt: Tensor, ctx: Tensor, window: Optional[int]) -> Tensor:
    """Per sequence and head, float64 softmax(q k^T / sqrt(D)) v over the live keys: the semantics spelled out."""
    B, H, D = q.shape
    bs, Hkv = kc.shape[1], kc.shape[2]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(ctx[b])
        blocks = bt[b, :math.ceil(n / bs)]
        k = kc[blocks].reshape(-1, Hkv, D)[:n].double()
        v = vc[blocks].reshape(-1, Hkv, D)[:n].double()
        pos = torch.arange(n)
        live = pos > n - 1 - window if window else pos >= 0
        for h in range(H):
            kvh = h // (H // Hkv)
            s = (k[live, kvh] @ q[b, h].double()) / math.sqrt(D)
            out[b, h] = torch.softmax(s, 0) @ v[live, kvh]
    return out


def _prefill_case(nc: int, n: int, H: int, Hkv: int, D: int, bs: int, dtype: torch.dtype, extra: int = 0,
                  seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q [n, H, D], k_cache, v_cache [N, bs, Hkv, D], block_table [nb + extra] for a chunk of n tokens after nc cached
    ones (the chunk's own K/V already in the cache, as write_kv leaves them): the context's blocks scattered over
    the cache; the unused blocks (which the ``extra`` padding entries of the table name) and the slots past the
    context in its last block hold NaN, so any read of them shows in the output."""
    g = torch.Generator().manual_seed(seed)
    ctx = nc + n
    nb = math.ceil(ctx / bs)
    N = nb + 3
    perm = torch.randperm(N, generator=g)
    used, spare = perm[:nb], perm[nb:]
    bt = torch.cat([used, spare[torch.arange(extra) % len(spare)]])
    q = torch.randn(n, H, D, generator=g)
    kc = torch.randn(N, bs, Hkv, D, generator=g)
    vc = torch.randn(N, bs, Hkv, D, generator=g)
    for c in (kc, vc):
        c[spare] = float("nan")
        c[used[-1], ctx - (nb - 1) * bs:] = float("nan")
    return q.to(dtype), kc.to(dtype), vc.to(dtype), bt


def _naive_prefill(q: Tensor, kc: Tensor, vc: Tensor, bt: Tensor, nc: int, window: Optional[int],
                   scale: Optional[float] = None) -> Tensor:
    """Per head, float64 softmax(q k^T * scale + mask) v over the context gathered through the block table, the query
    at position p = nc + i seeing keys p - window < k <= p: the prefill semantics spelled out."""
    n, H, D = q.shape
    bs, Hkv = kc.shape[1], kc.shape[2]
    ctx = nc + n
    scale = D ** -0.5 if scale is None else scale
    blocks = bt[:math.ceil(ctx / bs)]
    k = kc[blocks].reshape(-1, Hkv, D)[:ctx].double()
    v = vc[blocks].reshape(-1, Hkv, D)[:ctx].double()
    qpos = torch.arange(nc, ctx)[:, None]
    kpos = torch.arange(ctx)[None, :]
    live = kpos <= qpos
    if window:
        live &= kpos > qpos - window
    out = torch.empty(n, H, D, dtype=torch.float64)
    for h in range(H):
        kvh = h // (H // Hkv)
        s = (q[:, h].double() @ k[:, kvh].T) * scale
        out[:, h] = torch.softmax(s.masked_fill(~live, float("-inf")), dim=-1) @ v[:, kvh]
    return out
