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
* ``graphs``: decode with CUDA graphs (a CUDA engine's default; every other phase runs with them too) against
  the same engine with ``enforce_eager``: capture cost, greedy bf16 tokens of both, decode step time of both at
  each decode batch (benchmarks/cuda/graphs.py).
* ``prefill``: time to prefill 512, 2048 and 8192 tokens (batch 1) and 8 x 1024 in one engine step,
  FLOPs = 2 x non-embedding params x tokens + causal attention (2 x layers x heads x head_dim x n(n+1)
  per sequence) + the LM head on one row per sequence, as a fraction of dense bf16 peak; transformers'
  forward on the same input (``logits_to_keep=1``) as reference.
* ``kernels`` (not in the default phases): where a prefill step's and a decode step's device time goes, by kernel
  class, and how much of the step the device idles (benchmarks/cuda/kernels.py: ``torch.profiler``).

Peaks are looked up from ``torch.cuda.get_device_name`` (H200 4.8 TB/s, H100 SXM 3.35 TB/s, both 989
TFLOP/s dense bf16) and printed; on CUDA the run also measures a device copy and a large bf16 GEMM, as
the ceilings actually reachable on that card.

Usage (GPU; 62 s on an H200, 72 s wall with python start): PYTHONUNBUFFERED=1 python3 benchmarks/cuda_engine.py --out "$OUT"
CPU smoke run (< 1 min): python benchmarks/cuda_engine.py --device cpu --quick --out /tmp/cuda_quick
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from benchmarks.cuda.checkpoint import FULL, QUICK, SHAPES, VOCAB, make_checkpoint
from benchmarks.cuda.context import Ctx, log
from benchmarks.cuda.graphs import phase_graphs
from benchmarks.cuda.kernels import phase_kernels
from benchmarks.cuda.parity import phase_parity
from benchmarks.cuda.speed import device_info, measure_ceilings, phase_decode, phase_prefill


PHASES = {"parity": phase_parity, "decode": phase_decode, "prefill": phase_prefill, "graphs": phase_graphs,
          "kernels": phase_kernels}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="results/cuda_engine")
    ap.add_argument("--quick", action="store_true", help="tiny shape, few tokens (a CPU smoke run)")
    ap.add_argument("--phases", default="parity,decode,prefill,graphs")
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
