"""Tests of metrics/'s role classes (RouterMetrics, WorkerMetrics) and the owner table: names and labels,
movement on observation, the methods each role has, the HTTP endpoint, isolation. The counters a worker
feeds from its engine's running totals are in test_engine_counters.py."""
from __future__ import annotations

import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.stats import SchedulerStats
from metrics import OWNERS, ROLES, ComponentMetrics, RouterMetrics, WorkerMetrics, owner_of, series_of
from metrics.series import SERIES
from tests.metrics.helpers import LABELS, ROUTER, component, families, router, samples, value

ROUTER_HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                     "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens",
                     "request_params_n", "request_params_max_tokens", "ttft_phase_seconds"]
ROUTER_COUNTERS = ["request_success", "request_errors", "prompt_tokens", "generation_tokens", "request_migrations",
                   "local_prefill_requests", "degraded_requests", "kv_events_consumed", "kv_events_rejected",
                   "kv_events_resyncs", "kv_events_redis_errors", "kv_replica_published", "kv_replica_dropped",
                   "kv_replica_applied", "kv_cold_ties", "routing_decisions", "decode_routing_decisions",
                   "decode_prefix_stale", "quota_rejections",
                   "stream_stalls", "redis_fallbacks", "lora_requests"]
ROUTER_GAUGES = ["router_requests_in_flight", "router_requests_waiting", "kv_events_consumer_lag_seconds",
                 "kv_index_blocks", "kv_index_workers"]
WORKER_HISTOGRAMS = ["request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                     "kv_transfer_time_seconds", "iteration_tokens_total", "kv_transfer_phase_seconds"]
WORKER_COUNTERS = ["kv_transfer_bytes", "kv_transfers", "kv_transfer_cached_tokens", "kv_prefix_fetches", "kv_prefix_fetch_tokens",
                   "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
                   "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                   "spec_decode_num_accepted_tokens_per_pos", "kv_events_published", "kv_events_dropped",
                   "engine_steps", "engine_steps_ahead"]
WORKER_GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "tensor_parallel_rank_up",
                 "lora_requests_info"]
ROUTER_NAMES = ROUTER_HISTOGRAMS + ROUTER_COUNTERS + ROUTER_GAUGES
WORKER_NAMES = WORKER_HISTOGRAMS + WORKER_COUNTERS + WORKER_GAUGES
@pytest.mark.parametrize("role", ROLES)
def test_each_role_registers_exactly_its_own_series(role):
    labels = {"model_name": "tiny", "role": role, "worker": f"{role}-0"}
    fams = families(component(**labels))
    kinds = ((ROUTER_HISTOGRAMS, "histogram"), (ROUTER_COUNTERS, "counter"), (ROUTER_GAUGES, "gauge")) \
        if role == "router" else ((WORKER_HISTOGRAMS, "histogram"), (WORKER_COUNTERS, "counter"),
                                  (WORKER_GAUGES, "gauge"))
    want = {f"pdserve:{n}": kind for names, kind in kinds for n in names}
    assert {name: f.type for name, f in fams.items()} == want
    # every series carries the three identity labels
    for fam in fams.values():
        for s in fam.samples:
            assert {k: s.labels[k] for k in labels} == labels, (fam.name, s.labels)
    # series_of and the owner table agree with what is registered (counters are listed with "_total")
    # (a histogram keeps "_total" when vLLM's name has it: iteration_tokens_total)
    listed = {n[:-len("_total")] if n.endswith("_total") and SERIES[n][1] == "counter" else n
              for n in series_of(role)}
    assert {f"pdserve:{n}" for n in listed} == set(want)


def test_owner_table_splits_router_and_workers():
    assert set(OWNERS.values()) == {"router", "worker"}
    exported = {n + "_total" if n in ROUTER_COUNTERS + WORKER_COUNTERS else n for n in ROUTER_NAMES + WORKER_NAMES}
    assert set(OWNERS) == exported
    assert owner_of("pdserve:inter_token_latency_seconds") == "router"
    assert owner_of("kv_cache_usage_perc") == "worker"
    assert owner_of("router_requests_waiting") == "router"
    assert set(series_of("router")).isdisjoint(series_of("decode"))
    assert series_of("prefill") == series_of("decode") == series_of("colocated")
    assert router().owns("pdserve:request_success_total")
    assert not WorkerMetrics(**LABELS).owns("request_success_total")
    with pytest.raises(ValueError, match="not a pdserve series"):
        owner_of("vllm:foo")


