"""The router's metrics: the request-level series, what the client sees (vLLM's API server and output
processor record these).

Lifecycle: ``RouterCore.load`` builds one ``RouterMetrics(model_name, max_model_len=...)``; the request
flow records each request's timings and tokens as its events pass (TTFT, ITL, a finished request's
histograms, success or error), the core keeps its queue gauges current, and ``serve()`` exposes them
(see ``metrics.component`` for the registry and the endpoint). Only router-owned series exist here.
"""
from __future__ import annotations

from typing import Optional, Union

import grpc
from prometheus_client import CollectorRegistry

from metrics.component import ComponentMetrics
from metrics.series import (DEFAULT_MAX_MODEL_LEN, FINISH_REASONS, check_count, check_label, check_seconds,
                            token_buckets)


class RouterMetrics(ComponentMetrics):
    """The router-owned series (``series_of("router")``) of one router."""

    def __init__(self, model_name: str, worker: str = "router", *, max_model_len: Optional[int] = None,
                 registry: CollectorRegistry | None = None, process_collectors: bool = True) -> None:
        """``worker``: the ``worker`` label of this router's series; ``max_model_len``: the model's context
        length, the top of the token-count buckets (vLLM's), None: ``DEFAULT_MAX_MODEL_LEN``."""
        tokens = token_buckets(DEFAULT_MAX_MODEL_LEN if max_model_len is None else max_model_len)
        if not tokens:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len!r}")
        super().__init__(model_name, "router", worker, registry, tokens, process_collectors)
        # Pre-create the usual reasons so rate() queries see 0 rather than no series (as vLLM does).
        for reason in FINISH_REASONS:
            self._child("request_success_total", reason)

    # --- request timings (seconds) ---
    def observe_ttft(self, seconds: float) -> None:
        self._series["time_to_first_token_seconds"].observe(check_seconds("ttft", seconds))

    def observe_itl(self, seconds: float) -> None:
        self._series["inter_token_latency_seconds"].observe(check_seconds("itl", seconds))

    def observe_e2e(self, seconds: float) -> None:
        self._series["e2e_request_latency_seconds"].observe(check_seconds("e2e", seconds))

    def observe_finished_request(self, prompt_tokens: int, generation_tokens: int, tpot_s: Optional[float],
                                 n: int = 1, max_tokens: Optional[int] = None) -> None:
        """A request that finished normally, once, at its last event (vLLM records these per finished
        request): its prompt and generated token counts (every choice's), its time per output token
        (None: fewer than two output tokens, nothing to average) and its ``n`` and ``max_tokens``
        parameters (None: not given). Nothing is recorded when any value is rejected."""
        prompt_tokens = check_count("prompt_tokens", prompt_tokens)
        generation_tokens = check_count("generation_tokens", generation_tokens)
        tpot = None if tpot_s is None else check_seconds("tpot", tpot_s)
        n = check_count("n", n)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        max_tokens = None if max_tokens is None else check_count("max_tokens", max_tokens)
        self._series["request_prompt_tokens"].observe(prompt_tokens)
        self._series["request_generation_tokens"].observe(generation_tokens)
        if tpot is not None:
            self._series["request_time_per_output_token_seconds"].observe(tpot)
        self._series["request_params_n"].observe(n)
        if max_tokens:  # as vLLM: only when the request set it
            self._series["request_params_max_tokens"].observe(max_tokens)

    # --- counters ---
    def inc_prompt_tokens(self, n: int) -> None:
        self._series["prompt_tokens_total"].inc(check_count("prompt_tokens", n))

    def inc_generation_tokens(self, n: int) -> None:
        self._series["generation_tokens_total"].inc(check_count("generation_tokens", n))

    def inc_migration(self) -> None:
        self._series["request_migrations_total"].inc()

    def inc_degraded(self, reason: str) -> None:
        """A request served on a fallback path (``reason``: "no_prefill", "no_decode", "no_kv_pair",
        "kv_transfer_failed")."""
        self._child("degraded_requests_total", check_label("reason", reason)).inc()

    def inc_redis_fallback(self, use: str) -> None:
        """A request-path decision made on local state because Redis was away (``use``: "cold_tie", "kv_pair",
        "routing")."""
        self._child("redis_fallbacks_total", check_label("use", use)).inc()

    def inc_local_prefill(self) -> None:
        self._series["local_prefill_requests_total"].inc()

    def inc_success(self, finished_reason: str) -> None:
        """A request finished normally ("stop", "length", "abort" or another reason)."""
        self._child("request_success_total", check_label("finished_reason", finished_reason)).inc()

    def inc_error(self, code: Union[grpc.StatusCode, str]) -> None:
        """A request ended in an error; ``code`` is a gRPC status (enum or its name, e.g. "UNAVAILABLE")."""
        name = code.name if isinstance(code, grpc.StatusCode) else check_label("code", code)
        self._child("request_errors_total", name).inc()

    # --- gauges: the router's own queue (num_requests_running/waiting are the engines') ---
    def set_router_in_flight(self, n: int) -> None:
        """Requests the router holds, its waiting ones included (``pdserve:router_requests_in_flight``)."""
        self._series["router_requests_in_flight"].set(check_count("router_requests_in_flight", n))

    def set_router_waiting(self, n: int) -> None:
        """Requests in the router's admission queue (``pdserve:router_requests_waiting``)."""
        self._series["router_requests_waiting"].set(check_count("router_requests_waiting", n))

    # --- per-key quotas (router/quotas.py) ---
    def inc_quota_rejection(self, key_name: str, limit: str) -> None:
        """A request refused over its key's quota (``router.quotas``): the key's name (never the key) and the
        limit it was over."""
        self._child("quota_rejections_total", check_label("key_name", key_name), check_label("limit", limit)).inc()

    def inc_lora_request(self, lora_name: str) -> None:
        """A request admitted under LoRA adapter ``lora_name`` (one of the adapters the workers serve: bounded)."""
        self._child("lora_requests_total", check_label("lora_name", lora_name)).inc()

    def inc_stream_stall(self, api: str) -> None:
        """A stream cut off because its client stopped reading (``router.stream_stall``); ``api``: grpc, http."""
        self._child("stream_stalls_total", check_label("api", api)).inc()

    # --- cache-aware routing (router/kv/index.py) ---
    def inc_kv_events_consumed(self, n: int = 1) -> None:
        self._series["kv_events_consumed_total"].inc(check_count("kv_events_consumed", n))

    def inc_kv_events_rejected(self, reason: str) -> None:
        """A KV event batch dropped (``reason``: "malformed", "out_of_order" or "gap")."""
        self._child("kv_events_rejected_total", check_label("reason", reason)).inc()

    def inc_kv_events_resync(self) -> None:
        self._series["kv_events_resyncs_total"].inc()

    def inc_kv_events_redis_error(self) -> None:
        self._series["kv_events_redis_errors_total"].inc()

    def inc_kv_replica_published(self, n: int = 1) -> None:
        """Placements this router shared with the other routers (router/kv/replica.py)."""
        self._series["kv_replica_published_total"].inc(check_count("kv_replica_published", n))

    def inc_kv_replica_dropped(self, reason: str, n: int = 1) -> None:
        """Placements not shared (``reason``: queue_full, redis_error)."""
        self._child("kv_replica_dropped_total", check_label("reason", reason)).inc(check_count("kv_replica_dropped", n))

    def inc_kv_replica_applied(self, n: int = 1) -> None:
        """Other routers' placements marked pending in this router's index."""
        self._series["kv_replica_applied_total"].inc(check_count("kv_replica_applied", n))

    def inc_kv_cold_tie(self, result: str) -> None:
        """A cold placement's tie broken (``result``: shared, local; router/kv/ties.py)."""
        self._child("kv_cold_ties_total", check_label("result", result)).inc()

    def set_kv_events_lag(self, seconds: float) -> None:
        self._series["kv_events_consumer_lag_seconds"].set(check_seconds("kv_events_lag", seconds))

    def set_kv_index_size(self, blocks: int, workers: int) -> None:
        self._series["kv_index_blocks"].set(check_count("kv_index_blocks", blocks))
        self._series["kv_index_workers"].set(check_count("kv_index_workers", workers))

    def observe_ttft_phases(self, phases: dict[str, float]) -> None:
        """One request's TTFT by part (``phase`` -> seconds: ``router.events.Timings.phases``)."""
        for phase, seconds in phases.items():
            self._child("ttft_phase_seconds", check_label("phase", phase)).observe(
                check_seconds(f"ttft_{phase}", seconds))

    def inc_decode_routing_decision(self, reason: str) -> None:
        """A decode worker ranked for a pair (``reason``: "history", "mirror" or "load")."""
        self._child("decode_routing_decisions_total", check_label("reason", reason)).inc()

    def inc_decode_prefix_stale(self) -> None:
        """A reservation found fewer cached prompt blocks on its decode worker than the KV event index said."""
        self._series["decode_prefix_stale_total"].inc()

    def inc_routing_decision(self, reason: str) -> None:
        """A prefill/colocated worker chosen (``reason``: "kv_events", "mirror" or "load_only")."""
        self._child("routing_decisions_total", check_label("reason", reason)).inc()
