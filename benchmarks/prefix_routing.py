"""Prefix routing with several routers: round-robin vs the router-local mirror vs the KV event index (issue 28).

Workload: ``--conversations`` multi-turn conversations run at once, each opening with one of ``--systems``
system prompts; every turn re-sends the whole history (system prompt, earlier user turns and the assistant's
answers, greedy) plus a new user message, as a chat client does. Each turn of a conversation enters through
the next router in turn, so with several routers no router sees a conversation twice in a row (what a
Kubernetes Service in front of router replicas does).

Deployment per run (fresh, so no run inherits another's cache): ``--workers`` colocated worker processes
(real engines, one torch thread each) that heartbeat into a Redis registry and publish their KV events; the
routers are ``RouterServer``s in this process over that registry, each with its own registry reader and
event consumer. Policies:

- ``round_robin``: the client sends request i to worker i mod N (a single-worker router each): no prefix
  awareness, perfectly even counts. The conversations start in a seeded random order (``--start-order``): started
  by index (the runs before 27 Nov), the opening burst's requests are numbered about in conversation order, and
  conversation c opens with system prompt c mod S, so with ``--systems`` equal to ``--workers`` each system
  prompt's first turns land on one worker, as a cache-aware router would place them (not a fair draw);
- ``mirror``: ``RouterConfig(kv_events=False)``: each router's own record of what it sent where (the router
  before issue 28);
- ``kv_events``: the default: every router scores workers on the index built from the workers' events, counts the
  blocks it has just placed as pending on that worker, and shares its placements with the other routers (replica
  sync, ``{ns}:kvplace``);
- ``kv_events_nosync``: the same without replica sync (``RouterConfig(kv_replica_sync=False)``): each router knows
  only its own pending placements (with 1 router it should equal ``kv_events``: nobody to share with).

Printed per (policy, routers): prefix-cache hit rate (cached / prompt tokens, from the responses' usage), mean
and p90 TTFT (client side; of all turns, and of the turns after each conversation's first, which routing decides:
a first turn finds at most its system prompt under any policy, and the opening burst of first turns sets the p90
of all turns; and of the first turns alone), load spread (requests per worker, max over mean), and each turn's outcome (``hit``;
``system_miss``: a first turn computed its system prompt; ``history_lost``: a later turn left the worker holding
its history; ``cold``: a later turn found not even its system prompt). Hit rate and spread depend on machine load
only through timing (how close together a burst's decisions fall); TTFT depends on it directly (run it on a quiet
machine, and read it as a ratio within one run). Runs are noisy (48-72 requests each): ``--repeat N`` runs every row
N times, interleaved, and prints each row's mean at the end.

    nice -n 10 .venv/bin/python benchmarks/prefix_routing.py --short       # a quick check (4 turns)
    .venv/bin/python benchmarks/prefix_routing.py --repeat 3 --json results/prefix_routing.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any



def _worker_main(worker_id: str, model: str, engine_kw: dict, redis_url: str, ns: str, ready_q: Any,
                 stop_evt: Any) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        from cluster.registry import Registry
        from decode_worker import ColocatedWorker, ColocatedWorkerConfig
        from engine.config import EngineConfig

        w = ColocatedWorker(ColocatedWorkerConfig(worker_id, engine=EngineConfig(model=model, num_threads=1,
                                                                                 **engine_kw),
                                                  serve_metrics=False, kv_events_url=redis_url,
                                                  kv_events_namespace=ns)).start()
        reg = Registry(redis_url, ns, ttl_s=3.0)
        reg.register(w.info())
    except BaseException:
        ready_q.put(("error", traceback.format_exc()))
        return
    ready_q.put((worker_id, w.address))
    try:
        while not stop_evt.wait(0.5):
            reg.heartbeat(w.info())
    finally:
        reg.deregister(worker_id)
        w.stop()
        reg.close()


class Run:
    """One fresh deployment: worker processes, a namespace, the routers of one policy."""

    def __init__(self, args: argparse.Namespace, redis_url: str, policy: str, n_routers: int) -> None:
        from cluster.registry import Registry

        self.ns = f"bench-pr-{uuid.uuid4().hex[:8]}"
        self.registry = Registry(redis_url, self.ns, ttl_s=3.0)
        ctx = mp.get_context("spawn")
        self.stop_evt = ctx.Event()
        q = ctx.Queue()
        engine_kw = dict(num_kv_blocks=args.kv_blocks, block_size=args.block_size)
        self.procs = [ctx.Process(target=_worker_main, args=(f"w{i}", args.model, engine_kw, redis_url, self.ns, q,
                                                             self.stop_evt), daemon=True)
                      for i in range(args.workers)]
        for p in self.procs:
            p.start()
        self.addresses: dict[str, str] = {}
        for _ in self.procs:
            got = q.get(timeout=300)
            if got[0] == "error":
                self.close()
                raise RuntimeError(got[1])
            self.addresses[got[0]] = got[1]
        from router import RouterConfig, RouterServer, StaticWorkerSource

        if policy == "round_robin":
            # one single-worker router per worker; the client picks the worker
            self.routers = []
            for wid in sorted(self.addresses):
                info = [w for w in self.registry.list() if w.worker_id == wid][0]
                self.routers.append(RouterServer(RouterConfig(mode="colocated", serve_metrics=False,
                                                              prefix_aware_routing=False),
                                                 StaticWorkerSource([info])).start())
        else:
            cfg = dict(mode="colocated", serve_metrics=False, worker_view_refresh_s=0.25,
                       kv_events=policy.startswith("kv_events"), **args.router_kw)
            if policy == "kv_events_nosync":
                cfg["kv_replica_sync"] = False
            self.routers = [RouterServer(RouterConfig(**cfg), self.registry).start() for _ in range(n_routers)]
            if policy.startswith("kv_events"):
                t0 = time.monotonic()
                while not all(r.core.kv_events.num_synced() == args.workers for r in self.routers):
                    if time.monotonic() - t0 > 30:
                        raise RuntimeError("routers never followed every worker's events")
                    time.sleep(0.05)
            else:
                t0 = time.monotonic()
                while not all(len(r.core.view.list("colocated")) == args.workers for r in self.routers):
                    if time.monotonic() - t0 > 30:
                        raise RuntimeError("routers never saw every worker")
                    time.sleep(0.05)
        import grpc

        from proto import pdserve_pb2_grpc

        self.channels = [grpc.insecure_channel(r.address) for r in self.routers]
        self.stubs = [pdserve_pb2_grpc.PDServeStub(c) for c in self.channels]

    def served(self) -> dict[str, int]:
        return {w.worker_id: w.requests_total for w in self.registry.list()}

    def decisions(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in self.routers:
            from prometheus_client.parser import text_string_to_metric_families

            for fam in text_string_to_metric_families(r.metrics.render().decode()):
                if fam.name == "pdserve:routing_decisions":
                    for s in fam.samples:
                        if s.name.endswith("_total"):
                            out[s.labels["reason"]] = out.get(s.labels["reason"], 0.0) + s.value
                elif fam.name.startswith(("pdserve:kv_replica_", "pdserve:kv_cold_ties")):  # replica sync, cold ties
                    for s in fam.samples:
                        if s.name.endswith("_total"):
                            k = fam.name[len("pdserve:"):] + (f"/{s.labels['reason']}" if "reason" in s.labels else "")
                            out[k] = out.get(k, 0.0) + s.value
        return out

    def close(self) -> None:
        for c in getattr(self, "channels", []):
            c.close()
        for r in getattr(self, "routers", []):
            r.stop()
        self.stop_evt.set()
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
        self.registry.clear()
        self.registry.close()


def _conversation(run: Run, c: int, args: argparse.Namespace, systems: list[list[int]], policy: str,
                  counter: list[int], lock: threading.Lock) -> list[tuple[float, int, int, str]]:
    """One conversation's turns: (ttft_s, prompt_tokens, cached_tokens, outcome) each; outcome (why tokens were
    recomputed): "hit" (the system prompt on a first turn, the previous turn's prompt on a later one, was cached),
    "system_miss" (a first turn computed its system prompt), "history_lost" (a later turn found only its system
    prompt: it left the worker that held its history), "cold" (a later turn found not even that)."""
    from proto import pdserve_pb2

    history = list(systems[c % len(systems)])
    bs = args.block_size
    out = []
    prev_prompt = 0
    for turn in range(args.turns):
        history += [(c * 7919 + turn * 104729 + j * 31) % 900 + 20 for j in range(args.user_tokens)]
        if policy == "round_robin":
            with lock:
                i = counter[0]
                counter[0] += 1
            stub = run.stubs[i % len(run.stubs)]
        else:
            stub = run.stubs[(c + turn) % len(run.stubs)]
        t0 = time.perf_counter()
        ttft = None
        tokens: list[int] = []
        last = None
        for resp in stub.Generate(pdserve_pb2.GenerateRequest(token_ids=history, max_tokens=args.output_tokens,
                                                              temperature=0.0), timeout=600):
            if ttft is None and resp.token_ids:
                ttft = time.perf_counter() - t0
            tokens.extend(resp.token_ids)
            last = resp
        cached = last.usage.cached_tokens
        if turn == 0:
            outcome = "hit" if cached >= args.system_tokens // bs * bs else "system_miss"
        elif cached >= prev_prompt // bs * bs:
            outcome = "hit"
        else:
            outcome = "history_lost" if cached >= args.system_tokens // bs * bs else "cold"
        prev_prompt = last.usage.prompt_tokens
        out.append((ttft or 0.0, last.usage.prompt_tokens, cached, outcome))
        history += tokens
    return out


def measure(args: argparse.Namespace, redis_url: str, policy: str, n_routers: int) -> dict[str, Any]:
    run = Run(args, redis_url, policy, n_routers)
    try:
        systems = [[(s * 7 + i * 13) % 900 + 20 for i in range(args.system_tokens)] for s in range(args.systems)]
        before = run.served()
        lock, counter = threading.Lock(), [0]
        t0 = time.perf_counter()
        order = list(range(args.conversations))
        if args.start_order == "shuffled":  # the burst's first turns arrive in an order unrelated to their systems
            random.Random(args.seed).shuffle(order)
        with ThreadPoolExecutor(args.conversations) as pool:
            futs = {c: pool.submit(_conversation, run, c, args, systems, policy, counter, lock) for c in order}
            convs = [futs[c].result() for c in range(args.conversations)]
        wall = time.perf_counter() - t0
        turns = [t for conv in convs for t in conv]
        ttfts = sorted(t[0] for t in turns)
        # the turns after each conversation's first: what routing decides (a first turn finds at most its system
        # prompt, the same under every policy, and the opening burst of them sets the p90 of all turns)
        later = sorted(t[0] for conv in convs for t in conv[1:]) or [float("nan")]
        first = sorted(conv[0][0] for conv in convs if conv)  # the opening burst: every conversation's first turn
        deadline = time.monotonic() + 10  # the counts come with the workers' heartbeats (every 0.5 s)
        while True:
            served = {w: n - before.get(w, 0) for w, n in run.served().items()}
            if sum(served.values()) >= len(turns) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        mean_served = statistics.mean(served.values())
        return {"policy": policy, "routers": n_routers if policy != "round_robin" else "-",
                "requests": len(turns), "hit_rate": sum(t[2] for t in turns) / sum(t[1] for t in turns),
                "ttft_mean_ms": 1000 * statistics.mean(ttfts),
                "ttft_p90_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
                "later_ttft_mean_ms": 1000 * statistics.mean(later),
                "later_ttft_p90_ms": 1000 * later[min(len(later) - 1, int(0.9 * len(later)))],
                "first_ttft_mean_ms": 1000 * statistics.mean(first),
                "first_ttft_p90_ms": 1000 * first[min(len(first) - 1, int(0.9 * len(first)))],
                "spread_max_over_mean": max(served.values()) / mean_served, "served": served,
                "outcomes": {k: sum(1 for t in turns if t[3] == k) for k in ("hit", "system_miss", "history_lost", "cold")},
                "decisions": run.decisions(), "wall_s": wall}
    finally:
        run.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--systems", type=int, default=3, help="distinct system prompts")
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--conversations", type=int, default=12, help="conversations at once (one client thread each)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=64,
                    help="answer tokens per turn (long enough that a request outlives a heartbeat, as in production)")
    ap.add_argument("--kv-blocks", type=int, default=256,
                    help="KV blocks per worker (256: a third of headroom over a balanced share of the conversations)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--redis-url", default=None, help="default: an embedded redis-server")
    ap.add_argument("--short", action="store_true", help="a quick run: 4 turns")
    ap.add_argument("--start-order", choices=("shuffled", "index"), default="shuffled",
                    help="order the conversations start in: shuffled (seeded by --seed), or by index (the runs before "
                         "27 Nov: round-robin's first turns then align with the system prompts)")
    ap.add_argument("--seed", type=int, default=0, help="seeds --start-order shuffled")
    ap.add_argument("--repeat", type=int, default=1, help="run every row this many times (interleaved); means at the end")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--only", default=None, help="comma-separated runs, e.g. kv_events/3,mirror/1 (default: all)")
    ap.add_argument("--kv-request-weight", type=float, default=None, help="RouterConfig.kv_request_weight")
    ap.add_argument("--kv-tie-blocks", type=float, default=None, help="RouterConfig.kv_tie_blocks")
    ap.add_argument("--kv-load-weight", type=float, default=None, help="RouterConfig.kv_load_weight")
    ap.add_argument("--kv-pending-s", type=float, default=None, help="RouterConfig.kv_pending_s")
    args = ap.parse_args()
    args.router_kw = {k: v for k, v in (("kv_request_weight", args.kv_request_weight),
                                        ("kv_tie_blocks", args.kv_tie_blocks),
                                        ("kv_load_weight", args.kv_load_weight),
                                        ("kv_pending_s", args.kv_pending_s)) if v is not None}
    if args.short:
        args.turns = 4
    server = None
    redis_url = args.redis_url
    if redis_url is None:
        from cluster.redis_server import EmbeddedRedis

        server = EmbeddedRedis().start()
        redis_url = server.url
    rows = []
    try:
        for _rep, (policy, n) in ((r, pn) for r in range(args.repeat) for pn in (
                ("round_robin", 1), ("mirror", 1), ("mirror", 3), ("kv_events_nosync", 1), ("kv_events", 1),
                ("kv_events_nosync", 3), ("kv_events", 3))):
            if args.only and f"{policy}/{n}" not in args.only.split(","):
                continue
            row = measure(args, redis_url, policy, n)
            rows.append(row)
            print(f"{policy:<16} routers={row['routers']!s:<2} hit_rate={row['hit_rate']:.3f} "
                  f"ttft_mean={row['ttft_mean_ms']:.1f}ms ttft_p90={row['ttft_p90_ms']:.1f}ms "
                  f"spread={row['spread_max_over_mean']:.2f} served={row['served']} outcomes={row['outcomes']} "
                  f"decisions={row['decisions']} "
                  f"wall={row['wall_s']:.1f}s", flush=True)
    finally:
        if server is not None:
            server.stop()
    means: dict[str, dict[str, float]] = {}
    for key in dict.fromkeys(f"{r['policy']}/{r['routers']}" for r in rows):
        same = [r for r in rows if f"{r['policy']}/{r['routers']}" == key]
        means[key] = {k: statistics.mean(r[k] for r in same)
                      for k in ("hit_rate", "ttft_mean_ms", "ttft_p90_ms", "later_ttft_mean_ms", "later_ttft_p90_ms",
                                "first_ttft_mean_ms", "first_ttft_p90_ms", "spread_max_over_mean")}
        m = means[key]
        each = " ".join(format(r["hit_rate"], ".3f") for r in same)
        print(f"mean of {len(same)}: {key:<18} hit_rate={m['hit_rate']:.3f} ttft_mean={m['ttft_mean_ms']:.1f}ms "
              f"ttft_p90={m['ttft_p90_ms']:.1f}ms later turns: ttft_mean={m['later_ttft_mean_ms']:.1f}ms "
              f"ttft_p90={m['later_ttft_p90_ms']:.1f}ms first turns: ttft_mean={m['first_ttft_mean_ms']:.1f}ms "
              f"ttft_p90={m['first_ttft_p90_ms']:.1f}ms spread={m['spread_max_over_mean']:.2f} (hit rates {each})")
    rr = means.get("round_robin/-")
    for key, m in means.items() if rr is not None else ():
        if key != "round_robin/-":
            print(f"{key} vs round_robin: hit rate {m['hit_rate'] - rr['hit_rate']:+.3f}, "
                  f"p90 TTFT x{rr['ttft_p90_ms'] / m['ttft_p90_ms']:.2f} better, "
                  f"later turns' p90 TTFT x{rr['later_ttft_p90_ms'] / m['later_ttft_p90_ms']:.2f} better")
    load = os.getloadavg()
    print(f"machine load average (1/5/15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "means": means, "loadavg": load}, f, indent=1)


if __name__ == "__main__":
    main()
