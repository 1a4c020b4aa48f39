"""KV that stays where it is used (issue 47): delta transfers and decode-aware routing against shipping every
prompt's whole KV, on multi-turn conversations through a disaggregated deployment.

Workload: ``--conversations`` conversations run at once (one client thread each), each of a seeded random number
of turns in ``--turns`` (4-8 by default) and opening with one shared system prompt; every turn re-sends the whole
history (system prompt, earlier user turns and the greedy answers) plus a new user message, as a chat client does.
Greedy answers depend only on the history, so both policies see the same prompts and must produce the same tokens
(checked, printed). A closed loop (the default) sends each turn as soon as the previous answer is in, so a policy
that answers faster is offered more load and queues more at the prefill pool (seen on 29 Nov: delta's TPOT 0.73-0.96x,
its runs 5-15% shorter, its TTFT higher); ``--turn-gap-s G`` paces each conversation's turns G seconds apart (an
open-loop schedule, as chat users who read and type), which compares TTFT at one offered load.

Deployment per run (fresh, so no run inherits another's cache): ``P`` prefill and ``D`` decode worker processes
(real engines, one torch thread each, KV over gloo) that heartbeat into a Redis registry, publish their KV events
and rendezvous through it; one ``RouterServer`` in this process reads the registry. Policies:

- ``whole``: ``RouterConfig(kv_delta_transfers=False, decode_prefix_routing=False)``: decode workers by load, every
  prompt's KV shipped whole (pdserve before issue 47);
- ``delta``: decode workers scored by the history they hold on the KV event index, and a decode worker's reservation
  takes the leading blocks it holds so the prefill worker sends only the rest; a prefill worker computes whatever its
  own cache lacks (``kv_prefix_fetch_min_tokens=0``);
- ``fetch``: ``delta``, and a prefill worker that holds at least ``--fetch-min-tokens`` (default 16: any whole block)
  fewer of the prompt's leading tokens than the decode worker receives them from it and computes only the rest (the
  default router does so from 256 on).

Printed per (policy, P+D): KV bytes shipped per request (the workers' ``pdserve:kv_transfer_bytes_total``, prefill
and decode: every byte that crossed, either way), prefix fetches (tokens the prefill workers received instead of
computing), mean KV transfer time (``pdserve:kv_transfer_time_seconds``), client-side TTFT (mean,
p90) and TPOT (mean), tokens the decode workers found cached (``pdserve:kv_transfer_cached_tokens_total``), and
delta against whole in the same run. TTFT and TPOT depend on the machine's load: read them as ratios within a run.

At scale (``--simulate PROFILE``): the same rule in ``pdserve simulate``'s cluster simulation, with the profile's
step and link costs, on an open-loop stream of such conversations (``--rate`` new conversations a second, a turn
``--think-s`` after the previous one's arrival; the simulated engines sample a fixed token, and each conversation's
history carries that token as its answers, so a decode worker's cache matches a next turn's prompt over the previous
answer too, as in a real chat; before 29 Nov 16:00 the history carried random answers, which no cache matched).
Printed per policy: KV bytes per request, p50/p90 TTFT, p90 time to the second token (the first token needs no
KV; the second waits for it), p90 TPOT, and the ratios.

    .venv/bin/python benchmarks/decode_history.py --short           # a quick check
    .venv/bin/python benchmarks/decode_history.py --repeat 2 --json results/decode_history.json
    .venv/bin/python benchmarks/decode_history.py --simulate docs/profiles/h200-llama-8b-shape-bf16.json \
        --prefills 2 --decodes 6 --rate 2 --conversations 200 --system-tokens 1024 --user-tokens 256 \
        --output-tokens 128
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
import urllib.request
import uuid
from typing import Any


POLICIES = {"whole": {"kv_delta_transfers": False, "decode_prefix_routing": False},
            "delta": {"kv_prefix_fetch_min_tokens": 0}, "fetch": {}}
BASELINES = {"delta": "whole", "fetch": "delta"}
"""What each policy is compared with in a run: delta against whole, fetch against delta."""


def policy_kw(policy: str, args: argparse.Namespace) -> dict:
    """The router (and simulator) settings of ``policy``: ``fetch`` prefetches from ``--fetch-min-tokens`` on."""
    kw = dict(POLICIES[policy])
    if policy == "fetch":
        kw["kv_prefix_fetch_min_tokens"] = args.fetch_min_tokens
    return kw


def _worker_main(role: str, worker_id: str, model: str, engine_kw: dict, redis_url: str, ns: str, ready_q: Any,
                 stop_evt: Any) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        from cluster.registry import Registry
        from engine.config import EngineConfig
        from kvtransfer import StoreConfig

        common = dict(worker_id=worker_id, engine=EngineConfig(model=model, num_threads=1, **engine_kw),
                      kv_store=StoreConfig(redis_url, namespace=f"{ns}:kvt", host="127.0.0.1"), host="127.0.0.1",
                      kv_backend="gloo", kv_events_url=redis_url, kv_events_namespace=ns)
        if role == "prefill":
            from prefill_worker import PrefillWorker, PrefillWorkerConfig

            w = PrefillWorker(PrefillWorkerConfig(**common)).start()
        else:
            from decode_worker import DecodeWorker, DecodeWorkerConfig

            w = DecodeWorker(DecodeWorkerConfig(**common)).start()
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


def _scrape(address: str) -> dict[str, float]:
    """A worker's /metrics: the pdserve series' values summed over labels (a histogram: its _sum and _count)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("pdserve:") and not s.name.endswith("_created") and "_bucket" not in s.name:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class Run:
    """One fresh deployment: P prefill and D decode worker processes, a namespace, one router of one policy."""

    def __init__(self, args: argparse.Namespace, redis_url: str, policy: str, n_prefill: int) -> None:
        from cluster.registry import Registry

        self.ns = f"bench-dh-{uuid.uuid4().hex[:8]}"
        self.registry = Registry(redis_url, self.ns, ttl_s=3.0)
        ctx = mp.get_context("spawn")
        self.stop_evt = ctx.Event()
        q = ctx.Queue()
        engine_kw = dict(num_kv_blocks=args.kv_blocks, block_size=args.block_size)
        roles = [("prefill", f"p{i}") for i in range(n_prefill)] + [("decode", f"d{i}") for i in range(args.decodes)]
        self.procs = [ctx.Process(target=_worker_main, args=(role, wid, args.model, engine_kw, redis_url, self.ns, q,
                                                             self.stop_evt), daemon=True) for role, wid in roles]
        for p in self.procs:
            p.start()
        for _ in self.procs:
            got = q.get(timeout=600)
            if got[0] == "error":
                self.close()
                raise RuntimeError(got[1])
        from router import RouterConfig, RouterServer

        self.router = RouterServer(RouterConfig(serve_metrics=False, worker_view_refresh_s=0.25,
                                                **policy_kw(policy, args)),
                                   self.registry).start()
        t0 = time.monotonic()
        while self.router.core.kv_events.num_synced() < len(roles):
            if time.monotonic() - t0 > 60:
                raise RuntimeError("the router never followed every worker's events")
            time.sleep(0.05)
        import grpc

        from proto import pdserve_pb2_grpc

        self.channel = grpc.insecure_channel(self.router.address)
        self.stub = pdserve_pb2_grpc.PDServeStub(self.channel)

    def scrape(self, role: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for w in self.registry.list(role):
            for k, v in _scrape(w.metrics_address).items():
                out[k] = out.get(k, 0.0) + v
        return out

    def router_counts(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(self.router.core.metrics.render().decode()):
            if fam.name in ("pdserve:decode_routing_decisions", "pdserve:decode_prefix_stale",
                            "pdserve:local_prefill_requests"):
                for s in fam.samples:
                    if s.name.endswith("_total"):
                        key = fam.name[len("pdserve:"):] + (f"/{s.labels['reason']}" if "reason" in s.labels else "")
                        out[key] = out.get(key, 0.0) + s.value
        return out

    def close(self) -> None:
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        if getattr(self, "router", None) is not None:
            self.router.stop()
        self.stop_evt.set()
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
        self.registry.clear()
        self.registry.close()


def _conversation(run: Run, c: int, turns: int, args: argparse.Namespace, system: list[int],
                  start: float = 0.0) -> list[dict]:
    """One conversation's turns: ttft, tpot, prompt and cached tokens, and the answer, each. With
    ``--turn-gap-s G``, turn k is sent at ``start + k G`` (or when turn k-1's answer is in, if later)."""
    from proto import pdserve_pb2

    history = list(system)
    out = []
    for turn in range(turns):
        if args.turn_gap_s > 0:
            wait = start + turn * args.turn_gap_s - time.perf_counter()
            if wait > 0:
                time.sleep(wait)  # (a paced client: the offered load does not follow the server's speed)
        history += [(c * 7919 + turn * 104729 + j * 31) % 900 + 20 for j in range(args.user_tokens)]
        t0 = time.perf_counter()
        first = None
        tokens: list[int] = []
        cached = 0
        timings = (0.0, 0.0, 0.0)
        for r in run.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=history, max_tokens=args.output_tokens,
                                                               temperature=0.0, ignore_eos=True), timeout=600):
            if first is None and r.token_ids:
                first = time.perf_counter()
            tokens += list(r.token_ids)
            if r.HasField("usage"):
                cached = r.usage.cached_tokens
            if r.HasField("timings"):
                timings = (r.timings.queue_s, r.timings.prefill_s, r.timings.kv_transfer_s)
        end = time.perf_counter()
        out.append({"ttft": first - t0, "tpot": (end - first) / max(1, len(tokens) - 1), "prompt": len(history),
                    "cached": cached, "answer": tokens, "turn": turn, "timings": timings})
        history += tokens
    return out


