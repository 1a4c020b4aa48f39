"""Chaos soak of the deployment shape (issue 30 item 2; today's defaults, issue 45 section 4):
``python -m benchmarks.soak --deployment ...``.

Lifecycle: ``main(ns)`` starts, each as its own process on this machine: the deployment's Redis (kill -9 and
restart target) and a second Redis that holds only Ray's GCS tables (Ray passes its Redis password on the GCS's
command line, so it gets a Redis of its own); a Ray head with GCS fault tolerance on that Redis (no CPUs) and one
worker node (a second raylet, ``--worker-cpus``, default one CPU per worker); the **disaggregated deployment**:
``pdserve controller --address`` (``--prefill`` + ``--decode`` detached workers, its supervisor) and two ``pdserve
router`` on fixed free ports; and, with ``--colocated K`` (default 1), a **colocated deployment** beside it on the
same Redis and Ray cluster: a second ``pdserve controller --colocated K --engine-process`` in a namespace of its own
and two ``pdserve router --mode colocated``. (One controller cannot mix the pools: ``ClusterConfig`` refuses
``num_colocated`` with ``num_prefill``/``num_decode``, a router serves one mode, and the controller lease is one
per namespace; so the colocated pool is a second deployment sharing Redis, Ray and the faults.) All processes of a
deployment share its namespace and one cluster secret (passed in the environment, never in argv).

Today's defaults, each on unless switched off:

- KV events and cold ties (``--no-kv-events``, ``--no-cold-ties``): the routers' defaults
  (``RouterConfig.kv_events``, ``kv_replica_sync``, ``kv_pending_s``); the soak passes no flag that turns them off
  and, at the end, reads every live router's ``/metrics`` (KV event batches applied, routing decisions by reason,
  cold ties by result, shared placements) so the JSON shows they were used.
- Per-key API quotas with two keys (``--no-quotas``): each deployment's routers get ``--api-keys-file`` (a
  throwaway TOML file, keys generated per run) and ``--quota-routers 2``. Key ``main`` carries most requests
  with limits far above its offered load (``requests_per_s`` 20x its rate, at least 20; ``tokens_per_min`` 20x
  its token rate; ``max_concurrent`` 64): its quota must never refuse, so a refusal is counted as lost (a quota
  bug, e.g. a lease not released). Key ``capped`` carries ``--capped-share`` of the requests (default 0.25) with
  ``requests_per_s`` at ``--capped-rate-factor`` (default 0.5) of its offered rate: its refusals
  (RESOURCE_EXHAUSTED naming the key and the limit) are expected, not retried, and counted as "refused by quota",
  apart from lost requests.
- Structured outputs (``--structured-every N``, default 8; 0 = off): every N-th request carries a constraint in
  ``GenerateRequest.structured_outputs``, alternately a JSON Schema and a regex; it is sent without ``ignore_eos``
  (the constraint ends it, ``finish_reason`` stop) and with ``max_tokens`` at least 48 (the schema's answer is
  about 32 tokens). Checked: a served constrained answer that stopped must validate (jsonschema / full regex
  match), and the offline check (below) includes constrained requests, compared with ``engine.LLM`` under the
  same constraint (greedy constrained decoding is deterministic offline too).
- A colocated pool with the engine in a process of its own (``--colocated K``, default 1, 0 = off;
  ``--no-engine-process``; ``--colocated-share``, default 0.25, of the requests go to it).

Load: a trace (``--trace``, gaps rescaled to ``--rate``, lengths x ``--length-scale``; greedy) is sent by client
threads that behave like real clients: a request that fails before its first token with UNAVAILABLE or
RESOURCE_EXHAUSTED (not a quota refusal) is retried with exponential backoff (0.25 s doubling, at most
``--client-retries`` times), through its deployment's other router on UNAVAILABLE (its router is gone). Every
``--fault-every-s`` a fault thread injects the next of a shuffled cycle (``--faults``) of: kill -9 of a decode
worker, of a prefill worker, of a colocated worker (with ``--colocated``), of a router (any of the deployments';
restarted on its port after ``--restart-after-s``, as a Deployment would), of a controller (either; restarted
likewise; the new one waits for the lease and adopts), of Redis (restarted empty on its port), of the GCS
(restarted with its own arguments, reloading from its Redis), and SIGSTOP of a random worker for ``--stop-s``
(then SIGCONT), and with ``--colocated`` ``kill_engine`` (kill -9 of a colocated worker's engine process, the
worker itself left alive; healed when the worker is replaced or runs a new engine process: until 29 Nov such a
worker went on reporting ready while failing every request routed to it and nothing replaced it; now its loop
ends, its probe fails and the supervisor replaces it).
After each fault it measures the time until everything is whole again (each deployment's 2 routers SERVING and
its controller up, every pool's workers ready with fresh records in its registry, the GCS up). A sampler records
every process's RSS (a colocated worker's engine process as ``<worker>.engine``) and Redis's memory and key count.

At the end: the load stops, in-flight requests finish, the workers' KV blocks must all come back (waited on,
bounded), Redis keys are counted; the routers' counters are read; then routers and controllers get SIGTERM,
``pdserve down`` removes each deployment's workers, and each namespace's keys left are counted. Requests are
classified (served; refused by the capped key's quota; lost with the reason: the router died under it, an error
after tokens, retries exhausted, a quota refusal of the main key), by deployment, key and constraint; duplicated
tokens are counted (an unconstrained output of another length than asked, or a sample's tokens differing from
the offline engine's), per-window p99 TTFT/ITL computed, and JSON, a log per process and an RSS plot written
beside ``--out``.

The pieces beside this module: ``stack.py`` (processes), ``clients.py`` (the plan and the clients),
``faults.py`` (faults and sampling), ``deploy_report.py`` (analysis).
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path


from benchmarks.soak.clients import CONSTRAINTS, STRUCTURED_MIN_TOKENS, Client, plan_requests, plan_summary
from benchmarks.soak.deploy_report import classify, duplicates, plot_rss, windows
from benchmarks.soak.faults import ALL_FAULTS, COLOCATED_FAULTS, FAULTS, OPT_IN_FAULTS, Chaos
from benchmarks.soak.stack import Deployment, _wait, sum_counters

from benchmarks.harness import write_json


def add_args(ap: argparse.ArgumentParser) -> None:
    """The flags of ``--deployment`` (``--rate`` is cluster.py's; this mode needs it)."""
    ap.add_argument("--fault-every-s", type=float, default=120.0, help="a fault this often")
    ap.add_argument("--faults", default=None,
                    help=f"comma-separated fault kinds drawn from, of {','.join(ALL_FAULTS)} (default: "
                         f"{','.join(FAULTS)}, plus {','.join(COLOCATED_FAULTS)} with --colocated; "
                         f"{','.join(OPT_IN_FAULTS)} only when named)")
    ap.add_argument("--restart-after-s", type=float, default=5.0, help="a killed router/controller/Redis/GCS "
                    "is restarted this long after its kill")
    ap.add_argument("--stop-s", type=float, default=10.0, help="SIGSTOP length")
    ap.add_argument("--client-retries", type=int, default=6, help="retries of a request before its first token")
    ap.add_argument("--worker-cpus", type=int, default=None,
                    help="CPUs the Ray worker node offers (default: one per worker: --prefill + --decode + "
                         "--colocated)")
    ap.add_argument("--num-kv-blocks", type=int, default=256, help="KV blocks per worker")
    # today's defaults (issue 45): each ON in --deployment; these flags turn them off or tune them (flags of the
    # --deployment group itself: argparse does not show a group nested in a group)
    d = ap
    d.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                   help="routers ignore the workers' KV events (pdserve router --no-kv-events; default: on)")
    d.add_argument("--no-cold-ties", dest="cold_ties", action="store_false",
                   help="routers neither share placements nor break cold ties through Redis "
                        "(pdserve router --no-kv-replica-sync; default: on)")
    d.add_argument("--no-quotas", dest="quotas", action="store_false",
                   help="no API keys: open routers (default: two keys with per-key quotas, see the docstring)")
    d.add_argument("--capped-share", type=float, default=0.25,
                   help="fraction of the requests sent with the capped key (default 0.25)")
    d.add_argument("--capped-rate-factor", type=float, default=0.5,
                   help="the capped key's requests_per_s as a fraction of its offered rate in each deployment: "
                        "its refusals are expected (default 0.5)")
    d.add_argument("--structured-every", type=int, default=8, metavar="N",
                   help="every N-th request carries a JSON-schema or regex constraint (default 8; 0 = none)")
    d.add_argument("--colocated", type=int, default=1, metavar="K",
                   help="colocated workers in a second deployment beside the disaggregated one (its own controller "
                        "and 2 routers --mode colocated; default 1, 0 = no colocated deployment)")
    d.add_argument("--colocated-share", type=float, default=0.25,
                   help="fraction of the requests sent to the colocated deployment (default 0.25)")
    d.add_argument("--no-engine-process", dest="engine_process", action="store_false",
                   help="colocated workers keep their engine in process (default: --engine-process)")


