"""Arrival processes: when each benchmark request is sent.

Lifecycle: the CLI asks for a schedule once, before the run: a list of send
offsets (seconds after the benchmark starts, non-decreasing), one per request.
``gamma_arrivals`` draws them from a seeded RNG; a trace replay takes them from
the trace instead (``loadtest.trace``). The client then sleeps until each
offset; a ``--max-concurrency`` cap is applied there, on top of the schedule.

The process is vLLM's (``vllm bench serve``): inter-arrival gaps are
Gamma(shape=burstiness, scale=1/(rate*burstiness)), so the mean rate is always
``request_rate``; burstiness 1 is a Poisson process, < 1 is burstier, > 1 more
uniform. An infinite rate sends everything at once.
"""
from __future__ import annotations

import math

import numpy as np


def gamma_arrivals(num_requests: int, request_rate: float, burstiness: float = 1.0,
                   seed: int = 0) -> list[float]:
    """Send offsets (s) of ``num_requests`` requests at mean ``request_rate`` req/s."""
    if num_requests < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_requests}")
    if not request_rate > 0:  # also rejects NaN
        raise ValueError(f"request_rate must be > 0 (inf = all at once), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=theta, size=num_requests)
    # The first request goes at t=0 (as in vLLM, the first gap is spent after it).
    offsets = np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if num_requests else np.array([])
    return [float(x) for x in offsets]


def trace_arrivals(arrival_s: list[float]) -> list[float]:
    """Offsets from a trace's (already scaled) arrival times, shifted so the first is 0."""
    if not arrival_s:
        return []
    base = min(arrival_s)
    out = [float(a - base) for a in arrival_s]
    if any(b < a for a, b in zip(out, out[1:])):
        raise ValueError("trace arrivals must be non-decreasing")
    return out