def measure(args: argparse.Namespace, redis_url: str, policy: str, n_prefill: int) -> dict:
    run = Run(args, redis_url, policy, n_prefill)
    try:
        rng = random.Random(args.seed)
        lo, hi = args.turns
        turns = [rng.randint(lo, hi) for _ in range(args.conversations)]
        system = [(i * 13) % 800 + 30 for i in range(args.system_tokens)]
        results: list[list[dict]] = [[] for _ in range(args.conversations)]
        errors: list[str] = []

        t_begin = time.perf_counter() + 0.05
        gap = args.turn_gap_s

        def one(c: int) -> None:
            try:  # paced: conversations start spread over one turn gap
                results[c] = _conversation(run, c, turns[c], args, system, t_begin + gap * c / args.conversations)
            except Exception as e:  # noqa: BLE001 - reported below, the run is then invalid
                errors.append(f"conversation {c}: {e!r}")

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(c,)) for c in range(args.conversations)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        if errors:
            raise RuntimeError("; ".join(errors))
        time.sleep(1.0)  # a prefill worker records a send when its loop next polls it
        pre, dec = run.scrape("prefill"), run.scrape("decode")
        spread = sorted(w.requests_finished_total for w in run.registry.list("decode"))
        counts = run.router_counts()
    finally:
        run.close()
    flat = [t for conv in results for t in conv]
    later = [t for t in flat if t["turn"] > 0]
    sends = pre.get("pdserve:kv_transfer_time_seconds_count", 0.0)
    ttft = sorted(t["ttft"] for t in flat)
    kv_bytes = pre.get("pdserve:kv_transfer_bytes_total", 0.0) + dec.get("pdserve:kv_transfer_bytes_total", 0.0)
    later_ttft = sorted(t["ttft"] for t in later)
    return {
        "policy": policy, "topology": f"{n_prefill}P+{args.decodes}D", "requests": len(flat), "wall_s": wall,
        "prompt_tokens": sum(t["prompt"] for t in flat),
        "kv_bytes": kv_bytes, "kv_bytes_decode_to_prefill": dec.get("pdserve:kv_transfer_bytes_total", 0.0),
        "kv_bytes_per_request": kv_bytes / max(1, len(flat)),
        "prefix_fetches": pre.get("pdserve:kv_prefix_fetches_total", 0.0),
        "prefix_fetch_tokens": pre.get("pdserve:kv_prefix_fetch_tokens_total", 0.0),
        "kv_sends": sends, "kv_transfer_mean_ms": 1e3 * pre.get("pdserve:kv_transfer_time_seconds_sum", 0.0)
        / max(1.0, sends),
        "decode_cached_tokens": dec.get("pdserve:kv_transfer_cached_tokens_total", 0.0),
        "ttft_mean_ms": 1e3 * statistics.mean(ttft), "ttft_p90_ms": 1e3 * ttft[int(0.9 * (len(ttft) - 1))],
        "later_ttft_p90_ms": 1e3 * later_ttft[int(0.9 * (len(later_ttft) - 1))] if later_ttft else 0.0,
        "tpot_mean_ms": 1e3 * statistics.mean(t["tpot"] for t in flat),
        # the router's own phases (Timings on the last message): admission -> prefill started (Reserve, the
        # prefill worker's queue), the prefill, the KV transfer
        "queue_mean_ms": 1e3 * statistics.mean(t["timings"][0] for t in flat),
        "prefill_mean_ms": 1e3 * statistics.mean(t["timings"][1] for t in flat),
        "router_kv_transfer_mean_ms": 1e3 * statistics.mean(t["timings"][2] for t in flat),
        "hit_rate": sum(t["cached"] for t in flat) / max(1, sum(t["prompt"] for t in flat)),
        "decode_requests": spread, "router": counts, "answers": [[t["answer"] for t in conv] for conv in results],
    }


