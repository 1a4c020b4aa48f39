"""The simulator against real runs: the same requests through a real deployment and through `pdserve simulate`.

Lifecycle: the script reads a profile (``pdserve profile`` taken the same day on this machine, with
the workers' thread count) and a slice of a trace; for each configuration (colocated 2, disaggregated
1+1, disaggregated 1+1 with conditional disaggregation; chunk size by flag) it starts a real
``Deployment`` (benchmarks/harness/deployment.py: pinned worker processes with one torch thread, a router
in this process), warms it up, and replays the slice at each request rate (the trace's own gaps
rescaled to the mean rate, as benchmarks/disagg_vs_colocated.py does). Each point's exact requests
(prompt ids, lengths, arrival times) are then simulated with the profile. It reports, per point, the
real and simulated p50 / p90 TTFT, mean TPOT and p99 ITL with their relative errors, SLO attainment at
fixed SLOs (``--ttft-slo-ms`` / ``--tpot-slo-ms``), the goodput (DistServe: highest tested rate with
attainment >= 90%) of each, and the median absolute error per metric; ``--out`` gets result.json and
table.md. Prefix caching is off in both (the same requests are replayed at every rate).

Usage:
    pdserve profile --model bench --out /tmp/bench-profile.json
    python benchmarks/sim_validation.py --profile /tmp/bench-profile.json            # ~15 min on 2 cores
    python benchmarks/sim_validation.py --profile P --quick                          # smoke: tiny, 2 rates
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


from benchmarks.harness import (CONVERSATION_TRACE, REPO, Deployment, machine_info, replay, server_limits, usable_cores,
                                warm_up, workload_requests)
from benchmarks.harness import write_json

DEFAULT_TRACE = CONVERSATION_TRACE


METRICS = ("median_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "p99_itl_ms")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, required=True, help="profile.json of this machine and model")
    ap.add_argument("--model", default="bench")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--trace-start", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--length-scale", type=float, default=0.25)
    ap.add_argument("--rates", default="0.5,1,1.5,2,3")
    ap.add_argument("--configs", default="colocated,disaggregated,conditional",
                    help="colocated (2 workers), disaggregated (1+1), conditional (1+1, --local-prefill-max-tokens), "
                         "each optionally @CHUNK (its --max-num-batched-tokens), e.g. colocated@256,colocated@2048")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="every engine's chunk size")
    ap.add_argument("--local-prefill-max-tokens", type=int, default=192, help="the conditional configuration's")
    ap.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=100.0)
    ap.add_argument("--goal", type=float, default=0.9)
    ap.add_argument("--workers-per-host", type=int, default=2,
                    help="the simulation's workers per host (default 2: both workers share this machine, so the "
                         "profile's co-run model prices their contention; 1 prices none)")
    ap.add_argument("--router-apart", action="store_true",
                    help="simulate the router apart from the workers' cores (its CPU per token unpriced), as before 29 Nov")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="sweeps of every rate per configuration (noise)")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "sim_validation")
    ap.add_argument("--quick", action="store_true", help="tiny model, 12 requests, 2 rates, colocated + disaggregated")
    ap.add_argument("--resimulate", type=Path, default=None, metavar="RESULT.json",
                    help="run no deployment: simulate the same requests again (this version's simulator, --profile) "
                         "against the real numbers of an earlier run's result.json; writes to --out")
    return ap


def parse_config(name: str, ns: argparse.Namespace) -> tuple[str, int]:
    """("colocated" | "disaggregated" | "conditional", chunk size) of a ``--configs`` entry ``KIND[@CHUNK]``."""
    kind, _, chunk = name.partition("@")
    if kind not in ("colocated", "disaggregated", "conditional"):
        raise SystemExit(f"--configs: unknown {kind!r} (colocated, disaggregated, conditional, each optionally @CHUNK)")
    return kind, int(chunk) if chunk else ns.max_num_batched_tokens


def sim_config(name: str, ns: argparse.Namespace) -> Any:
    from simulator.cluster_sim import SimConfig

    kind, chunk = parse_config(name, ns)
    # the router and this load generator run here, unpinned, on the workers' cores: their CPU per token is priced
    base = dict(max_num_batched_tokens=chunk, enable_prefix_caching=False, prefix_aware_routing=False,
                workers_per_host=ns.workers_per_host, router_on_worker_cores=not ns.router_apart)
    if kind == "colocated":
        return SimConfig(mode="colocated", colocated=2, prefill=0, decode=0, **base)
    return SimConfig(local_prefill_max_tokens=ns.local_prefill_max_tokens if kind == "conditional" else 0, **base)


def deployment(name: str, ns: argparse.Namespace, cores: list[int]) -> Deployment:
    kind, chunk = parse_config(name, ns)
    engine_kw = {"enable_prefix_caching": False, "max_num_batched_tokens": chunk}
    router_kw: dict = {"prefix_aware_routing": False}
    if kind == "conditional":
        router_kw["local_prefill_max_tokens"] = ns.local_prefill_max_tokens
    return Deployment("colocated" if kind == "colocated" else "disaggregated", ns.model, cores,
                      engine_kw=engine_kw, router_kw=router_kw)


def _summary(records: list, duration: float) -> dict:
    from loadtest.stats import summarize

    return summarize(records, duration, percentiles=(50, 90, 99))


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.quick:
        ns.model, ns.num_requests, ns.rates, ns.configs = "tiny", 12, "2,6", "colocated,disaggregated"
    from loadtest.stats import goodput_rate, slo_attainment
    from loadtest.trace import load_trace, scale_trace
    from loadtest.workload import trace_lengths
    from simulator.costs import load_profile

    profile = load_profile(ns.profile)
    if profile.model != ns.model:
        raise SystemExit(f"--profile {ns.profile} measured {profile.model!r}, not --model {ns.model!r}")
    rates = sorted(float(r) for r in ns.rates.split(","))
    names = [c for c in ns.configs.split(",") if c]
    cores = usable_cores()[:2]
    info = machine_info()
    rows = scale_trace(load_trace(ns.trace, ns.trace_start, ns.num_requests), ns.length_scale, 1.0)
    lengths = trace_lengths(rows)
    span = rows[-1].arrival_s
    slos = {"ttft": ns.ttft_slo_ms, "tpot": ns.tpot_slo_ms}
    print(f"{len(rows)} requests, prompt median {statistics.median(p for p, _ in lengths):.0f}, output median "
          f"{statistics.median(o for _, o in lengths):.0f}; cores {cores}; load {info['loadavg_start']}", flush=True)
    result: dict = {"machine": info, "settings": {k: str(v) for k, v in vars(ns).items()}, "slos_ms": slos,
                    "profile_meta": {"threads": profile.threads,
                                     **{k: profile.meta.get(k) for k in ("pdserve_commit", "date", "device_name")}},
                    "configs": {}}
    t_all = time.monotonic()
    if ns.resimulate is not None:
        return resimulate(ns, profile, rows, lengths, span, slos, result)
    for name in names:
        cfg = sim_config(name, ns)
        reps: list[list[dict]] = [[] for _ in range(ns.repeats)]
        with deployment(name, ns, cores) as dep:
            limits = server_limits(dep.target)
            warm_up(dep.target, lengths, limits, ns.seed, ns.request_timeout, dep.mode)
            for rep in range(ns.repeats):  # the whole rate sweep again: the noise between sweeps is visible
                for rate in rates:
                    factor = (len(rows) - 1) / (rate * span) if span > 0 else 0.0
                    arrivals = [r.arrival_s * factor for r in rows]
                    reqs = workload_requests(lengths, arrivals, limits, ns.seed, f"{name[:4]}-{rep}-r{rate:g}")
                    real, duration = replay(dep.target, reqs, ns.request_timeout)
                    end = time.monotonic() + 10
                    while dep.router.num_in_flight and time.monotonic() < end:
                        time.sleep(0.05)
                    time.sleep(0.5)
                    rs = _summary(real, duration)
                    p = _sim_point(name, ns, profile, reqs, slos, rate, {m: rs[m] for m in METRICS},
                                   slo_attainment(real, slos), rs["completed"])
                    p["repeat"] = rep
                    reps[rep].append(p)
                    print(f"  {name:13s} #{rep} {rate:4g} req/s  " + "  ".join(
                        f"{m} {p['real'][m]:7.1f}/{p['sim'][m]:7.1f} ({p['error'][m]:+.0%})" for m in METRICS)
                        + f"  attain {p['real_attainment']:.0%}/{p['sim_attainment']:.0%}", flush=True)
        c = _close(name, cfg.label(), [p for r in reps for p in r], ns.goal)
        c["goodput_real_per_repeat"] = [goodput_rate([(p["rate"], p["real_attainment"]) for p in r], ns.goal)
                                        for r in reps]
        result["configs"][name] = c
        print(f"{name}: median |error| " + ", ".join(f"{m} {v:.1%}" for m, v in c["median_abs_error"].items())
              + f"; goodput real {c['goodput_real_per_repeat']} vs sim {c['goodput_sim']:g} req/s", flush=True)
    result["wall_s"] = time.monotonic() - t_all
    info["loadavg_end"] = os.getloadavg()
    ns.out.mkdir(parents=True, exist_ok=True)
    write_json(ns.out / "result.json", result)
    (ns.out / "table.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def _sim_point(name: str, ns: argparse.Namespace, profile: Any, reqs: list, slos: dict, rate: float,
               real_metrics: dict, real_attainment: float, real_ok: int) -> dict:
    from loadtest.stats import slo_attainment
    from simulator.cli import run_simulation
    from simulator.cluster_sim import SimRequest

    sreqs = [SimRequest(r.request_id, r.arrival_s, r.prompt_token_ids, r.max_tokens) for r in reqs]
    simmed, sdur, pools = run_simulation(profile, sim_config(name, ns), sreqs)
    ss = _summary(simmed, sdur)
    p = {"rate": rate, "real": real_metrics, "sim": {m: ss[m] for m in METRICS}, "real_ok": real_ok,
         "sim_ok": ss["completed"], "real_attainment": real_attainment, "sim_attainment": slo_attainment(simmed, slos),
         "sim_utilisation": {k: v.utilisation(sdur) for k, v in pools.items()}}
    p["error"] = {m: (p["sim"][m] - p["real"][m]) / p["real"][m] if p["real"][m] else None for m in METRICS}
    return p


def _close(name: str, cfg_label: str, pts: list, goal: float) -> dict:
    from loadtest.stats import goodput_rate

    mae = {m: statistics.median(abs(p["error"][m]) for p in pts if p["error"][m] is not None) for m in METRICS}
    return {"deployment": cfg_label, "points": pts, "median_abs_error": mae,
            "goodput_real": goodput_rate([(p["rate"], p["real_attainment"]) for p in pts], goal),
            "goodput_sim": goodput_rate([(p["rate"], p["sim_attainment"]) for p in pts], goal)}


def resimulate(ns: argparse.Namespace, profile: Any, rows: list, lengths: list, span: float, slos: dict,
               result: dict) -> int:
    """Simulate an earlier run's points again (same lengths and arrivals; prefix caching is off, so the prompt
    ids themselves do not matter) and compare with its real numbers."""
    from loadtest.workload import ModelLimits

    old = json.loads(ns.resimulate.read_text())
    limits = ModelLimits(vocab_size=8192, max_context_length=profile.max_model_len)
    result["resimulated_from"] = str(ns.resimulate)
    for name, c in old["configs"].items():
        pts = []
        for q in c["points"]:
            rate = q["rate"]
            factor = (len(rows) - 1) / (rate * span) if span > 0 else 0.0
            reqs = workload_requests(lengths, [r.arrival_s * factor for r in rows], limits, ns.seed, f"{name[:4]}-r{rate:g}")
            pts.append(_sim_point(name, ns, profile, reqs, slos, rate, q["real"], q["real_attainment"], q["real_ok"]))
        result["configs"][name] = _close(name, sim_config(name, ns).label(), pts, ns.goal)
    ns.out.mkdir(parents=True, exist_ok=True)
    write_json(ns.out / "result.json", result)
    (ns.out / "table.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = ["| config | rate (req/s) | p50 TTFT real / sim (ms) | p90 TTFT real / sim (ms) | mean TPOT real / sim (ms) "
             "| p99 ITL real / sim (ms) | attainment real / sim |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, c in result["configs"].items():
        for p in c["points"]:
            cells = [f"{p['real'][m]:.0f} / {p['sim'][m]:.0f} ({p['error'][m]:+.0%})" if m != "mean_tpot_ms" else
                     f"{p['real'][m]:.1f} / {p['sim'][m]:.1f} ({p['error'][m]:+.0%})" for m in METRICS]
            lines.append(f"| {name} | {p['rate']:g} | " + " | ".join(cells)
                         + f" | {p['real_attainment']:.0%} / {p['sim_attainment']:.0%} |")
    lines += ["", "| config | median abs error p50 TTFT | p90 TTFT | mean TPOT | p99 ITL | goodput real / sim (req/s) |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, c in result["configs"].items():
        e = c["median_abs_error"]
        lines.append(f"| {name} | {e['median_ttft_ms']:.1%} | {e['p90_ttft_ms']:.1%} | {e['mean_tpot_ms']:.1%} "
                     f"| {e['p99_itl_ms']:.1%} | {c['goodput_real']:g} / {c['goodput_sim']:g} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
