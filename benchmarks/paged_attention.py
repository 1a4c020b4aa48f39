"""Paged decode attention: pdserve's C++ kernel against the gather + SDPA path, in one run.

Lifecycle: a one-shot script. For each (batch, context) point it builds a paged cache in the ``bench``
model's attention geometry (12 query heads, 4 KV heads, head_dim 64, block size 16, blocks scattered
at random), one query per sequence, and times ``gather_decode_attention`` (index_select of the context
into a contiguous copy, then one SDPA call: the engine's path without the kernels) and the kernel
(``cpu_kernels().paged_decode_attention``, reading K/V in place) on float32 and int8 caches; best of
``--repeats`` after a warm-up, both interleaved. Prints microseconds per call and the speed-up.

Usage: python benchmarks/paged_attention.py [--threads 2] [--repeats 20]
"""
from __future__ import annotations

import argparse
import time

import torch


from engine.attention import AttentionMetadata, gather_decode_attention
from engine.kernels import cpu_kernels
from engine.quant import quantize_kv

H, HKV, D, BS = 12, 4, 64, 16
POINTS = [(1, 256), (8, 256), (32, 256), (32, 1024), (64, 2048)]


def case(B: int, ctx: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(B * 7919 + ctx)
    nb = -(-ctx // BS)
    N = B * nb + 1
    table = torch.randperm(N, generator=g)[:B * nb].view(B, nb)
    k = torch.randn(N, BS, HKV, D, generator=g)
    v = torch.randn(N, BS, HKV, D, generator=g)
    if dtype == torch.int8:
        k, v = quantize_kv(k), quantize_kv(v)
    meta = AttentionMetadata(slot_mapping=torch.zeros(B, dtype=torch.long), num_decode=B,
                             decode_block_tables=table.contiguous(),
                             decode_ctx_lens=torch.full((B,), ctx, dtype=torch.long), block_size=BS)
    return torch.randn(B, H, D, generator=g), k, v, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kern = cpu_kernels()
    if kern is None:
        raise SystemExit("pdserve's CPU kernels are not built here (see the warning above)")
    print(f"{'batch':>5} {'ctx':>5} {'cache':>8} {'gather+sdpa us':>15} {'kernel us':>10} {'speed-up':>9}")
    for B, ctx in POINTS:
        for dtype in (torch.float32, torch.int8):
            q, k, v, meta = case(B, ctx, dtype)
            fns = {"ref": lambda: gather_decode_attention(q, k, v, meta, None),
                   "kern": lambda: kern.paged_decode_attention(q, k, v, meta.decode_block_tables,
                                                               meta.decode_ctx_lens, 0, D ** -0.5)}
            best = {n: float("inf") for n in fns}
            for rep in range(args.repeats + 1):
                for n, f in fns.items():
                    t = time.perf_counter()
                    f()
                    if rep:
                        best[n] = min(best[n], time.perf_counter() - t)
            print(f"{B:>5} {ctx:>5} {str(dtype).removeprefix('torch.'):>8} {best['ref'] * 1e6:>15.0f} "
                  f"{best['kern'] * 1e6:>10.0f} {best['ref'] / best['kern']:>8.1f}x", flush=True)


if __name__ == "__main__":
    main()
