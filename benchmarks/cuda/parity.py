"""Phase 1 of the CUDA benchmark: pdserve's ``LLM`` against transformers on the same weights, float32 (every
greedy token must match) and bfloat16 (reported: first divergence, match fraction, the float32 gap at each split).

Lifecycle: ``phase_parity(ctx)`` once per run; the rest are its steps.
"""
from __future__ import annotations

import time

import torch


from benchmarks.cuda.checkpoint import prompts_of
from benchmarks.cuda.context import Ctx, log


def engine_last_logits(llm, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The engine's float logits of each prompt's last position (one prompt per generate call)."""
    from engine import SamplingParams

    model = llm.llm_engine.model
    orig = model.compute_logits
    seen: list[torch.Tensor] = []

    def capture(hidden):
        out = orig(hidden)
        seen.append(out.detach().float().cpu())
        return out

    model.compute_logits = capture
    try:
        rows = []
        for p in prompts:
            seen.clear()
            llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            rows.append(seen[0][0])
        return rows
    finally:
        del model.compute_logits


def engine_greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    from engine import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def hf_last_logits(model, prompts: list[list[int]], device: str) -> list[torch.Tensor]:
    rows = []
    with torch.inference_mode():
        for p in prompts:
            rows.append(model(torch.tensor([p], device=device)).logits[0, -1].float().cpu())
    return rows


def hf_greedy(model, prompts: list[list[int]], n: int, device: str) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            o = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                               eos_token_id=None, pad_token_id=2)
            outs.append(o[0, len(p):].tolist())
    return outs


def compare(dtype: str, prompts, hf_logits, eng_logits, hf_toks, eng_toks) -> dict:
    per = []
    for p, hl, el, ht, et in zip(prompts, hf_logits, eng_logits, hf_toks, eng_toks):
        div = next((i for i, (a, b) in enumerate(zip(ht, et)) if a != b), None)
        if div is None and len(ht) != len(et):
            div = min(len(ht), len(et))
        n = max(len(ht), 1)
        per.append({
            "prompt_len": len(p), "logits_max_abs_diff": (hl - el).abs().max().item(),
            "logits_ref_std": hl.std().item(), "top1_ref": int(hl.argmax()), "top1_engine": int(el.argmax()),
            "top1_agree": int(hl.argmax()) == int(el.argmax()), "new_tokens": len(ht),
            "first_divergence": div, "prefix_match_frac": (len(ht) if div is None else div) / n,
            "positionwise_match_frac": sum(a == b for a, b in zip(ht, et)) / n,
            "distinct_ref_tokens": len(set(ht)), "ref_tokens_head": ht[:12], "engine_tokens_head": et[:12],
        })
    return {"dtype": dtype, "prompts": per,
            "all_top1_agree": all(r["top1_agree"] for r in per),
            "all_greedy_match": all(r["first_divergence"] is None for r in per),
            "greedy_match_frac": sum(r["prefix_match_frac"] for r in per) / len(per),
            "max_logits_diff": max(r["logits_max_abs_diff"] for r in per)}


def parity_dtype(ctx: Ctx, dtype: str, prompts, n_new: int) -> dict:
    hf = ctx.hf(dtype)
    t0 = time.perf_counter()
    hl, ht = hf_last_logits(hf, prompts, ctx.device), hf_greedy(hf, prompts, n_new, ctx.device)
    t_hf = time.perf_counter() - t0
    llm = ctx.engine(dtype)
    t0 = time.perf_counter()
    el, et = engine_last_logits(llm, prompts), engine_greedy(llm, prompts, n_new)
    t_eng = time.perf_counter() - t0
    res = compare(dtype, prompts, hl, el, ht, et)
    res["seconds"] = {"transformers": round(t_hf, 2), "engine": round(t_eng, 2)}
    res["_raw"] = (hl, el, ht, et)
    for r in res["prompts"]:
        div = r["first_divergence"]
        log("parity", f"{dtype:8s} prompt {r['prompt_len']:5d}: last logits max|diff| {r['logits_max_abs_diff']:.3g} "
                      f"(ref std {r['logits_ref_std']:.3g}), top-1 {'same' if r['top1_agree'] else 'DIFFERENT'}; "
                      f"greedy {int(r['prefix_match_frac'] * r['new_tokens'])}/{r['new_tokens']} before the first "
                      f"divergence ({'none' if div is None else f'at token {div}'}), "
                      f"{r['positionwise_match_frac']:.0%} positionwise, {r['distinct_ref_tokens']} distinct ref tokens")
    return res


def near_tie_gaps(ctx: Ctx, prompts, res16: dict) -> None:
    """Where bf16 greedy diverged: the float32 reference's logits at that point (after the shared
    prefix), as logit(ref's token) - logit(engine's token) and top-1 minus top-2."""
    hf32 = ctx.hf("float32")
    _, _, ht, et = res16["_raw"]
    with torch.inference_mode():
        for r, p, a, b in zip(res16["prompts"], prompts, ht, et):
            j = r["first_divergence"]
            if j is None or j >= min(len(a), len(b)):
                continue
            logits = hf32(torch.tensor([p + a[:j]], device=ctx.device)).logits[0, -1].float()
            top2 = logits.topk(2).values
            r["fp32_ref_gap_ref_minus_engine_token"] = (logits[a[j]] - logits[b[j]]).item()
            r["fp32_ref_top1_minus_top2"] = (top2[0] - top2[1]).item()
            log("parity", f"bfloat16 prompt {r['prompt_len']:5d}: at the divergence (token {j}) the float32 reference "
                          f"scores transformers' pick {r['fp32_ref_gap_ref_minus_engine_token']:+.4f} above the "
                          f"engine's (its top-1 - top-2 gap: {r['fp32_ref_top1_minus_top2']:.4f})")


def vs_fp32_reference(r32: dict, r16: dict) -> dict:
    """Both bf16 paths against transformers' float32 run: is the engine's bf16 error the size of
    transformers' own bf16 error?"""
    ref_l, _, ref_t, _ = r32["_raw"]
    hl, el, ht, et = r16["_raw"]
    res = {}
    for name, logits, toks in (("transformers_bf16", hl, ht), ("engine_bf16", el, et)):
        diffs = [(a - b).abs().max().item() for a, b in zip(logits, ref_l)]
        top1 = [int(a.argmax()) == int(b.argmax()) for a, b in zip(logits, ref_l)]
        divs = [next((i for i, (x, y) in enumerate(zip(t, r)) if x != y), None) for t, r in zip(toks, ref_t)]
        frac = sum((len(r) if d is None else d) / max(len(r), 1) for d, r in zip(divs, ref_t)) / len(ref_t)
        res[name] = {"last_logits_max_abs_diff": diffs, "top1_agree": top1, "first_divergence": divs,
                     "greedy_prefix_match_frac": frac}
    e, t = res["engine_bf16"], res["transformers_bf16"]
    log("parity", f"bfloat16 vs the float32 reference: last-logits max|diff| engine {max(e['last_logits_max_abs_diff']):.3g}"
                  f" / transformers {max(t['last_logits_max_abs_diff']):.3g}; top-1 agree engine "
                  f"{sum(e['top1_agree'])}/{len(e['top1_agree'])} / transformers {sum(t['top1_agree'])}/"
                  f"{len(t['top1_agree'])}; greedy tokens before the first divergence engine "
                  f"{e['greedy_prefix_match_frac']:.1%} (at {e['first_divergence']}) / transformers "
                  f"{t['greedy_prefix_match_frac']:.1%} (at {t['first_divergence']})")
    return res


