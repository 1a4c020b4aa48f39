"""How far a measured profile's steps are from the roofline of the same model on the same device.

Lifecycle: one run reads a measured profile (``pdserve profile``'s ``profile.json``, its ``meta.samples``: every
timed engine step with its features), builds the roofline profile of the same model and numerics
(``simulator.roofline``) on the named device, or on this machine's own peaks (``--hardware measure``: a float32
matrix product and a read of a large tensor, at ``--threads``), and prints, per kind of step, the measured time
over the roofline's (1.00x: the engine runs at the roofline; 20x: it spends 95% of each step elsewhere). With
the default efficiencies of 1 and no overheads the roofline is the device's floor.

    python benchmarks/roofline_check.py --profile docs/profiles/cpu-amd-epyc-bench-fp32-1thread.json \\
        --hardware measure --threads 1
    python benchmarks/roofline_check.py --profile docs/profiles/h200-llama-1b-shape-bf16.json --hardware h200 \\
        --model cuda-bench-1b
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

from simulator.costs import StepFeatures, load_profile
from simulator.roofline import GB, HARDWARE, TFLOP, Efficiency, Hardware, model_config_of, roofline_profile

FEATURES = ("tokens", "sampled", "prefill_pairs", "decode_ctx", "prefill_ctx", "prefill_cached_pairs",
            "prefill_chunks")


def measure_host(threads: int, dtype: str) -> Hardware:
    """This machine's peaks at ``threads`` torch threads: the best of 5 [2048 x 2048] products (torch.mm, and
    oneDNN's on a prepacked weight as pdserve's CPU engine runs them), the best of 5 reads of a 512 MiB tensor."""
    import torch

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    a, b = torch.randn(2048, 2048, dtype=dt), torch.randn(2048, 2048, dtype=dt)
    best_mm = min(_timed(lambda: torch.mm(a, b)) for _ in range(5))
    try:  # the engine's own CPU product (oneDNN on a prepacked weight): AVX-512 where torch.mm's BLAS is not
        packed = torch.ops.mkldnn._reorder_linear_weight(b, None)
        best_mm = min(best_mm, *(_timed(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
                                 for _ in range(5)))
    except (RuntimeError, AttributeError):
        pass
    big = torch.ones(128 << 20, dtype=torch.float32)
    best_rd = min(_timed(lambda: big.sum()) for _ in range(5))
    return Hardware(f"this host, {threads} thread(s)", {dtype: 2 * 2048 ** 3 / best_mm},
                    memory_bytes_per_s=big.numel() * 4 / best_rd, memory_bytes=1e15, interconnect_bytes_per_s=1e9,
                    source="measured by benchmarks/roofline_check.py")


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="a measured profile.json (with meta.samples)")
    ap.add_argument("--hardware", required=True, help=f"{', '.join(HARDWARE)} or measure (this machine)")
    ap.add_argument("--model", default=None,
                    help="the model's shape: a named shape (cuda-bench-1b / cuda-bench-8b for the H200 profiles), a "
                         "built-in model or a directory; default: the profile's model")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for --hardware measure (default 1)")
    ap.add_argument("--mbu", type=float, default=1.0)
    ap.add_argument("--mfu", type=float, default=1.0)
    ap.add_argument("--step-overhead-ms", type=float, default=0.0)
    ap.add_argument("--json", default=None, help="also write the comparison here")
    args = ap.parse_args(argv)

    measured = load_profile(args.profile)
    samples = measured.meta.get("samples") or []
    if not samples:
        print(f"error: {args.profile} has no meta.samples", file=sys.stderr)
        return 2
    name = args.model or measured.model
    mc = model_config_of(name, measured.dtype)
    hw = measure_host(args.threads, measured.dtype) if args.hardware == "measure" else HARDWARE[args.hardware]
    eff = Efficiency(mbu=args.mbu, mfu=args.mfu, attention_mfu=args.mfu, step_overhead_s=args.step_overhead_ms / 1e3,
                     chunk_overhead_s=0.0)
    roof = roofline_profile(mc, hw, model=name, dtype=measured.dtype, quantization=measured.quantization,
                            kv_cache_dtype=measured.kv_cache_dtype, eff=eff, block_size=measured.block_size,
                            max_model_len=measured.max_model_len)
    print(f"{args.profile}: {len(samples)} measured steps of {name} ({measured.dtype}) on "
          f"{measured.meta.get('device_name', measured.device)}; roofline on {hw.name}: "
          f"{hw.flops[roof.meta['roofline']['math_dtype']] / TFLOP:.3g} TFLOP/s, "
          f"{hw.memory_bytes_per_s / GB:.3g} GB/s, weights {roof.weight_bytes_per_rank / GB:.3g} GB "
          f"(mbu {args.mbu}, mfu {args.mfu}, overhead {args.step_overhead_ms} ms)")
    rows: dict[str, list[tuple[int, float, float]]] = {}
    for s in samples:
        f = StepFeatures(**{k: s.get(k, 0) for k in FEATURES})
        rows.setdefault(s.get("kind", "?"), []).append((f.tokens, s["seconds"], roof.step.seconds(f)))
    print(f"{'kind':>8} {'steps':>5} {'tokens':>11} {'measured ms':>16} {'roofline ms':>16} "
          f"{'measured / roofline':>26}")
    out = {}
    for kind, r in sorted(rows.items()):
        ratios = sorted(m / x for _, m, x in r)
        toks = [t for t, _, _ in r]
        out[kind] = {"steps": len(r), "median_ratio": statistics.median(ratios), "min_ratio": ratios[0],
                     "max_ratio": ratios[-1]}
        print(f"{kind:>8} {len(r):>5} {min(toks):>5}-{max(toks):<5} "
              f"{min(m for _, m, _ in r) * 1e3:>7.2f}-{max(m for _, m, _ in r) * 1e3:<8.2f} "
              f"{min(x for _, _, x in r) * 1e3:>7.3f}-{max(x for _, _, x in r) * 1e3:<8.3f} "
              f"median {out[kind]['median_ratio']:6.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})")
    # where the time goes at the two ends: one-row decode steps, and the largest prefill step
    dec = [x for x in rows.get("decode", []) if x[0] == 1]
    pre = rows.get("prefill", [])
    big = min((x for x in pre if x[0] == max(t for t, _, _ in pre)), key=lambda x: x[1]) if pre else None
    if dec:
        m = statistics.median(x[1] for x in dec)
        print(f"one-sequence decode: measured {m * 1e3:.2f} ms against a floor of {dec[0][2] * 1e3:.3f} ms: "
              f"{dec[0][2] / m:.1%} of the step is the roofline's")
    if big:
        flops = 2 * roof.meta["roofline"]["linear_params_per_rank"] * big[0]
        print(f"largest prefill ({big[0]} tokens): {flops / big[1] / hw.flops[roof.meta['roofline']['math_dtype']]:.1%}"
              f" of the peak in the linear layers")
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": args.profile, "hardware": hw.name,
                                               "peak_flops": hw.flops, "memory_bytes_per_s": hw.memory_bytes_per_s,
                                               "kinds": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
