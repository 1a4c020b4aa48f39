"""FetchCost: whether a prefill worker should receive a prompt prefix from its decode worker or compute it.

Lifecycle: one per ``PrefillRequests`` (loop thread only). The worker feeds it what it measures anyway: each
prefill's computed tokens and seconds (scheduled -> first token; from ``MIN_OBSERVED_TOKENS`` on) and each prefix fetch's tokens, time on the wire and
total seconds; ``decide(n)`` then says whether to receive ``n`` tokens: yes while receiving is estimated to take less
time than computing them, or while nothing was measured yet (the fetch is then measured), and once in
``PROBE_EVERY`` refusals (a probe keeps the estimate current as load changes). A prefill worker's own KV sends do
not feed the wire estimate: they go out layer by layer as the prefill computes them, so their time on the wire is
the prefill's, while a fetch is sent whole.

Why a cost and not a fixed threshold: on a CPU engine computing a token costs far more than moving its KV over
loopback gloo, so fetching a conversation's history halves its TTFT (docs/capacity.md); on a GPU engine with the
KV over gloo the H200 computes an 8B prompt's tokens faster than gloo moves their KV, and a fetch makes TTFT worse
while sparing prefill compute. The estimate: receive(n) = overhead + n x wire seconds per token (sends and fetches
move the same rows over the same kind of link), compute(n) = n x prefill seconds per computed token; both as
exponentially weighted means, so they follow load. ``overhead`` (the PrefixFetch/SendPrefix round trip, the pair's
first build) is learnt from fetches made, starting at ``DEFAULT_OVERHEAD_S``.
"""
from __future__ import annotations

from typing import Optional

DEFAULT_OVERHEAD_S = 0.002
"""A fetch's fixed cost before any was measured: two loopback RPCs and the decode worker's beside-the-step wait."""
PROBE_EVERY = 32
"""After this many refusals in a row, fetch once anyway to measure again."""
MIN_OBSERVED_TOKENS = 64
"""Prefills that computed fewer tokens are not measured: their time is mostly the step's fixed cost, not the cost of
a token a fetch would spare (which adds to a prefill that runs anyway)."""


class FetchCost:
    """Running estimates of receiving against computing prompt tokens (see module docstring)."""

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.compute_s_per_token: Optional[float] = None
        """Prefill seconds per computed prompt token (scheduled -> first token, over the tokens not cached)."""
        self.wire_s_per_token: Optional[float] = None
        """Seconds on the wire per token of KV sent or received."""
        self.overhead_s = DEFAULT_OVERHEAD_S
        """A fetch's time beyond its wire time."""
        self._refused = 0

    def _mean(self, old: Optional[float], new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prompt's prefill computed ``tokens`` tokens in ``seconds`` (ignored below ``MIN_OBSERVED_TOKENS``)."""
        if tokens >= MIN_OBSERVED_TOKENS and seconds > 0:
            self.compute_s_per_token = self._mean(self.compute_s_per_token, seconds / tokens)

    def observe_fetch(self, tokens: int, seconds: float, wire_seconds: float) -> None:
        """A prefix fetch of ``tokens`` tokens took ``seconds`` from its receive posted to done, ``wire_seconds`` of
        them on the wire."""
        if tokens <= 0 or seconds <= 0:
            return
        if wire_seconds > 0:
            self.wire_s_per_token = self._mean(self.wire_s_per_token, wire_seconds / tokens)
        self.overhead_s = self._mean(self.overhead_s, max(0.0, seconds - wire_seconds))

    def receive_s(self, tokens: int) -> Optional[float]:
        """Estimated seconds to receive ``tokens`` tokens (None before any transfer was measured)."""
        if self.wire_s_per_token is None:
            return None
        return self.overhead_s + tokens * self.wire_s_per_token

    def compute_s(self, tokens: int) -> Optional[float]:
        """Estimated seconds to compute ``tokens`` prompt tokens (None before any prefill was measured)."""
        return None if self.compute_s_per_token is None else tokens * self.compute_s_per_token

    def worth(self, tokens: int) -> bool:
        """Whether receiving ``tokens`` tokens is estimated faster than computing them (yes while unmeasured)."""
        recv, comp = self.receive_s(tokens), self.compute_s(tokens)
        return recv is None or comp is None or recv < comp

    def decide(self, tokens: int) -> bool:
        """``worth(tokens)``, but yes once in ``PROBE_EVERY`` refusals in a row (a probe)."""
        if self.worth(tokens):
            self._refused = 0
            return True
        self._refused += 1
        if self._refused >= PROBE_EVERY:
            self._refused = 0
            return True
        return False
