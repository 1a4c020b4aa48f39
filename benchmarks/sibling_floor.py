"""How fast the offline engine runs on one core while the other core does the router's and client's share of work.

Usage:
    python benchmarks/sibling_floor.py --model tiny --duty 0,0.2,0.4,1 --repeat 3
    python benchmarks/sibling_floor.py --quick

Why (issue 31): on the 2-vCPU host the cluster's worker runs on core 0 while the router and the client run on
core 1. The worker's engine thread takes longer per decode step than the offline engine alone on the machine,
and issue 26 measured that an engine step runs 15-60% slower while the other vCPU is busy. This script puts a
number on that floor without any serving code: the offline engine (``serving_overhead``'s reference: one torch
thread, a process pinned to the first usable core, C prompts at once, greedy, ``ignore_eos``) runs while a
sibling process pinned to the second core spins in the Python interpreter (the kind of work a gRPC router and
client do) for ``duty`` of every ``--period-ms`` and sleeps for the rest. ``duty`` 0 = no sibling. For each
duty the engine's decode and end-to-end tok/s are printed with their ratio to the engine alone, from runs
interleaved across duties (``--repeat`` rounds, medians) so the host's drift falls on every duty alike.

Read with ``serving_overhead.py``'s CPU per token: the router's plus the client's CPU per token x the tokens per
second they carry gives the duty the serving path puts on core 1 (about 0.3-0.4 at one `tiny` stream).

Lifecycle: each run spawns the sibling (if any), waits until it spins, runs the engine in its own spawned
process, then stops the sibling through an Event and joins both. Nothing outlives the script.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional


from benchmarks.harness import usable_cores
from benchmarks.serving_overhead import offline


def _sibling_main(core: Optional[int], duty: float, period_s: float, ready: Any, stop: Any) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})
    busy = duty * period_s
    ready.set()
    while not stop.is_set():
        t0 = time.perf_counter()
        x = 0
        while time.perf_counter() - t0 < busy:
            x += 1  # interpreter work, as a router's message handling is
        rest = period_s - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)


def run_once(model: str, prompts: dict, duty: float, ns: argparse.Namespace) -> dict:
    """The offline engine's rates (per concurrency) beside a sibling at ``duty`` (0: none)."""
    ctx = mp.get_context("spawn")
    cores = usable_cores()
    sib = None
    stop = ctx.Event()
    if duty > 0:
        ready = ctx.Event()
        sib = ctx.Process(target=_sibling_main, args=(cores[1] if len(cores) > 1 else None, duty,
                                                      ns.period_ms / 1000.0, ready, stop), daemon=True)
        sib.start()
        if not ready.wait(120):
            raise RuntimeError("the sibling did not start")
    try:
        return offline(model, prompts, ns)
    finally:
        stop.set()
        if sib is not None:
            sib.join(30)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--duty", default="0,0.2,0.4,1", help="comma-separated sibling duty cycles in [0, 1]")
    ap.add_argument("--period-ms", type=float, default=1.0, help="the sibling's busy+sleep period")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch1-max-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds over all duties")
    ap.add_argument("--quick", action="store_true", help="one round, 32 tokens, duties 0 and 1")
    ap.add_argument("--json", default="", help="also write the results here")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.quick:
        ns.duty, ns.repeat, ns.max_tokens, ns.batch1_max_tokens, ns.concurrency = "0,1", 1, 32, 32, "1"
    try:
        duties = [float(d) for d in ns.duty.split(",")]
        conc = [int(c) for c in ns.concurrency.split(",")]
    except ValueError:
        print("--duty and --concurrency take comma-separated numbers", file=sys.stderr)
        return 2
    if any(not 0 <= d <= 1 for d in duties) or any(c < 1 for c in conc) or ns.repeat < 1 or ns.period_ms <= 0:
        print("--duty must be in [0, 1], --concurrency >= 1, --repeat >= 1, --period-ms > 0", file=sys.stderr)
        return 2
    if len(usable_cores()) < 2:
        print("needs two usable cores (the engine's and the sibling's)", file=sys.stderr)
        return 2
    import random

    rng = random.Random(0)
    prompts = {c: [[rng.randrange(10, 200) for _ in range(ns.prompt_tokens)] for _ in range(c)] for c in conc}
    ns.repeat_inner, ns.repeat = ns.repeat, 1  # offline() runs each concurrency ns.repeat times; rounds are ours
    samples: dict[float, list[dict]] = {d: [] for d in duties}
    for r in range(ns.repeat_inner):
        for d in (duties if r % 2 == 0 else list(reversed(duties))):
            t0 = time.perf_counter()
            samples[d].append(run_once(ns.model, prompts, d, ns))
            print(f"round {r + 1} duty {d:.2f}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    rows = []
    base = {c: statistics.median(s[c]["decode_tok_s"] for s in samples[0.0]) if 0.0 in samples else None
            for c in conc}
    base_e2e = {c: statistics.median(s[c]["e2e_tok_s"] for s in samples[0.0]) if 0.0 in samples else None
                for c in conc}
    print(f"{'duty':>5} {'streams':>7} {'decode tok/s':>13} {'/ alone':>8} {'e2e tok/s':>10} {'/ alone':>8}")
    for d in duties:
        for c in conc:
            dec = statistics.median(s[c]["decode_tok_s"] for s in samples[d])
            e2e = statistics.median(s[c]["e2e_tok_s"] for s in samples[d])
            row = {"duty": d, "streams": c, "decode_tok_s": dec, "e2e_tok_s": e2e,
                   "decode_vs_alone": dec / base[c] if base[c] else None,
                   "e2e_vs_alone": e2e / base_e2e[c] if base_e2e[c] else None,
                   "decode_samples": [s[c]["decode_tok_s"] for s in samples[d]]}
            rows.append(row)
            ratio = f"{row['decode_vs_alone']:.2f}x" if row["decode_vs_alone"] else "-"
            ratio_e = f"{row['e2e_vs_alone']:.2f}x" if row["e2e_vs_alone"] else "-"
            print(f"{d:5.2f} {c:7d} {dec:13.0f} {ratio:>8} {e2e:10.0f} {ratio_e:>8}")
    if ns.json:
        Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json).write_text(json.dumps({"model": ns.model, "period_ms": ns.period_ms, "rows": rows,
                                             "load_avg": os.getloadavg()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
