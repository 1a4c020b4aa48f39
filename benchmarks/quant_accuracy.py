"""Held-out perplexity of the trained ``tiny`` model under each quantization setting, in one run.

Lifecycle: a one-shot script. It rebuilds the held-out stream ``engine/assets/train_models.py`` scored
when it trained ``tiny`` (every 20th file of the Python standard library sources, each as bos + tokens +
eos), cuts it into SEQ_LEN-token windows like the trainer, and scores each window teacher-forced
through the engine's own paged cache (``engine.scoring.prompt_logprobs``, ``--chunk`` tokens per
forward, so every chunk after a window's first reads the int8 KV cache when one is set) for: float32,
int8 weights, int4 weights (group 128 and 32), int8 KV cache, int8 weights + int8 KV. It prints
perplexity, its ratio to float32, the mean |logprob difference| and how often the greedy pick agrees.

Usage: python benchmarks/quant_accuracy.py [--tokens 32768] [--chunk 16] [--lib /usr/lib/python3.11] [--only w8a8 w4a8]
"""
from __future__ import annotations

import argparse
import math
import sysconfig
import time
from pathlib import Path

import torch


from engine import LLM
from engine.assets.train_models import SEQ_LEN, load_corpus
from engine.scoring import prompt_logprobs

SETTINGS = {
    "fp32": {},
    "int8 weights": {"quantization": "int8"},
    "int4 weights (g128)": {"quantization": "int4"},
    "int4 weights (g32)": {"quantization": "int4", "quantization_group_size": 32},
    "w8a8 (int8 weights and activations)": {"quantization": "w8a8"},
    "w4a8 (int4 g128 weights, int8 activations)": {"quantization": "w4a8"},
    "int8 KV cache": {"kv_cache_dtype": "int8"},
    "int8 weights + int8 KV": {"quantization": "int8", "kv_cache_dtype": "int8"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768, help="held-out tokens to score (whole windows)")
    ap.add_argument("--chunk", type=int, default=16, help="tokens per forward")
    ap.add_argument("--lib", default=sysconfig.get_paths()["stdlib"], help="the standard library sources")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="+", default=None, metavar="WORD",
                    help="run fp32 (the reference) and the settings whose name contains one of these words")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    _, held = load_corpus(Path(args.lib))
    n = min(args.tokens, len(held) - 1) // SEQ_LEN
    windows = [held[i * SEQ_LEN:(i + 1) * SEQ_LEN + 1].tolist() for i in range(n)]
    print(f"{n} windows of {SEQ_LEN} tokens from {args.lib}, chunk {args.chunk}", flush=True)
    ref = None
    print(f"{'setting':<26}{'perplexity':>11}{'vs fp32':>9}{'mean |dlogp|':>14}{'greedy agree':>14}{'s':>6}")
    for name, kw in SETTINGS.items():
        if args.only and name != "fp32" and not any(w in name for w in args.only):
            continue
        eng = LLM(args.model, num_kv_blocks=64, **kw).llm_engine
        t = time.perf_counter()
        scored = [prompt_logprobs(eng, w, args.chunk) for w in windows]
        lp = torch.cat([s[0] for s in scored])
        top = torch.cat([s[1] for s in scored])
        ppl = math.exp(-lp.mean().item())
        if ref is None:
            ref = (lp, top, ppl)
        d = (lp - ref[0]).abs().mean().item()
        agree = (top == ref[1]).float().mean().item()
        print(f"{name:<26}{ppl:>11.3f}{ppl / ref[2]:>9.4f}{d:>14.4f}{agree:>13.1%}{time.perf_counter() - t:>6.0f}",
              flush=True)


if __name__ == "__main__":
    main()
