"""Capacity at scale from a profile: best disaggregated vs best colocated goodput per worker at 8 to 512 workers.

Lifecycle: for each workload (the conversation and code traces at their real lengths with Poisson
arrivals, and the conversation trace with bursty arrivals, gamma shape 0.25) and each worker budget
(``--workers``, default 8,32,128,512) it runs ``pdserve plan``'s search (simulator/plan.py) on the given
profile and SLOs. Small budgets search every P:D split, chunk size and local-prefill threshold; past
``--full-search-max`` workers the search keeps the chunk sizes and the P share (prefill workers over all)
that won at the largest fully searched budget and tries shares around it (a budget 16x larger does not
need its chunk size found again; its P:D share is what scale changes). Requests per simulation grow with
the budget (``--requests-per-worker``, at least ``--min-requests``), drawn from the trace from its start;
or, with ``--probe-seconds T``, each probe at rate R replays ceil(R x T) requests, the whole trace looped
when it runs out (``simulator.plan.loop_requests``: same lengths and order, arrivals continuing after the
trace's last one, a new first token each pass so a repeat is no prefix-cache hit), so that at the hundreds
of req/s a GPU worker serves a probe still lasts T seconds and queues have time to form. ``--prune`` starts
each candidate's bisection at 0.75x the best goodput of its mode so far and drops it there when it misses
(one probe per loser), and seeds each budget's first candidates from the previous budget's per-worker
goodput; ``--won-from`` takes the winners of small budgets from an earlier run's capacity.json, so a run of
only large budgets need not search the small ones again. The JSON is rewritten after every row.
It prints one Markdown table per profile (goodput, per worker, the winning deployments, disaggregated /
colocated) and writes capacity.json / capacity.md into ``--out``; bad flags exit 2 naming the flag.

Usage:
    python benchmarks/capacity.py --profile docs/profiles/h200-llama-8b-shape-bf16.json --ttft-slo-ms 2000 \\
        --tpot-slo-ms 50 --out results/capacity-h200
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]

from simulator.cluster_sim import SimConfig, SimRequest
from simulator.costs import load_profile
from simulator.plan import Planner, candidates, default_jobs, prune_order

TRACES = REPO.parent / "shared" / "traces"
WORKLOADS = {"conversation": ("azure_llm_2023_conv.csv", 1.0), "code": ("azure_llm_2023_code.csv", 1.0),
             "conversation, bursty (gamma 0.25)": ("azure_llm_2023_conv.csv", 0.25)}


def trace_requests(path: Path, n: Optional[int], max_len: int, seed: int) -> list[SimRequest]:
    """The trace's first ``n`` requests (all of them with None) at their real lengths, arrivals all 0 (each
    probe sets them)."""
    from loadtest.trace import load_trace
    from loadtest.workload import ModelLimits, build_workload, trace_lengths

    rows = load_trace(path, 0, n)
    wl = build_workload(trace_lengths(rows), [0.0] * len(rows), ModelLimits(vocab_size=32000, max_context_length=max_len),
                        seed=seed, id_prefix="cap")
    return [SimRequest(r.request_id, 0.0, r.prompt_token_ids, r.max_tokens) for r in wl.requests]


def write_json(ns: argparse.Namespace, slos: dict[str, float], results: list[dict], wall_s: float,
               argv: Optional[list[str]]) -> None:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()}
    (ns.out / "capacity.json").write_text(json.dumps(
        {"profile": str(ns.profile), "slos_ms": slos, "settings": settings,
         "command": " ".join(["python benchmarks/capacity.py"] + (sys.argv[1:] if argv is None else argv)),
         "results": results, "wall_s": wall_s}, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, required=True)
    ap.add_argument("--ttft-slo-ms", type=float, required=True)
    ap.add_argument("--tpot-slo-ms", type=float, required=True)
    ap.add_argument("--workers", default="8,32,128,512")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--chunk-sizes", default="512,2048")
    ap.add_argument("--local-prefill", default="0,auto")
    ap.add_argument("--requests-per-worker", type=int, default=25)
    ap.add_argument("--min-requests", type=int, default=400)
    ap.add_argument("--full-search-max", type=int, default=32)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=256 * 1024 * 1024)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-link", default="gloo", help="the profile's KV link the split prices (default gloo)")
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe-seconds", type=float, default=None,
                    help="size each probe by duration: rate x this many seconds of arrivals, the whole trace "
                         "looped when it runs out (instead of --requests-per-worker)")
    ap.add_argument("--rel-tol", type=float, default=0.04, help="bisection stops at this relative bracket")
    ap.add_argument("--prune", action="store_true",
                    help="start each candidate's bisection at 0.75x the best of its mode so far; drop it there if "
                         "it misses (one probe per loser)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="processes simulating candidates side by side (default: as pdserve plan's; with "
                         "--prune candidates are evaluated ahead of their turn: the same answer at any N)")
    ap.add_argument("--share-window", type=int, default=3,
                    help="past --full-search-max: P shares tried = the winner's +- k/32, k <= this")
    ap.add_argument("--won-from", type=Path, default=None,
                    help="a capacity.json of an earlier run: its winners (at budgets <= --full-search-max) seed "
                         "the search of larger budgets, so small budgets need not be searched again")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "capacity")
    ns = ap.parse_args(argv)
    if ns.probe_seconds is not None and not 0 < ns.probe_seconds < float("inf"):
        ap.error(f"--probe-seconds must be a finite number > 0, got {ns.probe_seconds}")
    if ns.jobs is not None and ns.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {ns.jobs}")
    from simulator.plan import _locals

    prof = load_profile(ns.profile)
    budgets = sorted(int(x) for x in ns.workers.split(","))
    chunks = sorted(int(x) for x in ns.chunk_sizes.split(","))
    slos = {"ttft": ns.ttft_slo_ms, "tpot": ns.tpot_slo_ms}
    ns.out.mkdir(parents=True, exist_ok=True)
    lines = [f"Profile {ns.profile.name}: {prof.model} {prof.dtype} on {prof.meta.get('device_name', prof.device)}; "
             f"SLOs TTFT {ns.ttft_slo_ms:g} ms, TPOT {ns.tpot_slo_ms:g} ms, 90% of requests; "
             f"KV cache {ns.kv_cache_memory_bytes / 2**30:g} GiB per worker, max {ns.max_num_seqs} sequences\n",
             "| workload | workers | best disaggregated | goodput (req/s) | per worker | best colocated | goodput (req/s) "
             "| per worker | disagg / coloc |", "| --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    results = []
    t_all = time.monotonic()
    names: list[str] = []
    for w in ns.workloads.split(","):  # a name may hold a comma ("conversation, bursty ..."): glue it back
        if names and w not in WORKLOADS:
            names[-1] += "," + w
        elif w:
            names.append(w)
    for wname in names:
        fname, burst = WORKLOADS[wname]
        base = SimConfig(kv_cache_memory_bytes=ns.kv_cache_memory_bytes, max_num_seqs=ns.max_num_seqs,
                         max_num_requests=100_000, kv_link=ns.kv_link)
        won: dict = {}
        hints: dict[str, float] = {}
        if ns.won_from is not None:  # the largest fully searched budget's winners of this workload
            prior = [r for r in json.loads(ns.won_from.read_text())["results"]
                     if r["workload"] == wname and r["workers"] <= ns.full_search_max]
            if prior:
                top = max(prior, key=lambda r: r["workers"])
                won = {m: SimConfig(**b["config"]) for m, b in top["best"].items()}
                hints = {m: b["goodput_per_worker"] for m, b in top["best"].items()}
        whole = trace_requests(ns.traces / fname, None, prof.max_model_len, ns.seed) if ns.probe_seconds else None
        for n in budgets:
            t0 = time.monotonic()
            reqs = whole or trace_requests(ns.traces / fname, max(ns.min_requests, ns.requests_per_worker * n),
                                           prof.max_model_len, ns.seed)
            planner = Planner(prof, reqs, slos, 0.9, burst, ns.seed, base, duration_s=ns.probe_seconds,
                              rel_tol=ns.rel_tol, prune=ns.prune, jobs=ns.jobs or default_jobs())
            planner.hints = dict(hints)
            planner.refine = n <= ns.full_search_max  # past it, --share-window chose the splits
            locals_ = _locals(ns.local_prefill, reqs)
            if n <= ns.full_search_max or not won:
                cfgs = candidates(n, chunks, locals_, base, ["colocated", "disaggregated"])
            else:
                d, c = won.get("disaggregated"), won.get("colocated")
                cfgs = []
                if c is not None:
                    cfgs.append(replace(c, colocated=n))
                if d is not None:
                    share = d.prefill / (d.prefill + d.decode)
                    ps = {min(n - 1, max(1, round(n * (share + k / 32))))
                          for k in range(-ns.share_window, ns.share_window + 1)}
                    # the winner's own share first: a pruned search then has the highest bar from the start
                    p0 = min(n - 1, max(1, round(n * share)))
                    cfgs += [replace(d, prefill=p, decode=n - p) for p in sorted(ps, key=lambda p: abs(p - p0))]
            if ns.prune:  # colocated first, then the disaggregated ones from the likeliest winners out
                w = won.get("disaggregated")
                cfgs = prune_order(cfgs, w.prefill / w.num_workers if w is not None else 0.5)
            with planner:  # (its worker processes end with the budget)
                done, best = planner.best_of(cfgs)
            if n <= ns.full_search_max:
                won = {m: c.cfg for m, c in best.items()}
            hints = {m: c.per_worker for m, c in best.items()}
            d, c = best.get("disaggregated"), best.get("colocated")
            ratio = (d.per_worker / c.per_worker) if d and c and c.per_worker else None
            row = {"workload": wname, "workers": n, "requests": len(reqs), "simulations": planner.simulations,
                   "requests_simulated": planner.requests_simulated,
                   "wall_s": time.monotonic() - t0, "best": {m: b.as_dict(prof) for m, b in best.items()},
                   "candidates": [{"deployment": c.cfg.label(), "goodput_rps": c.goodput,
                                   "pruned_below_rps": c.pruned_below, "probes": len(c.probes)} for c in done],
                   "disagg_over_coloc": ratio}
            results.append(row)
            print(f"{wname:36s} N={n:4d}: disagg {d.cfg.label() if d else '-'} {d.goodput if d else 0:.3g} req/s | "
                  f"coloc {c.cfg.label() if c else '-'} {c.goodput if c else 0:.3g} req/s | ratio "
                  f"{'-' if ratio is None else f'{ratio:.2f}'} ({planner.simulations} sims, "
                  f"{planner.speculation_wasted} evaluations started ahead and dropped, "
                  f"{time.monotonic() - t0:.0f} s)", flush=True)
            lines.append(f"| {wname} | {n} | {d.cfg.label() if d else 'none meets the SLOs'} | "
                         f"{d.goodput if d else 0:.3g} | {d.per_worker if d else 0:.3g} | "
                         f"{c.cfg.label() if c else 'none meets the SLOs'} | {c.goodput if c else 0:.3g} | "
                         f"{c.per_worker if c else 0:.3g} | {'-' if ratio is None else f'{ratio:.2f}x'} |")
            write_json(ns, slos, results, time.monotonic() - t_all, argv)  # after every row: a cut run keeps them
    write_json(ns, slos, results, time.monotonic() - t_all, argv)
    table = "\n".join(lines) + "\n"
    (ns.out / "capacity.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