# (method, arguments, series it records) for every recording method of each role's class
ROUTER_CALLS = [
    ("observe_ttft", (0.1,), "time_to_first_token_seconds"),
    ("observe_itl", (0.1,), "inter_token_latency_seconds"),
    ("observe_e2e", (0.1,), "e2e_request_latency_seconds"),
    ("inc_prompt_tokens", (1,), "prompt_tokens_total"),
    ("inc_generation_tokens", (1,), "generation_tokens_total"),
    ("inc_success", ("stop",), "request_success_total"),
    ("inc_error", ("UNAVAILABLE",), "request_errors_total"),
    ("inc_migration", (), "request_migrations_total"),
    ("inc_local_prefill", (), "local_prefill_requests_total"),
    ("inc_degraded", ("no_prefill",), "degraded_requests_total"),
    ("set_router_in_flight", (1,), "router_requests_in_flight"),
    ("set_router_waiting", (1,), "router_requests_waiting"),
    ("observe_finished_request", (3, 4, 0.01, 1, 4), "request_prompt_tokens"),
    ("inc_kv_events_consumed", (2,), "kv_events_consumed_total"),
    ("inc_kv_events_rejected", ("gap",), "kv_events_rejected_total"),
    ("inc_kv_events_resync", (), "kv_events_resyncs_total"),
    ("inc_kv_events_redis_error", (), "kv_events_redis_errors_total"),
    ("inc_kv_replica_published", (2,), "kv_replica_published_total"),
    ("inc_kv_replica_dropped", ("redis_error", 3), "kv_replica_dropped_total"),
    ("inc_kv_replica_applied", (), "kv_replica_applied_total"),
    ("inc_kv_cold_tie", ("shared",), "kv_cold_ties_total"),
    ("inc_redis_fallback", ("cold_tie",), "redis_fallbacks_total"),
    ("set_kv_events_lag", (0.5,), "kv_events_consumer_lag_seconds"),
    ("set_kv_index_size", (3, 1), "kv_index_blocks"),
    ("inc_routing_decision", ("kv_events",), "routing_decisions_total"),
    ("inc_decode_routing_decision", ("history",), "decode_routing_decisions_total"),
    ("observe_ttft_phases", ({"placement": 0.01, "prefill": 0.02},), "ttft_phase_seconds"),
    ("inc_decode_prefix_stale", (), "decode_prefix_stale_total"),
    ("inc_quota_rejection", ("team-a", "max_concurrent"), "quota_rejections_total"),
    ("inc_stream_stall", ("grpc",), "stream_stalls_total"),
    ("inc_lora_request", ("sql",), "lora_requests_total"),
]
WORKER_CALLS = [
    ("observe_queue_time", (0.1,), "request_queue_time_seconds"),
    ("observe_prefill_time", (0.1,), "request_prefill_time_seconds"),
    ("observe_decode_time", (0.1,), "request_decode_time_seconds"),
    ("observe_kv_transfer", (0.1, 8), "kv_transfer_time_seconds"),
    ("observe_kv_transfer_phases", ("send", {"wire": 0.1}), "kv_transfer_phase_seconds"),
    ("inc_kv_transfer_bytes", (8,), "kv_transfer_bytes_total"),
    ("inc_kv_transfer_cached_tokens", (16,), "kv_transfer_cached_tokens_total"),
    ("inc_kv_prefix_fetch", ("done", 32), "kv_prefix_fetches_total"),
    ("set_prefix_cache_totals", (4, 2), "prefix_cache_queries_total"),
    ("set_running", (1,), "num_requests_running"),
    ("set_waiting", (1,), "num_requests_waiting"),
    ("set_kv_cache_usage", (0.5,), "kv_cache_usage_perc"),
    ("set_engine_totals", (1, 1, 8), "num_preemptions_total"),
    ("set_step_path_totals", (3, 1, 1), "engine_steps_total"),
    ("set_ahead_steps_total", (2,), "engine_steps_ahead_total"),
    ("set_spec_decode_totals", (1, 2, 1, [1, 0]), "spec_decode_num_drafts_total"),
    ("record_engine", (SchedulerStats(num_running=2, num_waiting=1, num_free_blocks=3, num_total_blocks=4,
                                      num_steps=1, num_scheduled_tokens=3, num_preemptions=0,
                                      prefix_cache_queries=0, prefix_cache_hits=0),), "num_requests_running"),
    ("inc_kv_events_published", (), "kv_events_published_total"),
    ("inc_kv_events_dropped", ("queue_full",), "kv_events_dropped_total"),
    ("set_ranks_up", ([True, False],), "tensor_parallel_rank_up"),
    ("set_lora_requests", (2, ["py"], []), "lora_requests_info"),
]


