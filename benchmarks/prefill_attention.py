"""Causal prefill attention: pdserve's C++ kernel against torch's flash SDPA (the engine's fallback), in one run.

Lifecycle: a one-shot script. For each prompt length it makes random q [n, H, D] and k / v [n, Hkv, D] float32
(the `bench` model's heads by default: 12 query heads, 4 KV heads, head_dim 64), checks the kernel against SDPA
(max abs difference), then times both interleaved round by round, best of ``--repeats``: the kernel
(``prefill_attention``: K and V copied into per-head blocks, flash-style tiles over the causal half) and what
engine/attention.py ran before it (GQA by ``repeat_interleave``, then ``F.scaled_dot_product_attention`` with
``is_causal=True``, torch's CPU flash kernel). Prints ms per call, GFLOP/s over the causal half and the ratio.

With ``--cached C [C ...]`` it also times a chunk of ``--chunk`` new tokens after C cached ones (a later chunk of
a chunked prefill, or a prefix-cache hit) in a paged float32 cache of 16-token blocks in shuffled order:
``prefill_attention_paged`` (the context read through the block table) against what engine/attention.py runs
without it (the sequence's blocks gathered by ``index_select``, GQA by ``repeat_interleave``, SDPA with an
explicit causal mask).

Usage: python benchmarks/prefill_attention.py [--n 512 2048 4096] [--heads 12] [--kv-heads 4] [--head-dim 64]
       [--threads 2] [--repeats 5] [--cached 512 1536 3584] [--chunk 512]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


from engine.kernels import cpu_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[512, 2048, 4096], help="prompt lengths")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cached", type=int, nargs="*", default=[], help="cached tokens before a chunk (paged case)")
    ap.add_argument("--chunk", type=int, default=512, help="new tokens of the paged case")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kern = cpu_kernels()
    if kern is None:
        raise SystemExit("pdserve's CPU kernels did not build here (see the warning above)")
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    G = H // Hkv
    print(f"H={H} Hkv={Hkv} D={D}, {args.threads} threads, torch {torch.__version__}")
    print(f"{'n':>6} {'sdpa ms':>9} {'kernel ms':>10} {'kernel GFLOP/s':>15} {'speed-up':>9} {'max diff':>9}")
    g = torch.Generator().manual_seed(0)
    for n in args.n:
        q, k, v = (torch.randn(n, h, D, generator=g) for h in (H, Hkv, Hkv))

        def sdpa():
            ks = k.transpose(0, 1).repeat_interleave(G, dim=0).unsqueeze(0)
            vs = v.transpose(0, 1).repeat_interleave(G, dim=0).unsqueeze(0)
            return F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), ks, vs, is_causal=True)[0].transpose(0, 1)

        def kernel():
            return kern.prefill_attention(q, k, v, 0, D ** -0.5)

        diff = (kernel() - sdpa()).abs().max().item()
        best = {"sdpa": float("inf"), "kernel": float("inf")}
        for _ in range(args.repeats + 1):  # the first round warms up
            for name, f in (("sdpa", sdpa), ("kernel", kernel)):
                t = time.perf_counter()
                f()
                best[name] = min(best[name], time.perf_counter() - t)
        flops = 2 * 2 * H * D * n * (n + 1) / 2  # q.k and p.v over the causal half
        print(f"{n:>6} {best['sdpa'] * 1e3:9.1f} {best['kernel'] * 1e3:10.1f} {flops / best['kernel'] / 1e9:15.0f} "
              f"{best['sdpa'] / best['kernel']:8.2f}x {diff:9.1e}")
    if args.cached:
        print(f"chunk of {args.chunk} new tokens after C cached ones, float32 paged cache, 16-token blocks")
        print(f"{'C':>6} {'gather+sdpa ms':>15} {'kernel ms':>10} {'speed-up':>9} {'max diff':>9}")
    for c in args.cached:
        n, ctx, bs = args.chunk, c + args.chunk, 16
        nblk = -(-ctx // bs)
        table = torch.randperm(nblk + 8, generator=g)[:nblk]
        kc, vc = (torch.randn(nblk + 8, bs, Hkv, D, generator=g) for _ in range(2))
        q = torch.randn(n, H, D, generator=g)
        i, j = torch.arange(c, ctx)[:, None], torch.arange(ctx)[None, :]
        mask = j <= i

        def gather_sdpa():
            ks = kc.index_select(0, table).view(-1, Hkv, D)[:ctx].transpose(0, 1).repeat_interleave(G, dim=0)
            vs = vc.index_select(0, table).view(-1, Hkv, D)[:ctx].transpose(0, 1).repeat_interleave(G, dim=0)
            return F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0),
                                                  attn_mask=mask)[0].transpose(0, 1)

        def paged():
            return kern.prefill_attention_paged(q, kc, vc, table, ctx, 0, D ** -0.5)

        diff = (paged() - gather_sdpa()).abs().max().item()
        best = {"sdpa": float("inf"), "kernel": float("inf")}
        for _ in range(args.repeats + 1):
            for name, f in (("sdpa", gather_sdpa), ("kernel", paged)):
                t = time.perf_counter()
                f()
                best[name] = min(best[name], time.perf_counter() - t)
        print(f"{c:>6} {best['sdpa'] * 1e3:15.1f} {best['kernel'] * 1e3:10.1f} {best['sdpa'] / best['kernel']:8.2f}x "
              f"{diff:9.1e}")


if __name__ == "__main__":
    main()
