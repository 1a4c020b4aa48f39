"""Benchmark arithmetic: per-request latencies and the run's summary, as `vllm bench serve` defines them.

Lifecycle: the client fills one ``RequestRecord`` per request (client-side
clock, seconds after the benchmark started); after the run ``summarize`` turns
the records and the wall duration into the summary dict whose keys users know
from ``vllm bench serve`` (``completed``, ``request_throughput``,
``mean_ttft_ms``, ``p99_itl_ms``, ``request_goodput``...). Pure functions on
plain data: no I/O, no clock, so they are tested against hand-worked numbers.

Definitions (vLLM's ``calculate_metrics``):
- TTFT: send -> first streamed message that carried a token.
- E2EL: send -> last streamed message.
- ITL: the gaps between consecutive token-carrying messages of a request (one
  per message, not per token: a message that carries k tokens is one gap).
- TPOT: (E2EL - TTFT) / (output_tokens - 1), only for requests with > 1 token.
- Goodput: successful requests meeting every given SLO (TTFT, TPOT, E2EL, in
  ms) per second of the run; a one-token request counts TPOT as 0.
- Percentiles: linear interpolation (numpy's default); std is the population
  std; an empty list reads as 0 (as in vLLM).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """Client-side timings of one benchmark request (times: s after the benchmark start)."""

    request_id: str
    prompt_len: int
    """Prompt tokens sent."""
    expected_output_len: int
    """max_tokens asked for (ignore_eos forces it)."""
    scheduled_s: float = 0.0
    """When the arrival process said to send it."""
    start_s: float = 0.0
    """When it was actually sent (later than scheduled_s under a concurrency cap)."""
    chunk_times_s: list[float] = field(default_factory=list)
    """Arrival time of each streamed message that carried at least one token."""
    chunk_tokens: list[int] = field(default_factory=list)
    """Tokens in each of those messages."""
    end_s: float = 0.0
    """Last message (or the error)."""
    output_tokens: int = 0
    """Tokens received (usage.completion_tokens when the server sent it)."""
    success: bool = False
    error: str = ""
    """Status name (gRPC) or HTTP status and details when it failed."""
    finish_reason: str = ""
    generated_text: str = ""
    """The text streamed back (vLLM's ``generated_texts``)."""
    token_ids: list[int] = field(default_factory=list)
    """The token ids streamed back (gRPC backend), in order: what a check against the offline engine compares."""
    ttft_phases_s: dict[str, float] = field(default_factory=dict)
    """Where the server says this request's TTFT went (pdserve's Timings: placement, worker_queue, prefill,
    delivery; the gRPC backend always, the OpenAI one with ``--pdserve-timings``); empty when it did not say."""


TTFT_PHASES = ("placement", "worker_queue", "prefill", "delivery")
"""TTFT's parts as pdserve reports them (``router.events.Timings.phases``): they add up to the server's TTFT."""


def ttft_s(rec: RequestRecord) -> Optional[float]:
    """Time to first token, or None when no token came."""
    return rec.chunk_times_s[0] - rec.start_s if rec.chunk_times_s else None


def e2el_s(rec: RequestRecord) -> float:
    """End-to-end latency."""
    return rec.end_s - rec.start_s


def itls_s(rec: RequestRecord) -> list[float]:
    """Inter-token latencies: gaps between consecutive token-carrying messages."""
    t = rec.chunk_times_s
    return [b - a for a, b in zip(t, t[1:])]


def tpot_s(rec: RequestRecord) -> Optional[float]:
    """Time per output token after the first; None with fewer than 2 tokens."""
    ttft = ttft_s(rec)
    if ttft is None or rec.output_tokens < 2:
        return None
    return (e2el_s(rec) - ttft) / (rec.output_tokens - 1)


def percentile(values: Iterable[float], p: float) -> float:
    """The p-th percentile (0..100), linear interpolation; 0.0 for no values."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {p}")
    vals = list(values)
    return float(np.percentile(vals, p)) if vals else 0.0


def parse_goodput(items: Optional[Iterable[str]]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, ms = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput: expected NAME:MS with NAME in {SLO_METRICS}, got {item!r}")
        try:
            value = float(ms)
        except ValueError:
            raise ValueError(f"goodput: {name} must be a number of milliseconds, got {ms!r}") from None
        if value < 0:
            raise ValueError(f"goodput: {name} must be >= 0 ms, got {value}")
        slos[name] = value
    return slos


def meets_slos(rec: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO (a one-token request's TPOT counts as 0)."""
    if not rec.success:
        return False
    got = {"ttft": ttft_s(rec) or 0.0, "tpot": tpot_s(rec) or 0.0, "e2el": e2el_s(rec)}
    return all(got[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def max_concurrency_seen(records: Iterable[RequestRecord]) -> int:
    """Most requests in flight at once (a request ending exactly when another starts does not overlap)."""
    events = []
    for r in records:
        events.append((r.start_s, 1))
        events.append((r.end_s, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # ends before starts at the same instant
    peak = cur = 0
    for _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return peak


def error_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Failed requests per kind: the error's text before the first ':' (the gRPC status name)."""
    counts: dict[str, int] = {}
    for r in records:
        if not r.success:
            kind = (r.error or "unknown").split(":", 1)[0]
            counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))


def _pword(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def max_output_tokens_per_s(records: Iterable[RequestRecord]) -> float:
    """Most output tokens received in one whole second of the run (vLLM's ``max_output_tokens_per_s``).

    Seconds are counted from the first request's send; each message's tokens
    fall into the second it arrived in (vLLM counts a chunk as one token; a
    message here carries a known number, counted whole).
    """
    ok = [r for r in records if r.success and r.chunk_times_s]
    if not ok:
        return 0.0
    t0 = min(r.start_s for r in ok)
    buckets: dict[int, int] = {}
    for r in ok:
        for t, n in zip(r.chunk_times_s, r.chunk_tokens):
            b = int(t - t0)
            buckets[b] = buckets.get(b, 0) + n
    return float(max(buckets.values()))


def parse_percentile_metrics(text: str) -> list[str]:
    """"ttft,tpot" -> ["ttft", "tpot"]; ValueError naming --percentile-metrics otherwise."""
    names = [x.strip().lower() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in LATENCY_METRICS]
    if not names or bad:
        raise ValueError(f"--percentile-metrics: expected a comma-separated subset of {','.join(LATENCY_METRICS)}, "
                         f"got {text!r}")
    return names


def summarize(records: list[RequestRecord], duration_s: float, percentiles: Iterable[float] = (99,),
              goodput_slos_ms: Optional[dict[str, float]] = None,
              percentile_metrics: Iterable[str] = LATENCY_METRICS) -> dict:
    """The run's summary with `vllm bench serve`'s keys (latencies in ms, throughputs per second).

    ``mean_/median_/std_/pNN_<metric>_ms`` are written for the ``percentile_metrics`` only (vLLM's
    ``--percentile-metrics``), in that order.
    """
    if not duration_s > 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    percentiles = list(percentiles)
    metrics = list(percentile_metrics)
    if any(m not in LATENCY_METRICS for m in metrics):
        raise ValueError(f"percentile_metrics must be within {LATENCY_METRICS}, got {metrics}")
    ok = [r for r in records if r.success]
    per_metric: dict[str, list[float]] = {"ttft": [], "tpot": [], "itl": [], "e2el": []}
    for r in ok:
        ttft = ttft_s(r)
        if ttft is not None:
            per_metric["ttft"].append(ttft)
        tpot = tpot_s(r)
        if tpot is not None:
            per_metric["tpot"].append(tpot)
        per_metric["itl"].extend(itls_s(r))
        per_metric["e2el"].append(e2el_s(r))
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    out: dict = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": max_output_tokens_per_s(records),
        "max_concurrent_requests": max_concurrency_seen(records),
        "error_counts": error_counts(records),
    }
    if goodput_slos_ms:
        good = sum(1 for r in ok if meets_slos(r, goodput_slos_ms))
        out["request_goodput"] = good / duration_s
        out["goodput_slos_ms"] = dict(goodput_slos_ms)
    for name in metrics:
        ms = [v * 1000.0 for v in per_metric[name]]
        out[f"mean_{name}_ms"] = float(np.mean(ms)) if ms else 0.0
        out[f"median_{name}_ms"] = percentile(ms, 50)
        out[f"std_{name}_ms"] = float(np.std(ms)) if ms else 0.0
        for p in percentiles:
            out[f"p{_pword(p)}_{name}_ms"] = percentile(ms, p)
    phased = [r.ttft_phases_s for r in ok if r.ttft_phases_s]
    if phased:  # the server's own breakdown of TTFT (pdserve's extension; not in vLLM's result)
        out["ttft_phases_ms"] = {
            ph: {"mean": float(np.mean([d.get(ph, 0.0) * 1e3 for d in phased])),
                 "median": percentile([d.get(ph, 0.0) * 1e3 for d in phased], 50),
                 **{f"p{_pword(p)}": percentile([d.get(ph, 0.0) * 1e3 for d in phased], p) for p in percentiles}}
            for ph in TTFT_PHASES}
    return out


def per_request_arrays(records: list[RequestRecord]) -> dict:
    """The per-request lists vLLM's result JSON carries (input_lens, output_lens, ttfts, itls, latencies,
    generated_texts, errors; times in s)."""
    return {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "ttfts": [ttft_s(r) or 0.0 for r in records],
        "itls": [itls_s(r) for r in records],
        "latencies": [e2el_s(r) if r.success else 0.0 for r in records],
        "start_times": [r.start_s for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
    }


def slo_attainment(records: list[RequestRecord], slos_ms: dict[str, float]) -> float:
    """Fraction of ALL requests (failed ones count as missing) meeting every SLO; 0.0 for no requests.

    DistServe's "SLO attainment": the denominator is every request sent, so a
    server cannot raise its attainment by rejecting work.
    """
    if not slos_ms:
        raise ValueError("slos_ms: give at least one SLO (ttft/tpot/e2el in ms)")
    if not records:
        return 0.0
    return sum(1 for r in records if meets_slos(r, slos_ms)) / len(records)


def goodput_rate(points: Iterable[tuple[float, float]], goal: float = 0.9,
                 interpolate: bool = False) -> float:
    """DistServe's goodput: the highest request rate whose SLO attainment is at least ``goal``.

    ``points`` are (request_rate, attainment) pairs of one system. Walking the
    rates upwards, the answer is the last rate before the first one that misses
    the goal (a lucky pass above a failure does not count: the system is not
    sustainably serving there); 0.0 when the lowest rate misses. With
    ``interpolate``, the crossing between that last passing rate and the first
    failing one is placed by linear interpolation of attainment (how DistServe
    reads the rate off its attainment-vs-rate curves).
    """
    if not 0.0 < goal <= 1.0:
        raise ValueError(f"goal must be within (0, 1], got {goal}")
    pts = sorted((float(r), float(a)) for r, a in points)
    if not pts:
        raise ValueError("points: need at least one (rate, attainment) pair")
    for r, a in pts:
        if not r > 0:
            raise ValueError(f"points: request rates must be > 0, got {r}")
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"points: attainment must be within [0, 1], got {a}")
    best, prev = 0.0, None
    for r, a in pts:
        if a < goal:
            if interpolate and prev is not None:
                r0, a0 = prev
                return r0 + (r - r0) * (a0 - goal) / (a0 - a)
            return best
        best, prev = r, (r, a)
    return best
