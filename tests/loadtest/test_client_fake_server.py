"""Unit tests of the load-test client layer and CLI against a tiny in-test grpc.aio PDServe server.

The server here is a fake (tests/loadtest/fake_server.py) that streams tokens on fixed sleeps; it tests
this layer only. The end-to-end test against a real router and workers is test_bench_real_cluster.py.
"""
from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path

import pytest

from loadtest.cli import main
from loadtest.client import ClientConfig, run_benchmark
from loadtest.stats import itls_s, summarize, tpot_s, ttft_s
from loadtest.workload import BenchRequest
from tests.loadtest.fake_server import FakeConfig, FakePDServe

TRACE = Path(__file__).resolve().parents[1] / "data/azure_llm_2023_conv_first400.csv"  # see tests/data/README.md


def test_client_times_the_stream():
    cfg = FakeConfig(ttft_s=0.05, itl_s=0.02)
    reqs = [BenchRequest(f"t-{i}", list(range(5 + i)), 4, 0.0) for i in range(6)]
    with FakePDServe(cfg) as srv:
        records, duration = asyncio.run(run_benchmark(ClientConfig(target=srv.target), reqs))
        seen = srv.seen.requests
    # what went out: the prompt ids as given, max_tokens, ignore_eos (forced output length), greedy
    assert sorted(len(r.token_ids) for r in seen) == [5, 6, 7, 8, 9, 10]
    assert all(r.max_tokens == 4 and r.ignore_eos and r.temperature == 0.0 for r in seen)
    assert [r.request_id for r in records] == [f"t-{i}" for i in range(6)]
    for r in records:
        assert r.success and r.output_tokens == 4 and r.finish_reason == "length" and r.chunk_tokens == [1] * 4
        assert r.token_ids == [7] * 4  # the fake server streams token 7
        # the server sleeps 50 ms before the first token and 20 ms before each later one: token j + 1 cannot
        # arrive before 50 + 20 j ms (a single gap can be shorter when the chunk before it was delivered late,
        # so the bound is on the arrival times, not on each gap)
        assert ttft_s(r) >= 0.05
        gaps = itls_s(r)
        assert len(gaps) == 3
        for j in range(1, 4):
            assert ttft_s(r) + sum(gaps[:j]) >= 0.05 + 0.02 * j - 1e-3, (j, ttft_s(r), gaps)
        # and each chunk is timed when it arrives, not all at the end: the gaps span the server's 60 ms of
        # sleeps, less what the first chunk's delivery may have been late by (30 ms allowed on a loaded box)
        assert sum(gaps) >= 0.03, gaps
        # TPOT = (E2EL - TTFT) / 3 = mean of the 3 gaps here (one token per message)
        assert tpot_s(r) == pytest.approx(statistics.mean(itls_s(r)))
    # all six were sent at once, so the whole run takes about one request (~0.11 s), not six
    assert duration < 6 * 0.11
    assert summarize(records, duration)["max_concurrent_requests"] == 6


def test_max_concurrency_caps_in_flight():
    reqs = [BenchRequest(f"c-{i}", [1, 2, 3], 3, 0.0) for i in range(6)]
    with FakePDServe(FakeConfig(ttft_s=0.03, itl_s=0.01)) as srv:
        records, _ = asyncio.run(run_benchmark(ClientConfig(target=srv.target, max_concurrency=2), reqs))
        peak = srv.seen.peak_in_flight
    assert peak == 2
    assert summarize(records, 1.0)["max_concurrent_requests"] <= 2
    assert all(r.success for r in records)


def test_arrival_schedule_is_followed():
    # sent at 0, 0.2, 0.4 s: each start no earlier than scheduled
    reqs = [BenchRequest(f"s-{i}", [1], 1, 0.2 * i) for i in range(3)]
    with FakePDServe(FakeConfig(ttft_s=0.0)) as srv:
        records, duration = asyncio.run(run_benchmark(ClientConfig(target=srv.target), reqs))
    for i, r in enumerate(records):
        assert r.start_s >= 0.2 * i - 1e-3
    assert duration >= 0.4


def test_errors_are_recorded_not_fatal(tmp_path):
    out = tmp_path / "r.json"
    with FakePDServe(FakeConfig(fail_every=3, ttft_s=0.01, itl_s=0.005)) as srv:
        rc = main(["--target", srv.target, "--num-prompts", "6", "--input-len", "8", "--output-len", "3",
                   "--save-result", str(out), "--disable-tqdm"])
    res = json.loads(out.read_text())
    # indices 0 and 3 fail (multiples of 3)
    assert rc == 0 and res["completed"] == 4 and res["failed"] == 2
    assert sum(e.startswith("RESOURCE_EXHAUSTED") for e in res["errors"]) == 2
    assert res["error_counts"] == {"RESOURCE_EXHAUSTED": 2}


