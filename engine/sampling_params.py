"""Per-request sampling parameters (the vLLM shape users know).

Lifecycle: built by the caller (offline API, router), validated once in
``__post_init__`` (``ValueError`` naming the field), then read-only for the
life of the request: the sampler, the scheduler's stop checks and the output
processor all read it, and it crosses process boundaries as plain fields.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

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

    allowed_token_ids: Optional[list[int]] = None
    """vLLM's: only these token ids can be generated (every other logit is -inf before sampling); logprobs still
    describe the model's own distribution. With a ``structured_outputs`` constraint that allows none of them at
    some step, the constraint wins there."""
    bad_words: list[str] = field(default_factory=list)
    """vLLM's: words never generated. Each is tokenized as at the start of a text and after a space
    (``bad_words_token_ids``); a word's last token is banned wherever the output so far ends with the tokens
    before it. Where that would leave a row nothing to pick (with ``allowed_token_ids`` or a constraint), the ban
    gives way."""
    bad_words_token_ids: Optional[list[list[int]]] = None
    """``bad_words`` as token sequences: filled by the engine from its tokenizer when the request is added
    (``bad_words_token_ids()``), or given directly (the router tokenizes once and ships these)."""
    truncate_prompt_tokens: Optional[int] = None
    """vLLM's: keep only the last k prompt tokens (left truncation; k >= 1); -1: the most that leaves room for
    ``max_tokens`` in the context. Applied where the prompt is tokenized (the engine's add_request, the router's
    validation), so the prompt a response reports is the kept one."""

    cache_salt: Optional[str] = None
    """vLLM's: the request's prompt blocks are cached under this salt (``engine.block_manager.salted_root``), so only
    requests with the same salt (a tenant's) share prefix-cache hits. None: the shared cache."""
    priority: int = 0
    """vLLM's request priority (its ``add_request(priority=)``; here it rides the params, so it crosses every process
    boundary with the request): lower values are scheduled first, and when KV blocks run out the worst priority is
    preempted first; equal priorities are first-come-first-served. A cluster accepts non-zero values only when
    started with ``--scheduling-policy priority``."""

    structured_outputs: Optional[StructuredOutputsParams] = None
    """Constrain the output to a JSON Schema, regex, choice list or grammar (``engine.structured_outputs``);
    the mask applies before every other processor, so logprobs describe the constrained distribution."""

    reasoning_end_token_ids: Optional[list[int]] = None
    """The answer opens inside a reasoning block that this token sequence closes (a thinking model's ``</think>``
    as the router's reasoning parser tokenizes it; ``engine.reasoning``): ``structured_outputs`` then constrains
    only what follows it, and ``thinking_token_budget`` counts the tokens before it. None: no reasoning block."""
    reasoning_start_token_ids: Optional[list[int]] = None
    """The block's opening sequence (``<think>``): where the answer begins with it (the model writing its own),
    those tokens are not counted against ``thinking_token_budget``."""
    thinking_token_budget: Optional[int] = None
    """vLLM's: at most this many tokens of reasoning; then the end sequence is forced (over every other
    restriction), one token a step. Needs ``reasoning_end_token_ids``."""

    lora_name: Optional[str] = None
    """The LoRA adapter this request runs under (engine/lora.py), by the name the engine serves it as
    (``EngineConfig.lora_modules``); None: the base model. Its K/V is cached apart from other adapters'."""

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 1024
    MAX_ALLOWED_TOKEN_IDS = 131072
    MAX_BAD_WORDS = 128
    MAX_BAD_WORD_CHARS = 512
    MAX_CACHE_SALT_CHARS = 1024
    MAX_REASONING_MARKER_TOKENS = 64
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
        self._check_token_lists()
        self._check_reasoning()
        self._check_int("priority", -(2**31), 2**31 - 1)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > self.MAX_CACHE_SALT_CHARS):
            raise ValueError(f"cache_salt must be a non-empty string of at most {self.MAX_CACHE_SALT_CHARS} "
                             f"characters, got {self.cache_salt!r:.80}")
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

    def _check_token_lists(self) -> None:
        """allowed_token_ids, bad_words, bad_words_token_ids and truncate_prompt_tokens (ranges against the
        vocabulary are the engine's and the router's checks)."""
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                raise ValueError(f"allowed_token_ids must be a list of token ids, got {type(ids).__name__}")
            ids = list(ids)
            if not ids:
                raise ValueError("allowed_token_ids is empty: no token could be generated")
            if len(ids) > self.MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids has {len(ids)} ids; at most {self.MAX_ALLOWED_TOKEN_IDS}")
            if not (all(type(t) is int for t in ids) and min(ids) >= 0):  # (the common case at C speed)
                for i, t in enumerate(ids):
                    if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                        raise ValueError(f"allowed_token_ids[{i}] must be a non-negative token id, got {t!r}")
            self.allowed_token_ids = ids
        if self.bad_words is None:
            self.bad_words = []
        if isinstance(self.bad_words, str):
            raise ValueError("bad_words must be a list of strings, not one string")
        self.bad_words = list(self.bad_words)
        if len(self.bad_words) > self.MAX_BAD_WORDS:
            raise ValueError(f"bad_words has {len(self.bad_words)} words; at most {self.MAX_BAD_WORDS}")
        for i, w in enumerate(self.bad_words):
            if not isinstance(w, str) or not w.strip():
                raise ValueError(f"bad_words[{i}] must be a string with a non-space character, got {w!r}")
            if len(w) > self.MAX_BAD_WORD_CHARS:
                raise ValueError(f"bad_words[{i}] is {len(w)} characters; at most {self.MAX_BAD_WORD_CHARS}")
        if self.bad_words_token_ids is not None:
            seqs = [list(s) for s in self.bad_words_token_ids]
            if len(seqs) > 2 * self.MAX_BAD_WORDS:
                raise ValueError(f"bad_words_token_ids has {len(seqs)} sequences; at most {2 * self.MAX_BAD_WORDS}")
            for i, seq in enumerate(seqs):
                if not seq or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in seq):
                    raise ValueError(f"bad_words_token_ids[{i}] must be a non-empty list of token ids, got {seq!r}")
            self.bad_words_token_ids = seqs or None
        if self.truncate_prompt_tokens is not None:
            k = self.truncate_prompt_tokens
            if not isinstance(k, int) or isinstance(k, bool) or (k < 1 and k != -1):
                raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, or -1 (as much as fits), "
                                 f"got {k!r}")

    def _check_reasoning(self) -> None:
        for name in ("reasoning_end_token_ids", "reasoning_start_token_ids"):
            ids = getattr(self, name)
            if ids is None:
                continue
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                raise ValueError(f"{name} must be a list of token ids, got {type(ids).__name__}")
            ids = list(ids)
            if not ids or len(ids) > self.MAX_REASONING_MARKER_TOKENS:
                raise ValueError(f"{name} must hold 1 to {self.MAX_REASONING_MARKER_TOKENS} token ids, got {len(ids)}")
            for i, t in enumerate(ids):
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise ValueError(f"{name}[{i}] must be a non-negative token id, got {t!r}")
            setattr(self, name, ids)
        if self.thinking_token_budget is not None:
            self._check_int("thinking_token_budget", 0, None)
            if self.reasoning_end_token_ids is None:
                raise ValueError("thinking_token_budget needs reasoning_end_token_ids (the sequence that ends the "
                                 "reasoning block; a cluster takes it from its --reasoning-parser)")
        if self.reasoning_start_token_ids is not None and self.reasoning_end_token_ids is None:
            raise ValueError("reasoning_start_token_ids needs reasoning_end_token_ids")

    @property
    def needs_history(self) -> bool:
        """Whether a draw depends on the tokens generated so far (penalties, multi-token bad words, a thinking
        budget, a grammar waiting for the reasoning block to close): an async engine waits for the step before's
        tokens to draw such a row."""
        # (read for every running sequence each step of an async engine: no generator unless there are bad words)
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or (self.reasoning_end_token_ids is not None
                    and (self.thinking_token_budget is not None or self.structured_outputs is not None))
                or (self.bad_words_token_ids is not None and any(len(s) > 1 for s in self.bad_words_token_ids)))

    def truncate_prompt(self, prompt_token_ids: list[int], context_length: int) -> list[int]:
        """The prompt as ``truncate_prompt_tokens`` keeps it: its last k tokens (-1: the last
        ``context_length - max_tokens``); ValueError when -1 leaves no room for any prompt token."""
        return truncated_prompt(prompt_token_ids, self.truncate_prompt_tokens, self.max_tokens, context_length)

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


