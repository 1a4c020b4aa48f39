"""Disaggregated (P prefill + D decode workers, default 1+1) vs colocated (N workers, default 2) serving on a trace.

Lifecycle: the script loads a slice of the Azure LLM conversation trace (read
from ``../shared/traces``, never copied), scales its lengths to fit the model on
this machine, and keeps that one list of requests (same prompts, same lengths,
same arrival pattern) for every point. For each mode it starts a ``Deployment``
(workers in their own processes, each pinned to its own core with one torch
thread; the router and this load generator share the machine, unpinned), warms
it up, and for each request rate replays the slice with its inter-arrival times
rescaled to that mean rate (``loadtest``'s client and stats). Before the colocated
runs it measures the unloaded latency of one request at a time (the slice's median
and 90th-percentile prompts): the SLOs are multiples of it (DistServe's practice):
TTFT SLO = ``--ttft-slo-scale`` x unloaded TTFT of the p90 prompt (with a 90%
attainment goal the p90 prompt must fit, with room to queue behind others), TPOT SLO
= ``--tpot-slo-scale`` x unloaded TPOT (one sequence decoding alone).
Per rate and mode it reports p50/p99 TTFT, p99 ITL, mean TPOT and SLO attainment
(requests meeting both SLOs / requests sent), then goodput in DistServe's sense
(the highest rate with attainment >= 90%), the ratios to the goals (disaggregated
p99 ITL <= 1/3 of colocated; goodput >= 2x), a JSON file and PNG plots in ``--out``.

Usage:
    python benchmarks/disagg_vs_colocated.py                 # the recorded run (bench model, ~7 min on a quiet 2-core host)
    python benchmarks/disagg_vs_colocated.py --quick         # smoke run: tiny model, few requests (~1 min)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


from benchmarks.harness import (CONVERSATION_TRACE, REPO, Deployment, machine_info, replay, server_limits, usable_cores,
                                warm_up, workload_requests)
from benchmarks.harness import spy, write_json

DEFAULT_TRACE = CONVERSATION_TRACE
MODES = ("colocated", "disaggregated")  # colocated first: it also hosts the unloaded calibration


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench", help="built-in model or HF dir (default: bench)")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Azure conversation trace CSV")
    ap.add_argument("--trace-start", type=int, default=0, help="first trace row of the slice")
    ap.add_argument("--num-requests", type=int, default=32, help="requests per (mode, rate) point")
    ap.add_argument("--length-scale", type=float, default=0.25, help="multiply the trace's prompt/output lengths")
    ap.add_argument("--rates", default="0.5,1,1.5,2,2.5,3,4", help="comma-separated mean request rates (req/s)")
    ap.add_argument("--local-prefill-max-tokens", type=int, default=0,
                    help="disaggregated mode: the router's conditional disaggregation, prompts of at most this many "
                         "tokens are prefilled on the decode worker (default 0: off)")
    ap.add_argument("--prefill-queue-max-tokens", type=int, default=None,
                    help="disaggregated mode: prefill on the decode worker while the prefill worker has at least "
                         "this many prompt tokens queued (default: off)")
    ap.add_argument("--ttft-slo-scale", type=float, default=3.0, help="TTFT SLO = this x unloaded TTFT of the p90 prompt")
    ap.add_argument("--tpot-slo-scale", type=float, default=3.0, help="TPOT SLO = this x unloaded TPOT")
    ap.add_argument("--goal", type=float, default=0.9, help="SLO attainment that counts as served (DistServe: 0.9)")
    ap.add_argument("--cdf-rate", type=float, default=None, help="rate of the TTFT CDF plot (default: middle rate)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="deadline of each request (s)")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "disagg_vs_colocated", help="JSON + PNG folder")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of modes to run (dev aid)")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "int8", "fp8"), default="auto",
                    help="every worker's KV cache (int8: a quarter of float32's bytes per transferred token)")
    ap.add_argument("--quantization", choices=("int8", "int4", "w8a8", "w4a8"), default=None, help="every worker's weights")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny model, 8 requests, 2 rates")
    ap.add_argument("--colocated-workers", type=int, default=2, help="workers of the colocated deployment")
    ap.add_argument("--prefill-workers", type=int, default=1, help="prefill workers of the disaggregated deployment")
    ap.add_argument("--decode-workers", type=int, default=1, help="decode workers of the disaggregated deployment")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the engines run; cuda: every worker on the one GPU (a 1P+1D deployment's KV over "
                         "CUDA IPC, the prefill cache one shareable allocation), each still pinned to a core")
    ap.add_argument("--dtype", default=None, help="engine dtype (default: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="each worker's KV cache (default: the engine's 256 MiB); on a shared GPU all must fit")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="every engine's step budget, i.e. the chunked-prefill chunk (default: the engine's 2048)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="colocated and decode workers launch each step while the one before runs (--device cuda)")
    ap.add_argument("--reserve-cores", type=int, default=0,
                    help="leave this many of the usable cores (the lowest) to the router and the load generator; "
                         "workers are pinned one per core on the next ones")
    ap.add_argument("--cores-per-worker", type=int, default=1,
                    help="pin each worker to this many consecutive cores (a GPU worker's engine thread, gRPC threads "
                         "and, with --engine-process, its engine process share them); every mode gets the same")
    ap.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS",
                    help="sample every worker (and engine process) with py-spy, idle threads too, for this long "
                         "during each mode's lowest-rate point: top leaf functions printed, stacks in --out")
    ap.add_argument("--engine-process", action="store_true",
                    help="colocated workers run their engine core in a process of their own (vLLM v1's split; "
                         "prefill and decode workers keep it in process: their KV cache is shared with the link)")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ns = build_parser().parse_args(argv)
    if ns.quick:
        ns.model, ns.num_requests, ns.rates = "tiny", 8, "4,16"
    try:
        ns.rate_list = sorted({float(r) for r in ns.rates.split(",") if r.strip()})
    except ValueError:
        raise SystemExit(f"--rates: expected comma-separated numbers, got {ns.rates!r}")
    if not ns.rate_list or min(ns.rate_list) <= 0:
        raise SystemExit(f"--rates: need positive rates, got {ns.rates!r}")
    if ns.num_requests < 2:
        raise SystemExit(f"--num-requests must be >= 2, got {ns.num_requests}")
    if ns.async_scheduling and ns.device != "cuda":
        raise SystemExit("--async-scheduling needs --device cuda (a CPU forward runs on the thread that schedules)")
    if ns.py_spy < 0 or (ns.py_spy and spy.py_spy_bin() is None):
        raise SystemExit("--py-spy: needs a positive number of seconds and the py-spy command (pdserve[bench])")
    if not ns.trace.is_file():
        raise SystemExit(f"--trace: no such file {ns.trace}")
    ns.mode_list = [m for m in MODES if m in ns.modes.split(",")]
    if not ns.mode_list:
        raise SystemExit(f"--modes: expected some of {MODES}, got {ns.modes!r}")
    for name in ("colocated_workers", "prefill_workers", "decode_workers"):
        if getattr(ns, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    if ns.cores_per_worker < 1:
        raise SystemExit(f"--cores-per-worker must be >= 1, got {ns.cores_per_worker}")
    need = ns.reserve_cores + ns.cores_per_worker * max(len(worker_roles(m, ns)) for m in ns.mode_list)
    if ns.reserve_cores < 0 or need > len(usable_cores()):
        raise SystemExit(f"--reserve-cores {ns.reserve_cores} + {ns.cores_per_worker} core(s) for each worker of the "
                         f"largest deployment need {need} cores; {len(usable_cores())} are usable here")
    if ns.cdf_rate is None:
        ns.cdf_rate = ns.rate_list[len(ns.rate_list) // 2]
    return ns


def engine_and_worker_kw(ns: argparse.Namespace) -> tuple[dict, dict]:
    """Every worker's engine fields, and the prefill and decode workers' config fields, from the flags."""
    engine_kw: dict = {"enable_prefix_caching": False, "kv_cache_dtype": ns.kv_cache_dtype,
                       "quantization": ns.quantization}
    if ns.dtype is not None or ns.device == "cuda":
        engine_kw["dtype"] = ns.dtype or "bfloat16"
    if ns.kv_cache_gib is not None:
        engine_kw["kv_cache_memory_bytes"] = int(ns.kv_cache_gib * 2**30)
    if ns.max_num_batched_tokens is not None:
        engine_kw["max_num_batched_tokens"] = ns.max_num_batched_tokens
    role_kw: dict = {}
    if ns.device == "cuda":
        # one GPU for all: a prefill cache another process maps (CUDA IPC; NCCL refuses two ranks on one device)
        engine_kw.update(device="cuda", kv_cache_shared=True)
        if ns.async_scheduling:  # (the harness's prefill workers drop it, as the cluster's do)
            engine_kw["async_scheduling"] = True
        role_kw = {"prefill": {"kv_backend": "nccl"}, "decode": {"kv_backend": "nccl"}}
    if ns.engine_process:
        role_kw["colocated"] = {"engine_process": True}
    return engine_kw, role_kw


def _spy_on(dep: Deployment, mode: str, rate: float, ns: argparse.Namespace) -> dict:
    """py-spy on every worker and engine process of ``dep`` (not the router) for ``--py-spy`` seconds, from now."""
    ns.out.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, pid in dep.pids.items():
        if name != "router":
            raw = ns.out / f"py-spy-{mode}-{name}-rate{rate:g}.txt"
            out[name] = (spy.start(pid, ns.py_spy, raw, idle=True), raw)
    return out


def _spy_report(spies: dict, point: dict, ns: argparse.Namespace) -> None:
    """Wait for ``spies`` (``_spy_on``), print each process's top leaf functions and keep them in ``point``."""
    for name, (proc, raw) in spies.items():
        proc.wait(ns.py_spy + 60)
        top = spy.top_functions(raw) if raw.exists() else []
        point.setdefault("profiles", {})[name] = top
        print(f"    py-spy {name} ({raw}): " + ", ".join(f"{f} {share:.0%}" for f, share in top[:8]), flush=True)


