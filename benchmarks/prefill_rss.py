"""A prefill worker's engine fed prompts of many lengths, one at a time: its RSS every ``--every`` prompts.

Lifecycle: a one-shot script. It builds the ``LLMEngine`` a prefill worker builds (``--model``, one thread,
prefix caching off so every prompt is computed whole), then prefills ``-n`` random prompts (``max_tokens=1``,
``prefill_only``, released at once, as a worker does after the KV send) of lengths drawn from ``--lo``..``--hi``
(``--fixed L``: all of length L) and prints the process's RSS and the number of distinct lengths seen so far.
``--exact-rows`` runs every oneDNN product at its own row count, as before the row buckets
(engine/float_formats.py ``onednn_rows``), to show the growth they stop (docs/reliability.md).

Usage: taskset -c 1 python benchmarks/prefill_rss.py [-n 2000] [--lo 50 --hi 400 | --fixed 200] [--exact-rows]
"""
from __future__ import annotations

import argparse
import os
import random
import time

import torch


import engine.float_formats as float_formats
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=2000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--lo", type=int, default=50)
    ap.add_argument("--hi", type=int, default=400)
    ap.add_argument("--fixed", type=int, default=None)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--exact-rows", action="store_true", help="no row buckets (the growth before the fix)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.exact_rows:
        float_formats.onednn_rows = lambda m: m
    eng = LLMEngine(EngineConfig(model=a.model, num_threads=1, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(a.seed)
    seen: set[int] = set()
    t0 = time.time()
    print(f"start rss={rss_mib():.1f} MiB", flush=True)
    for i in range(a.n):
        n = a.fixed or rng.randint(a.lo, a.hi)
        seen.add(n)
        rid = f"r{i}"
        eng.add_request(rid, [rng.randrange(3, 8000) for _ in range(n)], params, prefill_only=True)
        while not any(o.request_id == rid for o in eng.step()):
            pass
        eng.release(rid)
        if (i + 1) % a.every == 0:
            print(f"{i + 1} prompts: rss={rss_mib():.1f} MiB, {len(seen)} distinct lengths, {time.time() - t0:.0f} s",
                  flush=True)


if __name__ == "__main__":
    main()
