"""`pdserve simulate`: replay a workload through a simulated deployment and report what `pdserve bench` would.

Lifecycle: ``main(argv)`` parses ``pdserve bench``'s workload, load and output flags (the same
functions build them: ``loadtest.cli.add_workload_args``) plus ``--profile`` and the deployment's
flags as ``pdserve up`` spells them; checks everything before any work (exit 2 with the flag
named); builds the same requests a ``pdserve bench`` with those flags would send (same lengths,
arrivals, seeds; prompts from the trace's ``hash_ids`` when it has them, so shared prefixes hit
the prefix cache); runs ``simulator.cluster_sim.Simulation`` on a virtual clock (each pool's steps priced
by the ``--profile`` taken at its tensor-parallel size: one file per size, ``simulator.costs.ProfileSet``);
prints the same
summary table and, with ``--save-result``, writes the same JSON keys as ``pdserve bench`` plus a
``simulation`` block (per-pool utilisation, the deployment, the profile's provenance).

Example::

    pdserve profile --model bench --out bench.json
    pdserve simulate --profile bench.json --trace ../shared/traces/azure_llm_2023_conv.csv \\
        --num-prompts 200 --length-scale 0.25 --request-rate 2 --prefill 1 --decode 1 \\
        --goodput ttft:2000 tpot:100 --save-result sim.json
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any, Optional

import numpy as np

from loadtest.cli import (add_workload_args, check_workload_args, result_path, workload_lengths_and_arrivals,
                          workload_settings)
from loadtest.report import print_summary, save_result
from loadtest.stats import RequestRecord, summarize
from loadtest.trace import HASH_BLOCK_TOKENS, load_trace
from loadtest.workload import ModelLimits, build_workload
from simulator.cluster_sim import (DEFAULT_KV_CACHE_BYTES, DEFAULT_MAX_NUM_SEQS, PoolStats, SimConfig, SimRequest,
                                   Simulation)
from simulator.costs import Profile, ProfileSet, load_profiles

log = logging.getLogger(__name__)

SIM_VOCAB = 32000
"""Vocabulary random prompt ids are drawn from (only equality of ids matters to the simulated engines)."""


def add_deployment_args(p: argparse.ArgumentParser, pools: bool = True) -> None:
    """The deployment flags, spelled as ``pdserve up`` spells them."""
    g = p.add_argument_group("deployment (as `pdserve up` takes them)")
    if pools:
        g.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers (default 1)")
        g.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers (default 1)")
        g.add_argument("--colocated", type=int, default=0, metavar="K",
                       help="K colocated workers instead of prefill/decode pools")
        g.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                       help="every engine's per-step token budget (chunked prefill; default 2048)")
        g.add_argument("--local-prefill-max-tokens", type=int, default=0, metavar="N",
                       help="conditional disaggregation: prompts of at most N tokens prefill on the decode worker")
        g.add_argument("--prefill-queue-max-tokens", type=int, default=None, metavar="N",
                       help="conditional disaggregation: prefill on the decode worker while the prefill pool has "
                            "N prompt tokens queued")
        g.add_argument("--no-kv-delta-transfers", dest="kv_delta_transfers", action="store_false",
                       help="ship every prompt's whole KV, even what the decode worker holds from earlier turns")
        g.add_argument("--kv-prefix-fetch-min-tokens", type=int, default=64, metavar="N",
                       help="a prefill worker holding N or more fewer of a prompt's leading tokens than its decode "
                            "worker receives them from it instead of computing them (and receiving them is estimated faster; default 64, 0 = never)")
        g.add_argument("--no-decode-prefix-routing", dest="decode_prefix_routing", action="store_false",
                       help="pick decode workers by load alone, not by the history they hold")
        g.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                       help="the router scores prefixes on its mirror of where it sent what, not on the engines' KV "
                            "events (as `pdserve router --no-kv-events`)")
        g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                       help="ranks of every worker (priced by the --profile taken at N; default 1)")
        g.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                       help="ranks of each prefill worker (default --tensor-parallel-size)")
        g.add_argument("--decode-tp", type=int, default=None, metavar="N",
                       help="ranks of each decode worker (default --tensor-parallel-size)")
    g.add_argument("--rank-memory-bytes", type=int, default=None, metavar="B",
                   help="memory of one rank (a GPU, or a process's share of a host) for weights and KV: the KV cache "
                        "gets what the profile's weights per rank leave (default: --kv-cache-memory-bytes per rank)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per worker (default: by memory)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=DEFAULT_KV_CACHE_BYTES,
                   help="KV cache per worker when --num-kv-blocks is not given (the engine's default 256 MiB)")
    g.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                   help=f"running sequences per engine (default {DEFAULT_MAX_NUM_SEQS})")
    g.add_argument("--no-prefix-caching", action="store_true", help="engines do not reuse cached prompt prefixes")
    g.add_argument("--max-num-requests", type=int, default=192, metavar="N",
                   help="router-wide bound on requests held (default 192, the router's)")
    g.add_argument("--kv-link", default="gloo", help="KV transport of the profile to price transfers with (gloo)")
    g.add_argument("--workers-per-host", type=int, default=1, metavar="N",
                   help="workers sharing one host (one core or GPU each; hosts fill in creation order): steps slow "
                        "while host mates step, by the profile's co-run model (default 1: no contention)")
    g.add_argument("--router-on-worker-cores", action="store_true",
                   help="the router (and the load's client) shares the workers' cores, as pdserve up and a load test "
                        "on one machine do: each token's router CPU (the profile's) lengthens its worker's step")
    g.add_argument("--quantization", default=None, help="must match the profile's (checked)")
    g.add_argument("--kv-cache-dtype", default=None, help="must match the profile's (checked)")


def sim_config_from_args(args: argparse.Namespace, **over: Any) -> SimConfig:
    kw = dict(mode="colocated" if args.colocated else "disaggregated", prefill=args.prefill, decode=args.decode,
              colocated=args.colocated, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, enable_prefix_caching=not args.no_prefix_caching,
              local_prefill_max_tokens=args.local_prefill_max_tokens,
              prefill_queue_max_tokens=args.prefill_queue_max_tokens, max_num_requests=args.max_num_requests,
              kv_link=args.kv_link, workers_per_host=args.workers_per_host, seed=args.seed,
              router_on_worker_cores=getattr(args, "router_on_worker_cores", False),
              tensor_parallel_size=args.tensor_parallel_size, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
              rank_memory_bytes=args.rank_memory_bytes,
              kv_delta_transfers=getattr(args, "kv_delta_transfers", True),
              decode_prefix_routing=getattr(args, "decode_prefix_routing", True),
              kv_prefix_fetch_min_tokens=getattr(args, "kv_prefix_fetch_min_tokens", 64),
              kv_events=getattr(args, "kv_events", True))
    kw.update(over)
    return SimConfig(**kw)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, action="append", metavar="FILE",
                   help="profile.json from `pdserve profile`; repeat it with one profile per tensor-parallel size "
                        "the pools run")
    p.add_argument("--model", default=None, help="the model the profile must have measured (checked)")
    add_workload_args(p)
    add_deployment_args(p)
    return p


def check_profile_args(args: argparse.Namespace) -> ProfileSet:
    """The ``--profile`` files (one per TP) as a checked ``ProfileSet``; ValueError naming the flag."""
    profiles = load_profiles(args.profile)
    profiles.base.check_matches(model=args.model, kv_cache_dtype=args.kv_cache_dtype,
                                quantization=args.quantization if args.quantization is not None else "",
                                where=profiles.where)
    return profiles


def _hash_prompt(hashes: tuple[int, ...], length: int, block: int, seed: int) -> list[int]:
    """A prompt whose i-th block of ``block`` tokens is a function of ``hashes[i]`` alone (then unique ids)."""
    out: list[int] = []
    for h in hashes:
        if len(out) >= length:
            break
        rng = np.random.default_rng([seed, h & 0xFFFFFFFF, h >> 32 & 0xFFFFFFFF])
        out.extend(rng.integers(0, SIM_VOCAB, size=block).tolist())
    if len(out) < length:
        rng = np.random.default_rng([seed, 1 << 31, length, len(hashes)] + list(hashes[:4]))
        out.extend(rng.integers(0, SIM_VOCAB, size=length - len(out)).tolist())
    return out[:length]


def hashed_trace_rows(args: argparse.Namespace) -> Optional[list]:
    """The trace's rows when their ``hash_ids`` name the prompts' blocks (only JSON lines carry them), else None:
    the simulated prompts are then made from those ids, so requests sharing ids share prefixes."""
    if args.dataset_name == "trace" and str(args.trace).endswith(".jsonl"):
        rows = load_trace(args.trace, args.trace_start, args.num_prompts)
        if any(r.hash_ids for r in rows):
            return rows
    return None


def requests_from_args(args: argparse.Namespace, profile: Profile) -> tuple[list[SimRequest], Any, int]:
    """(requests, request rate as reported, how many were clipped to the model's length): what `pdserve bench`
    with the same flags would send."""
    rate, lengths, arrivals = workload_lengths_and_arrivals(args)
    limits = ModelLimits(vocab_size=SIM_VOCAB, max_context_length=profile.max_model_len)
    wl = build_workload(lengths, arrivals, limits, seed=args.seed, id_prefix="sim", prefix_len=args.random_prefix_len)
    reqs = [SimRequest(r.request_id, r.arrival_s, r.prompt_token_ids, r.max_tokens) for r in wl.requests]
    rows = hashed_trace_rows(args)
    if rows is not None:
        block = max(1, int(round(HASH_BLOCK_TOKENS * args.length_scale)))
        for r, row in zip(reqs, rows):
            r.prompt_token_ids = _hash_prompt(row.hash_ids, len(r.prompt_token_ids), block, args.seed)
    return reqs, rate, wl.num_clipped


def run_simulation(profile: "Profile | ProfileSet", cfg: SimConfig, requests: list[SimRequest]
                   ) -> tuple[list[RequestRecord], float, dict[str, PoolStats]]:
    """(records, duration in virtual seconds, per-pool stats)."""
    sim = Simulation(profile, cfg)
    records = sim.run(requests)
    duration = max([r.end_s for r in records] + [1e-9])
    return records, duration, sim.pool_stats()


def simulation_block(cfg: SimConfig, pools: dict[str, PoolStats], duration: float, profiles: ProfileSet,
                     wall_s: float) -> dict:
    profile = profiles.base
    return {"deployment": cfg.label(), "pdserve_up_flags": cfg.up_flags(profiles), "num_workers": cfg.num_workers,
            "num_ranks": cfg.num_ranks, "tensor_parallel": {r: cfg.pool_tp(r) for r in cfg.roles},
            "pools": {role: {"workers": s.workers, "utilisation": s.utilisation(duration), "steps": s.steps,
                             "tokens": s.tokens,
                             **({"kv_bytes_received": s.kv_bytes_received, "kv_cached_tokens": s.kv_cached_tokens}
                                if role == "decode" else {})} for role, s in pools.items()},
            "profile": {"model": profile.model, "dtype": profile.dtype, "quantization": profile.quantization,
                        "device": profile.device, "threads": profile.threads,
                        **{k: profile.meta.get(k) for k in ("pdserve_commit", "date", "device_name")}},
            "wall_seconds": wall_s}


def _settings(args: argparse.Namespace, profile: Profile, cfg: SimConfig, rate: Any, n: int, clipped: int) -> dict:
    s = {"backend": "pdserve-simulate", "endpoint_type": "simulation", "label": args.label or "simulate",
         "model_id": profile.model, "mode": cfg.mode, "num_prompts": n,
         "request_rate": rate if rate is not None else "trace", "burstiness": args.burstiness,
         "max_concurrency": None, "seed": args.seed, "temperature": 0.0, "num_warmups": 0,
         "percentile_metrics": ",".join(args.percentile_metric_list),
         "metric_percentiles": ",".join(f"{p:g}" for p in args.percentile_list),
         "num_clipped_to_model_limits": clipped}
    s.update(workload_settings(args, s["request_rate"]))
    s["metadata"] = args.metadata_dict
    return s


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of `pdserve simulate`; 0 when a request completed, 1 when none did, 2 on bad input."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_workload_args(args)
        profiles = check_profile_args(args)
        cfg = sim_config_from_args(args)
        for role in cfg.roles:  # a pool's TP has a profile and its weights leave room for KV: before any work
            cfg.kv_blocks(profiles.at(cfg.pool_tp(role), cfg.tp_flag(role)))
        profile = profiles.base
        requests, rate, clipped = requests_from_args(args, profile)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    records, duration, pools = run_simulation(profiles, cfg, requests)
    wall = time.perf_counter() - t0
    settings = _settings(args, profile, cfg, rate, len(requests), clipped)
    summary = summarize(records, duration, args.percentile_list, args.slos or None, args.percentile_metric_list)
    summary["simulation"] = simulation_block(cfg, pools, duration, profiles, wall)
    print_summary(summary, settings)
    util = ", ".join(f"{r} {s.utilisation(duration):.0%}" for r, s in pools.items())
    print(f"simulated {cfg.label()}: {len(requests)} requests over {duration:.1f} virtual s in {wall:.1f} s; "
          f"utilisation {util}")
    if args.save_result:
        path = save_result(result_path(args, settings), summary, settings, records)
        print(f"result saved to {path}")
    return 0 if summary["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
