"""pdserve's engine on CUDA: bf16/fp32 parity with transformers, decode bandwidth and prefill MFU, in one run.

Lifecycle: a one-shot script. It writes a random-weight Llama checkpoint (a Hugging Face directory:
config.json, bfloat16 model.safetensors, the built-in tokenizer's files) at a realistic shape
(``--shape 1b``: Llama-3.2-1B's layers, heads, head_dim, llama3 RoPE, with the built-in 8192-token
vocabulary and untied embeddings; weights N(0, 0.02) like HF's initializer_range), then runs the
phases asked for (``--phases``), each on its own: a phase prints one line per result as soon as it
has it, catches its own exception (the traceback is printed and recorded) and the next phase runs.
Everything goes to ``--out/cuda_engine.json``, rewritten after every phase.

* ``parity``: for prompts of several lengths, the last prompt position's logits (max |diff|, top-1
  agreement) and greedy continuations of pdserve's ``LLM`` (all prompts in one batch) against
  transformers' own forward and ``generate(do_sample=False)`` (one prompt at a time), on the same
  weights, in float32 (the strict check: every greedy token must match) and bfloat16 (reported, not
  asserted: the first divergence per prompt, the fraction of tokens that match, and the float32
  reference's logit gap between the two candidates where they diverge, i.e. how near a tie it was).
  The weights are bf16 values, so the float32 run holds exactly the same numbers.
* ``decode``: decode tokens/s of ``LLMEngine.step`` at batch 1, 8, 32, 128 (128-token prompts, 128
  new tokens, EOS ignored; only steps where every sequence decodes are counted), the memory bandwidth
  that implies (weights + the KV of every context read once per step, over the step time) and its
  fraction of the card's peak; transformers ``generate`` at batch 1 and 8 as the same-run reference
  (decode rate = batch x (N - 1) / (t_N - t_1)).
* ``prefill``: time to prefill 512, 2048 and 8192 tokens (batch 1) and 8 x 1024 in one engine step,
  FLOPs = 2 x non-embedding params x tokens + causal attention (2 x layers x heads x head_dim x n(n+1)
  per sequence) + the LM head on one row per sequence, as a fraction of dense bf16 peak; transformers'
  forward on the same input (``logits_to_keep=1``) as reference.

Peaks are looked up from ``torch.cuda.get_device_name`` (H200 4.8 TB/s, H100 SXM 3.35 TB/s, both 989
TFLOP/s dense bf16) and printed; on CUDA the run also measures a device copy and a large bf16 GEMM, as
the ceilings actually reachable on that card.

Usage (GPU; 62 s on an H200, 72 s wall with python start): PYTHONUNBUFFERED=1 python3 benchmarks/cuda_engine.py --out "$OUT"
CPU smoke run (< 1 min): python benchmarks/cuda_engine.py --device cpu --quick --out /tmp/cuda_quick
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.builtin import tokenizer_dir  # noqa: E402
from engine.config import ModelConfig  # noqa: E402

VOCAB = 8192  # the built-in tokenizer's; prompts use ids 5..8191 (0-4 are its special tokens)

SHAPES = {
    # Llama-3.2-1B's decoder (vocab aside): 16 x (2048 hidden, 32 q / 8 kv heads of 64, SwiGLU 8192)
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, head_dim=64),
    "small": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                  intermediate_size=4096, head_dim=64),
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, head_dim=64),
}


@dataclass(frozen=True)
class Workload:
    parity_lens: tuple = (8, 50, 300, 1000)
    parity_new: int = 48
    decode_batches: tuple = (1, 8, 32, 128)
    hf_decode_batches: tuple = (1, 8)
    decode_prompt: int = 128
    decode_new: int = 128
    prefill: tuple = ((1, 512), (1, 2048), (1, 8192), (8, 1024))
    repeats: int = 3
    max_pos: int = 16384


FULL = Workload()
QUICK = Workload(parity_lens=(5, 19, 60), parity_new=32, decode_batches=(1, 4), hf_decode_batches=(1, 4),
                 decode_prompt=32, decode_new=16, prefill=((1, 64), (1, 256), (4, 64)), repeats=2, max_pos=2048)


# -- the checkpoint ----------------------------------------------------------------------------------

def hf_config(shape: dict, max_pos: int, std: float) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": VOCAB, **shape, "max_position_embeddings": max_pos, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,  # the built-in tokenizer's
        "initializer_range": std, "torch_dtype": "bfloat16", "use_cache": True,
    }


def make_checkpoint(d: Path, shape: dict, max_pos: int = 16384, std: float = 0.02, seed: int = 0,
                    device: str = "cpu") -> Path:
    """A random Llama as a HF directory: config.json, bfloat16 model.safetensors, tokenizer files.

    Weights are drawn N(0, std) on ``device`` (fast on a GPU) and stored as bfloat16, so a float32 load
    of them is exact and both sides of every comparison hold the same numbers; norms are 1."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(shape, max_pos, std)
    h, inter, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    H, Hkv, D = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    shapes: dict[str, tuple] = {"model.embed_tokens.weight": (VOCAB, h)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (H * D, h), p + "self_attn.k_proj.weight": (Hkv * D, h),
                       p + "self_attn.v_proj.weight": (Hkv * D, h), p + "self_attn.o_proj.weight": (h, H * D),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
    shapes["lm_head.weight"] = (VOCAB, h)
    g = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, shp in shapes.items():
        state[name] = (torch.randn(shp, generator=g, device=device) * std).to(torch.bfloat16).cpu()
    for i in range(L):
        for n in ("input_layernorm", "post_attention_layernorm"):
            state[f"model.layers.{i}.{n}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    state["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in tokenizer_dir().iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    return d


def prompts_of(lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, VOCAB, (n,), generator=g).tolist() for n in lengths]


# -- the run's context: device, caches of loaded models, the report ----------------------------------

@dataclass
class Ctx:
    device: str
    ckpt: Path
    shape: dict
    work: Workload
    out: Path
    report: dict
    _hf: dict = field(default_factory=dict)
    _eng: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "cuda_engine.json").write_text(json.dumps(self.report, indent=2, default=str))

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf_dict(json.loads((self.ckpt / "config.json").read_text()), torch.bfloat16)

    # at most one transformers model and one engine per dtype are kept; drop() frees them
    def hf(self, dtype: str):
        if dtype not in self._hf:
            import transformers

            dt = getattr(torch, dtype)
            try:
                m = transformers.AutoModelForCausalLM.from_pretrained(self.ckpt, dtype=dt, attn_implementation="sdpa")
            except TypeError:  # transformers 4.x spelling
                m = transformers.AutoModelForCausalLM.from_pretrained(self.ckpt, torch_dtype=dt,
                                                                      attn_implementation="sdpa")
            m = m.to(self.device).eval()
            m.generation_config.eos_token_id = None  # never stop early: the engine runs with ignore_eos
            m.generation_config.pad_token_id = 2
            self._hf[dtype] = m
        return self._hf[dtype]

    def engine(self, dtype: str):
        """pdserve's offline ``LLM`` on this checkpoint, sized for every workload of the run."""
        if dtype not in self._eng:
            from engine import LLM

            mc = self.model_config()
            w = self.work
            elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
            per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * elem
            tokens = max(max(w.decode_batches) * (w.decode_prompt + w.decode_new + 32),
                         max(b * (n + 32) for b, n in w.prefill), sum(w.parity_lens) + 64 * len(w.parity_lens) * 2)
            step_tokens = max(max(b * n for b, n in w.prefill), sum(w.parity_lens), 2048)
            self._eng[dtype] = LLM(model=str(self.ckpt), dtype=dtype, device=self.device,
                                   kv_cache_memory_bytes=int(tokens * per_token * 1.25),
                                   max_num_seqs=max(max(w.decode_batches), len(w.parity_lens), 8),
                                   max_num_batched_tokens=step_tokens, max_model_len=w.max_pos,
                                   enable_prefix_caching=False)
        return self._eng[dtype]

    def drop(self, hf: tuple = (), eng: tuple = ()) -> None:
        for k in hf:
            self._hf.pop(k, None)
        for k in eng:
            self._eng.pop(k, None)
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def log(phase: str, msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] [{phase}] {msg}", flush=True)