def worker_roles(mode: str, ns: argparse.Namespace) -> tuple[str, ...]:
    """The worker roles of ``mode``'s deployment, from the worker-count flags."""
    if mode == "colocated":
        return ("colocated",) * ns.colocated_workers
    return ("prefill",) * ns.prefill_workers + ("decode",) * ns.decode_workers



def calibrate(dep: Deployment, prompt_lens: dict, limits: Any, seed: int, timeout_s: float,
              n: int = 3, out_len: int = 33) -> dict:
    """Unloaded latency: ``n`` requests per prompt length, one at a time; medians of TTFT (per length) and TPOT."""
    from loadtest.stats import tpot_s, ttft_s

    out: dict = {"mode": dep.mode, "requests_per_length": n, "output_len": out_len, "prompt_lens": prompt_lens}
    tpots = []
    for name, plen in prompt_lens.items():
        reqs = workload_requests([(plen, out_len)] * n, [0.0] * n, limits, seed + 3, f"calib-{name}")
        recs, _ = replay(dep.target, reqs, timeout_s, max_concurrency=1)
        if not all(r.success for r in recs):
            raise RuntimeError(f"calibration failed: {[r.error for r in recs if not r.success]}")
        out[f"ttft_{name}_s"] = statistics.median(ttft_s(r) for r in recs)
        tpots += [tpot_s(r) for r in recs]
    out["tpot_s"] = statistics.median(tpots)
    return out