def test_cli_synthetic_json_and_plots(tmp_path, capsys):
    out, plots = tmp_path / "res.json", tmp_path / "plots"
    with FakePDServe(FakeConfig(ttft_s=0.02, itl_s=0.005, max_new_tokens=6)) as srv:
        rc = main(["--target", srv.target, "--num-prompts", "8", "--input-len", "16", "--output-len", "4",
                   "--range-ratio", "0.5", "--request-rate", "50", "--burstiness", "0.5", "--max-concurrency", "4",
                   "--goodput", "ttft:10000", "tpot:10000", "--save-result", str(out), "--plot", str(plots),
                   "--disable-tqdm"])
        prompts = [len(r.token_ids) for r in srv.seen.requests]
    assert rc == 0
    res = json.loads(out.read_text())
    for key in ("completed", "failed", "duration", "request_throughput", "output_throughput",
                "total_token_throughput", "request_goodput", "total_input_tokens", "total_output_tokens",
                "input_lens", "output_lens", "ttfts", "itls", "request_rate", "burstiness", "max_concurrency"):
        assert key in res, key
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert f"{stat}_{m}_ms" in res, f"{stat}_{m}_ms"
    assert res["completed"] == 8 and res["failed"] == 0
    # every request meets generous SLOs -> goodput equals throughput
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    # range ratio 0.5 around 16 -> prompts in [8, 24]; outputs around 4 in [2, 6]
    assert all(8 <= n <= 24 for n in prompts) and sorted(res["input_lens"]) == sorted(prompts)
    assert all(2 <= n <= 6 for n in res["output_lens"])
    assert res["mean_ttft_ms"] >= 20.0
    assert res["dataset"] == "random" and res["request_rate"] == 50.0
    for name in ("latency_cdf.png", "ttft_over_time.png", "itl_over_time.png"):
        data = (plots / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Mean TTFT (ms)" in text and "P99 ITL (ms)" in text


def test_cli_trace_slice_with_scaling(tmp_path):
    out = tmp_path / "trace.json"
    with FakePDServe(FakeConfig(ttft_s=0.01, itl_s=0.002, max_new_tokens=8, max_prompt_tokens=200)) as srv:
        rc = main(["--target", srv.target, "--trace", str(TRACE), "--trace-start", "0", "--num-prompts", "4",
                   "--length-scale", "0.1", "--time-scale", "0.05", "--save-result", str(out), "--disable-tqdm"])
        seen = sorted(srv.seen.requests, key=lambda r: int(r.request_id.rsplit("-", 1)[-1]))
    assert rc == 0
    res = json.loads(out.read_text())
    # first four rows scaled by 0.1: prompts 37, 40, 88, 9; outputs 4, 11, 6, 2 -> 11 clipped to max_new_tokens 8
    assert [len(r.token_ids) for r in seen] == [37, 40, 88, 9]
    assert [r.max_tokens for r in seen] == [4, 8, 6, 2]
    assert res["num_clipped_to_model_limits"] == 1
    assert res["completed"] == 4 and res["total_output_tokens"] == 4 + 8 + 6 + 2
    assert res["dataset"] == "trace" and res["length_scale"] == 0.1 and res["time_scale"] == 0.05
    assert res["request_rate"] == "trace"
    # arrivals 4.3146 s * 0.05 = 0.216 s after the first: the run lasts at least that
    assert res["duration"] >= 0.2157


def test_cli_bad_input(tmp_path, capsys):
    assert main(["--target", "nohost", "--disable-tqdm"]) == 2
    assert "target" in capsys.readouterr().err
    assert main(["--target", "127.0.0.1:1", "--goodput", "speed:3", "--disable-tqdm"]) == 2
    assert "goodput" in capsys.readouterr().err
    assert main(["--target", "127.0.0.1:1", "--max-concurrency", "0"]) == 2
    assert main(["--target", "127.0.0.1:1", "--percentiles", "50,abc", "--disable-tqdm"]) == 2
    assert "percentiles" in capsys.readouterr().err
    assert main(["--target", "127.0.0.1:1", "--no-such-flag"]) == 2  # argparse error -> status, not exception
    # nothing listens on port 1: reported, not hung
    assert main(["--target", "127.0.0.1:1", "--ready-timeout", "0.5", "--disable-tqdm"]) == 2
    assert "unreachable" in capsys.readouterr().err
    with FakePDServe() as srv:
        assert main(["--target", srv.target, "--trace", str(tmp_path / "none.csv"), "--disable-tqdm"]) == 2
    assert "no such file" in capsys.readouterr().err
