"""Phases 2 and 3 of the CUDA benchmark: decode tokens/s and implied bandwidth at several batch sizes,
prefill time and MFU, each against transformers in the same run, and the card's reachable ceilings.

Lifecycle: ``phase_decode(ctx)`` and ``phase_prefill(ctx)`` once per run; ``device_info`` and
``measure_ceilings`` once at its start.
"""
from __future__ import annotations

import platform
import time
from typing import Any, Optional

import torch


from engine.config import ModelConfig

from benchmarks.cuda.checkpoint import prompts_of
from benchmarks.cuda.context import Ctx, log


# -- phase 2: decode ---------------------------------------------------------------------------------

_rid = [0]


def submit_greedy(eng, prompts: list[list[int]], n_new: int) -> list[str]:
    """Add each prompt to ``eng`` (an ``LLMEngine``) for ``n_new`` greedy tokens, EOS ignored; their request ids."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    ids = []
    for p in prompts:
        _rid[0] += 1
        ids.append(f"b{_rid[0]}")
        eng.add_request(ids[-1], p, params)
    return ids


def engine_timed(ctx: Ctx, eng, prompts: list[list[int]], n_new: int) -> dict:
    """Run prompts through LLMEngine.step to completion, timing each step; the decode steps are those
    where every sequence already has its first token."""
    ids = submit_greedy(eng, prompts, n_new)
    plen = dict(zip(ids, map(len, prompts)))
    got = {r: 0 for r in ids}
    done: set = set()
    dec_time = dec_tokens = dec_steps = kv_tokens = 0
    step_times: list[float] = []
    step_log: list[tuple[bool, float]] = []
    ctx.sync()
    t_start = time.perf_counter()
    while eng.has_unfinished_requests():
        decoding = all(v > 0 for v in got.values())
        ctx_tokens = sum(plen[r] + got[r] for r in ids if r not in done)  # keys each live row reads this step
        ctx.sync()
        t0 = time.perf_counter()
        outs = eng.step()
        ctx.sync()
        dt = time.perf_counter() - t0
        n = 0
        for o in outs:
            got[o.request_id] += len(o.new_token_ids)
            n += len(o.new_token_ids)
            if o.finish_reason is not None:
                done.add(o.request_id)
        step_log.append((decoding, dt))
        if decoding:
            dec_time += dt
            dec_tokens += n
            dec_steps += 1
            kv_tokens += ctx_tokens
            step_times.append(dt)
    total = time.perf_counter() - t_start
    if any(v != n_new for v in got.values()):
        raise RuntimeError(f"engine produced {sorted(set(got.values()))} tokens per request, expected {n_new}")
    step_times.sort()
    return {"total_s": total, "decode_s": dec_time, "decode_tokens": dec_tokens, "decode_steps": dec_steps,
            "kv_tokens_read": kv_tokens, "median_step_ms": 1e3 * step_times[len(step_times) // 2] if step_times else None,
            "_step_log": step_log}


def forward_share(ctx: Ctx, eng, prompts: list[list[int]], n_new: int) -> Optional[dict]:
    """A short extra run with the model's forward timed alone (synchronized): how much of a decode step is the
    forward (kernel launches and kernels), and how much the rest (schedule, prepare, sample, bookkeeping)."""
    model = eng.runner.model
    orig = model.forward
    fwd: list[float] = []

    def timed(*a, **k):
        ctx.sync()
        t0 = time.perf_counter()
        out = orig(*a, **k)
        ctx.sync()
        fwd.append(time.perf_counter() - t0)
        return out

    model.forward = timed
    try:
        r = engine_timed(ctx, eng, prompts, n_new)
    finally:
        del model.forward
    steps = r["_step_log"]
    if len(fwd) != len(steps):
        return None
    pairs = sorted((dt, f) for (dec, dt), f in zip(steps, fwd) if dec)
    if not pairs:
        return None
    step_ms, fwd_ms = 1e3 * pairs[len(pairs) // 2][0], 1e3 * sorted(f for _, f in pairs)[len(pairs) // 2]
    return {"median_step_ms": step_ms, "median_forward_ms": fwd_ms, "steps": len(pairs)}


def hf_generate_time(ctx: Ctx, model, prompts: list[list[int]], n: int) -> float:
    ids = torch.tensor(prompts, device=ctx.device)
    with torch.inference_mode():
        ctx.sync()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=2)
        ctx.sync()
    if out.shape[1] != ids.shape[1] + n:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, expected {n}")
    return time.perf_counter() - t0


def phase_decode(ctx: Ctx) -> dict:
    w = ctx.work
    mc = ctx.model_config()
    peak_bw = ctx.report["device"].get("peak_hbm_bytes_per_s")
    eng = ctx.engine("bfloat16").llm_engine
    h, V = mc.hidden_size, mc.vocab_size
    # weights read once per step: every matrix but the embedding (only B rows of it are read), in bf16
    weight_bytes = 2 * (mc.num_params - V * h)
    kv_bytes_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 2
    out: dict[str, Any] = {"prompt_len": w.decode_prompt, "new_tokens": w.decode_new, "weight_bytes": weight_bytes,
                           "kv_bytes_per_token": kv_bytes_per_token, "engine": {}, "transformers": {}}
    for b in w.decode_batches:
        engine_timed(ctx, eng, prompts_of([w.decode_prompt] * b, seed=100 + b), 4)  # warm-up at this batch
        r = engine_timed(ctx, eng, prompts_of([w.decode_prompt] * b, seed=200 + b), w.decode_new)
        tps = r["decode_tokens"] / r["decode_s"]
        moved = r["decode_steps"] * (weight_bytes + b * h * 2) + r["kv_tokens_read"] * kv_bytes_per_token
        bw = moved / r["decode_s"]
        r.update(tokens_per_s=tps, e2e_tokens_per_s=b * w.decode_new / r["total_s"], achieved_bytes_per_s=bw,
                 frac_of_peak_bw=(bw / peak_bw) if peak_bw else None)
        r.pop("_step_log")
        share = forward_share(ctx, eng, prompts_of([w.decode_prompt] * b, seed=400 + b), min(w.decode_new, 24))
        r["forward_share"] = share
        out["engine"][str(b)] = r
        log("decode", f"engine batch {b:4d}: {tps:9.1f} tok/s decode ({r['median_step_ms']:.2f} ms/step median, "
                      f"{r['decode_steps']} steps), {bw / 1e9:8.1f} GB/s achieved"
                      + (f" = {bw / peak_bw:.1%} of peak" if peak_bw else "")
                      + f"; end to end {r['e2e_tokens_per_s']:.1f} tok/s"
                      + (f"; model forward {share['median_forward_ms']:.2f} of {share['median_step_ms']:.2f} ms "
                         f"a step (synchronized run)" if share else ""))
        ctx.save()
    hf = ctx.hf("bfloat16")
    hf_generate_time(ctx, hf, prompts_of([w.decode_prompt], seed=1), 4)  # warm-up
    for b in w.hf_decode_batches:
        ps = prompts_of([w.decode_prompt] * b, seed=300 + b)
        hf_generate_time(ctx, hf, ps, 2)  # warm-up at this batch
        t1 = min(hf_generate_time(ctx, hf, ps, 1) for _ in range(2))
        tn = hf_generate_time(ctx, hf, ps, w.decode_new)
        tps = b * (w.decode_new - 1) / max(tn - t1, 1e-9)
        ours = out["engine"].get(str(b), {}).get("tokens_per_s")
        out["transformers"][str(b)] = {"t1_s": t1, "tN_s": tn, "tokens_per_s": tps,
                                       "e2e_tokens_per_s": b * w.decode_new / tn,
                                       "engine_over_transformers": (ours / tps) if ours else None}
        log("decode", f"transformers batch {b:4d}: {tps:9.1f} tok/s decode (t{w.decode_new} - t1 over "
                      f"{w.decode_new - 1} steps: {1e3 * (tn - t1) / (w.decode_new - 1):.2f} ms/step)"
                      + (f" -> engine / transformers = {ours / tps:.2f}x" if ours else ""))
    return out


# -- phase 3: prefill --------------------------------------------------------------------------------

def prefill_flops(mc: ModelConfig, batch: int, n: int) -> float:
    h, V = mc.hidden_size, mc.vocab_size
    nonemb = mc.num_params - V * h * (1 if mc.tie_word_embeddings else 2) - h
    attn = 2 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim * n * (n + 1)
    return batch * (2 * nonemb * n + attn + 2 * h * V)


def phase_prefill(ctx: Ctx) -> dict:
    from engine import SamplingParams

    w = ctx.work
    mc = ctx.model_config()
    peak = ctx.report["device"].get("peak_bf16_flops")
    eng = ctx.engine("bfloat16").llm_engine
    hf = ctx.hf("bfloat16")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {"flops_formula": "batch * (2 * params_nonembedding * n + 2 * layers * heads * head_dim * "
                                            "n * (n + 1) + 2 * hidden * vocab)", "cases": {}}
    for b, n in w.prefill:
        flops = prefill_flops(mc, b, n)
        times, steps = [], 0
        for rep in range(w.repeats + 1):  # the first is the warm-up
            ps = prompts_of([n] * b, seed=1000 * rep + n + b)
            for p in ps:
                _rid[0] += 1
                eng.add_request(f"p{_rid[0]}", p, params)
            ctx.sync()
            t0 = time.perf_counter()
            steps = 0
            while eng.has_unfinished_requests():
                eng.step()
                steps += 1
            ctx.sync()
            if rep:
                times.append(time.perf_counter() - t0)
        hf_times = []
        with torch.inference_mode():
            for rep in range(w.repeats + 1):
                ids = torch.tensor(prompts_of([n] * b, seed=1000 * rep + n + b), device=ctx.device)
                ctx.sync()
                t0 = time.perf_counter()
                try:
                    hf(ids, logits_to_keep=1)
                except TypeError:
                    hf(ids)
                ctx.sync()
                if rep:
                    hf_times.append(time.perf_counter() - t0)
        t, th = min(times), min(hf_times)
        case = {"batch": b, "tokens": n, "flops": flops, "engine_s": t, "engine_steps": steps,
                "engine_tflops": flops / t / 1e12, "engine_mfu": flops / t / peak if peak else None,
                "transformers_s": th, "transformers_tflops": flops / th / 1e12,
                "transformers_mfu": flops / th / peak if peak else None, "engine_over_transformers": th / t,
                "all_engine_s": times, "all_transformers_s": hf_times}
        out["cases"][f"{b}x{n}"] = case
        mfu = f" MFU {case['engine_mfu']:.1%}" if peak else ""
        hmfu = f" MFU {case['transformers_mfu']:.1%}" if peak else ""
        log("prefill", f"{b}x{n:5d}: engine {1e3 * t:8.2f} ms ({steps} step{'s' if steps > 1 else ''}) "
                       f"{case['engine_tflops']:7.1f} TFLOP/s{mfu} | transformers {1e3 * th:8.2f} ms "
                       f"{case['transformers_tflops']:7.1f} TFLOP/s{hmfu} | engine speed = {th / t:.2f}x transformers")
        ctx.save()
    return out


# -- device facts ------------------------------------------------------------------------------------

def device_info(device: str) -> dict:
    import transformers

    info: dict[str, Any] = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
                            "python": platform.python_version(), "cuda": torch.version.cuda}
    if torch.device(device).type != "cuda":
        info.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                    peak_assumption="none for a CPU: no fractions of peak")
        return info
    name = torch.cuda.get_device_name(device)
    props = torch.cuda.get_device_properties(device)
    info.update(name=name, capability=list(torch.cuda.get_device_capability(device)),
                memory_bytes=props.total_memory, multiprocessors=props.multi_processor_count)
    u = name.upper()
    table = [("H200", 4.8e12, 989e12, "H200 SXM"), ("H100 PCIE", 2.0e12, 756e12, "H100 PCIe"),
             ("H100 NVL", 3.9e12, 835e12, "H100 NVL"), ("H100", 3.35e12, 989e12, "H100 SXM"),
             ("A100", 2.0e12, 312e12, "A100 80GB SXM")]
    for key, bw, fl, label in table:
        if key in u:
            info.update(peak_hbm_bytes_per_s=bw, peak_bf16_flops=fl,
                        peak_assumption=f"{label}: {bw / 1e12:.2f} TB/s HBM, {fl / 1e12:.0f} TFLOP/s dense bf16 "
                                        f"(datasheet, from the device name {name!r})")
            break
    else:
        info["peak_assumption"] = f"unknown card {name!r}: no fractions of peak"
    return info


def measure_ceilings(ctx: Ctx) -> dict:
    """What this card reaches on a plain device copy and a large bf16 GEMM (the practical ceilings)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=ctx.device)
    y = torch.empty_like(x)
    y.copy_(x)
    ctx.sync()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    ctx.sync()
    copy_bw = 10 * 2 * x.numel() / (time.perf_counter() - t0)
    del x, y
    a = torch.randn(8192, 8192, device=ctx.device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=ctx.device, dtype=torch.bfloat16)
    a @ b
    ctx.sync()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    ctx.sync()
    gemm = 10 * 2 * 8192 ** 3 / (time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s_read_plus_write": copy_bw, "bf16_gemm_8192_flops": gemm}
