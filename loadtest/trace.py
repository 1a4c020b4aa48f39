"""Request traces: loading a slice of a CSV trace and scaling it to fit a machine.

Lifecycle: ``load_trace(path, start, limit)`` reads rows ``start .. start+limit``
of a trace with columns ``TIMESTAMP, ContextTokens, GeneratedTokens`` (the Azure
LLM inference trace format) into ``TraceRow``s whose arrival times are seconds
after the slice's first row; ``scale_trace(rows, length_scale, time_scale)``
then multiplies lengths and inter-arrival gaps by stated factors, which the
report repeats so a scaled replay is never mistaken for the original. The
workload builder turns the rows into requests; nothing here talks to a server.

Traces live in ``../shared/traces`` beside the repository and are read from
there, never copied in.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace."""

    arrival_s: float
    """Seconds after the first request of the loaded slice."""
    prompt_len: int
    """Prompt tokens (ContextTokens)."""
    output_len: int
    """Tokens to generate (GeneratedTokens)."""


def parse_timestamp(text: str) -> float:
    """Seconds since the epoch (naive, so only differences matter) of "YYYY-MM-DD HH:MM:SS[.fffffff]".

    The Azure traces carry 7 fractional digits, more than ``datetime`` parses
    before Python 3.11, so the fraction is read separately.
    """
    text = text.strip()
    base, _, frac = text.partition(".")
    try:
        whole = datetime.strptime(base, "%Y-%m-%d %H:%M:%S")
        fraction = float("0." + frac) if frac else 0.0
    except ValueError as e:
        raise ValueError(f"TIMESTAMP: cannot parse {text!r}: {e}") from None
    return (whole - datetime(1970, 1, 1)).total_seconds() + fraction


def load_trace(path: str | Path, start: int = 0, limit: int | None = None) -> list[TraceRow]:
    """Rows ``start`` .. ``start + limit`` (0-based, header excluded), arrivals relative to the first of them."""
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be > 0, got {limit}")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace: no such file {str(path)!r}")
    rows: list[TraceRow] = []
    t0: float | None = None
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"trace {path.name}: missing column(s) {missing}; expected {list(COLUMNS)}")
        for i, rec in enumerate(reader):
            if i < start:
                continue
            if limit is not None and len(rows) >= limit:
                break
            ts = parse_timestamp(rec["TIMESTAMP"])
            try:
                prompt_len, output_len = int(rec["ContextTokens"]), int(rec["GeneratedTokens"])
            except ValueError:
                raise ValueError(f"trace {path.name} row {i}: ContextTokens/GeneratedTokens must be ints, "
                                 f"got {rec['ContextTokens']!r}, {rec['GeneratedTokens']!r}") from None
            if prompt_len < 0 or output_len < 0:
                raise ValueError(f"trace {path.name} row {i}: negative ContextTokens/GeneratedTokens")
            if t0 is None:
                t0 = ts
            rows.append(TraceRow(arrival_s=ts - t0, prompt_len=prompt_len, output_len=output_len))
    if not rows:
        raise ValueError(f"trace {path.name}: no rows from start={start}")
    # Arrivals must not go backwards; the Azure traces are sorted, but a merged trace might not be.
    rows.sort(key=lambda r: r.arrival_s)
    base = rows[0].arrival_s
    return [TraceRow(r.arrival_s - base, r.prompt_len, r.output_len) for r in rows]


def _scale_len(n: int, factor: float) -> int:
    # Round to nearest, but a request keeps at least one token: a zero-length
    # prompt is invalid and a zero-length output measures nothing.
    return max(1, int(math.floor(n * factor + 0.5)))


def scale_trace(rows: list[TraceRow], length_scale: float = 1.0, time_scale: float = 1.0) -> list[TraceRow]:
    """Multiply prompt/output lengths by ``length_scale`` (rounded, at least 1) and arrival times by ``time_scale``.

    ``time_scale`` < 1 compresses the trace (0.5 replays an hour in half an
    hour: twice the request rate); > 1 stretches it.
    """
    if not (length_scale > 0 and math.isfinite(length_scale)):
        raise ValueError(f"length_scale must be a positive finite number, got {length_scale}")
    if not (time_scale >= 0 and math.isfinite(time_scale)):
        raise ValueError(f"time_scale must be a non-negative finite number, got {time_scale}")
    return [TraceRow(arrival_s=r.arrival_s * time_scale,
                     prompt_len=_scale_len(r.prompt_len, length_scale),
                     output_len=_scale_len(r.output_len, length_scale)) for r in rows]