def _pdserve_samples(m: ComponentMetrics) -> dict:
    return {k: v for k, v in samples(m.render()).items()
            if k[0].startswith("pdserve:") and not k[0].endswith("_created")}


def _sample_total(m: ComponentMetrics, series: str) -> float:
    """The sum of a series' samples (a histogram's _count, a counter's or gauge's values)."""
    kind = SERIES[series][1]
    name = "pdserve:" + (series + "_count" if kind == "histogram" else series)
    return sum(v for (n, _labels), v in _pdserve_samples(m).items() if n == name)


@pytest.mark.parametrize("role", ROLES)
def test_each_role_has_methods_for_its_own_series_only(role):
    """A role's class records its own series, each method moving the series it names; a method for a series
    the role does not own does not exist (an AttributeError where the wiring bug is written)."""
    m = component("tiny", role, "w")
    own, foreign = (ROUTER_CALLS, WORKER_CALLS) if role == "router" else (WORKER_CALLS, ROUTER_CALLS)
    for method, args, series in own:
        before = _sample_total(m, series)
        getattr(m, method)(*args)
        assert _sample_total(m, series) > before, (method, series)
    before = _pdserve_samples(m)
    for method, args, _series in foreign:
        assert not hasattr(m, method), method
        with pytest.raises(AttributeError):
            getattr(m, method)(*args)
    assert _pdserve_samples(m) == before
    # every public recording method is in the table above (a new one must say which series it records)
    recording = {n for n in dir(m) if n.startswith(("observe_", "inc_", "set_", "record_"))}
    assert recording == {method for method, _a, _s in own}


def test_router_success_reasons_are_precreated():
    # vLLM pre-creates finished_reason series so they read 0 before any request
    m = router()
    for reason in ("stop", "length", "abort"):
        assert value(m.render(), "pdserve:request_success_total", ROUTER, finished_reason=reason) == 0.0
    # the text form uses the exact names users grep for
    text = m.render().decode()
    assert 'pdserve:prompt_tokens_total{model_name="tiny",role="router",worker="router"} 0.0' in text
    assert "pdserve:router_requests_in_flight{" in text
    assert "kv_cache_usage_perc" not in text and "num_requests_running" not in text
    w = WorkerMetrics(**LABELS).render().decode()
    assert "pdserve:kv_transfer_bytes_total{" in w and 'pdserve:kv_cache_usage_perc{' in w
    assert "request_success" not in w and "inter_token_latency" not in w and "router_requests" not in w


