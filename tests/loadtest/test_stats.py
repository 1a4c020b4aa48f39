"""loadtest.stats against hand-worked numbers (the arithmetic is written out beside each expectation)."""
from __future__ import annotations

import math

import pytest

from loadtest.stats import (RequestRecord, e2el_s, itls_s, max_concurrency_seen, meets_slos, parse_goodput,
                            percentile, summarize, tpot_s, ttft_s)


def records() -> list[RequestRecord]:
    # A: sent at 0.0, three 1-token messages at 0.1, 0.3, 0.6.
    a = RequestRecord("a", prompt_len=10, expected_output_len=3, start_s=0.0, chunk_times_s=[0.1, 0.3, 0.6],
                      chunk_tokens=[1, 1, 1], end_s=0.6, output_tokens=3, success=True)
    # B: sent at 1.0, a 1-token message at 1.2 then one message carrying 2 tokens at 1.3.
    b = RequestRecord("b", prompt_len=20, expected_output_len=3, start_s=1.0, chunk_times_s=[1.2, 1.3],
                      chunk_tokens=[1, 2], end_s=1.3, output_tokens=3, success=True)
    # C: sent at 2.0, a single token at 2.4.
    c = RequestRecord("c", prompt_len=30, expected_output_len=1, start_s=2.0, chunk_times_s=[2.4],
                      chunk_tokens=[1], end_s=2.4, output_tokens=1, success=True)
    # D: failed after 0.1 s without a token.
    d = RequestRecord("d", prompt_len=40, expected_output_len=5, start_s=2.5, end_s=2.6,
                      error="UNAVAILABLE: no decode worker")
    return [a, b, c, d]


def test_per_request_latencies():
    a, b, c, d = records()
    # A: TTFT = 0.1 - 0.0; E2EL = 0.6; ITL = [0.3-0.1, 0.6-0.3]; TPOT = (0.6 - 0.1) / (3 - 1) = 0.25
    assert ttft_s(a) == pytest.approx(0.1)
    assert e2el_s(a) == pytest.approx(0.6)
    assert itls_s(a) == pytest.approx([0.2, 0.3])
    assert tpot_s(a) == pytest.approx(0.25)
    # B: TTFT 0.2; one gap of 0.1 (the 2-token message is one gap, as in vLLM); TPOT = (0.3 - 0.2) / 2 = 0.05
    assert ttft_s(b) == pytest.approx(0.2)
    assert itls_s(b) == pytest.approx([0.1])
    assert tpot_s(b) == pytest.approx(0.05)
    # C: one token -> no ITL, TPOT undefined
    assert itls_s(c) == [] and tpot_s(c) is None
    # D: no token -> no TTFT
    assert ttft_s(d) is None and tpot_s(d) is None


def test_percentile_linear_interpolation():
    # [1, 2, 3, 4]: p50 sits halfway between the 2nd and 3rd values -> 2.5;
    # p99 at rank 0.99 * 3 = 2.97 -> 3 + 0.97 * (4 - 3) = 3.97; p0 / p100 are min / max.
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([], 99) == 0.0
    with pytest.raises(ValueError, match="percentile"):
        percentile([1.0], 101)


def test_summary_counts_and_throughputs():
    s = summarize(records(), duration_s=4.0, percentiles=[50, 99])
    assert s["completed"] == 3 and s["failed"] == 1
    # Successful requests only: inputs 10 + 20 + 30 = 60; outputs 3 + 3 + 1 = 7.
    assert s["total_input_tokens"] == 60 and s["total_output_tokens"] == 7
    assert s["request_throughput"] == pytest.approx(3 / 4)        # 0.75 req/s
    assert s["output_throughput"] == pytest.approx(7 / 4)         # 1.75 tok/s
    assert s["total_token_throughput"] == pytest.approx(67 / 4)   # 16.75 tok/s
    assert "request_goodput" not in s  # only with SLOs
    assert s["error_counts"] == {"UNAVAILABLE": 1}  # D's status name


def test_summary_latency_stats_ms():
    s = summarize(records(), duration_s=4.0, percentiles=[99])
    # TTFT ms [100, 200, 400]: mean 700/3; median 200; p99 rank 1.98 -> 200 + 0.98*200 = 396;
    # population std: deviations (-133.3, -33.3, 166.7), squares sum 46666.7, /3, sqrt -> 124.72
    assert s["mean_ttft_ms"] == pytest.approx(700 / 3)
    assert s["median_ttft_ms"] == pytest.approx(200)
    assert s["p99_ttft_ms"] == pytest.approx(396)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(46666.6667 / 3), rel=1e-6)
    # TPOT ms [250, 50] (C has one token, D failed): mean 150, median 150, std 100, p99 = 50 + 0.99*200 = 248
    assert s["mean_tpot_ms"] == pytest.approx(150)
    assert s["median_tpot_ms"] == pytest.approx(150)
    assert s["std_tpot_ms"] == pytest.approx(100)
    assert s["p99_tpot_ms"] == pytest.approx(248)
    # ITL ms: A's [200, 300] + B's [100] -> sorted [100, 200, 300]: mean 200, median 200,
    # p99 = 200 + 0.98*100 = 298, std sqrt((100^2 + 0 + 100^2)/3) = 81.65
    assert s["mean_itl_ms"] == pytest.approx(200)
    assert s["median_itl_ms"] == pytest.approx(200)
    assert s["p99_itl_ms"] == pytest.approx(298)
    assert s["std_itl_ms"] == pytest.approx(math.sqrt(20000 / 3))
    # E2EL ms [600, 300, 400] -> sorted [300, 400, 600]: mean 433.3, median 400, p99 = 400 + 0.98*200 = 596
    assert s["mean_e2el_ms"] == pytest.approx(1300 / 3)
    assert s["median_e2el_ms"] == pytest.approx(400)
    assert s["p99_e2el_ms"] == pytest.approx(596)


