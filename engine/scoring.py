"""Teacher-forced scoring of a token sequence through an engine's own model and paged KV cache.

Lifecycle: ``prompt_logprobs(engine, ids)`` borrows blocks from an idle engine's block manager, runs
the model over ``ids`` ``chunk_size`` tokens per forward (each chunk writes its K/V into the cache and
attends over everything cached before it, so with ``kv_cache_dtype="int8"`` every chunk after the
first reads quantized K/V), returns ``log p(ids[i] | ids[:i])`` for ``i >= 1`` (and the greedy pick at each position) and gives the blocks
back (unregistered, so the prefix cache never sees them). Used by the quantization accuracy tests and
``benchmarks/quant_accuracy.py`` (held-out perplexity).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from engine.attention import AttentionMetadata, PrefillSpan


def prompt_logprobs(engine: Any, ids: list[int], chunk_size: int = 16) -> tuple[Tensor, Tensor]:
    """(logprobs, argmax), each [len(ids) - 1]: the float32 log-probability of each token after the
    first given its prefix, and the token the model would have picked greedily there."""
    if len(ids) < 2:
        raise ValueError("ids must hold at least 2 tokens")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if engine.has_unfinished_requests():
        raise RuntimeError("prompt_logprobs needs an idle engine")
    bm, bs = engine.block_manager, engine.block_size
    model = engine.runner.model
    dev = next(iter(engine.kv_caches[0])).device
    table = bm.allocate(bm.blocks_for(len(ids)))
    out, top1 = [], []
    try:
        bt = torch.tensor(table, dtype=torch.long, device=dev)
        with torch.inference_mode():
            for p0 in range(0, len(ids) - 1, chunk_size):
                p1 = min(p0 + chunk_size, len(ids) - 1)
                pos = torch.arange(p0, p1, device=dev)
                meta = AttentionMetadata(slot_mapping=bt[pos // bs] * bs + pos % bs, num_decode=0, block_size=bs)
                meta.prefills.append(PrefillSpan(0, p1 - p0, p0, bt))
                hidden = model(torch.tensor(ids[p0:p1], dtype=torch.long, device=dev), pos, meta, engine.kv_caches)
                logp = model.compute_logits(hidden).log_softmax(dim=-1)
                nxt = torch.tensor(ids[p0 + 1:p1 + 1], dtype=torch.long, device=dev)
                out.append(logp.gather(1, nxt[:, None])[:, 0].cpu())
                top1.append(logp.argmax(dim=-1).cpu())
    finally:
        bm.free(table)
    return torch.cat(out), torch.cat(top1)
