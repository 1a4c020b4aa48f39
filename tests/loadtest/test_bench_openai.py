"""`pdserve bench --backend openai` against a real router's OpenAI-compatible HTTP port, and the vLLM-named flags.

The cluster is real (router + 1 prefill + 1 decode worker on the tiny model, KV over gloo, rendezvous in a real
Redis; see test_bench_real_cluster.py); its router serves HTTP on a free port and requires an API key, which the
bench sends from ``PDSERVE_API_KEY`` as ``Authorization: Bearer``. The router's Prometheus counters are an
independent tally of what the bench sent. Prompt construction (``--random-prefix-len``) is checked on the requests
a fake gRPC server received, and the flag checks need no server at all.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loadtest.arrivals import ramp_up_arrivals, ramp_up_rate
from loadtest.cli import main
from loadtest.workload import ModelLimits, build_workload
from tests.loadtest.fake_server import FakeConfig, FakePDServe
from tests.loadtest.test_bench_real_cluster import Cluster

TOKENIZER = Path(__file__).resolve().parents[2] / "engine/assets/tokenizer"
KEY = "bench-test-key-1"

VLLM_KEYS = ["date", "backend", "endpoint_type", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "output_throughput", "total_token_throughput",
             "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "generated_texts", "errors",
             "max_output_tokens_per_s", "max_concurrent_requests"]


@pytest.fixture(scope="module")
def http_cluster(redis_url):
    torch.set_num_threads(1)
    c = Cluster("disaggregated", redis_url, http=True, api_keys=(KEY,))
    yield c
    c.close()


def test_openai_backend_against_real_router(http_cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    before = http_cluster.router_counters()
    rc = main(["--backend", "openai", "--base-url", http_cluster.http_url, "--tokenizer", str(TOKENIZER),
               "--dataset-name", "random", "--random-input-len", "24", "--random-prefix-len", "16",
               "--random-output-len", "6", "--num-prompts", "8", "--num-warmups", "2", "--max-concurrency", "4",
               "--request-rate", "40", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
               "50,90,99", "--label", "oa-test", "--metadata", "run=ci", "commit=abc", "--save-result",
               "--result-dir", str(tmp_path / "results"), "--disable-tqdm", "--request-timeout", "60",
               "--pdserve-timings"])
    after = http_cluster.router_counters()
    files = list((tmp_path / "results").glob("*.json"))
    assert len(files) == 1, files
    res = json.loads(files[0].read_text())
    assert rc == 0, res["errors"]
    # vLLM's file name: {label}-{rate}qps-concurrency{N}-{model}-{date}.json
    assert files[0].name.startswith("oa-test-40.0qps-concurrency4-tiny-"), files[0].name
    for key in VLLM_KEYS:
        assert key in res, key
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert f"{stat}_{m}_ms" in res, f"{stat}_{m}_ms"
    assert res["backend"] == "openai" and res["label"] == "oa-test" and res["run"] == "ci" and res["commit"] == "abc"
    assert res["completed"] == 8 and res["failed"] == 0, res["errors"]
    # token-id prompts: exactly prefix 16 + 24; ignore_eos + max_tokens force 6 output tokens (usage says so)
    assert res["input_lens"] == [40] * 8 and res["output_lens"] == [6] * 8
    assert res["total_output_tokens"] == 48 and res["errors"] == [""] * 8
    # one SSE chunk per token here: 5 gaps per request, each a real positive time
    assert [len(x) for x in res["itls"]] == [5] * 8 and all(g > 0 for x in res["itls"] for g in x)
    assert all(0 < t <= lat for t, lat in zip(res["ttfts"], res["latencies"]))
    assert all(isinstance(t, str) and t for t in res["generated_texts"])
    assert 0 < res["max_output_tokens_per_s"] <= 48 and res["max_concurrent_requests"] <= 4
    assert res["p50_ttft_ms"] <= res["p90_ttft_ms"] <= res["p99_ttft_ms"]
    # the router saw 8 requests + 2 warm-ups (uncounted by the bench) with their exact token counts
    assert after["pdserve:request_success_total"] - before.get("pdserve:request_success_total", 0) == 10
    assert after["pdserve:prompt_tokens_total"] - before.get("pdserve:prompt_tokens_total", 0) == 10 * 40
    assert after["pdserve:generation_tokens_total"] - before.get("pdserve:generation_tokens_total", 0) == 10 * 6
    out = capsys.readouterr().out
    assert "warm-up: 2 of 2 request(s) completed" in out and "P90 TTFT (ms)" in out and "oa-test" in out
    # --pdserve-timings: the server's TTFT phases came back in the usage chunks and were summarized and printed
    phases = res["ttft_phases_ms"]
    assert list(phases) == ["placement", "worker_queue", "prefill", "delivery"]
    assert phases["prefill"]["p90"] >= phases["prefill"]["median"] > 0
    assert sum(st["mean"] for st in phases.values()) <= res["mean_ttft_ms"]
    assert "TTFT by phase" in out


def test_openai_embeddings_backend_against_real_router(http_cluster, tmp_path, monkeypatch, capsys):
    """vLLM's ``--backend openai-embeddings``: each request one ``POST /v1/embeddings``; the router's counters
    tally the requests and their exact prompt tokens, nothing is generated."""
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    before = http_cluster.router_counters()
    rc = main(["--backend", "openai-embeddings", "--base-url", http_cluster.http_url, "--vocab-size", "512",
               "--dataset-name", "random", "--random-input-len", "20", "--num-prompts", "6", "--max-concurrency", "3",
               "--save-result", "--result-dir", str(tmp_path / "results"), "--disable-tqdm", "--request-timeout",
               "60"])
    after = http_cluster.router_counters()
    res = json.loads(next((tmp_path / "results").glob("*.json")).read_text())
    assert rc == 0 and res["completed"] == 6 and res["failed"] == 0, res["errors"]
    assert res["backend"] == "openai-embeddings" and res["input_lens"] == [20] * 6 and res["total_output_tokens"] == 0
    assert res["request_throughput"] > 0 and all(lat > 0 for lat in res["latencies"])
    assert after["pdserve:request_success_total"] - before.get("pdserve:request_success_total", 0) == 6
    assert after["pdserve:prompt_tokens_total"] - before.get("pdserve:prompt_tokens_total", 0) == 6 * 20
    assert after.get("pdserve:generation_tokens_total", 0) == before.get("pdserve:generation_tokens_total", 0)
    assert "Request throughput" in capsys.readouterr().out


def test_openai_backend_without_key_is_refused(http_cluster, monkeypatch, capsys):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    rc = main(["--backend", "openai", "--base-url", http_cluster.http_url, "--vocab-size", "100", "--num-prompts",
               "2", "--disable-tqdm", "--ready-timeout", "5"])
    assert rc == 2
    assert "HTTP 401" in capsys.readouterr().err


def test_random_prefix_len_prompts_share_the_prefix(tmp_path):
    with FakePDServe(FakeConfig(ttft_s=0.0, itl_s=0.0, max_prompt_tokens=200)) as srv:
        rc = main(["--target", srv.target, "--dataset-name", "random", "--random-prefix-len", "12",
                   "--random-input-len", "8", "--random-range-ratio", "0.5", "--random-output-len", "2",
                   "--num-prompts", "6", "--save-result", str(tmp_path / "r.json"), "--disable-tqdm"])
        prompts = [list(r.token_ids) for r in srv.seen.requests]
    assert rc == 0 and len(prompts) == 6
    prefix = prompts[0][:12]
    for p in prompts:
        assert p[:12] == prefix  # the shared prefix, then each prompt's own random part of 4..12 ids
        assert 12 + 4 <= len(p) <= 12 + 12
    assert len({tuple(p[12:]) for p in prompts}) == 6  # the parts after the prefix differ
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["random_prefix_len"] == 12 and sorted(res["input_lens"]) == sorted(len(p) for p in prompts)


def test_build_workload_prefix():
    w = build_workload([(5, 2), (3, 2), (7, 2)], [0.0, 0.0, 0.0], ModelLimits(vocab_size=50000), seed=3,
                       prefix_len=10)
    ids = [r.prompt_token_ids for r in w.requests]
    assert [len(x) for x in ids] == [15, 13, 17]
    assert ids[0][:10] == ids[1][:10] == ids[2][:10]
    assert ids[0][10:13] != ids[1][10:13]
    # clipped to the model's prompt limit: the tail goes, the prefix stays
    w = build_workload([(5, 2)], [0.0], ModelLimits(vocab_size=50000, max_prompt_tokens=12), seed=3, prefix_len=10)
    assert len(w.requests[0].prompt_token_ids) == 12 and w.num_clipped == 1
    assert w.requests[0].prompt_token_ids[:10] == ids[0][:10]


def test_ramp_up_arrivals():
    # vLLM's rates: linear 2 -> 20 over 10 requests moves 2 req/s per request; exponential doubles each third
    assert [ramp_up_rate("linear", 2, 20, i, 10) for i in (0, 1, 9)] == [2, 4, 20]
    assert ramp_up_rate("exponential", 1, 8, 3, 10) == pytest.approx(2.0)
    # with a near-deterministic gamma (burstiness 1e4), each gap is 1 / (the rate of the request before it)
    offs = ramp_up_arrivals(10, "linear", 2, 20, burstiness=1e4, seed=1)
    gaps = [b - a for a, b in zip(offs, offs[1:])]
    assert offs[0] == 0.0
    assert gaps == pytest.approx([1 / (2 + 2 * i) for i in range(9)], rel=0.05)


def test_ramp_up_run_names_its_file(tmp_path):
    with FakePDServe(FakeConfig(ttft_s=0.0, itl_s=0.0)) as srv:
        rc = main(["--target", srv.target, "--num-prompts", "5", "--input-len", "4", "--output-len", "2",
                   "--ramp-up-strategy", "linear", "--ramp-up-start-rps", "20", "--ramp-up-end-rps", "100",
                   "--save-result", "--result-dir", str(tmp_path), "--disable-tqdm"])
    files = list(tmp_path.glob("*.json"))
    assert rc == 0 and len(files) == 1
    assert files[0].name.startswith("pdserve-grpc-ramp-up-linear-20.0qps-100.0qps-fake-"), files[0].name
    res = json.loads(files[0].read_text())
    assert res["ramp_up_strategy"] == "linear" and res["ramp_up_end_rps"] == 100.0
    # gaps at 20, 40, 60, 80 req/s (Poisson): the schedule lasts about 0.05 + 0.025 + 0.017 + 0.0125 s
    assert res["completed"] == 5 and res["start_times"] == sorted(res["start_times"])


BAD = [
    (["--backend", "openai"], "--base-url"),
    (["--backend", "openai", "--base-url", "ftp://x:1", "--vocab-size", "10"], "--base-url"),
    (["--backend", "openai", "--base-url", "http://127.0.0.1:1"], "--tokenizer"),
    (["--backend", "openai", "--base-url", "http://127.0.0.1:1", "--tokenizer", "/nonexistent"], "--tokenizer"),
    (["--backend", "openai", "--base-url", "http://127.0.0.1:1", "--vocab-size", "0"], "--vocab-size"),
    (["--backend", "rest"], "--backend"),
    (["--base-url", "http://127.0.0.1:1"], "--base-url"),
    (["--dataset-name", "trace"], "--trace"),
    (["--dataset-name", "sharegpt"], "--dataset-name"),
    (["--random-prefix-len", "-1"], "--random-prefix-len"),
    (["--random-prefix-len", "x"], "--random-prefix-len"),
    (["--num-warmups", "-1"], "--num-warmups"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1"], "--ramp-up-end-rps"),
    (["--ramp-up-strategy", "exponential", "--ramp-up-start-rps", "0", "--ramp-up-end-rps", "5"],
     "--ramp-up-start-rps"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "9", "--ramp-up-end-rps", "5"], "--ramp-up-start-rps"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "5", "--request-rate", "3"],
     "--request-rate"),
    (["--ramp-up-strategy", "quadratic"], "--ramp-up-strategy"),
    (["--ramp-up-end-rps", "5"], "--ramp-up-strategy"),
    (["--metadata", "novalue"], "--metadata"),
    (["--percentile-metrics", "ttft,bogus"], "--percentile-metrics"),
    (["--metric-percentiles", "50,abc"], "--metric-percentiles"),
    (["--metric-percentiles", "101"], "--metric-percentiles"),
    (["--result-dir", "/tmp/x"], "--save-result"),
]


@pytest.mark.parametrize("argv,flag", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_flags_exit_2_naming_the_flag(argv, flag, capsys):
    # nothing listens on port 1: every one of these must be refused before any connection is tried
    assert main(["--target", "127.0.0.1:1", "--ready-timeout", "0.2", "--disable-tqdm", *argv]) == 2
    assert flag in capsys.readouterr().err


def test_unreachable_base_url(capsys):
    assert main(["--backend", "openai", "--base-url", "http://127.0.0.1:1", "--vocab-size", "10",
                 "--ready-timeout", "0.3", "--disable-tqdm"]) == 2
    assert "unreachable" in capsys.readouterr().err
