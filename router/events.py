"""What a request flow hands its front end: plain events, and one error type with a status.

Lifecycle: a ``RequestFlow`` yields ``FlowEvent``s while a request runs (token ids, the
text they complete, logprobs, and with n > 1 the choice ``index``); each choice's last event
carries its ``finish_reason``, and the request's very last one also ``usage`` and ``timings``. A failure ends the iteration with ``FlowError``, whose ``code`` is the
status the front end answers with (gRPC uses it as is; the HTTP front end maps it to an
HTTP status). Nothing here knows gRPC messages or JSON: each front end renders these.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import grpc

from engine import TokenLogprob
from router.worker_source import Pool


@dataclass
class Usage:
    """Token counts of a finished request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens whose KV came from a prefix cache."""


@dataclass
class Timings:
    """Where a request's time went, in seconds (0 when a phase did not happen)."""

    queue_s: float = 0.0
    """Arrival -> its prefill started (router queue, worker queue)."""
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    """Prefill worker's first token -> the decode worker acknowledged the KV (0 when no KV moved or unknown)."""
    decode_s: float = 0.0
    """First token -> last token."""
    ttft_s: float = 0.0
    total_s: float = 0.0
    placement_s: float = 0.0
    """Arrival -> the call that prefills it: the router's queue, choosing workers, the decode Reserve."""
    worker_queue_s: float = 0.0
    """That call -> its prompt scheduled on the worker."""

    @property
    def delivery_s(self) -> float:
        """The rest of TTFT: the first token's way from the worker to the router's client stream."""
        return max(0.0, self.ttft_s - self.placement_s - self.worker_queue_s - self.prefill_s)

    def phases(self) -> dict[str, float]:
        """TTFT's parts (``pdserve:ttft_phase_seconds``'s phases), seconds; they add up to ``ttft_s``."""
        return {"placement": self.placement_s, "worker_queue": self.worker_queue_s, "prefill": self.prefill_s,
                "delivery": self.delivery_s}


@dataclass
class FlowEvent:
    """A piece of a request's output. The last one of a stream has ``finish_reason`` set."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    """Text these tokens complete (stop strings already cut)."""
    logprobs: Optional[list[TokenLogprob]] = None
    """One per token id, when the request asked for logprobs."""
    finish_reason: Optional[str] = None
    """"stop", "length" or "abort" on the last event of a choice."""
    usage: Optional[Usage] = None
    """On the last event of the request (all choices finished): completion tokens of every choice."""
    timings: Optional[Timings] = None
    index: int = 0
    """n > 1: the choice these tokens belong to; beam search: the sequence's rank (0 = best)."""
    score: Optional[float] = None
    """Beam search: the sequence's length-penalised score (what it is ranked by)."""
    cum_logprob: Optional[float] = None
    """Beam search: the sum of its generated tokens' log-probabilities."""
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    """With ``prompt_logprobs`` asked, on choice 0's first event: one per prompt token, None for the first."""
    stop_reason: Optional[Union[str, int]] = None
    """On a choice's last event when ``finish_reason`` is "stop": the stop string or ``stop_token_ids`` id that
    ended it (None: EOS); vLLM's ``stop_reason``."""


class FlowError(Exception):
    """The request ends with status ``code`` and ``message`` (which names the request, never an address)."""

    def __init__(self, code: grpc.StatusCode, message: str, worker_id: str = "", final: bool = False,
                 empty_pool: Optional[Pool] = None, fallback_reason: str = "") -> None:
        super().__init__(message)
        self.fallback_reason = fallback_reason
        """With ``empty_pool``: the ``degraded_requests_total`` reason when a fallback route serves the request
        ("" = ``no_<pool>``)."""
        self.code = code
        self.message = message
        self.empty_pool = empty_pool
        """Set when this pool had no live worker: a fallback route may serve the request, or the pool come back."""
        self.worker_id = worker_id
        """The worker whose call failed ("" when none did): a retry avoids it."""
        self.final = final
        """No other worker would do better (queue timeout, a prompt no decode worker can ever hold)."""
