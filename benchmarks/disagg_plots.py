"""Plots of the disaggregated-vs-colocated benchmark, drawn from its result dict.

Lifecycle: ``write_plots(result, out_dir, cdf_rate, goal)`` is called once at the
end of ``disagg_vs_colocated.py`` (or on a saved ``result.json``, to redraw) and
writes three small PNGs: SLO attainment vs request rate (with the goal line),
p99 inter-token latency vs request rate, and the TTFT CDF of both modes at one
rate. matplotlib's object API on the Agg canvas: no pyplot global state.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

STYLE = {"disaggregated": dict(color="tab:blue", marker="o"), "colocated": dict(color="tab:orange", marker="s")}


def _fig() -> tuple[Figure, object]:
    fig = Figure(figsize=(5.0, 3.4), dpi=90, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def write_plots(result: dict, out_dir: Path, cdf_rate: float, goal: float) -> list[Path]:
    """attainment_vs_rate.png, p99_itl_vs_rate.png, ttft_cdf.png in ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pts = result["points"]
    slos = result["slos_ms"]
    paths = []

    fig, ax = _fig()
    for mode, ps in pts.items():
        ax.plot([p["rate"] for p in ps], [100 * p["attainment"] for p in ps], label=mode, **STYLE[mode])
    ax.axhline(100 * goal, color="gray", linestyle="--", linewidth=1, label=f"goal {goal:.0%}")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(f"TTFT<={slos['ttft']:.0f} ms and TPOT<={slos['tpot']:.0f} ms", fontsize=10)
    ax.set_ylim(-3, 103)
    ax.legend(fontsize=8)
    paths.append(out_dir / "attainment_vs_rate.png")
    fig.savefig(paths[-1])

    fig, ax = _fig()
    for mode, ps in pts.items():
        ax.plot([p["rate"] for p in ps], [p["summary"]["p99_itl_ms"] for p in ps], label=mode, **STYLE[mode])
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("p99 inter-token latency (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    paths.append(out_dir / "p99_itl_vs_rate.png")
    fig.savefig(paths[-1])

    fig, ax = _fig()
    for mode, ps in pts.items():
        p = min(ps, key=lambda q: abs(q["rate"] - cdf_rate))
        ttfts = sorted(t * 1000 for t, e in zip(p["ttfts"], p["errors"]) if not e)
        if ttfts:
            ax.step(ttfts, [(i + 1) / len(ps[0]["ttfts"]) for i in range(len(ttfts))], where="post",
                    label=f"{mode} @ {p['rate']:g} req/s", color=STYLE[mode]["color"])
    ax.axvline(slos["ttft"], color="gray", linestyle="--", linewidth=1, label="TTFT SLO")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.legend(fontsize=8)
    paths.append(out_dir / "ttft_cdf.png")
    fig.savefig(paths[-1])
    return paths


if __name__ == "__main__":  # redraw: python benchmarks/disagg_plots.py OUT_DIR/result.json [CDF_RATE]
    res = json.loads(Path(sys.argv[1]).read_text())
    rate = float(sys.argv[2]) if len(sys.argv) > 2 else res["settings"]["cdf_rate"]
    print(write_plots(res, Path(sys.argv[1]).parent, rate, res["settings"]["goal"]))