def test_histograms_use_vllm_buckets_and_move():
    r = router()
    # vLLM's TTFT buckets are ..., 0.02, 0.04, ...: 0.03 s lands above 0.02 and within 0.04.
    r.observe_ttft(0.03)
    r.observe_ttft(0.5)  # 0.5 is itself a bucket edge; le is inclusive
    t = r.render()
    assert value(t, "pdserve:time_to_first_token_seconds_bucket", ROUTER, le="0.02") == 0
    assert value(t, "pdserve:time_to_first_token_seconds_bucket", ROUTER, le="0.04") == 1
    assert value(t, "pdserve:time_to_first_token_seconds_bucket", ROUTER, le="0.5") == 2
    assert value(t, "pdserve:time_to_first_token_seconds_count", ROUTER) == 2
    assert value(t, "pdserve:time_to_first_token_seconds_sum", ROUTER) == pytest.approx(0.53)
    # vLLM's ITL buckets start at 0.01; request-latency buckets start at 0.3
    r.observe_itl(0.012)
    r.observe_e2e(0.4)
    t = r.render()
    assert value(t, "pdserve:inter_token_latency_seconds_bucket", ROUTER, le="0.01") == 0
    assert value(t, "pdserve:inter_token_latency_seconds_bucket", ROUTER, le="0.025") == 1
    assert value(t, "pdserve:e2e_request_latency_seconds_bucket", ROUTER, le="0.3") == 0
    assert value(t, "pdserve:e2e_request_latency_seconds_bucket", ROUTER, le="0.5") == 1
    m = WorkerMetrics(**LABELS)
    m.observe_queue_time(0.1)
    m.observe_prefill_time(2.0)
    m.observe_decode_time(0.9)
    t = m.render()
    assert value(t, "pdserve:request_queue_time_seconds_bucket", le="0.3") == 1
    assert value(t, "pdserve:request_prefill_time_seconds_bucket", le="1.5") == 0
    assert value(t, "pdserve:request_prefill_time_seconds_bucket", le="2.0") == 1
    assert value(t, "pdserve:request_decode_time_seconds_bucket", le="0.8") == 0
    assert value(t, "pdserve:request_decode_time_seconds_bucket", le="1.0") == 1


