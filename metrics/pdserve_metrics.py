"""Prometheus metrics of one pdserve component (router, prefill or decode worker).

Lifecycle: a component builds one ``PDServeMetrics(model_name, role, worker)``
when it starts; the instance owns a private ``CollectorRegistry`` (never the
process-global one), so several workers, or two whole clusters, can live in one
process without their series colliding. The component calls the small typed
``observe_*`` / ``inc_*`` / ``set_*`` methods on its hot path, exposes the
registry over HTTP with ``serve()`` (a free port by default) and calls the
returned ``stop`` when it shuts down. ``render()`` returns the text exposition
for tests and for components that ship metrics some other way.

Names are vLLM's with a ``pdserve:`` prefix instead of ``vllm:``, and histogram
buckets are vLLM's (``vllm/v1/metrics/loggers.py``), so dashboards and alerts
written for vLLM carry over by swapping the prefix. Every series carries the
labels ``model_name``, ``role`` and ``worker``.
"""
from __future__ import annotations

import math
from typing import Callable, Union

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from metrics.exporter import serve_registry

PREFIX = "pdserve:"
LABELS = ("model_name", "role", "worker")
ROLES = ("router", "prefill", "decode", "colocated")
FINISH_REASONS = ("stop", "length", "abort")

# vLLM's buckets, copied so the histograms line up with vLLM dashboards.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM has no core KV-transfer histogram; a transfer sits on the TTFT path and
# spans sub-millisecond (loopback) to seconds (cross-node), like TTFT itself.
KV_TRANSFER_BUCKETS = TTFT_BUCKETS


def _check_label(field: str, value: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field} must be a non-empty string, got {value!r}")
    return value


def _check_seconds(field: str, seconds: float) -> float:
    seconds = float(seconds)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{field} must be a non-negative number of seconds, got {seconds!r}")
    return seconds


