"""Per-request sampling parameters (the vLLM shape users know).

Lifecycle: built by the caller (offline API, router), validated once in
``__post_init__`` (``ValueError`` naming the field), then read-only for the
life of the request: the sampler, the scheduler's stop checks and the output
processor all read it, and it crosses process boundaries as plain fields.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from engine.structured_outputs import StructuredOutputsParams


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    n: int = 1
    """Completions per prompt (only 1 is supported)."""
    max_tokens: int = 16
    """Maximum number of new tokens."""
    min_tokens: int = 0
    """EOS and stop token ids are suppressed until this many tokens are generated."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top probability."""
    typical_p: float = 1.0
    """Locally typical sampling mass in (0, 1]."""
    repetition_penalty: float = 1.0
    """transformers' semantics: divide positive / multiply negative logits of seen tokens (prompt and output)."""
    frequency_penalty: float = 0.0
    """OpenAI semantics: subtract penalty * count of each token in the output so far."""
    presence_penalty: float = 0.0
    """OpenAI semantics: subtract penalty once for each token present in the output so far."""
    seed: Optional[int] = None
    """Per-request seed: the same seed gives the same tokens whatever else is batched."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation ends when the text contains one; it is not emitted."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (the token is kept in token_ids)."""
    ignore_eos: bool = False
    """Keep generating past EOS (load tests force output lengths this way)."""
    logprobs: Optional[int] = None
    """None: no logprobs; 0: logprob of the chosen token; n > 0: also the top-n alternatives."""
    prompt_logprobs: Optional[int] = None
    """vLLM's prompt_logprobs: None: none; k >= 0: for each prompt position after the first, the logprob of the
    actual prompt token plus its top-k alternatives, from the model's raw distribution (no penalties, bias or
    constraint). Such a request skips the prefix cache (a cached position has no logits to give)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    logit_bias: Optional[dict[int, float]] = None
    """OpenAI semantics: added to the model's logit of each token id before sampling (in [-100, 100]; -100
    in effect bans a token, +100 forces it); logprobs still describe the model's own distribution."""

    structured_outputs: Optional[StructuredOutputsParams] = None
    """Constrain the output to a JSON Schema, regex, choice list or grammar (``engine.structured_outputs``);
    the mask applies before every other processor, so logprobs describe the constrained distribution."""

    lora_name: Optional[str] = None
    """The LoRA adapter this request runs under (engine/lora.py), by the name the engine serves it as
    (``EngineConfig.lora_modules``); None: the base model. Its K/V is cached apart from other adapters'."""

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 1024
    MAX_N = 16
    """Choices one request may ask for (n): the router's bound and a decode worker's (1 + siblings); the one
    constant both sides read."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._check_int("n", 1, 1)
        self._check_int("max_tokens", 1, None)
        self._check_int("min_tokens", 0, None)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        self._check_float("temperature", 0.0, None)
        self._check_float("top_p", 0.0, 1.0, low_open=True)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables), got {self.top_k!r}")
        self._check_float("min_p", 0.0, 1.0)
        self._check_float("typical_p", 0.0, 1.0, low_open=True)
        self._check_float("repetition_penalty", 0.0, None, low_open=True)
        self._check_float("frequency_penalty", -2.0, 2.0)
        self._check_float("presence_penalty", -2.0, 2.0)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not (0 <= self.seed < 2**63)):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop must contain non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        if self.logprobs is not None:
            self._check_int("logprobs", 0, self.MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self._check_int("prompt_logprobs", 0, self.MAX_LOGPROBS)
        if self.logit_bias is not None:
            self._check_logit_bias()
        if self.lora_name is not None:
            from engine.lora import check_lora_name

            check_lora_name(self.lora_name, "lora_name")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            if isinstance(self.structured_outputs, dict):
                unknown = sorted(set(self.structured_outputs) - {"json", "regex", "choice", "grammar",
                                                                  "json_object"})
                if unknown:
                    raise ValueError(f"structured_outputs.{unknown[0]} is not a known field")
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            else:
                raise ValueError(f"structured_outputs must be StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
        if len(self.logit_bias) > self.MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {self.MAX_LOGIT_BIAS}")
        clean: dict[int, float] = {}
        for t, b in self.logit_bias.items():
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {t!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or not -100 <= b <= 100:
                raise ValueError(f"logit_bias[{t}] must be a number in [-100, 100], got {b!r}")
            clean[t] = float(b)
        self.logit_bias = clean or None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _check_int(self, name: str, lo: Optional[int], hi: Optional[int]) -> None:
        v = getattr(self, name)
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{name} must be an integer, got {v!r}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ValueError(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")

    def _check_float(self, name: str, lo: Optional[float], hi: Optional[float], low_open: bool = False) -> None:
        v = getattr(self, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
        v = float(v)
        setattr(self, name, v)
        if lo is not None and (v < lo or (low_open and v == lo)):
            bound = f"> {lo}" if low_open else f">= {lo}"
            raise ValueError(f"{name} must be {bound}, got {v}")
        if hi is not None and v > hi:
            raise ValueError(f"{name} must be <= {hi}, got {v}")