def test_counters_and_gauges_move():
    r = router()
    r.inc_prompt_tokens(100)
    r.inc_prompt_tokens(28)
    r.inc_generation_tokens(7)
    r.inc_success("stop")
    r.inc_success("stop")
    r.inc_success("length")
    r.inc_error(grpc.StatusCode.UNAVAILABLE)
    r.inc_error("INVALID_ARGUMENT")
    r.inc_migration()
    r.inc_local_prefill()
    r.inc_degraded("no_decode")
    r.set_router_in_flight(4)
    r.set_router_waiting(1)
    t = r.render()
    assert value(t, "pdserve:prompt_tokens_total", ROUTER) == 128
    assert value(t, "pdserve:generation_tokens_total", ROUTER) == 7
    assert value(t, "pdserve:request_success_total", ROUTER, finished_reason="stop") == 2
    assert value(t, "pdserve:request_success_total", ROUTER, finished_reason="length") == 1
    assert value(t, "pdserve:request_success_total", ROUTER, finished_reason="abort") == 0
    assert value(t, "pdserve:request_errors_total", ROUTER, code="UNAVAILABLE") == 1
    assert value(t, "pdserve:request_errors_total", ROUTER, code="INVALID_ARGUMENT") == 1
    assert value(t, "pdserve:request_migrations_total", ROUTER) == 1
    assert value(t, "pdserve:local_prefill_requests_total", ROUTER) == 1
    assert value(t, "pdserve:degraded_requests_total", ROUTER, reason="no_decode") == 1
    assert value(t, "pdserve:router_requests_in_flight", ROUTER) == 4
    assert value(t, "pdserve:router_requests_waiting", ROUTER) == 1
    r.set_router_in_flight(0)
    assert value(r.render(), "pdserve:router_requests_in_flight", ROUTER) == 0
    m = WorkerMetrics(**LABELS)
    m.observe_kv_transfer(0.004, 4096)
    m.observe_kv_transfer(0.002, 0, "pull")
    m.observe_kv_transfer(0.002, 0, "pull")
    m.observe_kv_transfer(0.002, 0, "ring")
    with pytest.raises(ValueError, match="link"):
        m.observe_kv_transfer(0.002, 0, "carrier pigeon")
    m.inc_kv_transfer_bytes(1024)
    m.set_running(3)
    m.set_waiting(5)
    m.set_kv_cache_usage(0.25)
    t = m.render()
    assert value(t, "pdserve:kv_transfer_bytes_total") == 4096 + 1024
    assert value(t, "pdserve:kv_transfer_time_seconds_count") == 4
    assert value(t, "pdserve:kv_transfers_total", link="pull") == 2
    assert value(t, "pdserve:kv_transfers_total", link="ring") == 1
    assert value(t, "pdserve:num_requests_running") == 3
    assert value(t, "pdserve:num_requests_waiting") == 5
    assert value(t, "pdserve:kv_cache_usage_perc") == 0.25
    m.set_running(0)
    assert value(m.render(), "pdserve:num_requests_running") == 0


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="role"):
        WorkerMetrics("tiny", "bogus", "w")
    with pytest.raises(ValueError, match="role must be one of .* for a worker"):
        WorkerMetrics("tiny", "router", "w")
    with pytest.raises(ValueError, match="model_name"):
        WorkerMetrics("", "decode", "w")
    with pytest.raises(ValueError, match="model_name"):
        RouterMetrics("")
    with pytest.raises(ValueError, match="worker"):
        RouterMetrics("tiny", "")
    with pytest.raises(ValueError, match="max_model_len"):
        RouterMetrics("tiny", max_model_len=0)
    r = router()
    with pytest.raises(ValueError, match="ttft"):
        r.observe_ttft(-1.0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        r.inc_prompt_tokens(-3)
    with pytest.raises(ValueError, match="router_requests_waiting"):
        r.set_router_waiting(-1)
    # a rejected observation leaves the series untouched
    assert value(r.render(), "pdserve:time_to_first_token_seconds_count", ROUTER) == 0
    m = WorkerMetrics(**LABELS)
    with pytest.raises(ValueError, match="kv_cache_usage"):
        m.set_kv_cache_usage(1.5)
    with pytest.raises(ValueError, match="num_bytes"):
        m.observe_kv_transfer(0.1, -1)
    assert value(m.render(), "pdserve:kv_transfer_time_seconds_count") == 0
    with pytest.raises(ValueError, match="outcome"):
        m.inc_kv_prefix_fetch("maybe")
    with pytest.raises(ValueError, match="kv_prefix_fetch_tokens"):
        m.inc_kv_prefix_fetch("done", -2)
    assert "kv_prefix_fetches_total{" not in m.render().decode()


def test_http_endpoint_serves_on_free_port_and_stops():
    m = router()
    m.inc_generation_tokens(11)
    address, stop = m.serve()
    try:
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
            assert resp.status == 200
            body = resp.read()
        assert value(body, "pdserve:generation_tokens_total", ROUTER) == 11
    finally:
        stop()
    stop()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://{address}/metrics", timeout=2)


def test_two_instances_do_not_collide():
    # Same names, even the same labels: each owns its registry, so no "Duplicated timeseries" error
    # and no cross-talk. Also serve both at once on distinct free ports.
    a = WorkerMetrics("tiny", "prefill", "w")
    b = WorkerMetrics("tiny", "prefill", "w")
    a.inc_kv_transfer_bytes(5)
    b.inc_kv_transfer_bytes(2)
    lab = {"model_name": "tiny", "role": "prefill", "worker": "w"}
    key = ("pdserve:kv_transfer_bytes_total", tuple(sorted(lab.items())))
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


def test_finished_request_histograms_use_vllm_buckets():
    """TPOT with vLLM's buckets (its ITL ones); token counts in vLLM's 1-2-5 series up to the context length;
    n in 1, 2, 5, 10, 20; all observed once per finished request, on the router only."""
    r = router(max_model_len=2048)
    r.observe_finished_request(prompt_tokens=37, generation_tokens=5, tpot_s=0.03, n=1, max_tokens=16)
    r.observe_finished_request(prompt_tokens=200, generation_tokens=1, tpot_s=None, n=3, max_tokens=None)
    t = r.render()
    fam = {f.name: f for f in text_string_to_metric_families(t.decode())}
    edges = sorted({float(s.labels["le"]) for s in fam["pdserve:request_prompt_tokens"].samples
                    if s.name.endswith("_bucket")})
    assert edges == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, float("inf")]
    assert value(t, "pdserve:request_prompt_tokens_bucket", ROUTER, le="20.0") == 0
    assert value(t, "pdserve:request_prompt_tokens_bucket", ROUTER, le="50.0") == 1
    assert value(t, "pdserve:request_prompt_tokens_bucket", ROUTER, le="200.0") == 2
    assert value(t, "pdserve:request_prompt_tokens_sum", ROUTER) == 237
    assert value(t, "pdserve:request_generation_tokens_bucket", ROUTER, le="1.0") == 1
    assert value(t, "pdserve:request_generation_tokens_bucket", ROUTER, le="5.0") == 2
    # TPOT: only the request with two or more output tokens has one; 0.03 s lies in vLLM's (0.025, 0.05]
    assert value(t, "pdserve:request_time_per_output_token_seconds_count", ROUTER) == 1
    assert value(t, "pdserve:request_time_per_output_token_seconds_bucket", ROUTER, le="0.025") == 0
    assert value(t, "pdserve:request_time_per_output_token_seconds_bucket", ROUTER, le="0.05") == 1
    assert value(t, "pdserve:request_params_n_bucket", ROUTER, le="1.0") == 1
    assert value(t, "pdserve:request_params_n_bucket", ROUTER, le="5.0") == 2
    # max_tokens only when the request set it (as vLLM)
    assert value(t, "pdserve:request_params_max_tokens_count", ROUTER) == 1
    assert value(t, "pdserve:request_params_max_tokens_bucket", ROUTER, le="10.0") == 0
    assert value(t, "pdserve:request_params_max_tokens_bucket", ROUTER, le="20.0") == 1
    # a rejected call records nothing
    with pytest.raises(ValueError, match="generation_tokens"):
        r.observe_finished_request(prompt_tokens=3, generation_tokens=-1, tpot_s=0.1)
    with pytest.raises(ValueError, match="n must be >= 1"):
        r.observe_finished_request(prompt_tokens=3, generation_tokens=1, tpot_s=0.1, n=0)
    assert value(r.render(), "pdserve:request_prompt_tokens_count", ROUTER) == 2


