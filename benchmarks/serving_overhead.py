"""What the serving path costs: the cluster's tok/s against the offline engine with the workers' own threads.

Usage:
    python benchmarks/serving_overhead.py                       # tiny and bench, both modes, gRPC and HTTP
    python benchmarks/serving_overhead.py --models tiny --modes colocated --apis grpc --concurrency 1,32
    python benchmarks/serving_overhead.py --quick               # a smoke run (tiny, 32 tokens)
    python benchmarks/serving_overhead.py --py-spy 10           # also sample router and workers for 10 s at the
                                                                # largest concurrency (py-spy top functions)

For each model it first runs the offline engine (``engine.LLMEngine``, one thread, in a process pinned to
one core, as a worker is) on C prompts at once, for every concurrency C, and records its decode tok/s
(tokens after each request's first, over the time after the last first token) and end-to-end tok/s (every
token over the whole wall time). Then, for each mode, it starts a deployment as ``benchmarks/harness/deployment.py``
builds one: ``colocated`` = one colocated worker pinned to core 0; ``disaggregated`` = a prefill worker on
core 0 and a decode worker on core 1; workers with one torch thread each, the router in its own unpinned
process (as ``pdserve up`` runs it), this process as the client. The same C prompts (same token ids,
greedy, ``ignore_eos``, the same max tokens) go through gRPC ``Generate`` (``loadtest.client``) and the
OpenAI HTTP ``/v1/completions`` stream (``loadtest.openai_client``), and the same two rates are computed
from the client's per-chunk arrival times. Ratios cluster / offline come out of the same run.

CPU: each point reads utime+stime of the router and each worker from ``/proc/<pid>/stat`` (psutil) before
and after, and prints CPU milliseconds per streamed token per process. The client's CPU is this process's.

The host's two cores are shared by the workers, the router and the client: that is the situation a user
of ``pdserve up`` on such a machine is in, and what the issue measured. Results: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import statistics
import time
import traceback
from pathlib import Path
from typing import Any, Optional


from benchmarks.harness import Deployment, pin_threads, usable_cores
from benchmarks.harness import spy as py_spy
from benchmarks.harness import write_json
from loadtest.machine import machine_info

MODES = {"colocated": ("colocated",), "disaggregated": ("prefill", "decode"), "colocated-ep": ("colocated",),
         "disaggregated-ep": ("prefill", "decode"), "prefill-ep": ("prefill", "decode"),
         "decode-ep": ("prefill", "decode")}
# a mode's deployment: (Deployment mode, worker config fields by role, cores per worker). colocated-ep: the colocated
# worker with its engine core in a process of its own (WorkerConfig.engine_process), the engine on one core and
# the worker's gRPC and streaming threads on the next. disaggregated-ep: both roles' engines in processes of their
# own, on the cores disaggregated gives each worker (one each: the worker's threads share its engine's core, so
# the split is judged on the same cores; on a host with 4+ cores, 2 each as colocated-ep has). prefill-ep and
# decode-ep: one role's engine in a process of its own, the other's in process (the verdict for each role)
_EP = {"engine_process": True}
DEPLOY = {"colocated": ("colocated", {}, 1), "disaggregated": ("disaggregated", {}, 1),
          "colocated-ep": ("colocated", {"colocated": _EP}, 2),
          "disaggregated-ep": ("disaggregated", {"prefill": _EP, "decode": _EP}, 1),
          "prefill-ep": ("disaggregated", {"prefill": _EP}, 1), "decode-ep": ("disaggregated", {"decode": _EP}, 1)}
PATHS = {"streams": {"output_streams": True}, "per-call": {"output_streams": False},
         "one-loop": {"output_streams": True, "one_loop": True}}  # RouterConfig fields of each path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,bench", help="built-in model names or paths, comma-separated")
    p.add_argument("--modes", default="colocated,disaggregated", help="colocated (1 worker), disaggregated (1+1), colocated-ep (1 worker, its engine in a process of "
                        "its own on a second core), disaggregated-ep (1+1, both engines in processes of their own), "
                        "prefill-ep, decode-ep (1+1, that role's engine in a process of its own)")
    p.add_argument("--apis", default="grpc,http", help="grpc, http (OpenAI /v1/completions, streamed)")
    p.add_argument("--concurrency", default="1,8,32,128", help="streams at once, comma-separated")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of each request (random ids)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens of each request (ignore_eos)")
    p.add_argument("--batch1-max-tokens", type=int, default=256, help="output tokens at concurrency 1")
    p.add_argument("--max-num-seqs", type=int, default=128, help="engine max_num_seqs (offline and workers alike)")
    p.add_argument("--device", default="cpu", help="engine device of the offline engine and every worker: cpu, cuda "
                                                   "(one GPU: colocated only, NCCL needs a GPU per worker)")
    p.add_argument("--dtype", default="float32", help="engine dtype (offline and workers alike): float32, bfloat16")
    p.add_argument("--kv-cache-gib", type=float, default=0.25, help="each engine's KV cache budget (GiB)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="the offline engine and every worker launch each step while the one before runs (cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3, help="runs of every point (paths taking turns); medians reported")
    p.add_argument("--timeout-s", type=float, default=900.0, help="deadline of each request")
    p.add_argument("--pin-front", action="store_true",
                   help="pin the router and this client to the cores no engine uses (colocated modes: all but "
                        "the first), so the engines' cores serve nothing else: what the serving path costs when "
                        "the host has a core for it")
    p.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS",
                   help="sample the router and every worker with py-spy for this long during the largest concurrency's point of each API")
    p.add_argument("--paths", default="streams,per-call",
                   help="how tokens travel from worker to router: streams (one output stream per worker, a message "
                        "per step; the default since issue 31), per-call (a message per token on each request's "
                        "call, as before: the router's --no-output-streams), one-loop (streams, read on the gRPC "
                        "front end's event loop, which serves HTTP too: RouterConfig.one_loop); several: compared in "
                        "one run")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny, colocated, gRPC, concurrency 1,8, 32 tokens")
    p.add_argument("--json", default="", help="write every number here")
    return p


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ns = build_parser().parse_args(argv)
    if ns.quick:
        ns.models, ns.modes, ns.apis, ns.concurrency = "tiny", "colocated", "grpc", "1,8"
        ns.max_tokens = ns.batch1_max_tokens = 32
    ns.models = [m for m in ns.models.split(",") if m]
    ns.modes = [m for m in ns.modes.split(",") if m]
    ns.apis = [a for a in ns.apis.split(",") if a]
    ns.paths = [x for x in ns.paths.split(",") if x]
    for x in ns.paths:
        if x not in PATHS:
            raise SystemExit(f"--paths: {x!r} is not one of {tuple(PATHS)}")
    try:
        ns.concurrency = [int(c) for c in ns.concurrency.split(",") if c]
    except ValueError:
        raise SystemExit(f"--concurrency must be integers separated by commas, got {ns.concurrency!r}") from None
    for m in ns.modes:
        if m not in MODES:
            raise SystemExit(f"--modes: {m!r} is not one of {tuple(MODES)}")
    for a in ns.apis:
        if a not in ("grpc", "http"):
            raise SystemExit(f"--apis: {a!r} is not grpc or http")
    if not ns.concurrency or min(ns.concurrency) < 1:
        raise SystemExit("--concurrency: every value must be >= 1")
    if max(ns.concurrency) > ns.max_num_seqs:
        raise SystemExit(f"--concurrency {max(ns.concurrency)} exceeds --max-num-seqs {ns.max_num_seqs}")
    for name in ("prompt_len", "max_tokens", "batch1_max_tokens"):
        if getattr(ns, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if ns.device.startswith("cuda") and "disaggregated" in ns.modes:
        raise SystemExit("--device cuda: only --modes colocated or colocated-ep (every worker of a Deployment takes the same device, "
                         "and NCCL refuses two ranks on one GPU)")
    if ns.kv_cache_gib <= 0:
        raise SystemExit("--kv-cache-gib must be > 0")
    if ns.async_scheduling and not ns.device.startswith("cuda"):
        raise SystemExit("--async-scheduling needs --device cuda (a CPU forward runs on the thread that schedules)")
    if ns.py_spy and py_spy.py_spy_bin() is None:
        raise SystemExit("--py-spy: the py-spy command is not on PATH (pip install 'pdserve[bench]')")
    return ns


def engine_kw(ns: dict) -> dict:
    """The EngineConfig fields the offline engine and every worker share (``ns``: the parsed flags, as a dict)."""
    kw = {"max_num_seqs": ns["max_num_seqs"], "device": ns["device"], "dtype": ns["dtype"],
          "kv_cache_memory_bytes": int(ns["kv_cache_gib"] * 2**30)}
    if ns.get("async_scheduling"):
        kw["async_scheduling"] = True
    return kw


def _tokens_for(c: int, ns: argparse.Namespace) -> int:
    return ns.batch1_max_tokens if c == 1 else ns.max_tokens


def rates(first: list[float], last: list[float], counts: list[int], start: float, end: float) -> dict:
    """decode tok/s: tokens after each request's first, over the time after the last first token;
    e2e tok/s: every token over the whole wall time."""
    after = sum(n - 1 for n in counts)
    span = max(last) - max(first)
    return {"decode_tok_s": after / span if span > 0 and after > 0 else float("nan"),
            "e2e_tok_s": sum(counts) / (end - start) if end > start else float("nan"),
            "tokens": sum(counts)}


# -- the offline reference ----------------------------------------------------------------------------------

def _offline_main(model: str, core: Optional[int], prompts: dict, ns_dict: dict, q: Any) -> None:
    try:
        if core is not None:
            os.sched_setaffinity(0, {core})
        import torch

        torch.set_num_threads(1)
        from engine import SamplingParams
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine

        eng = LLMEngine(EngineConfig(model=model, num_threads=1, **engine_kw(ns_dict)))
        sync = torch.cuda.synchronize if ns_dict["device"].startswith("cuda") else (lambda: None)
        out = {}
        warm = prompts[min(prompts)][:1]
        runs = [(0, warm, 0)] + [(c, plist, rep) for c, plist in sorted(prompts.items())
                                 for rep in range(ns_dict["repeat"])]
        samples: dict[int, list] = {}
        tokens: dict[int, list] = {}  # the first repeat's output ids, by prompt index: the cluster must equal them
        for c, plist, rep in runs:
            n = ns_dict["batch1_max_tokens"] if c == 1 else ns_dict["max_tokens"]
            params = SamplingParams(max_tokens=n if c else 8, temperature=0.0, ignore_eos=True)
            first: dict[str, float] = {}
            last: dict[str, float] = {}
            counts: dict[str, int] = {}
            got: dict[str, list] = {}
            t0 = time.perf_counter()
            for i, ids in enumerate(plist):
                eng.add_request(f"r{c}-{rep}-{i}", list(ids), params)
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.new_token_ids:
                        now = time.perf_counter()
                        first.setdefault(o.request_id, now)
                        last[o.request_id] = now
                        counts[o.request_id] = counts.get(o.request_id, 0) + len(o.new_token_ids)
                        got.setdefault(o.request_id, []).extend(o.new_token_ids)
            sync()
            t1 = time.perf_counter()
            if c and rep == 0:
                tokens[c] = [got.get(f"r{c}-0-{i}", []) for i in range(len(plist))]
            if c:
                ids = sorted(counts)
                samples.setdefault(c, []).append(rates([first[i] for i in ids], [last[i] for i in ids],
                                                       [counts[i] for i in ids], t0, t1))
        for c, pts in samples.items():
            out[c] = {k: statistics.median(p[k] for p in pts) for k in pts[0]}
        q.put(("ok", (out, tokens)))
    except BaseException:
        q.put(("error", traceback.format_exc()))


def offline(model: str, prompts: dict, ns: argparse.Namespace) -> tuple[dict, dict]:
    """({concurrency: rates}, {concurrency: [output ids of each prompt]}) of the offline engine."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    cores = usable_cores()
    p = ctx.Process(target=_offline_main, args=(model, cores[0] if cores else None, prompts, vars(ns), q))
    p.start()
    status, val = q.get(timeout=3600)
    p.join(60)
    if status != "ok":
        raise RuntimeError(f"offline {model} failed:\n{val}")
    return val