def simulate(args: argparse.Namespace, n_prefill: int) -> list[dict]:
    """Both policies in the cluster simulation (``--simulate``): one row each."""
    from loadtest.stats import percentile, tpot_s, ttft_s
    from simulator.cluster_sim import SimConfig, SimRequest, Simulation
    from simulator.costs import load_profiles
    from simulator.engine_sim import SIM_TOKEN

    profiles = load_profiles([args.simulate])
    rng = random.Random(args.seed)
    lo, hi = args.turns
    system = [(i * 13) % 30000 + 30 for i in range(args.system_tokens)]
    reqs, t = [], 0.0
    for c in range(args.conversations):
        t += rng.expovariate(args.rate)
        history = list(system)
        for turn in range(rng.randint(lo, hi)):
            history = history + [rng.randrange(30, 30000) for _ in range(args.user_tokens)]
            if len(history) >= profiles.base.max_model_len - args.output_tokens:
                break
            reqs.append(SimRequest(f"c{c}-t{turn}", t + turn * args.think_s, list(history), args.output_tokens))
            history = history + [SIM_TOKEN] * args.output_tokens  # the answer the simulated decode worker streamed
    reqs.sort(key=lambda r: r.arrival_s)
    rows = []
    for policy in args.policies:
        cfg = SimConfig(prefill=n_prefill, decode=args.decodes, seed=args.seed, max_num_requests=100000,
                        kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_num_seqs=args.max_num_seqs,
                        **policy_kw(policy, args))
        sim = Simulation(profiles, cfg)
        t0 = time.perf_counter()
        recs = sim.run(reqs)
        ok = [r for r in recs if r.success]
        pools = sim.pool_stats()
        dec = pools["decode"]
        second = [r.chunk_times_s[1] - r.start_s for r in ok if len(r.chunk_times_s) > 1]
        errors = sorted({r.error for r in recs if not r.success})
        rows.append({"policy": policy, "errors": errors[:3], "topology": f"{n_prefill}P+{args.decodes}D (simulated)", "requests": len(recs),
                     "failed": len(recs) - len(ok), "kv_bytes_per_request": dec.kv_bytes_received / max(1, len(recs)),
                     "kv_cached_tokens": dec.kv_cached_tokens, "prefix_fetch_tokens": pools["prefill"].kv_fetched_tokens,
                     "prefill_tokens": pools["prefill"].tokens,
                     "ttft_p50_ms": 1e3 * percentile([ttft_s(r) for r in ok], 50),
                     "ttft_p90_ms": 1e3 * percentile([ttft_s(r) for r in ok], 90),
                     "second_token_p90_ms": 1e3 * percentile(second, 90),
                     "tpot_p90_ms": 1e3 * percentile([x for x in (tpot_s(r) for r in ok) if x is not None], 90),
                     "wall_s": time.perf_counter() - t0})
    return rows