def test_goodput():
    recs = records()
    # ttft<=250 and tpot<=100: A fails TPOT (250), B passes (200, 50), C fails TTFT (400), D failed -> 1 / 4 s
    s = summarize(recs, 4.0, goodput_slos_ms={"ttft": 250, "tpot": 100})
    assert s["request_goodput"] == pytest.approx(0.25)
    # ttft<=500 only: A, B, C pass (C's single token counts TPOT as 0 anyway) -> 3 / 4 s
    assert summarize(recs, 4.0, goodput_slos_ms={"ttft": 500})["request_goodput"] == pytest.approx(0.75)
    # e2el<=450: B (300) and C (400) pass, A (600) does not -> 2 / 4 s
    assert summarize(recs, 4.0, goodput_slos_ms={"e2el": 450})["request_goodput"] == pytest.approx(0.5)
    # tpot<=0: only C (one token => TPOT 0) passes
    assert [meets_slos(r, {"tpot": 0}) for r in recs] == [False, False, True, False]


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "TPOT:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    assert parse_goodput(None) == {}
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput(["latency:5"])
    with pytest.raises(ValueError, match="ttft"):
        parse_goodput(["ttft:fast"])
    with pytest.raises(ValueError, match="tpot"):
        parse_goodput(["tpot:-1"])


def test_peak_concurrency():
    # Intervals [0,3], [1,2], [1.5,4], [4,5]: at t=1.5 three overlap; [4,5] starts as [1.5,4] ends (no overlap).
    recs = [RequestRecord(str(i), 1, 1, start_s=s, end_s=e) for i, (s, e) in
            enumerate([(0, 3), (1, 2), (1.5, 4), (4, 5)])]
    assert max_concurrency_seen(recs) == 3
    assert max_concurrency_seen(records()) == 1


def test_empty_and_bad_duration():
    s = summarize([], 1.0)
    assert s["completed"] == 0 and s["mean_ttft_ms"] == 0.0 and s["p99_e2el_ms"] == 0.0
    with pytest.raises(ValueError, match="duration"):
        summarize(records(), 0.0)


# ---- SLO attainment and DistServe goodput (hand-worked) ------------------------------
def _rec(rid: str, ttft: float, tpot: float, n: int = 11, ok: bool = True):
    from loadtest.stats import RequestRecord

    # first token at `ttft`, then n-1 tokens evenly `tpot` apart: TPOT = tpot exactly
    times = [ttft + i * tpot for i in range(n)]
    return RequestRecord(rid, 10, n, start_s=0.0, chunk_times_s=times, chunk_tokens=[1] * n,
                         end_s=times[-1], output_tokens=n, success=ok)


def test_slo_attainment_counts_failed_requests_in_the_denominator():
    from loadtest.stats import slo_attainment

    recs = [_rec("a", 0.1, 0.02), _rec("b", 0.3, 0.02), _rec("c", 0.1, 0.06), _rec("d", 0.1, 0.01, ok=False)]
    # SLOs ttft 200 ms, tpot 50 ms: a meets both; b misses TTFT; c misses TPOT; d failed -> 1 of 4
    assert slo_attainment(recs, {"ttft": 200, "tpot": 50}) == 0.25
    assert slo_attainment(recs, {"ttft": 400}) == 0.75   # a, b, c
    assert slo_attainment([], {"ttft": 1}) == 0.0
    with pytest.raises(ValueError, match="slos_ms"):
        slo_attainment(recs, {})


def test_goodput_rate_is_last_rate_before_first_miss():
    from loadtest.stats import goodput_rate

    pts = [(1.0, 1.0), (2.0, 0.95), (3.0, 0.8), (4.0, 0.92)]   # 4.0 passes by luck after 3.0 failed
    assert goodput_rate(pts, 0.9) == 2.0
    assert goodput_rate(list(reversed(pts)), 0.9) == 2.0          # order of the input does not matter
    # interpolated: between (2, 0.95) and (3, 0.80) attainment crosses 0.9 one third of the way: 2 + 1/3
    assert goodput_rate(pts, 0.9, interpolate=True) == pytest.approx(2 + 1 / 3)
    assert goodput_rate([(1.0, 0.5), (2.0, 0.4)], 0.9) == 0.0     # misses even at the lowest rate
    assert goodput_rate([(1.0, 0.5)], 0.9, interpolate=True) == 0.0
    assert goodput_rate([(1.0, 0.9), (2.0, 1.0)], 0.9) == 2.0     # never misses: the highest tested rate
    for bad, field in [([], "points"), ([(0.0, 1.0)], "rates"), ([(1.0, 1.5)], "attainment")]:
        with pytest.raises(ValueError, match=field):
            goodput_rate(bad, 0.9)
    with pytest.raises(ValueError, match="goal"):
        goodput_rate(pts, 0.0)
