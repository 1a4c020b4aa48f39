"""Phase ``kernels`` of the CUDA benchmark: where an engine step's device time goes, by kernel.

Why: issue 43's prefill goal (>= 50% MFU at 2048 tokens; 46.4% on the 1 Dec H200 run) and the decode step's distance
from its roofline (2.2 ms at batch 1 over a 0.41 ms floor) cannot be attacked without knowing which kernels take the
time and how long the device sits idle inside a step; GPU time is scarce, so one short phase answers both.

Lifecycle: ``phase_kernels(ctx)`` once per run (``--phases kernels``). For each single-sequence prefill of the
workload and each decode batch, the same work is run once unprofiled (the warm-up: kernel variants compiled, caches
built), once timed, then once under ``torch.profiler``: the profiled run's kernels (on CUDA, device time of every
kernel and copy; on CPU, the operators' own CPU time, so the phase runs as a smoke test anywhere) are summed into
``busy``, grouped by ``classify`` into classes (GEMM, attention, norm, ...), and the top ``TOP`` listed. A step's
``idle share`` is 1 - busy / the profiled wall: launch gaps and host work the device waits on. For prefill, the
FLOPs over busy time give the kernels' own MFU beside the wall's (the host's share of the goal's gap).
"""
from __future__ import annotations

import re
import time
from typing import Any, Callable

from benchmarks.cuda.checkpoint import prompts_of
from benchmarks.cuda.context import Ctx, log
from benchmarks.cuda.speed import prefill_flops, submit_greedy

TOP = 12
DECODE_STEPS = 5
"""Decode steps per profiled run (per-step numbers are the run's over this)."""
CLASSES = (
    ("attention", r"attn|attention|flash|paged|sdpa|fmha"),
    ("gemm", r"gemm|cutlass|nvjet|xmma|cublas|matmul|\bmm\b|addmm|aten::linear|_linear|splitk"),
    ("norm", r"norm"),
    ("rope", r"rope|rotary"),
    ("activation", r"silu|gelu|swiglu|act_and_mul|silu_mul"),
    ("sampling", r"argmax|softmax|topk|sort|multinomial|cumsum|max_|reduce"),
    ("copy", r"copy|memcpy|memset|cat|index|gather|scatter|fill|embedding|contiguous|to_copy"),
)
"""Kernel classes, first match wins (a fused norm+residual kernel is "norm"); anything else is "other"."""


def classify(name: str) -> str:
    """The class of a kernel (or, on CPU, operator) name: one of CLASSES' names, or "other"."""
    for cls, pat in CLASSES:
        if re.search(pat, name, re.IGNORECASE):
            return cls
    return "other"


def _kernel_times(prof: Any, cuda: bool) -> list[tuple[str, int, float]]:
    """(name, calls, seconds) of every kernel the profile saw, longest first. CUDA: the device-side events alone
    (kernels, copies, memsets; an operator's or a launch call's device time is its kernels', which are counted once,
    as themselves); CPU: every operator's own (self) CPU time."""
    from torch.autograd import DeviceType

    acc: dict[str, list] = {}
    for e in prof.events():
        if cuda:
            if e.device_type != DeviceType.CUDA:
                continue
            t = e.time_range.elapsed_us()
        else:
            if e.device_type != DeviceType.CPU:
                continue
            t = e.self_cpu_time_total
        if t > 0:
            a = acc.setdefault(e.name, [0, 0.0])
            a[0] += 1
            a[1] += t / 1e6
    return sorted(((name, n, t) for name, (n, t) in acc.items()), key=lambda r: -r[2])


