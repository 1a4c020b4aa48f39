"""Decode-attention cases for pdserve's Triton kernel and the float64 reference they are checked against, shared by
the interpreter tests (test_triton_kernels.py) and the GPU ones (test_triton_kernels_cuda.py). Torch only: importing
this never imports triton (which the interpreter tests must import first, in interpreter mode)."""
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