def main() -> None:
    from loadtest.machine import machine_info

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prefills", default="1,2", help="prefill pool sizes to run, comma-separated")
    ap.add_argument("--decodes", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=8, help="conversations at once (one client thread each)")
    ap.add_argument("--turns", type=int, nargs=2, default=(4, 8), metavar=("MIN", "MAX"))
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--kv-blocks", type=int, default=1024, help="KV blocks per worker")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help="seeds the turns per conversation")
    ap.add_argument("--redis-url", default=None, help="default: an embedded redis-server")
    ap.add_argument("--short", action="store_true", help="a quick run: 4 conversations of 4 turns, 1P+2D")
    ap.add_argument("--repeat", type=int, default=1, help="run every row this many times (interleaved)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--simulate", default=None, metavar="PROFILE",
                    help="run the cluster simulation with this `pdserve profile` instead of real workers")
    ap.add_argument("--rate", type=float, default=1.0, help="--simulate: new conversations a second (Poisson)")
    ap.add_argument("--turn-gap-s", type=float, default=0.0,
                    help="live runs: send a conversation's turn k at its start + k x this (or when turn k-1 is "
                         "answered, if later), the starts spread over one gap: an offered load that does not depend "
                         "on the policy's speed. 0 (default): closed loop, each turn right after the previous answer")
    ap.add_argument("--think-s", type=float, default=20.0, help="--simulate: seconds between a conversation's turns")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=30_000_000_000,
                    help="--simulate: KV cache per worker (default 30 GB, docs/capacity.md's GPU tables)")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="--simulate: running sequences per engine")
    ap.add_argument("--policies", default="whole,delta",
                    help=f"policies in the order each repetition runs them, two or more of {', '.join(POLICIES)} "
                         "(default whole,delta)")
    ap.add_argument("--fetch-min-tokens", type=int, default=16, metavar="N",
                    help="policy fetch: prefetch the decode worker's history from N more tokens on (default 16)")
    args = ap.parse_args()
    args.policies = [x for x in args.policies.split(",") if x]
    if len(args.policies) < 2 or len(set(args.policies)) != len(args.policies) \
            or not set(args.policies) <= set(POLICIES):
        ap.error(f"--policies must name two or more of {', '.join(POLICIES)}, each once")
    if args.fetch_min_tokens < 1:
        ap.error("--fetch-min-tokens must be >= 1")
    prefills = [int(x) for x in args.prefills.split(",")]
    if args.short:
        args.conversations, args.turns, prefills = 4, (4, 4), [1]
    if args.simulate:
        rows = [row for n_p in prefills for row in simulate(args, n_p)]
        for row in rows:
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        for b in rows:
            a = next((r for r in rows if r["topology"] == b["topology"] and r["policy"] == BASELINES.get(b["policy"])),
                     None)
            if a is None:
                continue
            print(f"{b['topology']}: {b['policy']} vs {a['policy']}: KV bytes "
                  f"x{b['kv_bytes_per_request'] / a['kv_bytes_per_request']:.3f}, prefill tokens computed "
                  f"x{b['prefill_tokens'] / a['prefill_tokens']:.3f}, TTFT p90 x{b['ttft_p90_ms'] / a['ttft_p90_ms']:.2f}, "
                  f"second token p90 x{b['second_token_p90_ms'] / a['second_token_p90_ms']:.2f}, "
                  f"TPOT p90 x{b['tpot_p90_ms'] / a['tpot_p90_ms']:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": rows}, f, indent=1)
        return
    server = None
    redis_url = args.redis_url
    if redis_url is None:
        from cluster.redis_server import EmbeddedRedis

        server = EmbeddedRedis().start()
        redis_url = server.url
    rows = []
    try:
        for _rep in range(args.repeat):
            for n_p in prefills:
                for policy in args.policies:
                    row = measure(args, redis_url, policy, n_p)
                    rows.append(row)
                    print(f"{policy:<6} {row['topology']:<6} requests={row['requests']} "
                          f"kv_bytes/request={row['kv_bytes_per_request'] / 1024:.1f}KiB "
                          f"kv_transfer_mean={row['kv_transfer_mean_ms']:.2f}ms "
                          f"ttft_mean={row['ttft_mean_ms']:.1f}ms ttft_p90={row['ttft_p90_ms']:.1f}ms "
                          f"later_ttft_p90={row['later_ttft_p90_ms']:.1f}ms tpot_mean={row['tpot_mean_ms']:.2f}ms "
                          f"phases: queue={row['queue_mean_ms']:.1f}ms prefill={row['prefill_mean_ms']:.1f}ms "
                          f"kv={row['router_kv_transfer_mean_ms']:.1f}ms "
                          f"decode_cached_tokens={row['decode_cached_tokens']:.0f} hit_rate={row['hit_rate']:.3f} "
                          f"fetches={row['prefix_fetches']:.0f} fetched_tokens={row['prefix_fetch_tokens']:.0f} "
                          f"decode_requests={row['decode_requests']} router={row['router']} wall={row['wall_s']:.1f}s", flush=True)
    finally:
        if server is not None:
            server.stop()
    def mean(rs: list[dict], k: str) -> float:
        return statistics.mean(r[k] for r in rs)

    for n_p in prefills:
        topo = f"{n_p}P+{args.decodes}D"
        by = {p: [r for r in rows if r["topology"] == topo and r["policy"] == p] for p in args.policies}
        for policy in args.policies:
            base = BASELINES.get(policy)
            if base not in by:
                continue
            a, b = by[base], by[policy]
            same = all(x["answers"] == y["answers"] for x in a for y in b)
            print(f"{topo}: {policy} vs {base} over {len(b)} run(s): KV bytes x{mean(b, 'kv_bytes') / mean(a, 'kv_bytes'):.3f} "
                  f"({1 - mean(b, 'kv_bytes') / mean(a, 'kv_bytes'):.1%} saved), "
                  f"prompt tokens cached on the prefill side x{mean(b, 'hit_rate') / max(1e-9, mean(a, 'hit_rate')):.2f}, "
                  f"transfer time x{mean(b, 'kv_transfer_mean_ms') / mean(a, 'kv_transfer_mean_ms'):.2f}, "
                  f"TTFT mean x{mean(b, 'ttft_mean_ms') / mean(a, 'ttft_mean_ms'):.2f}, "
                  f"TTFT p90 x{mean(b, 'ttft_p90_ms') / mean(a, 'ttft_p90_ms'):.2f}, "
                  f"TPOT x{mean(b, 'tpot_mean_ms') / mean(a, 'tpot_mean_ms'):.2f}; "
                  f"greedy answers equal between policies: {same}")
    info = machine_info()
    print(f"machine: {info}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "rows": rows, "machine": info}, f, indent=1)


if __name__ == "__main__":
    main()