def run_point(dep: Deployment, rate: float, rows: list, lengths: list, limits: Any, ns: argparse.Namespace) -> dict:
    """Replay the slice at mean ``rate`` req/s; the summary plus per-request arrays."""
    from loadtest.stats import per_request_arrays, summarize

    span = rows[-1].arrival_s
    # rescale the trace's gaps so N-1 gaps average 1/rate: same burst pattern at every rate
    factor = (len(rows) - 1) / (rate * span) if span > 0 else 0.0
    arrivals = [r.arrival_s * factor for r in rows]
    reqs = workload_requests(lengths, arrivals, limits, ns.seed, f"{dep.mode[:4]}-r{rate:g}")
    t = time.monotonic()
    records, duration = replay(dep.target, reqs, ns.request_timeout)
    summary = summarize(records, duration, percentiles=(50, 90, 99))
    print(f"  {dep.mode:13s} rate {rate:5.2f} req/s: {summary['completed']}/{len(records)} ok in "
          f"{time.monotonic() - t:5.1f} s, p99 TTFT {summary['p99_ttft_ms']:8.1f} ms, "
          f"p99 ITL {summary['p99_itl_ms']:7.1f} ms, mean TPOT {summary['mean_tpot_ms']:6.1f} ms", flush=True)
    phases = summary.get("ttft_phases_ms")
    if phases:  # the server's own TTFT breakdown: where the first token's time went (1 Dec: the worker queue)
        print("    TTFT p50 by phase: " + ", ".join(f"{ph} {v['median']:.1f} ms" for ph, v in phases.items()),
              flush=True)
    # a finished request's decode blocks are freed right after its last token: let the workers settle
    end = time.monotonic() + 10
    while dep.router.num_in_flight and time.monotonic() < end:
        time.sleep(0.05)
    time.sleep(0.5)
    return {"rate": rate, "summary": summary, "records": records, **per_request_arrays(records)}