# -- the cluster -----------------------------------------------------------------------------------------

def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    import psutil

    out = {}
    for name, pid in pids.items():
        t = psutil.Process(pid).cpu_times()
        out[name] = t.user + t.system
    return out


def _requests(plist: list, n: int, prefix: str) -> list:
    from loadtest.workload import BenchRequest

    return [BenchRequest(f"{prefix}-{i}", list(ids), n, 0.0) for i, ids in enumerate(plist)]


def _send(api: str, dep: Deployment, model: str, reqs: list, timeout_s: float) -> list:
    from loadtest.client import ClientConfig, run_benchmark
    from loadtest.openai_client import run_openai_benchmark

    if api == "grpc":
        cfg = ClientConfig(target=dep.target, request_timeout_s=timeout_s)
        return asyncio.run(run_benchmark(cfg, reqs))[0]
    cfg = ClientConfig(target=dep.http_target, request_timeout_s=timeout_s)
    return asyncio.run(run_openai_benchmark(cfg, f"http://{dep.http_target}", model, reqs))[0]


def _median_point(points: list[dict]) -> dict:
    """Each number of the points' median (CPU per process too); profiles from the first point that has them."""
    out = dict(points[0])
    for k, v in points[0].items():
        if isinstance(v, (int, float)):
            out[k] = statistics.median(p[k] for p in points)
    out["cpu_ms_per_token"] = {k: statistics.median(p["cpu_ms_per_token"][k] for p in points)
                               for k in points[0]["cpu_ms_per_token"]}
    out["repeats"] = len(points)
    for k in ("same_tokens", "compared"):  # over every repeat, not a median: one differing request must show
        out[k] = sum(p[k] for p in points)
    return out