def check_args(ns: argparse.Namespace) -> None:
    """SystemExit naming the flag of a bad value; fills ``ns.faults`` and ``ns.worker_cpus`` defaults."""
    if ns.colocated < 0:
        raise SystemExit("--colocated must be >= 0")
    if ns.structured_every < 0:
        raise SystemExit("--structured-every must be >= 0")
    for name in ("capped_share", "colocated_share"):
        if not 0 <= getattr(ns, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be in [0, 1)")
    if not ns.capped_rate_factor > 0:
        raise SystemExit("--capped-rate-factor must be > 0")
    if ns.faults is None:
        ns.faults = ",".join(FAULTS + (COLOCATED_FAULTS if ns.colocated else ()))
    kinds = [k for k in ns.faults.split(",") if k]
    bad = [k for k in kinds if k not in ALL_FAULTS]
    if bad:
        raise SystemExit(f"--faults: unknown {bad}; known: {','.join(ALL_FAULTS)}")
    if not ns.colocated and any(k in COLOCATED_FAULTS + OPT_IN_FAULTS for k in kinds):
        raise SystemExit("--faults: kill_colocated and kill_engine need --colocated > 0")
    if ns.worker_cpus is None:
        ns.worker_cpus = ns.prefill + ns.decode + ns.colocated


# ---- main -------------------------------------------------------------------------------------------------
def main(ns: argparse.Namespace) -> int:
    from benchmarks.harness import machine_info
    from benchmarks.harness import trace_requests as make_requests
    from benchmarks.soak.cluster import load_rows

    check_args(ns)
    out_dir = ns.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = (f"controller + 2 routers + {ns.prefill} prefill + {ns.decode} decode"
             + (f"; beside it controller + 2 routers (--mode colocated) + {ns.colocated} colocated"
                + (" (--engine-process)" if ns.engine_process else "") if ns.colocated else "")
             + f"; Ray head + 1 worker node ({ns.worker_cpus} CPUs), GCS fault tolerance on its own Redis")
    res: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()},
                 "machine": machine_info(), "shape": shape}
    n = max(2, int(ns.rate * ns.duration_s))
    rows = load_rows(ns, n + 1)
    # the keys' token limits are set from the trace before the clip to the model's limits (an upper bound)
    token_cost = sum(r.prompt_len + max(r.output_len, STRUCTURED_MIN_TOKENS) for r in rows) / len(rows)
    dep = Deployment(ns, out_dir, token_cost)
    chaos = client = None
    t_start = time.monotonic()
    try:
        dep.start()
        from loadtest.client import fetch_model_info, limits_from_info
        from transport.client_auth import ClientAuth
        import asyncio

        auth = ClientAuth(api_key=dep.keys["main"]) if dep.keys else None
        limits = limits_from_info(asyncio.run(fetch_model_info(dep.targets[0], 120.0, auth)))
        print(f"deployment {dep.namespace} up in {time.monotonic() - t_start:.0f} s: routers {dep.targets}, "
              f"ray {dep.head.address}, load average {os.getloadavg()}", flush=True)
        span = rows[-1].arrival_s - rows[0].arrival_s
        factor = n / (ns.rate * span) if span > 0 else 0.0
        arrivals = [(r.arrival_s - rows[0].arrival_s) * factor for r in rows]
        reqs, clipped = make_requests(rows[:n], limits, ns.seed, "dep", arrivals[:n])
        plan = plan_requests(ns, reqs, limits)
        res["workload"] = {"trace": ns.trace.name, "requests": n, "rate": ns.rate, "length_scale": ns.length_scale,
                           "clipped": clipped, "prompt_len_median": sorted(len(q.prompt_token_ids) for q in reqs)[n // 2],
                           "output_len_median": sorted(q.max_tokens for q in reqs)[n // 2], **plan_summary(plan)}
        res["defaults"] = {"kv_events": ns.kv_events, "cold_ties": ns.cold_ties, "router_flags": dep.router_flags(),
                           "quotas": dep.limits, "quota_routers": 2 if dep.keys else None,
                           "structured_every": ns.structured_every, "constraints": CONSTRAINTS,
                           "colocated": ns.colocated, "engine_process": ns.engine_process and bool(ns.colocated),
                           "namespaces": {st.label: st.namespace for st in dep.stacks}, "faults": ns.faults}
        print(f"  {plan_summary(plan)}; quotas {dep.limits or 'off'}; router flags {dep.router_flags()}", flush=True)
        client = Client(dep, ns.request_timeout, ns.client_retries, ns.seed)
        chaos = Chaos(dep, ns)
        stop = threading.Event()
        t0 = time.perf_counter()
        chaos.start(t0)
        loader = threading.Thread(target=client.run, args=(reqs, plan, t0, stop), name="load")
        loader.start()
        last = 0.0
        while loader.is_alive():
            loader.join(timeout=5)
            el = time.perf_counter() - t0
            if el - last >= 30:
                last = el
                done = [r for r in client.recs if r.t_end is not None]
                print(f"  [{el:6.0f} s] sent {len(client.recs)}, done {len(done)}, served "
                      f"{sum(r.ok for r in done)}, refused by quota {sum(r.refused_by_quota for r in done)}, "
                      f"lost {sum(r.lost for r in done)}, load average {os.getloadavg()[0]:.2f}", flush=True)
        chaos.join()
        res["load_wall_s"] = round(time.perf_counter() - t0, 1)
        # leaks: every block back once the load is over (the registry's records are refreshed by heartbeats)
        waited = _wait(lambda: all(w.num_free_blocks == w.num_total_blocks and not w.num_running
                                   for w in dep.workers()), 120, 1.0)
        res["kv_blocks_not_free"] = {w.worker_id: w.num_total_blocks - w.num_free_blocks for w in dep.workers()}
        res["kv_free_after_s"] = waited
        res["redis_keys_before_down"] = sorted(k for st in dep.stacks if st.registry is not None
                                               for k in st.registry.keys())
        res["router_counters"] = dep.router_counters()
        res["kv_routing"] = sum_counters(res["router_counters"])
        res["faults"] = chaos.faults
        res["exits"] = chaos.exits
        res["requests"] = classify(client.recs, chaos.faults)
        res["windows"] = windows(client.recs, ns.window_s, ns.duration_s)
        res["rss_mib"] = {k: {"first": round(v[0][1] / 2**20, 1), "last": round(v[-1][1] / 2**20, 1),
                              "max": round(max(x for _, x in v) / 2**20, 1), "from_s": round(v[0][0]),
                              "to_s": round(v[-1][0])} for k, v in chaos.rss.items() if v}
        res["redis_stats"] = chaos.redis_stats
        res["rss_series"] = {k: [(round(t, 1), x) for t, x in v] for k, v in chaos.rss.items()}
        plot_rss(chaos.rss, chaos.faults, ns.out.with_suffix(".rss.png"))
    finally:
        if client is not None:
            client.close()
        if chaos is not None:
            chaos.stop.set()
        dep.stop(res)
        res["loadavg_end"] = os.getloadavg()
    if client is not None and client.recs:
        res["tokens"] = duplicates(client.recs, reqs, ns.model, ns.check_requests)
    write_json(ns.out, res)
    with open(ns.out.with_suffix(".requests.jsonl"), "w") as f:
        for r in client.recs if client is not None else []:
            f.write(json.dumps(asdict(r)) + "\n")
    summary = {k: res.get(k) for k in ("requests", "tokens", "kv_blocks_not_free", "redis_keys_left_after_down",
                                       "loadavg_end")}
    print(json.dumps(summary, indent=1, default=str))
    for f in res.get("faults", []):
        print(f"  fault {f}")
    for w in res.get("windows", []):
        print(f"  window {w}")
    for label, c in res.get("kv_routing", {}).items():
        print(f"  routers {label} (live incarnations, summed): {json.dumps(c)}")
    for name, v in sorted(res.get("rss_mib", {}).items()):
        print(f"  rss {name}: {v['first']} -> {v['last']} MiB (max {v['max']}, {v['from_s']}-{v['to_s']} s)")
    print(f"result: {ns.out} (plot {ns.out.with_suffix('.rss.png')})")
    tok = res.get("tokens", {})
    bad = (res.get("requests", {}).get("lost_with_router_alive", 1) or tok.get("wrong_length")
           or tok.get("offline_mismatched") or tok.get("structured_invalid")
           or any(res.get("kv_blocks_not_free", {}).values()) or res.get("redis_keys_left_after_down"))
    return 1 if bad else 0