def test_process_and_python_collectors_are_on_per_registry():
    for m in (router(), WorkerMetrics(**LABELS)):
        names = {f.name for f in text_string_to_metric_families(m.render().decode())}
        assert {"python_info", "python_gc_objects_collected", "process_cpu_seconds",
                "process_resident_memory_bytes"} <= names, names
    # off on request (a caller whose registry already has them)
    off = router(process_collectors=False).render().decode()
    assert "python_info" not in off and "process_cpu_seconds_total" not in off


def test_serve_checks_host_and_port():
    m = WorkerMetrics(**LABELS)
    with pytest.raises(ValueError, match=r"port must be an integer port in \[0, 65535\] \(0: a free port\)"):
        m.serve(port=70000)
    with pytest.raises(ValueError, match="port"):
        m.serve(port=True)
    with pytest.raises(ValueError, match="host"):
        m.serve(host="")


def test_lora_requests_info_keeps_one_series_with_the_adapters_now():
    """vLLM's lora_requests_info, as a LoRA-aware scheduler reads it: one series, whose labels name the adapters of
    the running and waiting requests now; the old label set goes when they change, and the value (when they last
    changed) stays while they do not."""
    m = WorkerMetrics(**LABELS)

    def series() -> list:
        return [(s.labels["max_lora"], s.labels["running_lora_adapters"], s.labels["waiting_lora_adapters"], s.value)
                for s in families(m)["pdserve:lora_requests_info"].samples]

    m.set_lora_requests(2, ["alt", "py"], ["py"])
    ((max_lora, running, waiting, t0),) = series()
    assert (max_lora, running, waiting) == ("2", "alt,py", "py") and t0 > 1.7e9
    m.set_lora_requests(2, ["alt", "py"], ["py"])
    assert series() == [("2", "alt,py", "py", t0)]
    m.set_lora_requests(2, [], [])
    assert [x[:3] for x in series()] == [("2", "", "")]
    with pytest.raises(ValueError):
        m.set_lora_requests(-1, [], [])
