"""benchmarks/external_harnesses.py: the trace it hands AIPerf and pdserve bench is the sample's rows, scaled.

(The harnesses themselves need their registry installs and minutes: the script is run by hand, docs/loadtest.md.)
"""
from __future__ import annotations

import json

import pytest

from loadtest.trace import load_trace, scale_trace

import benchmarks.external_harnesses as eh


def test_the_mooncake_trace_is_the_samples_rows_scaled_and_fitted(tmp_path):
    out = eh.write_mooncake_trace(tmp_path / "t.jsonl", 50, 0.25, 2.0, 256)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    want = scale_trace(load_trace(eh.AZURE_CONV_SAMPLE, 0, 50), 0.25, 2.0)
    assert len(recs) == 50 and recs[0]["timestamp"] == 0
    assert all(b["timestamp"] >= a["timestamp"] for a, b in zip(recs, recs[1:]))
    for rec, row in zip(recs, want):
        assert rec["timestamp"] == round(row.arrival_s * 1000)
        assert rec["output_length"] == row.output_len
        assert rec["input_length"] == max(1, min(row.prompt_len, 256 - row.output_len - 1))
        assert rec["input_length"] + rec["output_length"] < 256
    assert any(r.prompt_len > rec["input_length"] for rec, r in zip(recs, want))  # some prompts had to be cut
    # pdserve bench reads it back as the same rows (AIPerf gets the same file)
    back = load_trace(out)
    assert [(r.prompt_len, r.output_len) for r in back] == [(x["input_length"], x["output_length"]) for x in recs]
    assert back[-1].arrival_s == pytest.approx(recs[-1]["timestamp"] / 1000, abs=1e-6)
