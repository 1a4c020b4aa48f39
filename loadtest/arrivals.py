"""Arrival processes: when each benchmark request is sent.

Lifecycle: the CLI asks for a schedule once, before the run: a list of send
offsets (seconds after the benchmark starts, non-decreasing), one per request.
``gamma_arrivals`` draws them from a seeded RNG; a trace replay takes them from
the trace instead (``loadtest.trace``). The client then sleeps until each
offset; a ``--max-concurrency`` cap is applied there, on top of the schedule.

The process is vLLM's (``vllm bench serve``): inter-arrival gaps are
Gamma(shape=burstiness, scale=1/(rate*burstiness)), so the mean rate is always
``request_rate``; burstiness 1 is a Poisson process, < 1 is burstier, > 1 more
uniform. An infinite rate sends everything at once. ``ramp_up_arrivals`` is
vLLM's ``--ramp-up-strategy``: the rate of request i moves from a start rate to
an end rate over the run (linearly or geometrically), each gap drawn at the
rate of the request it follows.
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


RAMP_UP_STRATEGIES = ("linear", "exponential")


def ramp_up_rate(strategy: str, start_rps: float, end_rps: float, index: int, total: int) -> float:
    """The rate (req/s) request ``index`` of ``total`` is sent at (vLLM's ``_get_current_request_rate``)."""
    progress = index / max(total - 1, 1)
    if strategy == "linear":
        return start_rps + (end_rps - start_rps) * progress
    if strategy == "exponential":
        return start_rps * (end_rps / start_rps) ** progress
    raise ValueError(f"--ramp-up-strategy must be one of {RAMP_UP_STRATEGIES}, got {strategy!r}")


def check_ramp_up(strategy: str, start_rps: float | None, end_rps: float | None) -> None:
    """ValueError naming the flag when a ramp-up is not well defined (vLLM's checks)."""
    if strategy not in RAMP_UP_STRATEGIES:
        raise ValueError(f"--ramp-up-strategy must be one of {RAMP_UP_STRATEGIES}, got {strategy!r}")
    if start_rps is None or end_rps is None:
        raise ValueError("--ramp-up-strategy needs both --ramp-up-start-rps and --ramp-up-end-rps")
    for flag, v in (("--ramp-up-start-rps", start_rps), ("--ramp-up-end-rps", end_rps)):
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"{flag} must be a finite number >= 0, got {v}")
    if start_rps > end_rps:
        raise ValueError(f"--ramp-up-start-rps ({start_rps}) must be <= --ramp-up-end-rps ({end_rps})")
    if end_rps == 0:
        raise ValueError("--ramp-up-end-rps must be > 0")
    if strategy == "exponential" and start_rps == 0:
        raise ValueError("--ramp-up-start-rps must be > 0 with --ramp-up-strategy exponential")


def ramp_up_arrivals(num_requests: int, strategy: str, start_rps: float, end_rps: float,
                     burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets (s) under a ramp-up: the gap after request i is Gamma(B, 1/(rate_i*B)) at its rate.

    A request whose rate is 0 (a linear ramp's first) waits as if sent at the next request's rate,
    so no gap is infinite.
    """
    check_ramp_up(strategy, start_rps, end_rps)
    if num_requests < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_requests}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness}")
    rng = np.random.default_rng(seed)
    offsets, t = [], 0.0
    for i in range(num_requests):
        offsets.append(t)
        rate = ramp_up_rate(strategy, start_rps, end_rps, i, num_requests)
        if rate <= 0:
            rate = ramp_up_rate(strategy, start_rps, end_rps, i + 1, num_requests)
        t += float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))
    return offsets


def trace_arrivals(arrival_s: list[float]) -> list[float]:
    """Offsets from a trace's (already scaled) arrival times, shifted so the first is 0."""
    if not arrival_s:
        return []
    base = min(arrival_s)
    out = [float(a - base) for a in arrival_s]
    if any(b < a for a, b in zip(out, out[1:])):
        raise ValueError("trace arrivals must be non-decreasing")
    return out
