"""Speculative decoding: propose k tokens cheaply, verify them with one target forward, keep what agrees.

Lifecycle: ``SpeculativeConfig.parse(EngineConfig.speculative_config)`` once at
engine start (vLLM's dict: ``{"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_min": 1, "prompt_lookup_max": 4}`` or ``{"method": "draft_model",
"model": "tiny-draft", "num_speculative_tokens": k}``). Every step, before
scheduling, the engine asks its proposer (``NgramProposer`` here, or
``engine.draft_model.DraftModelProposer``) for up to k draft tokens per
decoding sequence (``Sequence.spec_token_ids``); the scheduler gives such a
sequence 1 + k query positions (its last token and the drafts) when the step's
budget and blocks allow; the model runner computes logits at all of them in one
forward through the paged cache and samples every position with the ordinary
sampler, position j seeing the history extended by drafts 1..j; ``accept`` then
keeps the drafts up to the first one that differs from the sampled token and
adds the sampled token at that position (or the bonus token after the last
draft). The engine advances the sequence by what was accepted and frees the
blocks that only rejected drafts used (their stale K/V slots beyond the
sequence's length are never attended to and are overwritten later).

Why this is lossless, also for sampling: an n-gram or greedy-draft-model draft is deterministic (its
distribution q is one-hot on the draft d), so Leviathan et al.'s rule "accept d
with probability min(1, p(d)/q(d)) = p(d), else draw from max(p - q, 0)
normalised" is exactly "draw x ~ p; accept if x == d, else emit x". Each
position is drawn by the same sampler with the same history and, for a seeded
request, the same uniform (a function of the seed and the output index only)
as without speculation. Hence greedy output is identical, and a seeded sampled
request is token-for-token identical to the same request without speculation;
an unseeded one follows the same distribution (its uniforms come from the
engine generator in a different order). In floating point this holds as far as
the verification pass computes the same logits as a one-token decode step.
Each verified position runs as a one-token decode row of its own (its context
ends at its position; engine/model_runner.py), so the two differ only where a
row's result depends on the batch around it. pdserve's CPU kernels (the default
fp32 panels, every quantization, the fused layers, the paged decode attention)
give a row the same bits in any batch of up to 64 rows, so there verification
is bit-identical to plain decoding, logprobs included (tested exactly in
tests/engine/test_speculative.py). Elsewhere (oneDNN-only or torch linears,
CUDA, steps of more than 64 rows) the logits agree to about 1e-6, and a seeded
draw whose uniform falls within that of a boundary of the sampling CDF (or a
greedy exact near-tie) can come out differently: before verification became
decode rows, changing only the rounding of the RMSNorm made one of 8 seeded
24-token requests of tests/e2e/test_spec_cluster.py diverge.

Counters follow vLLM's spec-decode metrics: drafts (sequence-steps that
verified at least one draft token), draft tokens, accepted tokens, and
accepted tokens per draft position.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence as Seq

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """What to speculate with (vLLM's ``speculative_config`` keys)."""

    method: str = "ngram"
    """"ngram" (prompt lookup: the continuation of the latest earlier occurrence of the context's last n
    tokens) or "draft_model" (the greedy continuation of a small model sharing the target's tokenizer,
    ``engine.draft_model``; inferred when only ``model`` is given)."""
    num_speculative_tokens: int = 4
    """Draft tokens proposed per step (k)."""
    prompt_lookup_min: int = 1
    """Shortest suffix n-gram to look up (method "ngram")."""
    prompt_lookup_max: int = 4
    """Longest suffix n-gram to look up (longer matches are tried first; method "ngram")."""
    model: Optional[str] = None
    """The draft model (method "draft_model")."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config.model must name the draft model (a built-in name such as "
                             "'tiny-draft' or a HF directory) when method is 'draft_model'")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model is only used with method 'draft_model'")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")

    @classmethod
    def parse(cls, value: Any) -> Optional["SpeculativeConfig"]:
        """None, a SpeculativeConfig, or vLLM's dict (unknown keys are a ValueError naming them)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or None, got {type(value).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        if "model" in value and "method" not in value:
            value = {**value, "method": "draft_model"}  # as vLLM infers it
        return cls(**value)


class NgramProposer:
    """Prompt-lookup drafts: find the latest earlier occurrence of the last n tokens (n from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``) and propose the tokens that followed it."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg

    def propose(self, token_ids: Seq[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens continuing ``token_ids`` (empty when no n-gram recurs)."""
        L = len(token_ids)
        if k < 1 or L < self.cfg.prompt_lookup_min + 1:
            return []
        import numpy as np  # here: ``EngineConfig`` parses a SpeculativeConfig in the router, which needs no numpy

        arr = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.cfg.prompt_lookup_max, L - 1), self.cfg.prompt_lookup_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)  # starts 0 .. L-1-n
            hits = np.flatnonzero((windows == arr[L - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest occurrence: its continuation is the freshest guess
                return arr[start:start + k].tolist()
        return []


    def propose_many(self, items: Seq[tuple[str, Seq[int], int]]) -> list[list[int]]:
        """Drafts for each (request_id, token_ids, room) (the proposers' common interface)."""
        return [self.propose(toks, room) for _, toks, room in items]

    def release(self, request_id: str) -> None:
        """A request ended (n-grams keep no per-request state)."""


def accept(drafts: Seq[int], sampled: Seq[int]) -> list[int]:
    """The tokens a verified step emits: the drafts up to the first one the target disagrees with, then the
    target's own token at that position (``sampled[j]`` is what the target drew at position j, with drafts
    ``0..j-1`` in its history; ``len(sampled) == len(drafts) + 1``)."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"need one sampled token per draft plus one, got {len(sampled)} for {len(drafts)}")
    out = []
    for d, t in zip(drafts, sampled):
        out.append(t)
        if t != d:
            return out
    out.append(sampled[-1])
    return out


@dataclass
class SpecDecodeStats:
    """Running totals (vLLM's ``spec_decode`` counters)."""

    num_drafts: int = 0
    """Sequence-steps that verified at least one draft token."""
    num_draft_tokens: int = 0
    """Draft tokens verified."""
    num_accepted_tokens: int = 0
    """Draft tokens accepted."""
    accepted_per_pos: list = field(default_factory=list)
    """accepted_per_pos[i]: times the draft at position i was accepted."""

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One verified sequence-step with ``num_drafts`` draft tokens, of which the first ``num_accepted``
        were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos.extend([0] * (num_drafts - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def counts(self) -> tuple[int, int, int]:
        """(num_drafts, num_draft_tokens, num_accepted_tokens) now: what a step's record differences."""
        return self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verified sequence-step (accepted drafts + the target's own token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