def analyse(points: dict, slos_ms: dict, goal: float) -> dict:
    """Attainment per point, goodput per mode and the goal ratios."""
    from loadtest.stats import goodput_rate, slo_attainment

    out: dict = {"per_mode": {}, "ratios": {}}
    for mode, pts in points.items():
        for p in pts:
            p["attainment"] = slo_attainment(p["records"], slos_ms)
            p["attainment_ttft"] = slo_attainment(p["records"], {"ttft": slos_ms["ttft"]})
            p["attainment_tpot"] = slo_attainment(p["records"], {"tpot": slos_ms["tpot"]})
        curve = [(p["rate"], p["attainment"]) for p in pts]
        out["per_mode"][mode] = {"goodput_rate": goodput_rate(curve, goal),
                                 "goodput_rate_interpolated": goodput_rate(curve, goal, interpolate=True)}
    if set(MODES) - set(points):
        return out  # a one-mode dev run: no ratios
    d, c = points["disaggregated"], points["colocated"]
    out["ratios"]["p99_itl_disagg_over_coloc"] = {
        p["rate"]: (p["summary"]["p99_itl_ms"] / q["summary"]["p99_itl_ms"] if q["summary"]["p99_itl_ms"] else None)
        for p, q in zip(d, c)}
    for key in ("goodput_rate", "goodput_rate_interpolated"):
        gd, gc = out["per_mode"]["disaggregated"][key], out["per_mode"]["colocated"][key]
        out["ratios"][f"{key}_disagg_over_coloc"] = gd / gc if gc else (float("inf") if gd else None)
    return out


