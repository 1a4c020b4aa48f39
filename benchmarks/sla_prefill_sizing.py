"""The SLA planner's prefill size against the simulator: the smallest prefill pool that meets a TTFT SLO.

Lifecycle: for each point (profile, Poisson rate, prompt/output lengths, TTFT and TPOT SLOs) the script builds
seeded requests (fixed lengths, or (prompt, output) pairs drawn from the conversation trace's first 400 rows),
asks ``cluster.sla_planner.plan`` (headroom 1.0) for the pools, and simulates prefill pools of growing size with a
decode pool twice the planner's (plus one) and KV blocks enough that decode never holds a prefill back, until the
simulated 90th percentile TTFT is within the SLO (it starts near the offered load and steps down while the
smaller pool still meets it). It prints one line per point: the simulator's smallest P, the planner's P, the P of
the earlier M/M/1 rule (each worker its own M/M/1 queue on the mean prompt's lone prefill s:
TTFT90 = r + ITL(B*) + s + s ln(10 rho) / (1 - rho), rho <= rho_max), and the p90 TTFT at each P tried.
The profiles: tests/cluster/test_sla_planner.py's round-number one and docs/profiles' quiet CPU one.

Usage:
    python benchmarks/sla_prefill_sizing.py                 # the representative points (~1 min on one core)
    python benchmarks/sla_prefill_sizing.py --grid          # 68 points (~4 min a seed)
    python benchmarks/sla_prefill_sizing.py --seed 2 --only quiet
"""
from __future__ import annotations

import argparse
import csv
import math
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from cluster.sla_planner import Load, SlaConfig, plan, prefill_seconds, wait_p90
from loadtest.stats import percentile, ttft_s
from simulator.cluster_sim import SimConfig, SimRequest, Simulation
from simulator.costs import LinkModel, Profile, StepModel, load_profile

TRACE = REPO / "tests" / "data" / "azure_llm_2023_conv_first400.csv"
QUIET = REPO / "docs" / "profiles" / "cpu-amd-epyc-bench-fp32-1thread-quiet.json"


def round_profile() -> Profile:
    """tests/cluster/test_sla_planner.py's profile: lin(T) = 0.01 + 0.001 (T - 1) s, 1e-6 s per prefill pair, ..."""
    return Profile(model="tiny", dtype="float32", quantization=None, kv_cache_dtype="auto", device="cpu", threads=1,
                   block_size=16, num_layers=4, kv_bytes_per_token=1000, max_model_len=4096,
                   step=StepModel(knots=[1, 1001], knot_s=[0.01, 1.01], per_sampled_row_s=0.0,
                                  per_prefill_pair_s=1e-6, per_decode_ctx_s=1e-5),
                   links={"gloo": LinkModel(0.002, 1e6)}, router_per_request_s=0.005, router_per_token_s=0.001)


def trace_lengths() -> list[tuple[int, int]]:
    with open(TRACE) as f:
        return [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]