def same_tokens(recs: list, want: list) -> tuple[int, int]:
    """(requests whose streamed ids equal the offline engine's for the same prompt, requests compared): greedy
    through the cluster must be the offline engine's output. Only gRPC records carry ids (HTTP streams text)."""
    equal = compared = 0
    for r in recs:
        if not r.token_ids:
            continue
        compared += 1
        equal += list(r.token_ids) == list(want[int(r.request_id.rsplit("-", 1)[1])])
    return equal, compared


def cluster_points(model: str, mode: str, prompts: dict, ns: argparse.Namespace, ref_tokens: dict) -> dict:
    """{(path, api, concurrency): point}: every path's deployment is up at once and the paths take turns at each
    point, ``--repeat`` times (medians), so a load spike on this shared host hits both sides of a ratio alike."""
    samples: dict = {}
    ekw = engine_kw(vars(ns))
    with contextlib.ExitStack() as stack:
        deps = {}
        for path in ns.paths:
            router_kw = dict(PATHS[path])
            if "http" in ns.apis:  # the HTTP front end only where it is measured (its server needs the HTTP extras)
                router_kw["http_port"] = 0
            dmode, worker_kw, per_worker = DEPLOY[mode]
            if mode.endswith("-ep") and mode != "colocated-ep" and len(usable_cores()) >= 4:
                per_worker = 2
            deps[path] = stack.enter_context(Deployment(dmode, model, usable_cores(), engine_kw=ekw,
                                                        router_kw=router_kw, roles=MODES[mode], router_process=True,
                                                        role_worker_kw=worker_kw, cores_per_worker=per_worker))
            if ns.pin_front:  # the engines' cores (the first worker's first core) serve nothing else
                cores = usable_cores()
                front = cores[len(MODES[mode]) * per_worker:] if len(MODES[mode]) > 1 else cores[1:]
                if not front:
                    raise SystemExit(f"--pin-front: {mode} leaves no core for the router and the client")
                pin_threads(deps[path].pids["router"], front)
                pin_threads(os.getpid(), front)
                stack.callback(pin_threads, os.getpid(), cores)
            for api in ns.apis:  # warm both APIs
                recs = _send(api, deps[path], model, _requests(prompts[min(prompts)][:2], 8, f"warm-{api}"),
                             ns.timeout_s)
                if not all(r.success for r in recs):
                    raise RuntimeError(f"{mode} {path} {api}: warm-up failed: "
                                       f"{[r.error for r in recs if not r.success]}")
        for api in ns.apis:
            for c in ns.concurrency:
                for rep in range(ns.repeat):
                    for path, dep in deps.items():
                        samples.setdefault((path, api, c), []).append(
                            _point(dep, model, mode, path, api, c, prompts, ns, spy=rep == 0,
                                   ref_tokens=ref_tokens.get(c)))
    return {key: _median_point(pts) for key, pts in samples.items()}


