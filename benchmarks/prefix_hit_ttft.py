"""Time to first token of a prompt whose first C tokens are a prefix-cache hit, with the paged prefill attention
kernel against the path it replaced, in one run.

Lifecycle: a one-shot script. It writes the seeded ``bench`` model to a temp directory, starts one ``LLMEngine``
(float32, prefix caching on, ``--threads`` threads), fills the cache with a C-token prefix, then times prompts of
that prefix plus ``--new`` fresh tokens (one new token at the end of decode: ``max_tokens=1``), alternating two
settings round by round and keeping each one's best of ``--repeats``:

* ``kernel``: what the engine runs (engine/attention.py ``_prefill`` -> ``prefill_attention_paged``: the chunk
  attends over the context through the block table);
* ``gather``: the path before it, which engine/attention.py still runs where the kernels are missing: for this
  run ``attention.cpu_kernels`` answers None, so ``_prefill`` gathers the sequence's blocks with
  ``index_select``, repeats K/V per query head and calls SDPA with an explicit causal mask. (The last layer's
  one-row attention for the sampled token then also takes the gather path, one query row beside 512.
  RoPE, silu and the linears are untouched: engine/model.py holds its own reference to the kernels.)

Usage: python benchmarks/prefix_hit_ttft.py [--cached 512 1536 3072] [--new 512] [--repeats 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


import engine.attention as attention
from engine.builtin import save_builtin
from engine.config import EngineConfig
from engine.kernels import cpu_kernels
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cached", type=int, nargs="+", default=[512, 1536, 3072], help="prefix tokens in the cache")
    ap.add_argument("--new", type=int, default=512, help="fresh tokens after the prefix")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    real = cpu_kernels()
    if real is None:
        raise SystemExit("pdserve's CPU kernels did not build here (see the warning above)")
    settings = {"kernel": lambda: real, "gather": lambda: None}
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(save_builtin("bench", Path(tmp) / "bench"))
        eng = LLMEngine(EngineConfig(model=model, dtype="float32", num_threads=args.threads, max_num_seqs=8,
                                     max_num_batched_tokens=2048, kv_cache_memory_bytes=1 << 30,
                                     enable_prefix_caching=True))
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        rid = 0

        def ttft(prefix: list[int]) -> float:
            nonlocal rid
            rid += 1
            eng.add_request(str(rid), prefix + torch.randint(10, 1000, (args.new,), generator=g).tolist(), sp)
            t = time.perf_counter()
            while eng.has_unfinished_requests():
                eng.step()
            return time.perf_counter() - t

        print(f"bench, float32, {args.threads} threads, {args.new} new tokens after C cached; best of {args.repeats}")
        print(f"{'C':>6} {'kernel ms':>10} {'gather ms':>10} {'speed-up':>9}")
        try:
            for c in args.cached:
                prefix = torch.randint(10, 1000, (c,), generator=g).tolist()
                ttft(prefix)  # fills the prefix cache (and warms up)
                best = {name: float("inf") for name in settings}
                for _ in range(args.repeats):
                    for name, kern in settings.items():
                        attention.cpu_kernels = kern
                        best[name] = min(best[name], ttft(prefix))
                print(f"{c:>6} {best['kernel'] * 1e3:10.1f} {best['gather'] * 1e3:10.1f} "
                      f"{best['gather'] / best['kernel']:8.2f}x")
        finally:
            attention.cpu_kernels = cpu_kernels


if __name__ == "__main__":
    main()
