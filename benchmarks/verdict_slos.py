"""SLO attainment and goodput of a disagg_vs_colocated.py result at other SLOs than the run's own.

Usage:
    python benchmarks/verdict_slos.py RESULT.json [RESULT.json ...] [--slos 200:25,500:25,1000:50] [--goal 0.9]

Why: benchmarks/disagg_vs_colocated.py sets its SLOs at 3x the unloaded TTFT and TPOT (DistServe's practice), which
on a fast GPU engine are tens of milliseconds; a service promises absolute ones (docs/capacity.md's GPU tables use
TTFT 1000 ms / TPOT 50 ms). The result JSON keeps every request's TTFT, latency and output length, so the same
run answers for any SLO pair without rerunning it: a request meets (TTFT, TPOT) when its TTFT is within the first
and its mean time per output token after the first, (latency - TTFT) / (output tokens - 1), within the second
(the run's own rule). Goodput: the highest tested rate whose attainment reaches ``--goal``, and every rate below it
too (DistServe's), or 0.

Lifecycle: a one-shot reader; prints one line per SLO pair and mode.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def attainment(point: dict[str, Any], ttft_ms: float, tpot_ms: float) -> float:
    """The fraction of a point's requests that met both SLOs (failed requests count as missed)."""
    n = len(point["ttfts"])
    ok = 0
    for i, (ttft, lat, out) in enumerate(zip(point["ttfts"], point["latencies"], point["output_lens"])):
        if point.get("errors") and point["errors"][i]:
            continue
        tpot = (lat - ttft) / max(1, out - 1)
        ok += ttft * 1e3 <= ttft_ms and tpot * 1e3 <= tpot_ms
    return ok / n if n else 0.0


def goodput(points: list[dict[str, Any]], ttft_ms: float, tpot_ms: float, goal: float) -> float:
    """The highest rate such that it and every lower tested rate reach ``goal``; 0 if the lowest does not."""
    best = 0.0
    for p in sorted(points, key=lambda p: p["rate"]):
        if attainment(p, ttft_ms, tpot_ms) < goal:
            break
        best = p["rate"]
    return best


def parse_slos(text: str) -> list[tuple[float, float]]:
    try:
        pairs = [tuple(float(v) for v in item.split(":")) for item in text.split(",") if item.strip()]
    except ValueError:
        raise SystemExit(f"--slos: expected TTFT_MS:TPOT_MS pairs, comma-separated, got {text!r}")
    if not pairs or any(len(p) != 2 or min(p) <= 0 for p in pairs):
        raise SystemExit(f"--slos: expected positive TTFT_MS:TPOT_MS pairs, got {text!r}")
    return [(a, b) for a, b in pairs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--slos", default="200:25,500:25,1000:50", help="TTFT_MS:TPOT_MS pairs, comma-separated")
    ap.add_argument("--goal", type=float, default=0.9)
    args = ap.parse_args(argv)
    slos = parse_slos(args.slos)
    if not 0 < args.goal <= 1:
        raise SystemExit(f"--goal: a fraction of requests in (0, 1], got {args.goal}")
    for path in args.results:
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"{path}: not a disagg_vs_colocated.py result ({e})")
        if not isinstance(d, dict) or not isinstance(d.get("points"), dict) or "tpot" not in d.get("slos_ms", {}):
            raise SystemExit(f"{path}: not a disagg_vs_colocated.py result (no points or slos_ms)")
        own = (d["slos_ms"]["ttft"], d["slos_ms"]["tpot"])
        print(f"{path}:")
        for ttft, tpot in [own, *slos]:
            cells = []
            for mode, pts in d["points"].items():
                att = " ".join(f"{p['rate']:g}:{attainment(p, ttft, tpot):.0%}" for p in sorted(pts, key=lambda p: p["rate"]))
                cells.append(f"{mode} goodput {goodput(pts, ttft, tpot, args.goal):g} req/s ({att})")
            print(f"  TTFT <= {ttft:.0f} ms, TPOT <= {tpot:.1f} ms: " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