def _point(dep: Any, model: str, mode: str, path: str, api: str, c: int, prompts: dict, ns: argparse.Namespace,
           spy: bool, ref_tokens: Optional[list] = None) -> dict:
    reqs = _requests(prompts[c], _tokens_for(c, ns), f"{api}{c}")
    spies = {}
    if spy and ns.py_spy and c == max(ns.concurrency):
        for name, pid in dep.pids.items():
            raw = Path(f"/tmp/pdserve-{name}-{model}-{mode}-{path}-{api}-c{c}.txt")
            spies[name] = (py_spy.start(pid, ns.py_spy, raw), raw)
    cpu0, self0 = cpu_seconds(dep.pids), time.process_time()
    recs = _send(api, dep, model, reqs, ns.timeout_s)
    cpu1, self1 = cpu_seconds(dep.pids), time.process_time()
    bad = [r.error for r in recs if not r.success]
    if bad:
        raise RuntimeError(f"{mode} {path} {api} c={c}: {len(bad)} failed: {bad[:3]}")
    ok = [r for r in recs if r.chunk_times_s]
    point = rates([r.chunk_times_s[0] for r in ok], [r.chunk_times_s[-1] for r in ok],
                  [r.output_tokens for r in ok], min(r.start_s for r in recs), max(r.end_s for r in recs))
    tokens = point["tokens"]
    point["same_tokens"], point["compared"] = same_tokens(recs, ref_tokens) if ref_tokens else (0, 0)
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    cpu["client"] = self1 - self0
    point["cpu_ms_per_token"] = {k: 1e3 * v / tokens for k, v in cpu.items()}
    for name, (proc, raw) in spies.items():
        proc.wait(ns.py_spy + 60)
        point.setdefault("profiles", {})[name] = py_spy.top_functions(raw) if raw.exists() else []
        print(f"    py-spy {name} ({raw}): " + ", ".join(f"{f} {share:.0%}" for f, share
                                                      in point["profiles"][name][:8]), flush=True)
    print(f"  {model} {mode} {path} {api} c={c}: decode {point['decode_tok_s']:.1f} tok/s, "
          f"e2e {point['e2e_tok_s']:.1f} tok/s, offline's tokens {point['same_tokens']}/{point['compared']}, CPU ms/token "
          + ", ".join(f"{k} {v:.3f}" for k, v in point["cpu_ms_per_token"].items()), flush=True)
    return point