def profile_run(ctx: Ctx, run: Callable[[], None], per: int = 1) -> dict:
    """Warm-up, timed, profiled runs of ``run`` (see the module docstring); times per ``per`` (steps of a run)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    ctx.sync()
    t0 = time.perf_counter()
    run()
    ctx.sync()
    wall = time.perf_counter() - t0
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        run()
        ctx.sync()
        pwall = time.perf_counter() - t0
    rows = _kernel_times(prof, ctx.cuda)
    busy = sum(r[2] for r in rows)
    classes: dict[str, float] = {}
    for name, _n, t in rows:
        c = classify(name)
        classes[c] = classes.get(c, 0.0) + t
    ms = 1e3 / per
    return {"wall_ms": wall * ms, "profiled_wall_ms": pwall * ms, "busy_ms": busy * ms,
            "idle_share": max(0.0, 1 - busy / pwall) if pwall > 0 else None,
            "classes_ms": {c: round(t * ms, 4) for c, t in sorted(classes.items(), key=lambda kv: -kv[1])},
            "top": [[name[:120], n // per if n >= per else n, round(t * ms, 4), round(t / busy, 4) if busy else None]
                    for name, n, t in rows[:TOP]],
            "kernels_per_step": sum(n for _name, n, _t in rows) / per}


def _summary(r: dict) -> str:
    busy = r["busy_ms"]
    shares = ", ".join(f"{c} {t / busy:.0%}" for c, t in list(r["classes_ms"].items())[:5]) if busy else ""
    idle = (f" (idle {r['idle_share']:.0%} of the profiled {r['profiled_wall_ms']:.2f} ms)"
            if r["idle_share"] is not None else "")
    return (f"wall {r['wall_ms']:.2f} ms, kernels {busy:.2f} ms busy{idle}, {r['kernels_per_step']:.0f} a step: "
            f"{shares}")


def phase_kernels(ctx: Ctx) -> dict:
    w = ctx.work
    mc = ctx.model_config()
    peak = ctx.report.get("device", {}).get("peak_bf16_flops")
    eng = ctx.engine("bfloat16").llm_engine
    out: dict[str, Any] = {"what": "CUDA: kernels' device time; CPU: operators' self CPU time", "prefill": {},
                           "decode": {}}

    for n in sorted({n for b, n in w.prefill if b == 1}):
        seeds = iter(range(10_000))

        def prefill() -> None:
            submit_greedy(eng, prompts_of([n], seed=7000 + n + next(seeds)), 1)
            while eng.has_unfinished_requests():
                eng.step()

        r = profile_run(ctx, prefill)
        flops = prefill_flops(mc, 1, n)
        if peak:
            r["wall_mfu"] = flops / (r["wall_ms"] / 1e3) / peak
            r["kernel_mfu"] = flops / (r["busy_ms"] / 1e3) / peak if r["busy_ms"] else None
        out["prefill"][str(n)] = r
        mfu = (f"; MFU wall {r['wall_mfu']:.1%}, kernels alone {r['kernel_mfu']:.1%}"
               if peak and r.get("kernel_mfu") else "")
        log("kernels", f"prefill 1x{n}: {_summary(r)}{mfu}")
        ctx.save()

    for b in w.decode_batches:
        ids = submit_greedy(eng, prompts_of([w.decode_prompt] * b, seed=8000 + b), 3 * DECODE_STEPS + 8)
        graphs = getattr(eng.runner, "graphs", None)
        while _prefilling(eng):  # every prompt prefilled, then two steps: the ones after are pure decode
            eng.step()
        eng.step()
        eng.step()

        def decode() -> None:
            for _ in range(DECODE_STEPS):
                eng.step()

        before = graphs.replays if graphs is not None else 0
        r = profile_run(ctx, decode, per=DECODE_STEPS)
        # the share of the three runs' steps that replayed a decode graph (CPU: the static buffers' path)
        r["graph_share"] = (graphs.replays - before) / (3 * DECODE_STEPS) if graphs is not None else 0.0
        out["decode"][str(b)] = r
        log("kernels", f"decode batch {b}: {_summary(r)}")
        for x in ids:
            eng.abort_request(x)
        while eng.has_unfinished_requests():
            eng.step()
        ctx.save()
    return out


def _prefilling(eng: Any) -> bool:
    """Whether any running or waiting sequence still has prompt tokens to compute."""
    sched = eng.scheduler
    return bool(sched.waiting) or any(s.num_computed < s.num_prefill for s in sched.running)