# -- phase 1: parity ---------------------------------------------------------------------------------

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


# -- phase 2: decode ---------------------------------------------------------------------------------

_rid = [0]


def engine_timed(ctx: Ctx, eng, prompts: list[list[int]], n_new: int) -> dict:
    """Run prompts through LLMEngine.step to completion, timing each step; the decode steps are those
    where every sequence already has its first token."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    ids = []
    for p in prompts:
        _rid[0] += 1
        ids.append(f"b{_rid[0]}")
        eng.add_request(ids[-1], p, params)
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


# -- main --------------------------------------------------------------------------------------------

PHASES = {"parity": phase_parity, "decode": phase_decode, "prefill": phase_prefill}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="results/cuda_engine")
    ap.add_argument("--quick", action="store_true", help="tiny shape, few tokens (a CPU smoke run)")
    ap.add_argument("--phases", default="parity,decode,prefill")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: 1b (tiny with --quick)")
    ap.add_argument("--std", type=float, default=0.02, help="weight init std (HF Llama's initializer_range)")
    ap.add_argument("--ckpt", default=None, help="checkpoint directory to write (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    try:
        sys.stdout.reconfigure(line_buffering=True)
    except AttributeError:
        pass
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    bad = [p for p in phases if p not in PHASES]
    if bad:
        ap.error(f"unknown phases {bad}; choose from {', '.join(PHASES)}")
    shape_name = args.shape or ("tiny" if args.quick else "1b")
    work = QUICK if args.quick else FULL
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass
    t_run = time.perf_counter()
    out = Path(args.out)
    report: dict[str, Any] = {"args": vars(args), "shape_name": shape_name, "workload": work.__dict__,
                              "errors": {}}
    report["device"] = device_info(args.device)
    dev = report["device"]
    log("setup", f"device {dev['name']} | torch {dev['torch']} (CUDA {dev['cuda']}) | transformers "
                 f"{dev['transformers']} | peaks: {dev['peak_assumption']}")
    tmp = None
    ckpt = Path(args.ckpt) if args.ckpt else Path(tmp := tempfile.mkdtemp(prefix="pdserve_cuda_ckpt_"))
    ctx = Ctx(args.device, ckpt, SHAPES[shape_name], work, out, report)
    try:
        if ctx.cuda:
            try:
                dev["measured"] = measure_ceilings(ctx)
                m = dev["measured"]
                log("setup", f"measured: device copy {m['copy_bytes_per_s_read_plus_write'] / 1e12:.2f} TB/s "
                             f"(read + write), bf16 GEMM 8192^3 {m['bf16_gemm_8192_flops'] / 1e12:.0f} TFLOP/s")
            except Exception:  # a ceiling we could not measure is no reason to stop
                traceback.print_exc()
        t0 = time.perf_counter()
        make_checkpoint(ckpt, ctx.shape, work.max_pos, args.std, device=args.device)
        mc = ctx.model_config()
        report["model"] = {"shape": ctx.shape, "vocab_size": VOCAB, "max_position_embeddings": work.max_pos,
                           "params": mc.num_params, "init_std": args.std, "rope": mc.rope_scaling,
                           "tie_word_embeddings": mc.tie_word_embeddings,
                           "checkpoint_s": round(time.perf_counter() - t0, 2)}
        log("setup", f"checkpoint {shape_name} ({mc.num_params / 1e6:.0f}M params: {ctx.shape}, vocab {VOCAB}, "
                     f"bf16) written in {time.perf_counter() - t0:.1f} s to {ckpt}")
        ctx.save()
        for name in phases:
            t0 = time.perf_counter()
            log(name, "start")
            try:
                report[name] = PHASES[name](ctx)
                log(name, f"done in {time.perf_counter() - t0:.1f} s")
            except Exception:
                tb = traceback.format_exc()
                print(tb, file=sys.stderr, flush=True)
                report["errors"][name] = tb
                log(name, f"FAILED after {time.perf_counter() - t0:.1f} s (traceback above); going on")
            report.setdefault("phase_seconds", {})[name] = round(time.perf_counter() - t0, 2)
            ctx.save()
    finally:
        ctx.drop(hf=tuple(ctx._hf), eng=tuple(ctx._eng))
        report["total_s"] = round(time.perf_counter() - t_run, 2)
        ctx.save()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    log("done", f"{report['total_s']:.1f} s in all; results in {out / 'cuda_engine.json'}; "
                f"errors in: {', '.join(report['errors']) or 'no phase'}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
