"""Phase ``graphs`` of the CUDA benchmark: decode with CUDA graphs against the same engine run eagerly.

Lifecycle: ``phase_graphs(ctx)`` once per run. It loads the bf16 engine twice (decode graphs, as a CUDA engine
starts by default, and ``enforce_eager``), records what capture cost (buckets, seconds, device memory), then
(1) runs the same greedy batch through both and reports how many sequences give the same tokens (the graphs pad a
batch to its bucket, so a GEMM may round a row differently, as any batch-size change may on a GPU), and (2) times
decode steps of both at each of the workload's decode batches: the ratio eager / graphs is the launch overhead the
graphs removed; and (3) times mixed steps (``Workload.mixed``: a running decode batch plus one new prompt prefilled
whole each step, what a colocated worker under load runs), which the graphs engine replays piecewise
(engine/piecewise_graphs.py: everything but attention) and the eager one runs eagerly. Off a GPU (the CPU smoke run)
the graphs engine runs the static buffers uncaptured.
"""
from __future__ import annotations

import time
from typing import Any

from benchmarks.cuda.checkpoint import prompts_of
from benchmarks.cuda.context import Ctx, log
from benchmarks.cuda.speed import engine_timed


def phase_graphs(ctx: Ctx) -> dict:
    from engine import SamplingParams

    w = ctx.work
    graphs_llm = ctx.engine("bfloat16") if ctx.cuda else _static(ctx)
    g = graphs_llm.llm_engine.runner.graphs
    out: dict[str, Any] = {"buckets": g.sizes if g else None, "captured": bool(g and g.graphs),
                           "capture_s": g.capture_seconds if g else None,
                           "capture_bytes": g.memory_bytes if g else None, "tokens": {}, "decode": {}}
    log("graphs", (g.describe() if g else "no decode graphs (a split engine, or enforce_eager)"))
    eager_llm = ctx.engine("bfloat16", eager=True)
    prompts = prompts_of([w.decode_prompt // 2 + 7 * i for i in range(8)], seed=500)
    p = SamplingParams(max_tokens=w.decode_new, temperature=0.0, ignore_eos=True)
    a = [o.token_ids for o in graphs_llm.generate(prompts, p)]
    b = [o.token_ids for o in eager_llm.generate(prompts, p)]
    first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), None) for s, t in zip(a, b)]
    out["tokens"] = {"sequences": len(a), "identical": sum(f is None for f in first), "first_divergence": first}
    log("graphs", f"greedy bf16, graphs vs eager: {out['tokens']['identical']}/{len(a)} sequences identical "
                  f"over {w.decode_new} tokens")
    for bsz in w.decode_batches:
        row: dict[str, Any] = {}
        for name, llm in (("graphs", graphs_llm), ("eager", eager_llm)):
            eng = llm.llm_engine
            engine_timed(ctx, eng, prompts_of([w.decode_prompt] * bsz, seed=600 + bsz), 4)  # warm-up
            r = engine_timed(ctx, eng, prompts_of([w.decode_prompt] * bsz, seed=700 + bsz), w.decode_new)
            r.pop("_step_log")
            row[name] = r
        row["eager_over_graphs"] = row["eager"]["median_step_ms"] / row["graphs"]["median_step_ms"]
        out["decode"][str(bsz)] = row
        log("graphs", f"batch {bsz:4d}: decode step median {row['graphs']['median_step_ms']:.2f} ms with graphs, "
                      f"{row['eager']['median_step_ms']:.2f} ms eager ({row['eager_over_graphs']:.2f}x)")
        ctx.save()
    out["mixed"] = {}
    for bsz, plen in w.mixed:
        row = {name: mixed_timed(ctx, llm.llm_engine, bsz, plen, w.mixed_steps, seed=800 + plen)
               for name, llm in (("graphs", graphs_llm), ("eager", eager_llm))}
        row["eager_over_graphs"] = row["eager"]["median_step_ms"] / row["graphs"]["median_step_ms"]
        out["mixed"][f"{bsz}+{plen}"] = row
        log("graphs", f"mixed step, {bsz} decodes + a {plen}-token prompt: median {row['graphs']['median_step_ms']:.2f} "
                      f"ms piecewise ({row['graphs']['piecewise_steps']} of {w.mixed_steps} steps), "
                      f"{row['eager']['median_step_ms']:.2f} ms eager ({row['eager_over_graphs']:.2f}x)")
        ctx.save()
    return out


def mixed_timed(ctx: Ctx, eng, batch: int, prompt_len: int, steps: int, seed: int) -> dict:
    """Median time of ``steps`` mixed steps: ``batch`` sequences decoding, and each step one new ``prompt_len``-token
    prompt (``max_tokens`` 1: prefilled whole, sampled, finished in that step). Also how many of them the piecewise
    graphs ran (their replay count, where the engine has them)."""
    from engine import SamplingParams

    runner = eng.runner
    long = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    live = [f"mx{seed}-{i}" for i in range(batch)]
    for rid, p in zip(live, prompts_of([64] * batch, seed=seed)):
        eng.add_request(rid, p, long)
    started: set = set()
    while len(started) < batch:  # every running sequence has its first token: from here on its rows decode
        started |= {o.request_id for o in eng.step() if o.new_token_ids}
    times = []
    pw = getattr(runner, "piecewise", None)
    before = pw.replays if pw is not None else 0
    for k, p in enumerate(prompts_of([prompt_len] * steps, seed=seed + 1)):
        eng.add_request(f"mx{seed}-new{k}", p, one)
        ctx.sync()
        t0 = time.perf_counter()
        eng.step()
        ctx.sync()
        times.append(time.perf_counter() - t0)
    for rid in live:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    times.sort()
    return {"median_step_ms": 1e3 * times[len(times) // 2], "min_step_ms": 1e3 * times[0],
            "piecewise_steps": (pw.replays - before) if pw is not None else 0}


def _static(ctx: Ctx):
    """Off a GPU: the bf16 engine through the uncaptured static buffers (what the CPU smoke run checks)."""
    key = "bfloat16-static"
    if key not in ctx._eng:
        from engine import LLM

        base = ctx.engine("bfloat16").llm_engine.config
        kw = {k: getattr(base, k) for k in ("dtype", "device", "kv_cache_memory_bytes", "max_num_seqs",
                                            "max_num_batched_tokens", "max_model_len", "enable_prefix_caching")}
        ctx._eng[key] = LLM(model=str(ctx.ckpt), static_decode_buffers=True, **kw)
    return ctx._eng[key]
