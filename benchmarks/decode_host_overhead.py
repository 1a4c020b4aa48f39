"""The engine's host time per decode step, beside the model's: what a CUDA graph cannot remove, and what async
scheduling overlaps.

Lifecycle: a one-shot script. For each mode (``--async-scheduling off|on|both``) it starts one ``LLM`` whose decode
steps run through the decode graphs' static buffers (on CPU ``static_decode_buffers``: the same copies, padding
and bucket a captured graph replays; on CUDA the captured graphs), a bucket for each batch size asked for; for each
batch it fills the batch with requests that ignore EOS, lets every prompt finish prefilling, then times ``--steps``
pure decode steps back to back (one device synchronisation after the last). Per step it reports

* wall: ``LLMEngine.step`` calls back to back (schedule, inputs, forward, sampler, bookkeeping): the engine's
  decode step time as a server sees it; with async scheduling a call launches step N + 1 and reads step N back,
  so the wall is what the overlap leaves;
* forward: the model (``DecodeGraphs._forward`` on CPU; on CUDA the replay is asynchronous, so the GPU's share is
  read from CUDA events around replays of the bucket's graph alone);
* host: on CPU wall - forward - the sampler's tensor work is not separable from its Python, so "host" is
  wall - forward (the sampler included); on CUDA the process's CPU time per step (with the sampler's blocking
  wait the thread sleeps while the GPU works, so CPU time is host work);

and the ratio host / wall: the share of a step the GPU would sit idle waiting on Python without async scheduling.
With ``both`` it also prints wall(off) / wall(on): what async scheduling gained at that batch (on CPU the forward
runs on the scheduling thread, so nothing overlaps: ~1.0 is the right answer there; issue 43 asks the GPU).

Usage: python benchmarks/decode_host_overhead.py [--device cpu|cuda] [--model tiny] [--batches 1,64,256]
       [--steps 40] [--prompt-tokens 16] [--async-scheduling off|on|both] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any, Optional

import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs


def build(model: str, device: str, batches: list[int], steps: int, dtype: Optional[str], prompt_tokens: int = 16,
          async_scheduling: bool = False) -> LLM:
    """One engine for every batch of the run: a decode bucket per batch size, a KV cache for the largest."""
    batch = max(batches)
    kw: dict[str, Any] = dict(max_num_seqs=batch, cuda_graph_sizes=sorted({1, *batches}), device=device,
                              max_model_len=prompt_tokens + steps + 64,
                              max_num_batched_tokens=max(2048, prompt_tokens),
                              # every request's whole context at once (16-token blocks), whatever its length
                              num_kv_blocks=batch * -(-(prompt_tokens + steps + 64) // 16) + 16,
                              async_scheduling=async_scheduling)
    if dtype:
        kw["dtype"] = dtype
    if device == "cpu":
        kw["static_decode_buffers"] = True
    llm = LLM(model, **kw)
    if llm.llm_engine.runner.graphs is None:
        raise SystemExit(f"no decode graphs on {device} for {model}: nothing to measure (see the engine's log)")
    return llm


def measure(model: str, device: str, batch: int, steps: int, dtype: Optional[str],
            prompt_tokens: int = 16, llm: Optional[LLM] = None) -> dict[str, Any]:
    """One batch's row, on ``llm`` (default: a synchronous engine built for this batch alone)."""
    if llm is None:
        llm = build(model, device, [batch], steps, dtype, prompt_tokens)
    eng = llm.llm_engine
    graphs = eng.runner.graphs
    fwd = {"t": 0.0}
    orig = DecodeGraphs._forward
    cuda = device.startswith("cuda")

    def timed(self: DecodeGraphs, size: int):
        t = time.perf_counter()
        out = orig(self, size)
        fwd["t"] += time.perf_counter() - t
        return out

    if not cuda:
        DecodeGraphs._forward = timed
    try:
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        rids = [f"b{batch}-{eng.num_steps}-{i}" for i in range(batch)]
        for i, rid in enumerate(rids):
            eng.add_request(rid, [2 + (i * 7 + j) % 500 for j in range(prompt_tokens)], params)
        replays = graphs.replays
        while graphs.replays == replays:  # prefill every prompt, then the first decode step
            eng.step()
        gpu_ms = 0.0
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            replay = graphs.graphs[graphs.bucket_for(batch)]
            start.record()
            for _ in range(steps):
                replay.replay()
            end.record()
            end.synchronize()
            gpu_ms = start.elapsed_time(end) / steps
        fwd["t"] = 0.0
        replays0, ahead0 = graphs.replays, eng.ahead_steps
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            eng.step()
        if cuda:
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if graphs.replays - replays0 != steps:
            raise SystemExit(f"batch {batch}: {graphs.replays - replays0} of {steps} steps went through the graphs")
        ahead = eng.ahead_steps - ahead0
        for rid in rids:  # the batch's requests end here: the next batch starts from an empty engine
            eng.abort_request(rid)
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        DecodeGraphs._forward = orig
    wall_ms = wall / steps * 1e3
    forward_ms = gpu_ms if cuda else fwd["t"] / steps * 1e3
    host_ms = cpu / steps * 1e3 if cuda else wall_ms - forward_ms
    return {"batch": batch, "device": device, "model": model, "prompt_tokens": prompt_tokens,
            "wall_ms": round(wall_ms, 3),
            "forward_ms": round(forward_ms, 3), "host_ms": round(host_ms, 3),
            "host_share": round(host_ms / wall_ms, 3), "async_scheduling": eng.config.async_scheduling,
            "ahead_steps": ahead}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="tiny", help="'tiny', 'bench' or a Hugging Face model directory")
    ap.add_argument("--dtype", default=None, help="the model's (default: the checkpoint's)")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompt-tokens", type=int, default=16,
                    help="each request's prompt: longer contexts mean wider block tables to send each step")
    ap.add_argument("--async-scheduling", choices=("off", "on", "both"), default="both")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    batches = [int(x) for x in ns.batches.split(",")]
    modes = {"off": [False], "on": [True], "both": [False, True]}[ns.async_scheduling]
    rows = []
    print(f"{'batch':>6} {'async':>6} {'wall ms':>9} {'forward ms':>11} {'host ms':>9} {'host/wall':>10} "
          f"{'ahead':>6}")
    for mode in modes:
        llm = build(ns.model, ns.device, batches, ns.steps, ns.dtype, ns.prompt_tokens, mode)
        for b in batches:
            r = measure(ns.model, ns.device, b, ns.steps, ns.dtype, ns.prompt_tokens, llm)
            rows.append(r)
            print(f"{b:>6} {'on' if mode else 'off':>6} {r['wall_ms']:>9.2f} {r['forward_ms']:>11.2f} "
                  f"{r['host_ms']:>9.2f} {r['host_share']:>10.2f} {r['ahead_steps']:>6}", flush=True)
        del llm
    if len(modes) == 2:
        for b in batches:
            off, on = (next(r for r in rows if r["batch"] == b and r["async_scheduling"] is m) for m in (False, True))
            print(f"batch {b}: wall without / with async scheduling {off['wall_ms'] / on['wall_ms']:.2f}x")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"rows": rows, "args": vars(ns)}, f, indent=1)


if __name__ == "__main__":
    main()