def main(argv: Optional[list[str]] = None) -> int:
    ns = parse_args(argv)
    from loadtest.workload import ModelLimits, build_workload

    info = machine_info(ns.device)
    print(f"machine: {info}", flush=True)
    results: dict = {"machine": info, "args": {k: v for k, v in vars(ns).items()}, "rows": []}
    for model in ns.models:
        from engine import EngineConfig, load_model_config

        limits = ModelLimits(vocab_size=load_model_config(EngineConfig(model=model)).vocab_size)
        prompts = {c: [r.prompt_token_ids for r in build_workload([(ns.prompt_len, 1)] * c, [0.0] * c, limits,
                                                                  seed=ns.seed + c).requests]
                   for c in ns.concurrency}
        print(f"{model}: offline engine, 1 thread ...", flush=True)
        ref, ref_tokens = offline(model, prompts, ns)
        for c, r in sorted(ref.items()):
            print(f"  {model} offline c={c}: decode {r['decode_tok_s']:.1f} tok/s, e2e {r['e2e_tok_s']:.1f} tok/s",
                  flush=True)
        for mode in ns.modes:
            print(f"{model}: {mode}, paths {', '.join(ns.paths)} ...", flush=True)
            pts = cluster_points(model, mode, prompts, ns, ref_tokens)
            for (path, api, c), p in sorted(pts.items(), key=lambda kv: (ns.paths.index(kv[0][0]), kv[0][1], kv[0][2])):
                o = ref[c]
                results["rows"].append({
                    "model": model, "mode": mode, "path": path, "api": api, "concurrency": c,
                    "offline_decode_tok_s": o["decode_tok_s"], "offline_e2e_tok_s": o["e2e_tok_s"],
                    "decode_tok_s": p["decode_tok_s"], "e2e_tok_s": p["e2e_tok_s"],
                    "decode_ratio": p["decode_tok_s"] / o["decode_tok_s"], "e2e_ratio": p["e2e_tok_s"] / o["e2e_tok_s"],
                    "cpu_ms_per_token": p["cpu_ms_per_token"], "profiles": p.get("profiles", {}),
                    "repeats": p["repeats"], "same_tokens": p["same_tokens"], "compared": p["compared"]})
    print("\n| model | mode | path | api | streams | offline decode | cluster decode | ratio | offline e2e | cluster e2e "
          "| ratio | router CPU ms/tok | workers CPU ms/tok | offline's tokens |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results["rows"]:
        cpu = r["cpu_ms_per_token"]
        workers = sum(v for k, v in cpu.items() if k not in ("router", "client"))
        print(f"| {r['model']} | {r['mode']} | {r['path']} | {r['api']} | {r['concurrency']} | {r['offline_decode_tok_s']:.0f} "
              f"| {r['decode_tok_s']:.0f} | {r['decode_ratio']:.2f}x | {r['offline_e2e_tok_s']:.0f} "
              f"| {r['e2e_tok_s']:.0f} | {r['e2e_ratio']:.2f}x | {cpu['router']:.3f} | {workers:.3f} "
              f"| {r['same_tokens']}/{r['compared']} |")
    for r in results["rows"]:
        for name, prof in r["profiles"].items():
            print(f"\n{name}, {r['model']} {r['mode']} {r['path']} {r['api']} c={r['concurrency']}: leaf functions by share of samples")
            for fn, share in prof:
                print(f"  {100 * share:5.1f}%  {fn}")
    print(f"\nload average at the end: {os.getloadavg()}")
    if ns.json:
        write_json(ns.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
