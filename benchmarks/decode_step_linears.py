"""The linear layers of one batch-1 decode step of the `bench` model, against the memory limit, in one run.

Lifecycle: a one-shot script. It makes the 49 float32 weights one decode step of the built-in `bench` model
reads (12 layers of qkv [1280, 768], o [768, 768], gate_up [4096, 768], down [768, 2048], and the LM head
[8192, 768]; 327 MB, far beyond the last-level cache), packs them for oneDNN, and times one pass over all of
them at one input row through pdserve's panel kernel on the packed bytes, pdserve's row kernel on the dense
weights and oneDNN itself, interleaved round by round with a float32 sum over the same number of bytes, best
of ``--repeats``. Prints GB/s and milliseconds per step for each.

Usage: python benchmarks/decode_step_linears.py [--threads 2] [--repeats 12]
"""
from __future__ import annotations

import argparse
import time

import torch


from engine.kernels import cpu_kernels
from engine.onednn_layout import onednn_panels

SHAPES = [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12 + [(8192, 768)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kern = cpu_kernels()
    if kern is None:
        raise SystemExit("pdserve's CPU kernels did not build here (see the warning above)")
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) for n, k in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
    panels = [onednn_panels(p, w) for p, w in zip(packed, ws)]
    total = sum(w.numel() * 4 for w in ws)
    big = torch.ones(total // 4)
    xs = {k: torch.randn(1, k, generator=g) for k in (768, 2048)}
    cases = {
        "sum (reference)": lambda: big.sum(),
        "oneDNN": lambda: [torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")
                           for p, (_, k) in zip(packed, SHAPES)],
        "pdserve rows": lambda: [kern.linear_fp32(xs[k], w, None) for w, (_, k) in zip(ws, SHAPES)],
    }
    if all(p is not None for p in panels):
        cases["pdserve panels"] = lambda: [kern.linear_panel(xs[k], p, n, None) for p, (n, k) in zip(panels, SHAPES)]
    best = {name: float("inf") for name in cases}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, f in cases.items():
            t = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t)
    print(f"{len(SHAPES)} weights, {total / 1e6:.0f} MB, {args.threads} threads, {torch.__version__}")
    ref = total / best["sum (reference)"] / 1e9
    for name, t in best.items():
        gbs = total / t / 1e9
        print(f"{name:<16} {gbs:6.1f} GB/s {t * 1e3:7.2f} ms {gbs / ref:6.0%}")


if __name__ == "__main__":
    main()