def print_report(points: dict, analysis: dict, slos_ms: dict, calib: dict, ns: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=150)
    con.print(f"SLOs: TTFT <= {slos_ms['ttft']:.0f} ms ({ns.ttft_slo_scale:g} x unloaded {calib['ttft_p90_s'] * 1e3:.0f} ms"
              f" of the p90 prompt, {calib['prompt_lens']['p90']} tokens),"
              f" TPOT <= {slos_ms['tpot']:.1f} ms ({ns.tpot_slo_scale:g} x unloaded {calib['tpot_s'] * 1e3:.1f} ms);"
              f" goal: {ns.goal:.0%} of requests meet both")
    t = Table(title=f"{ns.model}: {ns.num_requests} requests/point from {ns.trace.name} "
                    f"(rows {ns.trace_start}+, lengths x{ns.length_scale:g})")
    for col in ("rate req/s", "mode", "ok", "p50 TTFT ms", "p99 TTFT ms", "p99 ITL ms", "mean TPOT ms",
                "attain TTFT", "attain TPOT", "attain both", "p99 ITL D/C"):
        t.add_column(col, justify="right")
    ratios = analysis["ratios"].get("p99_itl_disagg_over_coloc", {})
    for i, rate in enumerate(ns.rate_list):
        for mode in [m for m in MODES if m in points]:
            p = points[mode][i]
            s = p["summary"]
            ratio = ratios.get(rate) if mode == "disaggregated" else None
            t.add_row(f"{rate:g}", {"colocated": "coloc", "disaggregated": "disagg"}[mode], f"{s['completed']}/{s['completed'] + s['failed']}",
                      f"{s['median_ttft_ms']:.0f}", f"{s['p99_ttft_ms']:.0f}", f"{s['p99_itl_ms']:.0f}",
                      f"{s['mean_tpot_ms']:.1f}", f"{p['attainment_ttft']:.0%}", f"{p['attainment_tpot']:.0%}",
                      f"{p['attainment']:.0%}", "" if ratio is None else f"{ratio:.2f}")
    con.print(t)
    pm = analysis["per_mode"]
    for mode in [m for m in MODES if m in points]:
        con.print(f"goodput {mode}: {pm[mode]['goodput_rate']:g} req/s (tested rates), "
                  f"{pm[mode]['goodput_rate_interpolated']:.2f} req/s (interpolated)")
    r = analysis["ratios"]
    if not r:
        return
    con.print(f"goodput disagg/coloc: {r['goodput_rate_disagg_over_coloc']} (tested rates), "
              f"{r['goodput_rate_interpolated_disagg_over_coloc']} (interpolated); goal >= 2")


