"""Per-key fairness under a flood: does one API key's flood leave another key's TTFT alone? (issue 30, item 4)

Usage:
    python benchmarks/key_fairness.py                      # defaults below, about 3 minutes on tiny
    python benchmarks/key_fairness.py --flood-threads 48 --flood-max-concurrent 4 --json out.json

A deployment as ``benchmarks/harness/deployment.py`` builds one (one colocated worker pinned to core 0, the router in
its own process with ``--api-keys-file``), and two named keys: ``calm`` (no limits) and ``flood`` (at most
``--flood-max-concurrent`` requests at once). Three phases, the same calm schedule in each (``--calm-requests``
requests, Poisson at ``--calm-rate`` req/s, ``--prompt-len``-token prompts, ``--calm-max-tokens`` greedy tokens):

1. ``unloaded``: the calm key alone;
2. ``flood, quota``: ``--flood-threads`` client threads send the flood key's requests in a closed loop
   (``--flood-max-tokens`` tokens each); refused ones (RESOURCE_EXHAUSTED) wait the ``retry-after`` the router
   sent, as a well-behaved client does;
3. ``flood, no quota``: the keys file is rewritten without the flood key's limit (the router reloads it: key
   rotation without a restart) and the flood repeats: what the calm key would see without quotas.

Reported per phase: the calm key's TTFT p50 / p99 (client-side, call to first token), its requests served, and the
flood's served and refused counts; the goal is calm p99 TTFT under the flood within 2x of unloaded. Results:
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import grpc


from benchmarks.harness import Deployment, usable_cores
from benchmarks.harness import write_json

CALM_KEY, FLOOD_KEY = "pdk-calm-bench-0001", "pdk-flood-bench-001"


def keys_toml(flood_max_concurrent: Optional[int]) -> str:
    limit = f"max_concurrent = {flood_max_concurrent}\n" if flood_max_concurrent else ""
    return (f'[[key]]\nname = "calm"\nkey = "{CALM_KEY}"\n\n'
            f'[[key]]\nname = "flood"\nkey = "{FLOOD_KEY}"\n{limit}')


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--calm-requests", type=int, default=60)
    p.add_argument("--calm-rate", type=float, default=2.0, help="calm key's Poisson rate, req/s")
    p.add_argument("--calm-max-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--flood-threads", type=int, default=32)
    p.add_argument("--flood-max-tokens", type=int, default=64)
    p.add_argument("--flood-max-concurrent", type=int, default=4, help="the flood key's max_concurrent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="")
    return p


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 250) for _ in range(n)]


def _stream(stub: Any, key: str, prompt: list[int], max_tokens: int) -> tuple[Optional[float], Any]:
    """(TTFT seconds, None) or (None, the RpcError)."""
    from proto import pdserve_pb2

    t0 = time.monotonic()
    ttft = None
    try:
        for _ in stub.Generate(pdserve_pb2.GenerateRequest(token_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                                           ignore_eos=True),
                               metadata=(("authorization", f"Bearer {key}"),), timeout=300):
            if ttft is None:
                ttft = time.monotonic() - t0
        return ttft, None
    except grpc.RpcError as e:
        return None, e


def _retry_after(e: Any) -> float:
    for k, v in (e.trailing_metadata() or ()):
        if k == "retry-after":
            try:
                return max(0.05, float(v))
            except ValueError:
                pass
    return 0.5


def phase(stub: Any, ns: argparse.Namespace, flood: bool) -> dict:
    rng = random.Random(ns.seed)
    stop = threading.Event()
    counts = {"flood_served": 0, "flood_refused": 0, "flood_failed": 0}
    lock = threading.Lock()

    def flooder(i: int) -> None:
        r = random.Random(ns.seed * 1000 + i)
        while not stop.is_set():
            ttft, err = _stream(stub, FLOOD_KEY, _prompt(r, ns.prompt_len), ns.flood_max_tokens)
            with lock:
                if err is None:
                    counts["flood_served"] += 1
                elif err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    counts["flood_refused"] += 1
                else:
                    counts["flood_failed"] += 1
            if err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                stop.wait(_retry_after(err))

    threads = [threading.Thread(target=flooder, args=(i,), daemon=True) for i in range(ns.flood_threads if flood else 0)]
    for t in threads:
        t.start()
    if threads:
        time.sleep(2.0)  # the flood is under way before the calm key's first request
    ttfts: list[float] = []
    errors: list[str] = []
    calm_threads = []

    def calm(prompt: list[int]) -> None:
        ttft, err = _stream(stub, CALM_KEY, prompt, ns.calm_max_tokens)
        with lock:
            if err is None:
                ttfts.append(ttft)
            else:
                errors.append(f"{err.code().name}: {err.details()}")

    t_next = time.monotonic()
    for _ in range(ns.calm_requests):
        t_next += rng.expovariate(ns.calm_rate)
        time.sleep(max(0.0, t_next - time.monotonic()))
        t = threading.Thread(target=calm, args=(_prompt(rng, ns.prompt_len),), daemon=True)
        t.start()
        calm_threads.append(t)
    for t in calm_threads:
        t.join(300)
    stop.set()
    for t in threads:
        t.join(300)
    ttfts.sort()

    def pct(q: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else float("nan")

    return {"calm_served": len(ttfts), "calm_errors": errors[:5], "calm_ttft_p50_s": pct(0.5),
            "calm_ttft_p99_s": pct(0.99), **counts}


def main(argv: Optional[list[str]] = None) -> int:
    ns = build_parser().parse_args(argv)
    from proto import pdserve_pb2_grpc

    print(f"load average at start: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "keys.toml"
        path.write_text(keys_toml(ns.flood_max_concurrent))
        results: dict = {"args": vars(ns), "loadavg_start": os.getloadavg(), "phases": {}}
        with Deployment("colocated", ns.model, usable_cores(), engine_kw={"max_num_seqs": 128},
                        router_kw={"api_keys_file": str(path)}, router_process=True) as dep:
            with grpc.insecure_channel(dep.target) as ch:
                stub = pdserve_pb2_grpc.PDServeStub(ch)
                _stream(stub, CALM_KEY, [11, 12, 13], 4)  # warm
                for name, flood, limit in (("unloaded", False, ns.flood_max_concurrent),
                                           ("flood, quota", True, ns.flood_max_concurrent),
                                           ("flood, no quota", True, None)):
                    if limit != ns.flood_max_concurrent or name == "flood, no quota":
                        path.write_text(keys_toml(limit))
                        time.sleep(3.0)  # the router re-reads the file when it changes (checked every second)
                    r = results["phases"][name] = phase(stub, ns, flood)
                    print(f"{name}: calm p50 TTFT {1e3 * r['calm_ttft_p50_s']:.1f} ms, p99 "
                          f"{1e3 * r['calm_ttft_p99_s']:.1f} ms ({r['calm_served']}/{ns.calm_requests} served); flood "
                          f"served {r['flood_served']}, refused {r['flood_refused']}, failed {r['flood_failed']}",
                          flush=True)
        base = results["phases"]["unloaded"]["calm_ttft_p99_s"]
        for name in ("flood, quota", "flood, no quota"):
            ratio = results["phases"][name]["calm_ttft_p99_s"] / base
            results["phases"][name]["p99_ratio_to_unloaded"] = ratio
            print(f"calm p99 TTFT, {name} / unloaded: {ratio:.2f}x (goal with quota: <= 2x)")
        results["loadavg_end"] = os.getloadavg()
        print(f"load average at the end: {os.getloadavg()}")
        if ns.json:
            write_json(ns.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
