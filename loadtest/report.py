"""Reporting a benchmark run: the summary table, the result JSON and PNG plots.

Lifecycle: after the run, the CLI passes the summary (``stats.summarize``), the
run's settings and the raw records here: ``print_summary`` writes the table
(rich), ``save_result`` writes the JSON that ``vllm bench serve --save-result``
users expect (its keys plus the settings, trace and scale factors included),
and ``write_plots`` draws latency CDFs and TTFT/ITL over time into a folder.
Plots use matplotlib's object API with the Agg canvas, never pyplot, so no
global figure state or display is touched.
"""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, TextIO

from rich.console import Console
from rich.table import Table

from loadtest.stats import RequestRecord, e2el_s, itls_s, per_request_arrays, tpot_s, ttft_s

_SECTIONS = (("ttft", "Time to First Token", "TTFT"),
             ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
             ("itl", "Inter-token Latency", "ITL"),
             ("e2el", "End-to-end Latency", "E2EL"))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def summary_table(summary: dict, settings: dict) -> Table:
    """The run summary as a rich table, laid out like `vllm bench serve`'s."""
    t = Table(title="Serving Benchmark Result", show_header=False, title_justify="center")
    t.add_column("metric")
    t.add_column("value", justify="right")
    if settings.get("trace"):
        t.add_row("Trace", f"{Path(settings['trace']).name} (length x{settings['length_scale']}, "
                           f"time x{settings['time_scale']})")
    rows = [("Successful requests", summary["completed"]),
            ("Failed requests", summary["failed"]),
            ("Maximum request concurrency", settings.get("max_concurrency") or "none"),
            ("Peak concurrent requests", summary["max_concurrent_requests"]),
            ("Benchmark duration (s)", summary["duration"]),
            ("Total input tokens", summary["total_input_tokens"]),
            ("Total generated tokens", summary["total_output_tokens"]),
            ("Request throughput (req/s)", summary["request_throughput"])]
    if settings.get("label"):
        rows.insert(0, ("Label", settings["label"]))
    if "request_goodput" in summary:
        rows.append(("Request goodput (req/s)", summary["request_goodput"]))
    rows += [("Output token throughput (tok/s)", summary["output_throughput"]),
             ("Peak output token throughput (tok/s)", summary.get("max_output_tokens_per_s", 0.0)),
             ("Total token throughput (tok/s)", summary["total_token_throughput"])]
    for name, value in rows:
        t.add_row(name, _fmt(value))
    pcts = [k.split("_")[0] for k in summary if k.startswith("p") and k.endswith("_ttft_ms")]
    for key, title, short in _SECTIONS:
        if f"mean_{key}_ms" not in summary:  # not among --percentile-metrics
            continue
        t.add_section()
        t.add_row(f"[bold]{title}[/bold]", "")
        t.add_row(f"Mean {short} (ms)", _fmt(summary[f"mean_{key}_ms"]))
        t.add_row(f"Median {short} (ms)", _fmt(summary[f"median_{key}_ms"]))
        for p in pcts:
            t.add_row(f"{p.upper()} {short} (ms)", _fmt(summary[f"{p}_{key}_ms"]))
    phases = summary.get("ttft_phases_ms")
    if phases:  # pdserve's breakdown of its own TTFT: mean / median / percentiles of each part
        t.add_section()
        t.add_row("[bold]TTFT by phase (server side, ms)[/bold]", "mean / median / " + " / ".join(
            k.upper() for k in next(iter(phases.values())) if k not in ("mean", "median")))
        for ph, st in phases.items():
            t.add_row(f"  {ph}", " / ".join(_fmt(v) for v in st.values()))
    return t


def print_summary(summary: dict, settings: dict, file: Optional[TextIO] = None) -> None:
    """Print the table to ``file`` (stdout by default)."""
    Console(file=file, width=100).print(summary_table(summary, settings))


