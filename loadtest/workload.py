"""Workloads: the list of requests a benchmark sends, from a trace or from synthetic lengths.

Lifecycle: after ``GetModelInfo`` the CLI builds the workload once, before the
clock starts: each ``BenchRequest`` has its prompt token ids (random ids within
the model's vocabulary from a seeded RNG, so a rerun sends the same prompts),
its forced output length and its send offset. With ``prefix_len`` (vLLM's
``--random-prefix-len``) every prompt starts with the same ``prefix_len`` random
ids, drawn once, before its own random part. Lengths that do not fit the
model's limits are clipped (the prompt's tail goes first, so the shared prefix
survives), and how many were clipped is reported, so a replay never fails on
requests the server was never able to take.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from loadtest.trace import TraceRow


@dataclass(frozen=True)
class ModelLimits:
    """What the server accepts (0 = no limit given)."""

    vocab_size: int
    max_context_length: int = 0
    max_prompt_tokens: int = 0
    max_new_tokens: int = 0


@dataclass
class BenchRequest:
    """One request to send."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float
    model: str = ""
    """The model the request names ("" : the target's own; a LoRA adapter's name with ``--lora-modules``)."""


@dataclass
class Workload:
    """The requests plus how many had their lengths clipped to the model's limits."""

    requests: list[BenchRequest]
    num_clipped: int = 0


def assign_models(requests: list[BenchRequest], models: list[str], seed: int = 0) -> dict[str, int]:
    """Give each request one of ``models`` drawn at random (seeded: vLLM's ``--lora-modules`` in its serving
    benchmark); returns how many each got."""
    rng = np.random.default_rng([seed, 0x10A])
    counts = dict.fromkeys(models, 0)
    for r, i in zip(requests, rng.integers(len(models), size=len(requests)).tolist()):
        r.model = models[i]
        counts[r.model] += 1
    return counts


def synthetic_lengths(num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                      seed: int = 0) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs drawn uniformly in [L*(1-r), L*(1+r)], as vLLM's random dataset."""
    if num < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num}")
    if input_len < 1:
        raise ValueError(f"input_len must be >= 1, got {input_len}")
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be within [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)

    def draw(length: int) -> np.ndarray:
        lo = max(1, int(math.floor(length * (1 - range_ratio))))
        hi = max(lo, int(math.ceil(length * (1 + range_ratio))))
        return rng.integers(lo, hi + 1, size=num)

    return [(int(p), int(o)) for p, o in zip(draw(input_len), draw(output_len))]


def _clip(prompt_len: int, output_len: int, lim: ModelLimits) -> tuple[int, int]:
    if lim.max_prompt_tokens:
        prompt_len = min(prompt_len, lim.max_prompt_tokens)
    if lim.max_context_length:
        prompt_len = min(prompt_len, lim.max_context_length - 1)
    if lim.max_new_tokens:
        output_len = min(output_len, lim.max_new_tokens)
    if lim.max_context_length:
        output_len = min(output_len, lim.max_context_length - prompt_len)
    return max(1, prompt_len), max(1, output_len)


def build_workload(lengths: list[tuple[int, int]], arrivals: list[float], limits: ModelLimits,
                   seed: int = 0, id_prefix: str = "bench", prefix_len: int = 0) -> Workload:
    """Requests with random prompts of the given lengths, sent at ``arrivals``, clipped to ``limits``.

    ``prefix_len`` > 0: each prompt is one shared random prefix of that many ids followed by its own
    random ids of the given length (vLLM's random dataset: total = prefix_len + input_len).
    """
    if prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {prefix_len}")
    if len(lengths) != len(arrivals):
        raise ValueError(f"arrivals: {len(arrivals)} offsets for {len(lengths)} requests")
    if limits.vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {limits.vocab_size}")
    if limits.max_context_length == 1:
        raise ValueError("max_context_length 1 leaves no room for a prompt and an output token")
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, limits.vocab_size, size=prefix_len).tolist() if prefix_len else []
    reqs: list[BenchRequest] = []
    clipped = 0
    for i, ((p, o), t) in enumerate(zip(lengths, arrivals)):
        p += prefix_len
        cp, co = _clip(p, o, limits)
        clipped += (cp, co) != (p, o)
        ids = (prefix + rng.integers(0, limits.vocab_size, size=p - prefix_len).tolist())[:cp]
        reqs.append(BenchRequest(f"{id_prefix}-{i}", ids, co, float(t)))
    return Workload(reqs, clipped)


def trace_lengths(rows: list[TraceRow]) -> list[tuple[int, int]]:
    """(prompt_len, output_len) of trace rows; zero-length entries become 1 (nothing to measure otherwise)."""
    return [(max(1, r.prompt_len), max(1, r.output_len)) for r in rows]