def phase_parity(ctx: Ctx) -> dict:
    w = ctx.work
    prompts = prompts_of(w.parity_lens, seed=11)
    if ctx.cuda:  # the strict check must not run on TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    out = {"prompt_lens": list(w.parity_lens), "new_tokens": w.parity_new}
    r32 = parity_dtype(ctx, "float32", prompts, w.parity_new)
    ctx.drop(eng=("float32",))  # the float32 transformers model stays for the near-tie check
    out["float32"] = r32
    ok = r32["all_greedy_match"]
    log("parity", f"float32: greedy tokens {'MATCH' if ok else 'DO NOT MATCH'} transformers on every prompt "
                  f"({r32['greedy_match_frac']:.1%} of tokens before the first divergence); max last-logits diff "
                  f"{r32['max_logits_diff']:.3g}; top-1 {'all agree' if r32['all_top1_agree'] else 'DISAGREES'} "
                  f"-> {'PASS' if ok and r32['all_top1_agree'] else 'FAIL'}")
    r16 = parity_dtype(ctx, "bfloat16", prompts, w.parity_new)
    out["bfloat16"] = r16
    try:
        near_tie_gaps(ctx, prompts, r16)
    finally:
        ctx.drop(hf=("float32",))
    log("parity", f"bfloat16: {r16['greedy_match_frac']:.1%} of greedy tokens match before the first divergence; "
                  f"{sum(r['first_divergence'] is None for r in r16['prompts'])}/{len(prompts)} prompts match "
                  f"throughout; max last-logits diff {r16['max_logits_diff']:.3g}; top-1 "
                  f"{'all agree' if r16['all_top1_agree'] else 'DISAGREES on some prompt'}")
    out["bfloat16_vs_float32_reference"] = vs_fp32_reference(r32, r16)
    for r in (r32, r16):
        r.pop("_raw", None)
    out["float32_strict_pass"] = bool(r32["all_greedy_match"] and r32["all_top1_agree"])
    return out
