"""Request traces: loading a slice of a CSV trace and scaling it to fit a machine.

Lifecycle: ``load_trace(path, start, limit)`` reads rows ``start .. start+limit``
of a trace with columns ``TIMESTAMP, ContextTokens, GeneratedTokens`` (the Azure
LLM inference trace format; or JSON lines in Mooncake's format, whose ``hash_ids`` name
shared prefix blocks) into ``TraceRow``s whose arrival times are seconds
after the slice's first row; ``scale_trace(rows, length_scale, time_scale)``
then multiplies lengths and inter-arrival gaps by stated factors, which the
report repeats so a scaled replay is never mistaken for the original. The
workload builder turns the rows into requests; nothing here talks to a server.

A trace is a file path, or the name of a sample packaged with pdserve
(``SAMPLE_TRACES``: ``sample:conversation``, ``sample:code``, 1,000 rows each of the
Azure LLM inference trace 2023, CC-BY 4.0; loadtest/traces/README.md says where the
whole traces are), which ``resolve_trace`` turns into its path, so a fresh clone or a
plain install can replay one.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
SAMPLE_TRACES = {"sample:conversation": "azure_llm_2023_conv_sample.csv",
                 "sample:code": "azure_llm_2023_code_sample.csv"}
"""Names of the traces packaged under loadtest/traces/ -> their files."""


def resolve_trace(trace: str | Path) -> Path:
    """The file a ``--trace`` value names: a packaged sample's path for ``sample:...``, else the path itself.
    ValueError listing the samples for an unknown ``sample:`` name."""
    name = str(trace)
    if name.startswith("sample:"):
        if name not in SAMPLE_TRACES:
            raise ValueError(f"trace {name!r} is not a packaged sample (have {', '.join(SAMPLE_TRACES)})")
        return Path(__file__).resolve().parent / "traces" / SAMPLE_TRACES[name]
    return Path(trace)


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace."""

    arrival_s: float
    """Seconds after the first request of the loaded slice."""
    prompt_len: int
    """Prompt tokens (ContextTokens)."""
    output_len: int
    """Tokens to generate (GeneratedTokens)."""
    hash_ids: tuple[int, ...] = ()
    """Prefix-block ids (Mooncake's ``hash_ids``): two prompts share their first k blocks of
    ``HASH_BLOCK_TOKENS`` tokens exactly when their first k ids agree. Empty: no shared prefixes."""


HASH_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in the Mooncake traces."""

_JSONL_KEYS = {"arrival": ("timestamp", "arrival_time", "arrival_s"),
               "prompt": ("input_length", "prompt_len", "input_len", "prompt_tokens"),
               "output": ("output_length", "output_len", "output_tokens")}
"""Accepted JSONL field names: Mooncake's (``timestamp`` in ms, ``input_length``, ``output_length``,
``hash_ids``) and the plain ones a `vllm bench`-style replay writes (``arrival_time`` in s, ...)."""


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


def _csv_rows(path: Path) -> Iterator[tuple[int, float, int, int, tuple[int, ...]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"trace {path.name}: missing column(s) {missing}; expected {list(COLUMNS)}")
        for i, rec in enumerate(reader):
            if any(rec.get(c) is None for c in COLUMNS):
                raise ValueError(f"trace {path.name} row {i}: missing value(s) in {list(COLUMNS)}")
            try:
                ts = parse_timestamp(rec["TIMESTAMP"])
            except ValueError as e:
                raise ValueError(f"trace {path.name} row {i}: {e}") from None
            try:
                prompt_len, output_len = int(rec["ContextTokens"]), int(rec["GeneratedTokens"])
            except ValueError:
                raise ValueError(f"trace {path.name} row {i}: ContextTokens/GeneratedTokens must be ints, "
                                 f"got {rec['ContextTokens']!r}, {rec['GeneratedTokens']!r}") from None
            yield i, ts, prompt_len, output_len, ()


def _jsonl_field(path: Path, i: int, rec: dict, what: str) -> Any:
    for k in _JSONL_KEYS[what]:
        if k in rec:
            return k, rec[k]
    raise ValueError(f"trace {path.name} row {i}: no {what} field (one of {list(_JSONL_KEYS[what])})")


def _jsonl_rows(path: Path) -> Iterator[tuple[int, float, int, int, tuple[int, ...]]]:
    with path.open() as f:
        i = -1
        for line in f:
            if not line.strip():
                continue
            i += 1
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"trace {path.name} row {i}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"trace {path.name} row {i}: expected a JSON object")
            key, t = _jsonl_field(path, i, rec, "arrival")
            _, p = _jsonl_field(path, i, rec, "prompt")
            _, o = _jsonl_field(path, i, rec, "output")
            nums = (t, p, o)
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in nums):
                raise ValueError(f"trace {path.name} row {i}: arrival, prompt and output lengths must be numbers, "
                                 f"got {t!r}, {p!r}, {o!r}")
            if p != int(p) or o != int(o):
                raise ValueError(f"trace {path.name} row {i}: lengths must be whole numbers, got {p!r}, {o!r}")
            hashes = rec.get("hash_ids") or []
            if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                                       for h in hashes):
                raise ValueError(f"trace {path.name} row {i}: hash_ids must be a list of integers")
            yield i, float(t) / 1000.0 if key == "timestamp" else float(t), int(p), int(o), tuple(hashes)


def load_trace(path: str | Path, start: int = 0, limit: int | None = None) -> list[TraceRow]:
    """Rows ``start`` .. ``start + limit`` (0-based, header excluded), arrivals relative to the first of them.

    A ``.jsonl`` file is read as JSON lines (Mooncake's fields, with optional ``hash_ids``; or
    ``arrival_time`` / ``prompt_len`` / ``output_len``), anything else as the Azure CSV. ValueError
    naming the file and row for a missing or non-numeric field, a negative length or a time earlier
    than the row before it."""
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be > 0, got {limit}")
    path = resolve_trace(path)
    if not path.is_file():
        raise ValueError(f"trace: no such file {str(path)!r}")
    reader = _jsonl_rows(path) if path.suffix == ".jsonl" else _csv_rows(path)
    rows: list[TraceRow] = []
    t0: float | None = None
    prev: float | None = None
    try:
        for i, ts, prompt_len, output_len, hashes in reader:
            if not math.isfinite(ts):
                raise ValueError(f"trace {path.name} row {i}: arrival time {ts!r} is not finite")
            if prev is not None and ts < prev:
                raise ValueError(f"trace {path.name} row {i}: arrival time goes back {prev - ts:.6g} s "
                                 "(rows must be in arrival order)")
            prev = ts
            if i < start:
                continue
            if limit is not None and len(rows) >= limit:
                break
            if prompt_len < 0 or output_len < 0:
                raise ValueError(f"trace {path.name} row {i}: negative prompt or output length")
            if t0 is None:
                t0 = ts
            rows.append(TraceRow(arrival_s=ts - t0, prompt_len=prompt_len, output_len=output_len, hash_ids=hashes))
    except UnicodeDecodeError:
        raise ValueError(f"trace {path.name}: not a text file") from None
    if not rows:
        raise ValueError(f"trace {path.name}: no rows from start={start}")
    return rows


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
                     output_len=_scale_len(r.output_len, length_scale), hash_ids=r.hash_ids) for r in rows]