def _check_count(field: str, n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{field} must be a non-negative int, got {n!r}")
    return n


class PDServeMetrics:
    """All pdserve series of one component, in a registry of its own."""

    def __init__(self, model_name: str, role: str, worker: str,
                 registry: CollectorRegistry | None = None) -> None:
        _check_label("model_name", model_name)
        _check_label("worker", worker)
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.model_name, self.role, self.worker = model_name, role, worker
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        labels = (model_name, role, worker)
        reg = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=reg).labels(*labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, LABELS, registry=reg).labels(*labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, LABELS, registry=reg).labels(*labels)

        self._ttft = hist("time_to_first_token_seconds",
                          "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self._itl = hist("inter_token_latency_seconds",
                         "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self._e2e = hist("e2e_request_latency_seconds",
                         "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self._queue = hist("request_queue_time_seconds",
                           "Histogram of time spent in WAITING phase for request.",
                           REQUEST_LATENCY_BUCKETS)
        self._prefill = hist("request_prefill_time_seconds",
                             "Histogram of time spent in PREFILL phase for request.",
                             REQUEST_LATENCY_BUCKETS)
        self._decode = hist("request_decode_time_seconds",
                            "Histogram of time spent in DECODE phase for request.",
                            REQUEST_LATENCY_BUCKETS)
        self._kv_time = hist("kv_transfer_time_seconds",
                             "Histogram of KV-cache transfer time (prefill -> decode) in seconds.",
                             KV_TRANSFER_BUCKETS)
        self._kv_bytes = counter("kv_transfer_bytes", "Number of KV-cache bytes transferred.")
        self._prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self._gen_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self._pc_queries = counter("prefix_cache_queries",
                                   "Prefix cache queries, in terms of number of queried tokens.")
        self._pc_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self._pc_seen = (0, 0)
        self._migrations = counter("request_migrations",
                                   "Requests resumed on another worker after theirs failed mid-stream.")
        self._local_prefill = counter("local_prefill_requests",
                                      "Requests the router had a decode worker prefill itself (conditional "
                                      "disaggregation).")
        self._degraded = Counter(PREFIX + "degraded_requests",
                                 "Requests served on a fallback path because a pool had no live worker "
                                 "(reason: no_prefill = prefilled on a decode worker; no_decode = run whole on a "
                                 "colocated worker).", LABELS + ("reason",), registry=reg)
        self._success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                                LABELS + ("finished_reason",), registry=reg)
        self._errors = Counter(PREFIX + "request_errors", "Count of requests ended by an error, by gRPC status code.",
                               LABELS + ("code",), registry=reg)
        # Pre-create the usual reasons so rate() queries see 0 rather than no series (as vLLM does).
        for reason in FINISH_REASONS:
            self._success.labels(*labels, reason)
        self._running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self._waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self._kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self._labels = labels

    # --- request timings (seconds) ---
    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(_check_seconds("ttft", seconds))

    def observe_itl(self, seconds: float) -> None:
        self._itl.observe(_check_seconds("itl", seconds))

    def observe_e2e(self, seconds: float) -> None:
        self._e2e.observe(_check_seconds("e2e", seconds))

    def observe_queue_time(self, seconds: float) -> None:
        self._queue.observe(_check_seconds("queue_time", seconds))

    def observe_prefill_time(self, seconds: float) -> None:
        self._prefill.observe(_check_seconds("prefill_time", seconds))

    def observe_decode_time(self, seconds: float) -> None:
        self._decode.observe(_check_seconds("decode_time", seconds))

    def observe_kv_transfer(self, seconds: float, num_bytes: int) -> None:
        """One finished KV transfer: its duration and its payload size."""
        self._kv_time.observe(_check_seconds("kv_transfer_time", seconds))
        self._kv_bytes.inc(_check_count("num_bytes", num_bytes))

    # --- counters ---
    def inc_kv_transfer_bytes(self, n: int) -> None:
        self._kv_bytes.inc(_check_count("kv_transfer_bytes", n))

    def inc_prompt_tokens(self, n: int) -> None:
        self._prompt_tokens.inc(_check_count("prompt_tokens", n))

    def inc_generation_tokens(self, n: int) -> None:
        self._gen_tokens.inc(_check_count("generation_tokens", n))

    def set_prefix_cache_totals(self, queries: int, hits: int) -> None:
        """The engine's running totals of prefix-cache query and hit tokens; the counters move by
        the difference since the last call (a smaller total, e.g. a new engine, restarts the base)."""
        q, h = _check_count("prefix_cache_queries", queries), _check_count("prefix_cache_hits", hits)
        q0, h0 = self._pc_seen
        if q < q0 or h < h0:
            q0 = h0 = 0
        self._pc_queries.inc(q - q0)
        self._pc_hits.inc(h - h0)
        self._pc_seen = (q, h)

    def inc_migration(self) -> None:
        self._migrations.inc()

    def inc_degraded(self, reason: str) -> None:
        """A request served on a fallback path (``reason``: "no_prefill" or "no_decode")."""
        self._degraded.labels(*self._labels, reason).inc()

    def inc_local_prefill(self) -> None:
        self._local_prefill.inc()

    def inc_success(self, finished_reason: str) -> None:
        """A request finished normally ("stop", "length", "abort" or another reason)."""
        self._success.labels(*self._labels, _check_label("finished_reason", finished_reason)).inc()

    def inc_error(self, code: Union[grpc.StatusCode, str]) -> None:
        """A request ended in an error; ``code`` is a gRPC status (enum or its name, e.g. "UNAVAILABLE")."""
        name = code.name if isinstance(code, grpc.StatusCode) else _check_label("code", code)
        self._errors.labels(*self._labels, name).inc()

    # --- gauges ---
    def set_running(self, n: int) -> None:
        self._running.set(_check_count("num_requests_running", n))

    def set_waiting(self, n: int) -> None:
        self._waiting.set(_check_count("num_requests_waiting", n))

    def set_kv_cache_usage(self, fraction: float) -> None:
        """Fraction of KV blocks in use, 0..1 (vLLM's ``kv_cache_usage_perc`` is a fraction too)."""
        fraction = float(fraction)
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"kv_cache_usage must be within [0, 1], got {fraction!r}")
        self._kv_usage.set(fraction)

    # --- exposition ---
    def render(self) -> bytes:
        """The registry in Prometheus text format, as /metrics serves it."""
        return generate_latest(self.registry)

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, Callable[[], None]]:
        """Serve /metrics over HTTP; returns ("host:port", stop). Port 0 picks a free port."""
        return serve_registry(self.registry, host, port)
