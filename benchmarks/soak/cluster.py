"""Soak test: a cluster under steady trace load while workers and Redis are killed (issue 9, item 8).

Lifecycle: the script starts its own ``EmbeddedRedis`` on a free loopback port
(so it can ``kill -9`` it and restart it on the same port, with the same
password; launched with ``spawn=True``: this process has live gRPC and Ray
threads, and the fault thread that restarts it ends), then a ``Cluster``
(private local Ray, ``--prefill`` + ``--decode`` worker actors, the router in
this process) on that Redis, plus a ``Supervisor`` that replaces dead workers.
After a short warm-up it measures capacity (``--capacity-requests`` trace
requests, ``--capacity-concurrency`` at a time; completed / wall time) unless
``--rate`` is given, and replays the conversation trace at ``--load`` x that
rate for ``--duration-s``: a contiguous slice of the trace, its inter-arrival
gaps rescaled to the target mean rate (same burst pattern), its lengths
multiplied by ``--length-scale`` and clipped to the model's limits (both stated
in the report). Requests are sent by ``loadtest``'s client (``run_benchmark``:
greedy, ``ignore_eos``, so the output length is forced and the tokens are
reproducible offline) and timed by its ``RequestRecord``.

While the load runs, a fault thread kills a random worker (``kill -9`` of its
actor's pid) every ``--kill-every-s`` and Redis once, halfway (``kill -9``,
restarted empty on the same port after ``--redis-down-s``); after each fault it
waits (bounded) until the cluster is whole again: the supervisor has replaced
the worker and its successor is in the registry, or every worker has
re-registered into the new Redis. A sampler thread records the RSS of this
process (the router, which also hosts the load client), of every worker actor
process and of Redis (psutil). The router's Prometheus ``/metrics`` is read
before and after the load: ``request_migrations_total`` (requests resumed on
another worker after theirs failed mid-stream), ``request_errors_total`` by code
and ``request_success_total``. Which requests a fault touched is told by time:
those in flight when it hit (a retry before the first token is counted by no
series; such a request is among these).

At the end (load stopped, in-flight requests finished) it reads each worker's
``info()`` (KV blocks not free), stops the supervisor and the cluster, SCANs
``{namespace}:*`` in Redis (keys left behind), and checks a sample of the
successful requests against the offline engine (``engine.LLM``), token for
token (the requests in flight at a fault first). It prints a rich table and
writes JSON to ``--out``; exit status 1 when requests were lost, outputs
differed or blocks/keys leaked.

The faults and the RSS sampler are in ``chaos.py``, the analysis and the
report in ``report.py`` (beside this module).

``--deployment`` runs the deployment shape instead (separate controller, routers, Ray nodes; clients that retry and
fail over; kills of routers, the controller, Redis and the GCS; SIGSTOP): ``deployment.py`` beside this module. It runs
with today's defaults, each on unless switched off: KV events and cold ties in the routers (``--no-kv-events``,
``--no-cold-ties``), per-key quotas with two keys, one capped below its load (``--no-quotas``), structured-output
requests in the mix (``--structured-every 8``; 0 = none) and a colocated deployment beside the disaggregated one,
its worker's engine in a process of its own (``--colocated 1``, ``--no-engine-process``).

Usage:
    python -m benchmarks.soak --deployment --prefill 2 --decode 2 --rate 1 --duration-s 1800 --fault-every-s 120
    python -m benchmarks.soak                                   # the full soak: 30 min, a kill every 5 min
    python -m benchmarks.soak --duration-s 540 --kill-every-s 120 --window-s 120   # the recorded 9-min run
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from benchmarks.harness import CONVERSATION_TRACE, REPO, SAMPLE_TRACE, client_config, machine_info, replay
from benchmarks.harness import load_rows as _load_rows
from benchmarks.harness import trace_requests as make_requests
from benchmarks.harness import write_json
from benchmarks.soak.chaos import Chaos, spawned_redis
from benchmarks.soak.report import (check_offline, in_flight_at, ok, outcomes, pct, pick_check_sample, print_report,
                                    router_counters, rss_summary, windows)

DEFAULT_TRACE = CONVERSATION_TRACE if CONVERSATION_TRACE.is_file() else SAMPLE_TRACE



def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="built-in model or HF dir (default: tiny)")
    ap.add_argument("--prefill", type=int, default=1, help="prefill workers")
    ap.add_argument("--decode", type=int, default=1, help="decode workers")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                    help="Azure conversation trace CSV (default: ../shared/traces/azure_llm_2023_conv.csv)")
    ap.add_argument("--trace-start", type=int, default=0, help="first trace row replayed")
    ap.add_argument("--length-scale", type=float, default=0.1,
                    help="multiply the trace's prompt/output lengths (then clipped to the model's limits)")
    ap.add_argument("--duration-s", type=float, default=1800.0, help="how long the load runs")
    ap.add_argument("--load", type=float, default=0.7, help="fraction of measured capacity to offer")
    ap.add_argument("--rate", type=float, default=None, help="offered mean rate (req/s); skips the capacity probe")
    ap.add_argument("--capacity-requests", type=int, default=48, help="requests of the capacity probe")
    ap.add_argument("--capacity-concurrency", type=int, default=16, help="in flight during the capacity probe")
    ap.add_argument("--kill-every-s", type=float, default=300.0, help="kill -9 a random worker this often")
    ap.add_argument("--redis-down-s", type=float, default=5.0, help="how long Redis stays down after its kill")
    ap.add_argument("--no-redis-kill", action="store_true", help="do not kill Redis")
    ap.add_argument("--window-s", type=float, default=300.0, help="window of the per-window latency table")
    ap.add_argument("--rss-every-s", type=float, default=15.0, help="RSS sampling period")
    ap.add_argument("--recover-timeout-s", type=float, default=120.0, help="how long a fault may take to heal")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="deadline of each request (s)")
    ap.add_argument("--check-requests", type=int, default=32, help="successful requests checked against offline")
    ap.add_argument("--seed", type=int, default=0, help="seeds prompts and the choice of victims")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "soak" / "result.json", help="JSON result file")
    dep = ap.add_argument_group("--deployment", "the deployment shape instead (benchmarks/soak/deployment.py): "
                                "controller + 2 routers + workers on a Ray head and worker node, clients that retry; "
                                "beside it a colocated deployment (--colocated); KV events, cold ties, two API keys "
                                "with quotas and structured-output requests on by default")
    dep.add_argument("--deployment", action="store_true", help="run the deployment-shape chaos soak")
    from benchmarks.soak.deployment import add_args

    add_args(dep)
    return ap


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ns = build_parser().parse_args(argv)
    if ns.prefill < 1 or ns.decode < 1:
        raise SystemExit("--prefill and --decode must be >= 1")
    for name in ("duration_s", "load", "kill_every_s", "window_s", "rss_every_s", "length_scale",
                 "request_timeout", "recover_timeout_s"):
        if not getattr(ns, name) > 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0")
    if ns.rate is not None and not ns.rate > 0:
        raise SystemExit("--rate must be > 0")
    if not ns.trace.is_file():
        raise SystemExit(f"--trace: no such file {ns.trace}")
    return ns


# ---- main -------------------------------------------------------------------------------------------------

def load_rows(ns: argparse.Namespace, n: int) -> list:
    """``n`` rows of ``--trace`` from ``--trace-start``, lengths x ``--length-scale``, wrapping around the file."""
    return _load_rows(ns.trace, ns.trace_start, ns.length_scale, n)


def main(argv: Optional[list[str]] = None) -> int:
    ns = parse_args(argv)
    if ns.deployment:
        if ns.rate is None:
            raise SystemExit("--deployment needs --rate (req/s): it has no capacity probe")
        from benchmarks.soak import deployment

        return deployment.main(ns)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    log_path = ns.out.with_suffix(".log")
    logging.basicConfig(level=logging.WARNING, filename=str(log_path), filemode="w",
                        format="%(asctime)s %(levelname)s %(name)s %(threadName)s: %(message)s")

    import ray
    import redis as redis_py

    from cluster.launcher import Cluster, ClusterConfig
    from cluster.supervisor import Supervisor, SupervisorConfig
    from loadtest.client import fetch_model_info, limits_from_info, run_benchmark

    info = machine_info()
    t_all = time.monotonic()
    redis_srv = spawned_redis()
    cfg = ClusterConfig(model=ns.model, num_prefill=ns.prefill, num_decode=ns.decode, redis_url=redis_srv.url,
                        router_host="127.0.0.1", worker_host="127.0.0.1", start_timeout_s=300)
    cluster = Cluster(cfg)
    supervisor = None
    chaos = None
    res: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()},
                 "machine": info}
    try:
        cluster.start()
        supervisor = Supervisor(cluster, SupervisorConfig()).start()
        target = cluster.router_address
        limits = limits_from_info(asyncio.run(fetch_model_info(target, 120.0)))
        print(f"cluster {cluster.namespace} up at {target} in {time.monotonic() - t_all:.1f} s "
              f"(redis {redis_srv.display_url}); limits {limits}; load average {info['loadavg_start']}", flush=True)

        # warm-up, then capacity: a closed loop of trace requests
        warm, _ = make_requests(load_rows(ns, 4), limits, ns.seed + 1, "warm", [0.0] * 4)
        replay(target, warm, ns.request_timeout)
        cap: dict = {}
        if ns.rate is None:
            rows = load_rows(ns, ns.capacity_requests)
            probe_reqs, _ = make_requests(rows, limits, ns.seed + 2, "cap", [0.0] * len(rows))
            probe, dur = replay(target, probe_reqs, ns.request_timeout, ns.capacity_concurrency)
            done = sum(ok(r) for r in probe)
            cap = {"requests": len(probe), "concurrency": ns.capacity_concurrency, "ok": done,
                   "wall_s": dur, "req_per_s": done / dur if dur > 0 else 0.0}
            rate = ns.load * cap["req_per_s"]
            print(f"capacity: {done}/{len(probe)} in {dur:.1f} s = {cap['req_per_s']:.2f} req/s "
                  f"-> offering {rate:.2f} req/s ({ns.load:g} x)", flush=True)
            if not rate > 0:
                raise RuntimeError(f"capacity probe completed nothing: {dict(outcomes(probe))}")
        else:
            rate = ns.rate
        res["capacity"] = cap

        # the soak's schedule: a contiguous trace slice, gaps rescaled to the mean rate
        n = max(2, int(rate * ns.duration_s))
        rows = load_rows(ns, n + 1)
        span = rows[-1].arrival_s - rows[0].arrival_s
        factor = n / (rate * span) if span > 0 else 0.0
        arrivals = [(r.arrival_s - rows[0].arrival_s) * factor for r in rows]
        reqs, clipped = make_requests(rows[:n], limits, ns.seed, "soak", arrivals[:n])
        plens = [len(q.prompt_token_ids) for q in reqs]
        olens = [q.max_tokens for q in reqs]
        res["workload"] = {"trace": ns.trace.name, "trace_start": ns.trace_start, "length_scale": ns.length_scale,
                           "requests": n, "num_clipped_to_model_limits": clipped,
                           "prompt_len": {"median": float(np.median(plens)), "p90": pct(plens, 90), "max": max(plens)},
                           "output_len": {"median": float(np.median(olens)), "p90": pct(olens, 90), "max": max(olens)},
                           "model_limits": vars(limits) if hasattr(limits, "__dict__") else str(limits)}
        print(f"soak: {n} requests over {ns.duration_s:g} s ({rate:.2f} req/s), prompt median "
              f"{res['workload']['prompt_len']['median']:.0f} / max {max(plens)}, output median "
              f"{res['workload']['output_len']['median']:.0f} / max {max(olens)}, {clipped} clipped", flush=True)

        chaos = Chaos(ns, cluster, supervisor, redis_srv)
        metrics_address = cluster.metrics_addresses().get("router", "")
        res["router_counters_before_load"] = router_counters(metrics_address)

        async def run_load() -> tuple[list, float]:
            done: list = []
            # run_benchmark takes its own t0 when its task first runs, within a millisecond of this one: the
            # faults' times and the records' share one clock
            t0 = time.perf_counter()
            task = asyncio.ensure_future(run_benchmark(client_config(target, ns.request_timeout), reqs, done.append))
            chaos.start(t0)
            last = 0.0
            while not task.done():
                await asyncio.wait([task], timeout=1.0)
                el = time.perf_counter() - t0
                if el - last >= 30:
                    last = el
                    print(f"  [{el:6.1f} s] sent {sum(q.arrival_s <= el for q in reqs)}, done {len(done)}, failed "
                          f"{sum(not ok(r) for r in done)}, load average {os.getloadavg()[0]:.2f}", flush=True)
            return task.result()

        recs, wall = asyncio.run(run_load())
        chaos.join()
        chaos.sample_rss()
        redis_srv = chaos.redis  # the live incarnation
        # in-flight requests are done; let the workers free their last blocks
        end = time.monotonic() + 15
        while cluster.router.num_in_flight and time.monotonic() < end:
            time.sleep(0.1)
        time.sleep(2.0)
        blocks = []
        for role in ("prefill", "decode"):
            for wid, h in cluster.members(role):
                try:
                    wi = ray.get(h.info.remote(), timeout=30)
                    blocks.append({"worker_id": wid, "role": role, "total": wi.num_total_blocks,
                                   "free": wi.num_free_blocks, "not_free": wi.num_total_blocks - wi.num_free_blocks,
                                   "running": wi.num_running, "waiting": wi.num_waiting})
                except Exception as e:
                    blocks.append({"worker_id": wid, "role": role, "error": repr(e)})
        res["router_counters"] = router_counters(metrics_address)
        res["router_in_flight_at_end"] = cluster.router.num_in_flight
        supervisor.stop()
        cluster.stop()
        try:
            r = redis_py.Redis.from_url(redis_srv.url, socket_timeout=10)
            keys_left = sorted(k.decode() for k in r.scan_iter(match=f"{cluster.namespace}:*", count=1000))
            r.close()
        except Exception as e:  # Redis gone: say so instead of claiming zero keys
            res["keys_scan_error"] = repr(e)
            keys_left = ["<SCAN failed: %r>" % e]
        info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]

        touched = in_flight_at(recs, [f["t_s"] for f in chaos.faults])
        counts = outcomes(recs)
        t = time.monotonic()
        sample = pick_check_sample(recs, touched, ns.check_requests)
        by_id = {q.request_id: q for q in reqs}
        res["offline_check"] = (check_offline(ns.model, [(by_id[r.request_id], r) for r in sample]) if sample
                                else {"checked": 0, "matched": 0})
        res["offline_check"]["wall_s"] = time.monotonic() - t
        res["faults"] = chaos.faults
        res["windows"] = windows(recs, ns.window_s, ns.duration_s)
        res["rss"] = rss_summary(chaos.rss)
        res["redis_stats"] = chaos.redis_stats
        if chaos.redis_stats:
            peak = max(chaos.redis_stats, key=lambda x: x[2])
            print(f"redis used_memory peak {peak[2] / 2**20:.1f} MiB ({peak[3]} keys) at t={peak[0]} s; "
                  f"last {chaos.redis_stats[-1][2] / 2**20:.1f} MiB ({chaos.redis_stats[-1][3]} keys)", flush=True)
        res["rss_series"] = {k: v for k, v in chaos.rss.items()}
        res["blocks_at_end"] = blocks
        res["keys_left"] = keys_left
        res["replacements"] = [{"t_s": round(ts - chaos.t0_wall, 1), "role": role,
                                "failed": f, "new": nw} for ts, role, f, nw in supervisor.replacements]
        failed = [r for r in recs if not ok(r)]
        res["failures"] = [{"request_id": r.request_id, "start_s": round(r.start_s, 2), "error": r.error,
                            "finish_reason": r.finish_reason, "tokens": len(r.token_ids),
                            "in_flight_at_a_fault": r.request_id in touched} for r in failed[:200]]
        res["in_flight_at_faults"] = sorted(touched)[:200]
        ok_ids = {r.request_id for r in recs if ok(r)}
        before, after = res["router_counters_before_load"], res["router_counters"]
        res["summary"] = {
            "requests": len(recs), "succeeded": counts.get("OK", 0), "lost": len(failed),
            "errors_by_code": {k: v for k, v in counts.items() if k != "OK"},
            "migrations": after.get("migrations", 0.0) - before.get("migrations", 0.0),
            "in_flight_at_faults_ok": len(touched & ok_ids),
            "in_flight_at_faults_failed": len(touched - ok_ids),
            "offered_rate": rate, "achieved_rate": counts.get("OK", 0) / wall if wall else 0.0, "wall_s": wall,
            "faults_injected": len(chaos.faults), "faults_survived": sum(bool(f.get("survived")) for f in chaos.faults),
            "blocks_not_free": sum(b.get("not_free", 0) for b in blocks), "keys_left": len(keys_left),
            "unchecked_worker_infos": sum("error" in b for b in blocks)}
        res["wall_s_total"] = time.monotonic() - t_all
        print_report(res)
        if ns.out.is_dir():  # a folder was given: the result goes inside it
            ns.out = ns.out / "result.json"
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(ns.out, res)
        print(f"wrote {ns.out} (log {log_path}); {res['wall_s_total']:.0f} s in all")
        s = res["summary"]
        good = (s["lost"] == 0 and s["blocks_not_free"] == 0 and s["keys_left"] == 0
                and res["offline_check"]["matched"] == res["offline_check"]["checked"]
                and s["faults_survived"] == s["faults_injected"])
        return 0 if good else 1
    finally:
        if chaos is not None:
            chaos.stop.set()
            redis_srv = chaos.redis
        if supervisor is not None:
            supervisor.stop(wait=False)
        cluster.stop()
        redis_srv.stop()


if __name__ == "__main__":
    sys.exit(main())
