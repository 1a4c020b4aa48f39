"""Plain data objects that cross the engine's layer boundaries.

Lifecycle: the sampler makes ``TokenLogprob``s, the engine core's ``step()``
returns ``CoreOutput``s (token ids only, one per request that made progress),
the output processor turns those into text deltas, and the offline API
collects ``RequestOutput``s. Workers forward ``CoreOutput`` fields over gRPC.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass
class TokenLogprob:
    """Log-probability of one chosen token and, optionally, its top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    """(token_id, logprob) of the top-n tokens, most likely first."""
    rank: Optional[int] = None
    """Prompt logprobs only: token_id's 1-based rank in the vocabulary (vLLM's: tokens at least as likely)."""


@dataclass
class CoreOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    logprobs: Optional[list[TokenLogprob]] = None
    finish_reason: Optional[str] = None
    """None while running; "stop" (EOS or stop token), "length", "abort",
    or "prefill_done" for a prefill-only request whose KV is held for hand-off."""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    """With ``SamplingParams.prompt_logprobs``, on the request's first output only: one per prompt token, None
    for the first (nothing predicts it), then the actual token's logprob and its top-k alternatives."""
    embedding: Optional[Any] = None
    """An embedding request's (``add_request(pooling=True)``) only output: its pooled hidden state, float32
    [hidden] on the host, not normalised (engine/pooling.py); finish_reason "stop", no tokens."""


@dataclass
class EmbeddingOutput:
    """vLLM's ``EmbeddingOutput``: one prompt's vector."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """The offline API's embedding of one prompt (vLLM's shape: ``.outputs.embedding``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    prompt: Optional[str] = None
    finished: bool = True


@dataclass
class ScoringOutput:
    """vLLM's ``ScoringOutput``: one pair's score."""

    score: float


@dataclass
class ScoringRequestOutput:
    """The offline API's score of one text pair (vLLM's shape: ``.outputs.score``)."""

    request_id: str
    prompt_token_ids: list[int]
    """The pair as the model read it (a cross-encoder's), or the second text's ids (an embedding model's)."""
    outputs: ScoringOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    """vLLM's ``ClassificationOutput``: one input's probabilities, by label."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """The offline API's classification of one prompt (vLLM's shape: ``.outputs.probs``), with its best label's
    name (config.json ``id2label``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    label: str
    prompt: Optional[str] = None
    finished: bool = True


@dataclass
class RequestOutput:
    """The offline API's result for one prompt (vLLM shape, flattened to n=1)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: Optional[str]
    logprobs: Optional[list[TokenLogprob]] = None
    finished: bool = True
    stop_reason: Optional[Union[str, int]] = None
    """vLLM's: the stop string or ``stop_token_ids`` id that ended it (None: EOS or the length limit)."""
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    """vLLM's ``RequestOutput.prompt_logprobs`` when asked for: None first, then per prompt position a
    ``TokenLogprob`` whose ``token_id``/``logprob`` are the actual prompt token's and ``top`` its top-k (vLLM
    gives a {token_id: Logprob} dict per position; ``top`` plus the actual token is the same information)."""