def requests(rate: float, n: int, lengths, max_len: int, seed: int) -> list[SimRequest]:
    """``n`` Poisson arrivals; ``lengths`` a (prompt, output) pair or a list to draw from (prompts clipped so that
    prompt + output fits ``max_len``); unique random token ids (no prefix hits)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        p, o = lengths if isinstance(lengths, tuple) else rng.choice(lengths)
        o = max(1, o)
        p = max(1, min(p, max_len - o - 1))
        out.append(SimRequest(f"r{i}", t, [rng.randrange(1, 32000) for _ in range(p)], o))
    return out


def p90_ttft(profile: Profile, reqs: list[SimRequest], prefill: int, decode: int, seed: int) -> float:
    sim = Simulation(profile, SimConfig(prefill=prefill, decode=decode, num_kv_blocks=8192, max_num_requests=100000,
                                        enable_prefix_caching=False, seed=seed))
    recs = sim.run(reqs)
    bad = [r for r in recs if not r.success]
    if bad:
        return math.inf
    return percentile([ttft_s(r) for r in recs], 90)


def smallest_p(profile, reqs, slo_s, decode, seed, start=1, most=40):
    """The smallest prefill pool whose simulated p90 TTFT is within ``slo_s`` (None past ``most``), and the p90 TTFT
    of every size tried. Starts at ``start`` and steps down while that still meets the SLO."""
    tried = {}

    def ok(p):
        if p not in tried:
            tried[p] = p90_ttft(profile, reqs, p, decode, seed)
        return tried[p] <= slo_s

    p = max(1, start)
    if ok(p):
        while p > 1 and ok(p - 1):
            p -= 1
        return p, dict(sorted(tried.items()))
    while p < most:
        p += 1
        if ok(p):
            return p, dict(sorted(tried.items()))
    return None, dict(sorted(tried.items()))


def mm1_prefill(cfg: SlaConfig, load: Load, itl_s: float) -> int:
    """The earlier rule: every worker its own M/M/1 queue on the mean prompt's lone prefill s, at the largest
    utilisation rho <= rho_max (bisection) with r + ITL(B*) + s + s ln(10 rho) / (1 - rho) within the SLO."""
    prof = cfg.profile
    s = prefill_seconds(prof, load.prompt_tokens, cfg.max_num_batched_tokens)
    pair = prof.router_per_request_pair_s
    over = (prof.router_per_request_s if pair is None else max(pair, prof.router_per_request_s)) + itl_s
    slo = cfg.ttft_slo_ms / 1000
    if over + s >= slo:
        rho = cfg.rho_infeasible
    elif over + s + wait_p90(cfg.rho_max, s) <= slo:
        rho = cfg.rho_max
    else:
        lo, hi = 0.1, cfg.rho_max
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if over + s + wait_p90(mid, s) <= slo else (lo, mid)
        rho = lo
    return max(1, math.ceil(cfg.headroom * load.rate * s / rho - 1e-9))


POINTS = [
    # (profile key, rate, lengths ('trace' or (p, o)), TTFT SLO ms, TPOT SLO ms)
    ("round", 10.0, (100, 64), 560.0, 60.0),
    ("round", 20.0, (100, 64), 350.0, 60.0),
    ("round", 40.0, (100, 64), 560.0, 60.0),
    ("round", 4.0, (500, 64), 2000.0, 60.0),
    ("round", 0.75, "trace", 10000.0, 100.0),
    ("round", 1.5, "trace", 3000.0, 100.0),
    ("round", 3.0, "trace", 5000.0, 100.0),
    ("quiet", 20.0, (100, 64), 500.0, 100.0),
    ("quiet", 3.0, (1000, 64), 1000.0, 100.0),
    ("quiet", 3.0, (1000, 64), 3000.0, 100.0),
    ("quiet", 1.0, (3000, 64), 5000.0, 150.0),
    ("quiet", 1.0, "trace", 6000.0, 150.0),
    ("quiet", 2.0, "trace", 3000.0, 150.0),
    ("quiet", 4.0, "trace", 1500.0, 150.0),
]


def grid() -> list:
    out = []

    def add(key, lens, rates, slos, tpot):
        out.extend((key, r, lens, s, tpot) for r in rates for s in slos)

    add("round", (100, 64), (5, 10, 20, 40), (250, 350, 560, 1000), 60.0)
    add("round", (500, 64), (2, 4, 8), (1000, 2000, 4000), 60.0)
    add("round", "trace", (0.75, 1.5, 3), (3000, 5000, 10000), 100.0)
    add("quiet", (100, 64), (10, 20, 40), (200, 500, 1000), 100.0)
    add("quiet", (1000, 64), (1.5, 3, 6), (1000, 1500, 3000, 6000), 100.0)
    add("quiet", (3000, 64), (0.5, 1), (5000, 8000), 150.0)
    add("quiet", "trace", (1, 2, 4), (1500, 3000, 6000), 150.0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["round", "quiet"])
    ap.add_argument("--grid", action="store_true", help="68 points instead of the representative ones")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    profiles = {"round": round_profile(), "quiet": load_profile(QUIET)}
    trace = trace_lengths()
    for key, rate, lengths, ttft_ms, tpot_ms in (grid() if args.grid else POINTS):
        if args.only and key != args.only:
            continue
        prof = profiles[key]
        n = int(max(400, min(2000, rate * 200)))
        reqs = requests(rate, n, trace if lengths == "trace" else lengths, prof.max_model_len, args.seed)
        mp = sum(len(r.prompt_token_ids) for r in reqs) / n
        mo = sum(r.max_tokens for r in reqs) / n
        cfg = SlaConfig(profile=prof, ttft_slo_ms=ttft_ms, tpot_slo_ms=tpot_ms, headroom=1.0)
        load = Load(rate, mp, mo)
        pl = plan(cfg, load)
        old = mm1_prefill(cfg, load, pl.detail["itl_s"])
        decode = 2 * pl.sizes["decode"] + 1
        offered = rate * sum(prefill_seconds(prof, len(r.prompt_token_ids), cfg.max_num_batched_tokens)
                             for r in reqs) / n
        t0 = time.time()
        best, tried = smallest_p(prof, reqs, ttft_ms / 1000, decode, args.seed, start=int(0.85 * offered))
        lens = "trace" if lengths == "trace" else f"{lengths[0]}/{lengths[1]}"
        print(f"{key:5s} rate {rate:5.2f} lengths {lens:8s} (mean {mp:.0f}/{mo:.0f}) TTFT {ttft_ms:6.0f} ms "
              f"n={n} D={decode}: sim P {best}, planner P {pl.sizes['prefill']}, M/M/1 P {old}; p90 TTFT ms by P: "
              + ", ".join(f"{p}:{1000 * v:.0f}" for p, v in tried.items()) + f" [{time.time() - t0:.0f} s]",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