def markdown_table(result: dict) -> str:
    """The per-rate table of both modes as Markdown (for docs/benchmarks.md)."""
    pts, ratios = result["points"], result["ratios"].get("p99_itl_disagg_over_coloc", {})
    lines = ["| rate (req/s) | mode | ok | p50 TTFT (ms) | p99 TTFT (ms) | p99 ITL (ms) | mean TPOT (ms) "
             "| TTFT SLO met | TPOT SLO met | both met | p99 ITL disagg/coloc |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    modes = [m for m in MODES if m in pts]
    for i in range(len(pts[modes[0]])):
        for mode in modes:
            p = pts[mode][i]
            s = p["summary"]
            r = ratios.get(p["rate"]) if mode == "disaggregated" else None
            lines.append(f"| {p['rate']:g} | {mode} | {s['completed']}/{s['completed'] + s['failed']} "
                         f"| {s['median_ttft_ms']:.0f} | {s['p99_ttft_ms']:.0f} | {s['p99_itl_ms']:.0f} "
                         f"| {s['mean_tpot_ms']:.1f} | {p['attainment_ttft']:.0%} | {p['attainment_tpot']:.0%} "
                         f"| **{p['attainment']:.0%}** | {'' if r is None else f'{r:.2f}'} |")
    return "\n".join(lines) + "\n"


def _write_partial(out: Path, calib: dict, points: dict) -> None:
    """Every point measured so far (``out/partial.json``), without the per-request records."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "partial.json").write_text(json.dumps({"calibration": calib, "points": _without_records(points)},
                                                 indent=1, default=str))


def _without_records(points: dict) -> dict:
    """Each mode's points without their per-request records (what the JSON files keep)."""
    return {m: [{k: v for k, v in p.items() if k != "records"} for p in pts] for m, pts in points.items()}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    from loadtest.trace import load_trace, scale_trace
    from loadtest.workload import trace_lengths

    cores = usable_cores()[ns.reserve_cores:]
    info = machine_info()
    rows = scale_trace(load_trace(ns.trace, ns.trace_start, ns.num_requests), ns.length_scale, 1.0)
    lengths = trace_lengths(rows)
    plens = sorted(p for p, _ in lengths)
    median_prompt = int(statistics.median(plens))
    p90_prompt = int(round(float(np.percentile(plens, 90))))
    print(f"{len(rows)} requests from {ns.trace.name}, lengths x{ns.length_scale:g}: prompt median {median_prompt}, "
          f"p90 {p90_prompt}, max {max(p for p, _ in lengths)}; output median {int(statistics.median(o for _, o in lengths))}; "
          f"worker cores {cores[:ns.cores_per_worker * max(len(worker_roles(m, ns)) for m in ns.mode_list)]} "
          f"({ns.cores_per_worker} a worker); load average {info['loadavg_start']}", flush=True)
    points: dict = {}
    calib: dict = {}
    pinning: dict = {}
    t_all = time.monotonic()
    for mode in ns.mode_list:
        t = time.monotonic()
        # prefix caching off: the same requests are replayed at every rate, so a warm cache would
        # make later rates' prefills free and the rates incomparable
        # prefix-aware routing off too: with the engines' caches off its hints would only skew load balance
        router_kw: dict = {"prefix_aware_routing": False}
        if mode == "disaggregated":
            router_kw.update(local_prefill_max_tokens=ns.local_prefill_max_tokens,
                             prefill_queue_max_tokens=ns.prefill_queue_max_tokens)
        engine_kw, role_kw = engine_and_worker_kw(ns)
        roles = worker_roles(mode, ns)
        with Deployment(mode, ns.model, cores[:ns.cores_per_worker * len(roles)], engine_kw=engine_kw,
                        router_kw=router_kw, roles=roles, role_worker_kw=role_kw,
                        cores_per_worker=ns.cores_per_worker) as dep:
            limits = server_limits(dep.target)
            pinning[mode] = dep.pinning
            print(f"{mode}: up in {time.monotonic() - t:.1f} s, workers pinned {dep.pinning}", flush=True)
            warm_up(dep.target, lengths, limits, ns.seed, ns.request_timeout, dep.mode)
            if not calib:
                calib = calibrate(dep, {"p50": median_prompt, "p90": p90_prompt}, limits, ns.seed,
                                  ns.request_timeout)
                print(f"unloaded ({mode}): TTFT {calib['ttft_p50_s'] * 1e3:.1f} ms (prompt {median_prompt}), "
                      f"{calib['ttft_p90_s'] * 1e3:.1f} ms (prompt {p90_prompt}); "
                      f"TPOT {calib['tpot_s'] * 1e3:.1f} ms", flush=True)
            points[mode] = []
            for rate in ns.rate_list:
                spies = _spy_on(dep, mode, rate, ns) if ns.py_spy and rate == ns.rate_list[0] else {}
                points[mode].append(run_point(dep, rate, rows, lengths, limits, ns))
                _spy_report(spies, points[mode][-1], ns)
                _write_partial(ns.out, calib, points)  # a run cut short (a deadline, a lent machine) keeps its points
    slos_ms = {"ttft": ns.ttft_slo_scale * calib["ttft_p90_s"] * 1e3, "tpot": ns.tpot_slo_scale * calib["tpot_s"] * 1e3}
    analysis = analyse(points, slos_ms, ns.goal)
    print_report(points, analysis, slos_ms, calib, ns)
    info["loadavg_end"] = os.getloadavg()
    ns.out.mkdir(parents=True, exist_ok=True)
    result = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()},
              "machine": info, "pinning": pinning, "wall_s": time.monotonic() - t_all,
              "calibration": calib, "slos_ms": slos_ms, **analysis,
              "points": _without_records(points)}
    (ns.out / "table.md").write_text(markdown_table(result))
    write_json(ns.out / "result.json", result)
    from benchmarks.disagg_plots import write_plots

    write_plots(result, ns.out, ns.cdf_rate, ns.goal)
    print(f"wrote {ns.out / 'result.json'} and plots in {ns.out} ({time.monotonic() - t_all:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
