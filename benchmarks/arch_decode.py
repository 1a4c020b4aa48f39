"""Decode speed of each architecture the engine serves against Llama's, at one shape, on this machine's CPU.

Lifecycle: a one-shot script. It saves a random transformers checkpoint of each architecture with the same widths
(hidden, heads, KV heads, head_dim, intermediate, layers, vocabulary), loads each in our ``LLM`` (float32, the
default kernels: a layer that fuses runs as one C++ call per decode step), and, round by round (interleaved, best of
``--rounds``, so load bursts hit every contender), times a greedy batch of ``--batch`` 64-token prompts with 1 and
with 257 new tokens: decode tokens/s = batch x 256 / (t257 - t1). It prints each architecture's rate and its ratio
to Llama's: what a model's extra per-layer work (Gemma 3's four norms and GeGLU, Qwen3's q/k norms) costs when the
widths are equal.

Usage: python benchmarks/arch_decode.py [--archs llama,gemma3,qwen3] [--batch 1] [--rounds 3] [--layers 4]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

SHAPE = dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_attention_heads=6, num_key_value_heads=2,
             head_dim=64, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, tie_word_embeddings=True)


def checkpoint(arch: str, layers: int, root: str) -> str:
    import transformers

    kw = dict(SHAPE, num_hidden_layers=layers)
    cfg, cls = {
        "llama": (lambda: transformers.LlamaConfig(**kw), transformers.LlamaForCausalLM),
        "qwen3": (lambda: transformers.Qwen3Config(**kw), transformers.Qwen3ForCausalLM),
        "gemma3": (lambda: transformers.Gemma3TextConfig(**kw, sliding_window=512, query_pre_attn_scalar=64,
                                                          pad_token_id=0), transformers.Gemma3ForCausalLM),
    }[arch]
    torch.manual_seed(0)
    d = f"{root}/{arch}"
    cls(cfg()).save_pretrained(d)
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", default="llama,gemma3,qwen3")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engine import LLM, SamplingParams

    archs = args.archs.split(",")
    if "llama" not in archs:
        archs.insert(0, "llama")
    root = tempfile.mkdtemp()
    llms = {a: LLM(checkpoint(a, args.layers, root), num_kv_blocks=1024, num_threads=args.threads) for a in archs}
    fused = {a: all(layer.fused is not None for layer in llm.llm_engine.model.layers) for a, llm in llms.items()}
    prompts = [[5 + i] * 64 for i in range(args.batch)]
    best = {a: 0.0 for a in archs}
    for _ in range(args.rounds):
        for a, llm in llms.items():
            def run(n: int) -> float:
                t = time.perf_counter()
                llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                return time.perf_counter() - t
            run(2)  # (warm)
            t1, t257 = run(1), run(257)
            best[a] = max(best[a], args.batch * 256 / max(t257 - t1, 1e-9))
    out = {a: {"decode_tok_s": round(best[a], 1), "vs_llama": round(best[a] / best["llama"], 3), "fused": fused[a]}
           for a in archs}
    print(json.dumps({"batch": args.batch, "layers": args.layers, "threads": args.threads, "archs": out}, indent=1))


if __name__ == "__main__":
    main()