def result_dict(summary: dict, settings: dict, records: list[RequestRecord]) -> dict:
    """Summary + settings + per-request arrays, the shape saved to JSON (``settings["backend"]``: which front end;
    ``settings["metadata"]``: ``--metadata`` pairs, written as top-level keys as vLLM does)."""
    settings = dict(settings)
    metadata = settings.pop("metadata", None) or {}
    return {"date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"), "backend": "pdserve-grpc",
            **settings, **metadata, **summary, **per_request_arrays(records)}


def default_result_name(settings: dict, date: Optional[str] = None) -> str:
    """vLLM's file name: ``{label}-{rate}qps[-concurrencyN]-{model}-{date}.json`` (ramp-up: both rates)."""
    date = date or datetime.now().strftime("%Y%m%d-%H%M%S")
    label = settings.get("label") or settings.get("backend", "pdserve")
    conc = f"-concurrency{settings['max_concurrency']}" if settings.get("max_concurrency") is not None else ""
    model = str(settings.get("model_id", "model")).rstrip("/").split("/")[-1]
    if settings.get("ramp_up_strategy"):
        rate = (f"ramp-up-{settings['ramp_up_strategy']}-{settings['ramp_up_start_rps']}qps-"
                f"{settings['ramp_up_end_rps']}qps")
    else:
        rate = f"{settings.get('request_rate')}qps"
    return f"{label}-{rate}{conc}-{model}-{date}.json"


def save_result(path: str | Path, summary: dict, settings: dict, records: list[RequestRecord]) -> Path:
    """Write the result JSON (parent folders created); returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result_dict(summary, settings, records), indent=2))
    return path


def _cdf(ax, values_ms: list[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(True, alpha=0.3)
    if not values_ms:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    xs = sorted(values_ms)
    n = len(xs)
    ax.step(xs, [(i + 1) / n for i in range(n)], where="post")


def write_plots(out_dir: str | Path, records: list[RequestRecord], title: str = "") -> list[Path]:
    """Latency CDFs (TTFT, TPOT, ITL, E2EL) and TTFT / ITL over time as PNGs in ``out_dir``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in records if r.success]
    paths: list[Path] = []

    def save(fig: Figure, name: str) -> None:
        FigureCanvasAgg(fig)
        fig.tight_layout()
        p = out / name
        fig.savefig(p, dpi=100)
        paths.append(p)

    fig = Figure(figsize=(10, 8))
    axes = fig.subplots(2, 2).ravel()
    _cdf(axes[0], [ttft_s(r) * 1000 for r in ok if ttft_s(r) is not None], "TTFT CDF")
    _cdf(axes[1], [tpot_s(r) * 1000 for r in ok if tpot_s(r) is not None], "TPOT CDF")
    _cdf(axes[2], [x * 1000 for r in ok for x in itls_s(r)], "ITL CDF")
    _cdf(axes[3], [e2el_s(r) * 1000 for r in ok], "E2E latency CDF")
    if title:
        fig.suptitle(title)
    save(fig, "latency_cdf.png")

    fig = Figure(figsize=(10, 4))
    ax = fig.subplots()
    ax.scatter([r.start_s for r in ok if r.chunk_times_s], [ttft_s(r) * 1000 for r in ok if r.chunk_times_s], s=8)
    ax.set_xlabel("request sent (s after start)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"TTFT over time {title}".strip())
    ax.grid(True, alpha=0.3)
    save(fig, "ttft_over_time.png")

    fig = Figure(figsize=(10, 4))
    ax = fig.subplots()
    # Each gap is drawn at the time its later message arrived.
    ax.scatter([t for r in ok for t in r.chunk_times_s[1:]], [x * 1000 for r in ok for x in itls_s(r)], s=4)
    ax.set_xlabel("token received (s after start)")
    ax.set_ylabel("ITL (ms)")
    ax.set_title(f"ITL over time {title}".strip())
    ax.grid(True, alpha=0.3)
    save(fig, "itl_over_time.png")
    return paths