def bad_words_token_ids(words: list[str], tokenizer: Any, vocab_size: int) -> Optional[list[list[int]]]:
    """``SamplingParams.bad_words`` as the token sequences the sampler bans (vLLM's rule, so a word list means
    the same on both): each word (leading spaces stripped) as tokenized alone, and after a space where that is
    another tokenization of the same length (a tokenizer whose words carry their leading space has two
    spellings of every word). None for no words; ValueError naming ``bad_words[i]`` for a word that tokenizes
    to nothing or past ``vocab_size``."""
    out: list[list[int]] = []
    for i, word in enumerate(words):
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not alone:
            raise ValueError(f"bad_words[{i}] tokenizes to no tokens")
        spellings = [list(alone)]
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            spellings.append(list(spaced))
        for t in (t for seq in spellings for t in seq):
            if not 0 <= t < vocab_size:
                raise ValueError(f"bad_words[{i}] tokenizes to id {t}, outside the vocabulary [0, {vocab_size})")
        out += spellings
    return out or None


def truncated_prompt(prompt_token_ids: list[int], keep: Optional[int], max_tokens: int,
                     context_length: int) -> list[int]:
    """``truncate_prompt_tokens`` (``keep``) applied: the prompt's last ``keep`` tokens (None: all; -1: the last
    ``context_length - max_tokens``); ValueError when -1 leaves no room for any prompt token."""
    if keep is None:
        return prompt_token_ids
    if keep == -1:
        keep = context_length - max_tokens
        if keep < 1:
            raise ValueError(f"truncate_prompt_tokens: -1 keeps what fits beside max_tokens ({max_tokens}), and "
                             f"the context ({context_length} tokens) leaves no room")
    return prompt_token_ids[-keep:] if len(prompt_token_ids) > keep else prompt_token_ids
