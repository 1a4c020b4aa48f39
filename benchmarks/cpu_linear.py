"""One decode-shaped linear layer from DRAM: pdserve's CPU kernels and oneDNN against the memory limit, in one run.

Lifecycle: a one-shot script. It makes ``--copies`` distinct [N, K] float32 weights (together far beyond the
last-level cache, so every call reads DRAM, as a decode step over a whole model does), their oneDNN-prepacked,
int8 and int4 forms (read weight-only, and as w8a8 / w4a8 with int8 activations, by the row kernels and, on
AVX2 / AVX-512 builds, the integer panel kernels), and times pdserve's panel kernel on the oneDNN-packed bytes
beside oneDNN itself, and times one pass over all copies at M input rows for each format, interleaved round by
round, best of ``--repeats``; the panel kernels run once per ``--prefetch`` distance (bytes of their weight
stream prefetched ahead; 0 = none), so their machine-dependent setting is measured in the same rounds; the reference is a float32 sum over a tensor of the same total size, timed in
the same rounds. Prints GB/s of weight bytes read and the fraction of the sum's rate.

Usage: python benchmarks/cpu_linear.py [--n 2048] [--k 768] [--m 1 8 32] [--copies 48] [--threads 2]
       [--prefetch 0 4096]
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch


from engine.kernels import cpu_kernels
from engine.onednn_layout import onednn_panels
from engine.quant import (quantize_int4, quantize_int8, step_order, to_panels_int4, to_panels_int8,
                          to_panels_w4a8, to_panels_w8a8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2048, help="output features")
    ap.add_argument("--k", type=int, default=768, help="input features")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32], help="input rows (decode batch sizes)")
    ap.add_argument("--copies", type=int, default=48, help="distinct weights cycled through")
    ap.add_argument("--group", type=int, default=128, help="int4 group size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prefetch", type=int, nargs="+", default=None,
                    help="prefetch distances (bytes) to run the panel kernels with; default: none (this script loads no "
                         "model, so nothing tunes it)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kern = cpu_kernels()
    if kern is None:
        raise SystemExit("pdserve's CPU kernels did not build here (see the warning above)")
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(args.n, args.k, generator=g) for _ in range(args.copies)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
    panels = [onednn_panels(p, w) for p, w in zip(packed, ws)]  # views of the same packed bytes
    q8 = [quantize_int8(w) for w in ws]
    q4 = [quantize_int4(w, args.group) for w in ws]
    pw = kern.qpanel_width()
    order = step_order(args.k, kern.qstep())
    q8rows = [(q[:, order].contiguous(), s) for q, s in q8]  # the row kernel's stored order
    q8i = [to_panels_int8(q, s) for q, s in q8]
    q4i = [to_panels_int4(p, d, args.group) for p, d in q4]
    q8p = [to_panels_w8a8(q, s, pw, kern.qpanel_unsigned()) for q, s in q8] if pw else []
    q4p = [to_panels_w4a8(p, d, args.group, pw) for p, d in q4] if pw else []
    fp32_bytes = args.copies * args.n * args.k * 4
    big = torch.ones(fp32_bytes // 4)
    print(f"{args.copies} x [{args.n}, {args.k}] weights ({fp32_bytes / 2**20:.0f} MiB in float32), "
          f"{args.threads} threads, {torch.__version__}")
    dist = kern.PanelPrefetch()  # the panel cases' prefetch distances (a model keeps its own, tuned at load)
    print(f"prefetch (one row, several rows): {dist.get()} bytes unless named")
    print(f"{'M':>3} {'format':<22} {'GB/s':>7} {'of sum':>7}")
    for m in args.m:
        x = torch.randn(m, args.k, generator=g)
        cases: dict[str, tuple[Callable[[int], object], int]] = {
            "sum (reference)": (lambda i: big.sum() if i == 0 else None, fp32_bytes),
            "fp32 oneDNN": (lambda i: torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], ""),
                            fp32_bytes),
            "fp32 pdserve": (lambda i: kern.linear_fp32(x, ws[i], None), fp32_bytes),
            "fp32 panels": (lambda i: kern.linear_panel(x, panels[i], args.n, None, dist), fp32_bytes),
            "int8 pdserve": (lambda i: kern.linear_int8(x, *q8[i], None), fp32_bytes // 4),
            "int8 panels": (lambda i: kern.linear_int8_panels(x, *q8i[i], args.n, None, dist), fp32_bytes // 4),
            "int4 pdserve": (lambda i: kern.linear_int4(x, *q4[i], args.group, None), fp32_bytes // 8),
            "int4 panels": (lambda i: kern.linear_int4_panels(x, *q4i[i], args.n, args.group, None, dist), fp32_bytes // 8),
            "w8a8 pdserve": (lambda i: kern.linear_w8a8(x, *q8rows[i], None), fp32_bytes // 4),
            "w4a8 pdserve": (lambda i: kern.linear_w4a8(x, *q4[i], args.group, None), fp32_bytes // 8),
        }
        if pw:  # the integer panel kernels (what the engine uses on AVX2 / AVX-512 builds)
            cases["w8a8 panels"] = (lambda i: kern.linear_w8a8_panels(x, *q8p[i], args.n, None, dist), fp32_bytes // 4)
            cases["w4a8 panels"] = (lambda i: kern.linear_w4a8_panels(x, *q4p[i], args.n, args.group, None, dist),
                                    fp32_bytes // 8)
        if panels[0] is None:
            del cases["fp32 panels"]  # oneDNN packed another layout on this machine
        pfs = {name: None for name in cases}
        if args.prefetch is not None:  # every panel case once per distance
            for name in [n for n in cases if "panels" in n]:
                f_nb = cases.pop(name)
                for pf in args.prefetch:
                    cases[f"{name} pf{pf}"], pfs[f"{name} pf{pf}"] = f_nb, pf
        best = {name: float("inf") for name in cases}
        for _ in range(args.repeats + 1):  # the first round warms up
            for name, (f, _) in cases.items():
                if pfs.get(name) is not None:
                    dist.set(pfs[name], pfs[name])
                t = time.perf_counter()
                for i in range(args.copies):
                    f(i)
                best[name] = min(best[name], time.perf_counter() - t)
        ref = fp32_bytes / best["sum (reference)"] / 1e9
        for name, (_, nbytes) in cases.items():
            gbs = nbytes / best[name] / 1e9
            print(f"{m:>3} {name:<22} {gbs:7.1f} {gbs / ref:7.0%}")


if __name__ == "__main__":
    main()
