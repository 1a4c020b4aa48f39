"""Trace rows to requests, and replaying them through ``loadtest``'s client (greedy, ``ignore_eos``).

Lifecycle: pure helpers; ``replay`` and ``server_limits`` each run one ``asyncio`` loop for their call.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
CONVERSATION_TRACE = REPO.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
"""The full Azure LLM 2023 conversation trace (``../shared/traces``; read in place, never copied)."""
SAMPLE_TRACE = REPO / "tests" / "data" / "azure_llm_2023_conv_first400.csv"
"""Its first 400 rows, carried by the tests: the fallback where ``../shared`` is absent."""


def client_config(target: str, timeout_s: float, max_concurrency: Optional[int] = None) -> Any:
    """``loadtest``'s client settings the benchmarks send with: greedy, one deadline per request."""
    from loadtest.client import ClientConfig

    return ClientConfig(target=target, temperature=0.0, max_concurrency=max_concurrency, request_timeout_s=timeout_s)


def replay(target: str, requests: list, timeout_s: float, max_concurrency: Optional[int] = None) -> tuple[list, float]:
    """Send ``requests`` on their schedule over one channel (greedy); (records in request order, wall seconds)."""
    from loadtest.client import run_benchmark

    return asyncio.run(run_benchmark(client_config(target, timeout_s, max_concurrency), requests))


def server_limits(target: str, timeout_s: float = 60.0) -> Any:
    """The served model's limits (``GetModelInfo``), for clipping a workload's lengths."""
    from loadtest.client import fetch_model_info, limits_from_info

    return limits_from_info(asyncio.run(fetch_model_info(target, timeout_s)))


def workload_requests(lengths: Sequence, arrivals: Sequence, limits: Any, seed: int, prefix: str) -> list:
    """``loadtest`` requests for (prompt, output) ``lengths`` at ``arrivals``; one seed gives the same prompt ids."""
    from loadtest.workload import build_workload

    return build_workload(list(lengths), list(arrivals), limits, seed=seed, id_prefix=prefix).requests


def trace_requests(rows: list, limits: Any, seed: int, prefix: str, arrivals: Sequence) -> tuple[list, int]:
    """Requests for trace ``rows`` at ``arrivals``, and how many were clipped to the limits."""
    from loadtest.workload import build_workload, trace_lengths

    wl = build_workload(trace_lengths(rows), list(arrivals), limits, seed=seed, id_prefix=prefix)
    return wl.requests, wl.num_clipped


def load_rows(trace: Path, start: int, length_scale: float, n: int) -> list:
    """``n`` trace rows from row ``start``, lengths scaled, wrapping around the file (arrivals kept increasing)."""
    from loadtest.trace import load_trace, scale_trace

    rows = scale_trace(load_trace(trace, start, None), length_scale, 1.0)
    if not rows:
        raise SystemExit(f"--trace: no rows from {start}")
    span = rows[-1].arrival_s + (rows[-1].arrival_s / max(1, len(rows) - 1))
    return [type(r)(r.arrival_s + (i // len(rows)) * span, r.prompt_len, r.output_len)
            for i, r in ((i, rows[i % len(rows)]) for i in range(n))]


def warm_up(target: str, lengths: Sequence, limits: Any, seed: int, timeout_s: float, label: str = "") -> None:
    """Four requests at once, then two alone: every worker compiles its paths before the clock counts."""
    recs, _ = replay(target, workload_requests(lengths[:4], [0.0] * 4, limits, seed + 1, "warm"), timeout_s)
    recs += replay(target, workload_requests(lengths[:2], [0.0, 0.0], limits, seed + 2, "warm2"), timeout_s, 1)[0]
    if not all(r.success for r in recs):
        raise RuntimeError(f"{label}: warm-up failed: {[r.error for r in recs if not r.success]}")
