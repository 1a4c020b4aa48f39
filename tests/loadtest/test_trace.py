"""loadtest.trace on a slice of the real Azure conversation trace (tests/data, the first 400 rows of
the team's azure_llm_2023_conv.csv), and the workload built from it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loadtest.arrivals import gamma_arrivals, trace_arrivals
from loadtest.trace import load_trace, parse_timestamp, scale_trace
from loadtest.workload import ModelLimits, build_workload, synthetic_lengths

TRACE = Path(__file__).resolve().parents[1] / "data/azure_llm_2023_conv_first400.csv"  # see tests/data/README.md

# The file's first four data rows, as printed by `head -5`:
#   2023-11-16 18:15:46.6805900,374,44
#   2023-11-16 18:15:50.9951690,396,109
#   2023-11-16 18:15:51.2224670,879,55
#   2023-11-16 18:15:51.3910170,91,16


def test_load_first_rows():
    rows = load_trace(TRACE, start=0, limit=4)
    assert [(r.prompt_len, r.output_len) for r in rows] == [(374, 44), (396, 109), (879, 55), (91, 16)]
    # arrivals relative to the first: 50.995169 - 46.68059 = 4.314579, 51.222467 - 46.68059 = 4.541877, ...
    assert [r.arrival_s for r in rows] == pytest.approx([0.0, 4.314579, 4.541877, 4.710427], abs=1e-6)


def test_load_slice_from_offset():
    rows = load_trace(TRACE, start=2, limit=2)
    assert [(r.prompt_len, r.output_len) for r in rows] == [(879, 55), (91, 16)]
    # 51.391017 - 51.222467 = 0.16855
    assert [r.arrival_s for r in rows] == pytest.approx([0.0, 0.16855], abs=1e-6)


def test_scale_lengths_and_times():
    rows = scale_trace(load_trace(TRACE, limit=4), length_scale=0.1, time_scale=0.5)
    # 374*0.1=37.4->37, 44*0.1=4.4->4; 396->39.6->40, 109->10.9->11; 879->87.9->88, 55->5.5->6; 91->9.1->9, 16->1.6->2
    assert [(r.prompt_len, r.output_len) for r in rows] == [(37, 4), (40, 11), (88, 6), (9, 2)]
    # times halve: 4.314579 / 2 = 2.1572895 ...
    assert [r.arrival_s for r in rows] == pytest.approx([0.0, 2.1572895, 2.2709385, 2.3552135], abs=1e-6)
    # a tiny scale still leaves one token each
    assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in scale_trace(rows, 0.001, 1.0))


def test_trace_statistics_match_readme():
    # the traces' README (source in tests/data/README.md): prompts median 1020, outputs median 129 over the hour;
    # the first 400 rows should be in that neighbourhood (a gross parsing error would not be).
    rows = load_trace(TRACE)
    assert len(rows) == 400
    assert 500 < np.median([r.prompt_len for r in rows]) < 2000
    assert 60 < np.median([r.output_len for r in rows]) < 260
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(rows, rows[1:]))


def test_bad_trace_input(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_trace(tmp_path / "missing.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.1,5\n")
    with pytest.raises(ValueError, match="GeneratedTokens"):
        load_trace(bad)
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,5\n")
    with pytest.raises(ValueError, match="TIMESTAMP"):
        load_trace(bad)
    with pytest.raises(ValueError, match="length_scale"):
        scale_trace([], length_scale=0)
    with pytest.raises(ValueError, match="start"):
        load_trace(TRACE, start=-1)


def test_parse_timestamp_seven_digit_fraction():
    # 47.1234567 - 46.6805900 = 0.4428667 s (to the microsecond: epoch seconds in a double keep ~0.2 us)
    assert parse_timestamp("2023-11-16 18:15:47.1234567") - parse_timestamp("2023-11-16 18:15:46.6805900") == \
        pytest.approx(0.4428667, abs=1e-6)
    # a whole day and a second later
    assert parse_timestamp("2023-11-17 18:15:47") - parse_timestamp("2023-11-16 18:15:46") == 86401.0


def test_gamma_arrivals_rate_and_burstiness():
    # Gamma(k, 1/(rate*k)) has mean 1/rate and coefficient of variation 1/sqrt(k):
    # rate 10 -> mean gap 0.1 s; Poisson (k=1) CV 1; k=0.25 CV 2.
    for k, cv in ((1.0, 1.0), (0.25, 2.0), (4.0, 0.5)):
        t = gamma_arrivals(4000, 10.0, burstiness=k, seed=1)
        gaps = np.diff(t)
        assert t[0] == 0.0
        assert gaps.mean() == pytest.approx(0.1, rel=0.1)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)
    assert gamma_arrivals(3, float("inf")) == [0.0, 0.0, 0.0]
    assert gamma_arrivals(5, 2.0, seed=7) == gamma_arrivals(5, 2.0, seed=7)
    with pytest.raises(ValueError, match="request_rate"):
        gamma_arrivals(3, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        gamma_arrivals(3, 1.0, burstiness=0)
    assert trace_arrivals([5.0, 5.5, 7.0]) == [0.0, 0.5, 2.0]


def test_synthetic_lengths_and_workload_clipping():
    lens = synthetic_lengths(500, input_len=100, output_len=10, range_ratio=0.5, seed=3)
    # uniform in [100*(1-0.5), 100*(1+0.5)] = [50, 150] and [5, 15]
    assert min(p for p, _ in lens) >= 50 and max(p for p, _ in lens) <= 150
    assert min(o for _, o in lens) >= 5 and max(o for _, o in lens) <= 15
    assert np.mean([p for p, _ in lens]) == pytest.approx(100, rel=0.05)
    assert synthetic_lengths(4, 8, 2) == [(8, 2)] * 4  # range_ratio 0 -> fixed
    with pytest.raises(ValueError, match="range_ratio"):
        synthetic_lengths(4, 8, 2, range_ratio=1.0)

    limits = ModelLimits(vocab_size=50, max_context_length=64, max_prompt_tokens=60, max_new_tokens=16)
    w = build_workload([(10, 5), (100, 5), (40, 40)], [0.0, 0.1, 0.2], limits, seed=0, id_prefix="t")
    # (100, 5): prompt clipped to max_prompt 60, then to context-1 = 63 (no change) -> 60; output 5 fits 64-60=4? no -> 4
    # (40, 40): output clipped to max_new 16 and to 64-40=24 -> 16
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in w.requests] == [(10, 5), (60, 4), (40, 16)]
    assert w.num_clipped == 2
    assert [r.request_id for r in w.requests] == ["t-0", "t-1", "t-2"]
    assert all(0 <= t < 50 for r in w.requests for t in r.prompt_token_ids)
    # same seed -> same prompts (a rerun is comparable)
    again = build_workload([(10, 5), (100, 5), (40, 40)], [0.0, 0.1, 0.2], limits, seed=0, id_prefix="t")
    assert [r.prompt_token_ids for r in again.requests] == [r.prompt_token_ids for r in w.requests]


def test_packaged_samples_are_the_traces_first_rows_and_replay_from_a_fresh_clone():
    """sample:conversation is the same trace as tests/data's slice (both `head` of the Azure conversation trace):
    its first 400 rows must equal that file's, read independently; sample:code has its own 1,000 rows."""
    from loadtest.trace import SAMPLE_TRACES, resolve_trace

    conv = load_trace("sample:conversation")
    first400 = load_trace(Path(__file__).resolve().parents[1] / "data" / "azure_llm_2023_conv_first400.csv")
    assert len(conv) == 1000 and conv[:400] == first400
    code = load_trace("sample:code", start=10, limit=5)
    assert len(code) == 5 and code[0].arrival_s == 0.0 and all(r.prompt_len > 0 for r in code)
    assert load_trace("sample:code")[0].prompt_len == 4808  # the first row of the code CSV
    for name in SAMPLE_TRACES:  # shipped with the package (pyproject package-data), licence beside them
        assert resolve_trace(name).is_file()
    assert "CC-BY 4.0" in (resolve_trace("sample:code").parent / "README.md").read_text()
    with pytest.raises(ValueError, match="not a packaged sample .*sample:conversation"):
        load_trace("sample:chat")


def test_bench_flags_take_a_sample_name():
    from loadtest.cli import build_parser, check_workload_args, workload_lengths_and_arrivals

    args = build_parser().parse_args(["--trace", "sample:conversation", "--num-prompts", "20"])
    check_workload_args(args)
    _rate, lengths, arrivals = workload_lengths_and_arrivals(args)
    assert len(lengths) == 20 and lengths[0] == (374, 44)  # the conversation trace's first row
