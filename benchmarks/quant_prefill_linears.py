"""Prefill-sized products of quantized weights: pdserve's panel kernel against dequantize + one float GEMM.

Lifecycle: a one-shot script. For each ``--shapes`` [N, K] layer it makes one random float32 weight, its
int8 / int4 weight-only panels and (on AVX2 / AVX-512 builds) its w8a8 / w4a8 integer panels, and times, for
each row count in ``--m``, the kernel the engine runs (``Linear._quantized_forward``) beside what it ran
before above 64 rows: the layer dequantized to float32 and ``F.linear`` (MKL), with the same activation
rounding for w8a8 / w4a8; and the plain float32 GEMM on the unquantized weight as a reference. Best of
``--repeats``, milliseconds, and the kernel's speed-up over dequantize + GEMM.

Usage: python benchmarks/quant_prefill_linears.py [--shapes 3072x768 768x3072] [--m 128 512 2048]
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F


from engine.kernels import cpu_kernels
from engine.quant import (fake_quantize_act, from_panels_int4, from_panels_int8, from_panels_w4a8,
                          from_panels_w8a8, quantize_int4, quantize_int8, to_panels_int4, to_panels_int8,
                          to_panels_w4a8, to_panels_w8a8)


def best_ms(f: Callable[[], object], repeats: int) -> float:
    f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["3072x768", "768x3072"], help="layers as NxK")
    ap.add_argument("--m", type=int, nargs="+", default=[128, 512, 2048], help="rows (prompt tokens)")
    ap.add_argument("--group", type=int, default=128, help="int4 group size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    k = cpu_kernels()
    if k is None:
        sys.exit("pdserve's CPU kernels are not built here")
    pw, unsigned, G = k.qpanel_width(), k.qpanel_unsigned(), args.group
    print(f"{args.threads} threads, torch {torch.__version__}; ms, best of {args.repeats}")
    print(f"{'layer':>10} {'rows':>5} {'format':<6} {'kernel':>8} {'dequant+GEMM':>13} {'speed-up':>9} "
          f"{'fp32 GEMM':>10}")
    for shape in args.shapes:
        N, K = (int(v) for v in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        w = torch.randn(N, K, generator=g)
        q8, s8 = quantize_int8(w)
        p4, d4 = quantize_int4(w, G)
        i8, i4 = to_panels_int8(q8, s8), to_panels_int4(p4, d4, G)
        fmts: dict[str, tuple[Callable, Callable]] = {
            "int8": (lambda x: k.linear_int8_panels(x, *i8, N, None),
                     lambda x: F.linear(x, from_panels_int8(*i8, N))),
            "int4": (lambda x: k.linear_int4_panels(x, *i4, N, G, None),
                     lambda x: F.linear(x, from_panels_int4(*i4, N, G))),
        }
        if pw:
            w8, w4 = to_panels_w8a8(q8, s8, pw, unsigned), to_panels_w4a8(p4, d4, G, pw)
            fmts["w8a8"] = (lambda x: k.linear_w8a8_panels(x, *w8, N, None),
                            lambda x: F.linear(fake_quantize_act(x), from_panels_w8a8(*w8, N, unsigned)))
            fmts["w4a8"] = (lambda x: k.linear_w4a8_panels(x, *w4, N, G, None),
                            lambda x: F.linear(fake_quantize_act(x), from_panels_w4a8(*w4, N, G)))
        for M in args.m:
            x = torch.randn(M, K, generator=g)
            ref = best_ms(lambda: F.linear(x, w), args.repeats)
            for name, (kern, gemm) in fmts.items():
                a, b = best_ms(lambda: kern(x), args.repeats), best_ms(lambda: gemm(x), args.repeats)
                print(f"{shape:>10} {M:>5} {name:<6} {a:8.1f} {b:13.1f} {b / a:8.2f}x {ref:10.1f}")


if __name__ == "__main__":
    main()
