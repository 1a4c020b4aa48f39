"""Tensor parallelism on this machine: an engine at TP=2 against TP=1, step time and the collectives' share.

Lifecycle: a one-shot script. For each contender (TP=1 with every core's threads, TP=1 with one thread, TP=2
with the cores shared out among its ranks), it builds one engine on ``--model`` (default ``bench``: 12 layers,
hidden 768, 12 query / 4 KV heads) and measures, in one run:

* decode: the median ``step()`` time with B sequences decoding (B in ``--batches``, default 1, 8, 32; prompts of
  32 tokens, prefilled first and not counted);
* prefill: the time of the one step that prefills a ``--prefill-tokens`` prompt (default 512);

and, for TP=2, the share of rank 0's step time spent in the group's collectives (``TPComm.reduce_seconds``:
the exchanges and the waits for the other rank, which include its compute running late). Ratios are against
TP=1 with every core, measured in the same run. Greedy outputs of all contenders are checked equal first. Before
the engines, it times summing one decode row between two rank processes both ways: gloo's ``allreduce`` and
``TPComm``'s point-to-point exchange.

Usage: python benchmarks/tensor_parallel.py [--model bench] [--batches 1 8 32] [--repeats 15] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from loadtest.machine import machine_info



def _comm_seconds(eng: LLMEngine) -> float:
    return eng.tp_group.comm.reduce_seconds if eng.tp_group is not None else 0.0


def greedy_tokens(eng: LLMEngine) -> dict:
    """16 greedy tokens for two fixed prompts (the contenders must agree)."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out: dict = {"g0": [], "g1": []}
    eng.add_request("g0", [5, 17, 400, 23, 99, 4], params)
    eng.add_request("g1", [300, 12, 77], params)
    while eng.has_unfinished_requests():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    return out


def decode_steps(eng: LLMEngine, batch: int, repeats: int, prompt_len: int = 32) -> tuple[float, float]:
    """(median decode step seconds, collectives' share of those steps) with ``batch`` sequences decoding."""
    params = SamplingParams(temperature=0.0, max_tokens=repeats + 4, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"d{batch}-{i}", [(7 * i + j) % 1000 + 3 for j in range(prompt_len)], params)
    while any(s.num_computed < len(s.prompt_token_ids) for s in eng._seqs.values()):
        eng.step()  # prefills (not counted)
    timed = [_timed_step(eng) for _ in range(repeats)]
    while eng.has_unfinished_requests():
        eng.step()
    return _summary(timed)


def prefill_step(eng: LLMEngine, tokens: int, repeats: int) -> tuple[float, float]:
    """(median seconds of the step that prefills a ``tokens`` prompt, collectives' share)."""
    timed = []
    for r in range(repeats):
        # a fresh prompt each time (no prefix-cache hit)
        eng.add_request(f"p{r}", [(r * 31 + 11 * j) % 1000 + 3 for j in range(tokens)],
                        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        timed.append(_timed_step(eng))
        while eng.has_unfinished_requests():
            eng.step()
    return _summary(timed)


def _timed_step(eng: LLMEngine) -> tuple[float, float]:
    """(seconds, seconds of it in the group's collectives) of one ``step()``."""
    c0, t0 = _comm_seconds(eng), time.perf_counter()
    eng.step()
    return time.perf_counter() - t0, _comm_seconds(eng) - c0


def _summary(timed: list[tuple[float, float]]) -> tuple[float, float]:
    """(median step seconds, collectives' share of all the steps' time)."""
    return statistics.median(t for t, _ in timed), sum(c for _, c in timed) / sum(t for t, _ in timed)


def _collectives_peer(port: int, width: int, n: int) -> None:
    _collective_loop(1, port, width, n)


def _collective_loop(rank: int, port: int, width: int, n: int, master=None) -> dict:
    """Rank ``rank`` of a 2-rank group: seconds per gloo ``allreduce`` and per ``TPComm.all_reduce`` of a
    [1, width] float32 row, each timed over ``n`` iterations in lockstep with the peer."""
    import torch

    from engine.tensor_parallel import open_comm

    torch.set_num_threads(1)
    comm = open_comm("127.0.0.1", port, rank, 2, master=master)
    row = torch.ones(1, width)
    out = {}
    for name, op in (("gloo allreduce", lambda: comm.pg.allreduce([row]).wait()),
                     ("TPComm exchange", lambda: comm.all_reduce(row))):
        for _ in range(50):
            op()
        t0 = time.perf_counter()
        for _ in range(n):
            op()
        out[name] = (time.perf_counter() - t0) / n
    return out


def collectives(width: int, n: int = 2000) -> dict:
    """The two ways of summing a decode row between two rank processes, in the same run."""
    import multiprocessing as mp

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    peer = mp.get_context("spawn").Process(target=_collectives_peer, args=(store.port, width, n))
    peer.start()
    try:
        return _collective_loop(0, store.port, width, n, master=store)
    finally:
        peer.join(60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", type=Path, default=None)
    ns = ap.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    contenders = [("TP=1", 1, cores), ("TP=1 (1 thread)", 1, 1), ("TP=2", 2, max(1, cores // 2))]
    common = dict(model=ns.model, max_num_batched_tokens=max(2048, ns.prefill_tokens),
                  max_num_seqs=max(ns.batches), kv_cache_memory_bytes=512 * 1024 * 1024)
    print(json.dumps(machine_info()))
    from engine.loader import load_model_config

    width = load_model_config(EngineConfig(model=ns.model)).hidden_size
    coll = collectives(width)
    print("summing one [1, %d] float32 row between 2 rank processes: %s" % (
        width, ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in coll.items())))
    results: dict = {"collectives_s": coll}
    ref_tokens = None
    for name, tp, threads in contenders:
        eng = LLMEngine(EngineConfig(tensor_parallel_size=tp, num_threads=threads, **common))
        try:
            toks = greedy_tokens(eng)
            if ref_tokens is None:
                ref_tokens = toks
            elif toks != ref_tokens:
                print(f"{name}: greedy tokens differ from TP=1: {toks} vs {ref_tokens}", file=sys.stderr)
                return 1
            row = {"threads_per_rank": threads}
            for b in ns.batches:
                row[f"decode_b{b}"] = decode_steps(eng, b, ns.repeats)
            row["prefill"] = prefill_step(eng, ns.prefill_tokens, max(3, ns.repeats // 5))
            results[name] = row
        finally:
            eng.close()
    ref = results["TP=1"]
    print(f"\nmodel {ns.model}, {cores} cores; step ms (ratio to TP=1 with {cores} threads; collectives' share "
          "of rank 0's step)")
    cols = [f"decode_b{b}" for b in ns.batches] + ["prefill"]
    print(f"{'':18}" + "".join(f"{c:>26}" for c in cols))
    for name, row in results.items():
        if name == "collectives_s":
            continue
        cells = []
        for c in cols:
            sec, share = row[c]
            cells.append(f"{sec * 1e3:8.2f} ({ref[c][0] / sec:4.2f}x" + (f", {share:4.0%})" if share else ")"))
        print(f"{name:18}" + "".join(f"{x:>26}" for x in cells))
    if ns.json:
        ns.json.write_text(json.dumps({"machine": machine_info(), "args": vars(ns) | {"json": str(ns.json)},
                                       "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
