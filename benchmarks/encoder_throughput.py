"""Embedding throughput of an encoder (engine/encoder.py) against transformers on the same weights, on this CPU.

Lifecycle: a one-shot script. It saves a random transformers ``BertModel`` of a real embedding model's shape
(``--shape minilm``: all-MiniLM-L6-v2, 6 x 384; ``bge-base``: bge-base-en-v1.5, 12 x 768; vocabulary 30522, 512
positions), then, round by round (interleaved, best of ``--rounds``, so load bursts hit both), embeds ``--texts``
token-id inputs of random lengths in [``--min-len``, ``--max-len``] (a seeded draw):

- pdserve: ``LLM.embed`` (CLS pooling, normalised), the engine batching as it serves (``max_num_seqs`` prompts a
  step, whole prompts);
- transformers: ``BertModel`` in batches of ``--hf-batch`` padded to their longest input with an attention mask
  (what sentence-transformers' ``encode`` does, which also sorts inputs by length first: ``--hf-sort``), CLS state
  normalised.

It prints texts/s and tokens/s of each and pdserve's ratio to transformers, and checks that the two agree on every
vector (max abs difference).

Usage: python benchmarks/encoder_throughput.py [--shape minilm] [--texts 256] [--rounds 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

SHAPES = {"minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
          "bge-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="minilm")
    ap.add_argument("--texts", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--hf-sort", action="store_true", help="sort transformers' inputs by length (ST's encode)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    from engine import LLM

    cfg = transformers.BertConfig(vocab_size=30522, max_position_embeddings=512, **SHAPES[args.shape])
    torch.manual_seed(0)
    hf = transformers.BertModel(cfg).eval()
    root = tempfile.mkdtemp()
    hf.save_pretrained(root)
    llm = LLM(root, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=4096, num_threads=args.threads)
    rng = random.Random(0)
    inputs = [[101] + [rng.randrange(1000, 30000) for _ in range(rng.randint(args.min_len, args.max_len) - 2)] + [102]
              for _ in range(args.texts)]
    n_tokens = sum(map(len, inputs))

    def ours() -> list[list[float]]:
        return [o.outputs.embedding for o in llm.embed(inputs)]

    def theirs() -> list[list[float]]:
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i])) if args.hf_sort else list(range(len(inputs)))
        out: dict[int, list[float]] = {}
        with torch.inference_mode():
            for a in range(0, len(order), args.hf_batch):
                idx = order[a:a + args.hf_batch]
                width = max(len(inputs[i]) for i in idx)
                ids = torch.tensor([inputs[i] + [0] * (width - len(inputs[i])) for i in idx])
                mask = torch.tensor([[1] * len(inputs[i]) + [0] * (width - len(inputs[i])) for i in idx])
                cls = torch.nn.functional.normalize(hf(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0], dim=-1)
                out.update({i: v.tolist() for i, v in zip(idx, cls)})
        return [out[i] for i in range(len(inputs))]

    best = {"pdserve": float("inf"), "transformers": float("inf")}
    got = {}
    ours()  # (warm-up: first-call allocations)
    for _ in range(args.rounds):
        for name, fn in (("pdserve", ours), ("transformers", theirs)):
            t0 = time.perf_counter()
            got[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    diff = max(abs(x - y) for a, b in zip(got["pdserve"], got["transformers"]) for x, y in zip(a, b))
    print(f"shape {args.shape}: {args.texts} texts of {args.min_len}-{args.max_len} tokens ({n_tokens} tokens), "
          f"{args.threads} threads, best of {args.rounds}")
    for name, t in best.items():
        print(f"  {name:13s} {args.texts / t:8.1f} texts/s {n_tokens / t:9.0f} tokens/s")
    print(f"  pdserve / transformers: {best['transformers'] / best['pdserve']:.2f}x   max |diff| {diff:.2e}")


if __name__ == "__main__":
    main()
