"""Tests of metrics/: names and labels, movement on observation, the HTTP endpoint, isolation."""
from __future__ import annotations

import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from metrics import PDServeMetrics

HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds", "kv_transfer_time_seconds"]
COUNTERS = ["kv_transfer_bytes", "prompt_tokens", "generation_tokens", "request_success"]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
LABELS = {"model_name": "tiny", "role": "decode", "worker": "decode-0"}


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from the text exposition."""
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: bytes, name: str, **extra: str) -> float:
    return samples(text)[(name, tuple(sorted({**LABELS, **extra}.items())))]


def test_names_types_and_labels_in_render():
    m = PDServeMetrics(**LABELS)
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    for name in HISTOGRAMS:
        assert fams[f"pdserve:{name}"].type == "histogram", name
    for name in COUNTERS:
        assert fams[f"pdserve:{name}"].type == "counter", name
    for name in GAUGES:
        assert fams[f"pdserve:{name}"].type == "gauge", name
    # every series carries the three identity labels
    for name in HISTOGRAMS + COUNTERS + GAUGES:
        for s in fams[f"pdserve:{name}"].samples:
            assert {k: s.labels[k] for k in LABELS} == LABELS, (name, s.labels)
    # vLLM pre-creates finished_reason series so they read 0 before any request
    for reason in ("stop", "length", "abort"):
        assert value(m.render(), "pdserve:request_success_total", finished_reason=reason) == 0.0
    # the text form uses the exact names users grep for
    text = m.render().decode()
    assert 'pdserve:prompt_tokens_total{model_name="tiny",role="decode",worker="decode-0"} 0.0' in text
    assert "pdserve:kv_transfer_bytes_total{" in text


def test_histograms_use_vllm_buckets_and_move():
    m = PDServeMetrics(**LABELS)
    # vLLM's TTFT buckets are ..., 0.02, 0.04, ...: 0.03 s lands above 0.02 and within 0.04.
    m.observe_ttft(0.03)
    m.observe_ttft(0.5)  # 0.5 is itself a bucket edge; le is inclusive
    t = m.render()
    assert value(t, "pdserve:time_to_first_token_seconds_bucket", le="0.02") == 0
    assert value(t, "pdserve:time_to_first_token_seconds_bucket", le="0.04") == 1
    assert value(t, "pdserve:time_to_first_token_seconds_bucket", le="0.5") == 2
    assert value(t, "pdserve:time_to_first_token_seconds_count") == 2
    assert value(t, "pdserve:time_to_first_token_seconds_sum") == pytest.approx(0.53)
    # vLLM's ITL buckets start at 0.01; request-latency buckets start at 0.3
    m.observe_itl(0.012)
    m.observe_e2e(0.4)
    m.observe_queue_time(0.1)
    m.observe_prefill_time(2.0)
    t = m.render()
    assert value(t, "pdserve:inter_token_latency_seconds_bucket", le="0.01") == 0
    assert value(t, "pdserve:inter_token_latency_seconds_bucket", le="0.025") == 1
    assert value(t, "pdserve:e2e_request_latency_seconds_bucket", le="0.3") == 0
    assert value(t, "pdserve:e2e_request_latency_seconds_bucket", le="0.5") == 1
    assert value(t, "pdserve:request_queue_time_seconds_bucket", le="0.3") == 1
    assert value(t, "pdserve:request_prefill_time_seconds_bucket", le="1.5") == 0
    assert value(t, "pdserve:request_prefill_time_seconds_bucket", le="2.0") == 1


def test_counters_and_gauges_move():
    m = PDServeMetrics(**LABELS)
    m.inc_prompt_tokens(100)
    m.inc_prompt_tokens(28)
    m.inc_generation_tokens(7)
    m.observe_kv_transfer(0.004, 4096)
    m.inc_kv_transfer_bytes(1024)
    m.inc_success("stop")
    m.inc_success("stop")
    m.inc_success("length")
    m.inc_error(grpc.StatusCode.UNAVAILABLE)
    m.inc_error("INVALID_ARGUMENT")
    m.set_running(3)
    m.set_waiting(5)
    m.set_kv_cache_usage(0.25)
    t = m.render()
    assert value(t, "pdserve:prompt_tokens_total") == 128
    assert value(t, "pdserve:generation_tokens_total") == 7
    assert value(t, "pdserve:kv_transfer_bytes_total") == 4096 + 1024
    assert value(t, "pdserve:kv_transfer_time_seconds_count") == 1
    assert value(t, "pdserve:request_success_total", finished_reason="stop") == 2
    assert value(t, "pdserve:request_success_total", finished_reason="length") == 1
    assert value(t, "pdserve:request_success_total", finished_reason="abort") == 0
    assert value(t, "pdserve:request_errors_total", code="UNAVAILABLE") == 1
    assert value(t, "pdserve:request_errors_total", code="INVALID_ARGUMENT") == 1
    assert value(t, "pdserve:num_requests_running") == 3
    assert value(t, "pdserve:num_requests_waiting") == 5
    assert value(t, "pdserve:kv_cache_usage_perc") == 0.25
    m.set_running(0)
    assert value(m.render(), "pdserve:num_requests_running") == 0


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="role"):
        PDServeMetrics("tiny", "bogus", "w")
    with pytest.raises(ValueError, match="model_name"):
        PDServeMetrics("", "decode", "w")
    m = PDServeMetrics(**LABELS)
    with pytest.raises(ValueError, match="ttft"):
        m.observe_ttft(-1.0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        m.inc_prompt_tokens(-3)
    with pytest.raises(ValueError, match="kv_cache_usage"):
        m.set_kv_cache_usage(1.5)
    with pytest.raises(ValueError, match="num_bytes"):
        m.observe_kv_transfer(0.1, -1)
    # a rejected observation leaves the series untouched
    assert value(m.render(), "pdserve:time_to_first_token_seconds_count") == 0


def test_http_endpoint_serves_on_free_port_and_stops():
    m = PDServeMetrics(**LABELS)
    m.inc_generation_tokens(11)
    address, stop = m.serve()
    try:
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
            assert resp.status == 200
            body = resp.read()
        assert value(body, "pdserve:generation_tokens_total") == 11
    finally:
        stop()
    stop()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://{address}/metrics", timeout=2)


def test_two_instances_do_not_collide():
    # Same names, even the same labels: each owns its registry, so no "Duplicated timeseries" error
    # and no cross-talk. Also serve both at once on distinct free ports.
    a = PDServeMetrics("tiny", "prefill", "w")
    b = PDServeMetrics("tiny", "prefill", "w")
    a.inc_prompt_tokens(5)
    b.inc_prompt_tokens(2)
    lab = {"model_name": "tiny", "role": "prefill", "worker": "w"}
    key = ("pdserve:prompt_tokens_total", tuple(sorted(lab.items())))
    assert samples(a.render())[key] == 5
    assert samples(b.render())[key] == 2
    addr_a, stop_a = a.serve()
    addr_b, stop_b = b.serve()
    try:
        assert addr_a != addr_b
        for addr, want in ((addr_a, 5), (addr_b, 2)):
            with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as resp:
                assert samples(resp.read())[key] == want
    finally:
        stop_a()
        stop_b()


def test_prefix_cache_counters_follow_engine_totals():
    m = PDServeMetrics(**LABELS)
    m.set_prefix_cache_totals(100, 0)
    m.set_prefix_cache_totals(164, 48)
    m.set_prefix_cache_totals(164, 48)  # no new admissions: no movement
    t = m.render()
    assert value(t, "pdserve:prefix_cache_queries_total") == 164
    assert value(t, "pdserve:prefix_cache_hits_total") == 48
    m.set_prefix_cache_totals(10, 2)  # a new engine restarted its totals: counters never go back
    t = m.render()
    assert value(t, "pdserve:prefix_cache_queries_total") == 174
    assert value(t, "pdserve:prefix_cache_hits_total") == 50
    with pytest.raises(ValueError, match="prefix_cache_hits"):
        m.set_prefix_cache_totals(1, -1)
