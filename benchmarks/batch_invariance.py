"""Does the offline engine's greedy output depend on how requests arrive? (batch invariance)

Usage:
    python benchmarks/batch_invariance.py                                   # tiny, CPU, float32 and bfloat16
    python benchmarks/batch_invariance.py --model /tmp/ck1b --device cuda --dtypes bfloat16 --num-prompts 128

Why: through the cluster on an H100 (27 Nov, bf16, random weights) greedy tokens equalled the offline engine's
for 1 of 1 streams, 7 of 8, 25-26 of 32 and 28-58 of 128, while on CPU every test and benchmark point matches
token for token. Requests reach a worker over milliseconds, so its batches differ from the offline run's, where
all prompts are added at once. If the engine alone gives different tokens for the same prompts when they arrive
one per step instead of all at once, the cluster's differences are the kernels' (GEMMs whose reduction order
depends on the batch shape, which bf16 rounding and near-tied random logits make visible), not the serving path.

Lifecycle: one ``LLMEngine`` per dtype; the same prompts (seeded random ids), greedy, ``ignore_eos``, run twice:
all added before the first step, then one added per step. Prints how many outputs are equal and, for the others,
the first position where they differ. No reference numbers: the result is the count, read against the cluster's.
"""
from __future__ import annotations

import argparse
import random
from typing import Optional



def generate(eng: object, prompts: list[list[int]], max_tokens: int, one_per_step: bool, tag: str) -> list[list[int]]:
    """Greedy outputs of ``prompts`` on ``eng``: all added at once, or one added before each step."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    if not one_per_step:
        for i, ids in pending:
            eng.add_request(f"{tag}-{i}", ids, params)  # type: ignore[attr-defined]
        pending = []
    while pending or eng.has_unfinished_requests():  # type: ignore[attr-defined]
        if pending:
            i, ids = pending.pop(0)
            eng.add_request(f"{tag}-{i}", ids, params)  # type: ignore[attr-defined]
        for o in eng.step():  # type: ignore[attr-defined]
            out[int(o.request_id.rsplit("-", 1)[1])].extend(o.new_token_ids)
    return [out[i] for i in range(len(prompts))]


def first_difference(a: list[int], b: list[int]) -> Optional[int]:
    """The first index where ``a`` and ``b`` differ (None if equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-cache-gib", type=float, default=None, help="CUDA: KV cache size (default: the engine's)")
    p.add_argument("--batch-invariant", default="off", choices=("off", "on", "both"),
                   help="EngineConfig.batch_invariant (CUDA: pdserve's fixed-tile GEMM and attention); both: each "
                        "dtype without, then with")
    ns = p.parse_args(argv)
    if ns.num_prompts < 1 or ns.prompt_len < 1 or ns.max_tokens < 1:
        raise SystemExit("--num-prompts, --prompt-len and --max-tokens must be >= 1")
    import torch

    torch.set_num_threads(1)
    from engine import EngineConfig, load_model_config
    from engine.llm_engine import LLMEngine

    vocab = load_model_config(EngineConfig(model=ns.model)).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(5, vocab) for _ in range(ns.prompt_len)] for _ in range(ns.num_prompts)]
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[ns.batch_invariant]
    for dtype, invariant in [(d, m) for d in ns.dtypes.split(",") if d for m in modes]:
        kw = {"kv_cache_memory_bytes": int(ns.kv_cache_gib * 2**30)} if ns.kv_cache_gib else {}
        eng = LLMEngine(EngineConfig(model=ns.model, num_threads=1, device=ns.device, dtype=dtype,
                                     batch_invariant=invariant, **kw))
        a = generate(eng, prompts, ns.max_tokens, False, "all")
        b = generate(eng, prompts, ns.max_tokens, True, "step")
        c = generate(eng, prompts, ns.max_tokens, False, "again")
        diffs = [first_difference(x, y) for x, y in zip(a, b)]
        same = sum(d is None for d in diffs)
        repeat = sum(x == y for x, y in zip(a, c))
        print(f"{ns.model} {ns.device} {dtype}{' batch_invariant' if invariant else ''}: all at once vs one per step: {same}/{len(a)} equal "
              f"(first differences at {sorted(d for d in diffs if d is not None)[:12]}); all at once twice: "
              f"{repeat}/{len(a)} equal", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
