"""Prometheus metrics of one pdserve component (router, prefill, decode or colocated worker).

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
labels ``model_name`` (the served model name, never a filesystem path), ``role``
and ``worker``. Each registry also has prometheus-client's process, platform and
GC collectors (``process_*``, ``python_*``: per process, unlabelled), as vLLM's
server has them.

Each series has exactly one owner, split as vLLM splits them (``SERIES`` below):
request-level series, what the client sees, belong to the router (vLLM's API
server / output processor); engine-level series belong to the workers (vLLM's
engine core). A component registers only its own role's series, so a dashboard
that sums a name over every pod counts each thing once, and never reads a 0
from a role that cannot know the value. Calling a method for a series this role
does not own raises ``RuntimeError`` naming the series and its owner: a wiring
bug fails loudly in tests instead of exporting a second, meaningless copy.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import grpc
from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram, PlatformCollector,
                               ProcessCollector, generate_latest)

from metrics.exporter import serve_registry

PREFIX = "pdserve:"
LABELS = ("model_name", "role", "worker")
ROLES = ("router", "prefill", "decode", "colocated")
WORKER_ROLES = ("prefill", "decode", "colocated")
FINISH_REASONS = ("stop", "length", "abort")

# vLLM's buckets, copied so the histograms line up with vLLM dashboards.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's request_time_per_output_token_seconds buckets are its ITL buckets.
TPOT_BUCKETS = ITL_BUCKETS
# vLLM's iteration_tokens_total buckets (tokens scheduled in one engine step).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM's request_params_n buckets.
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# Token-count histograms (request_prompt_tokens, ...) use vLLM's 1-2-5 series up to the model's context length,
# known only when the component is built: the table names them by this marker (``token_buckets``).
MODEL_LEN_BUCKETS = "1-2-5 up to max_model_len"
DEFAULT_MAX_MODEL_LEN = 1_000_000
"""The top of the token-count buckets when a component does not give its model's context length."""
# vLLM has no core KV-transfer histogram; a transfer sits on the TTFT path and
# spans sub-millisecond (loopback) to seconds (cross-node), like TTFT itself.
KV_TRANSFER_BUCKETS = TTFT_BUCKETS

# Owners: "router" (request-level, vLLM's front end) or "worker" (engine-level: prefill, decode, colocated).
ROUTER, WORKER = "router", "worker"
OWNER_ROLES = {ROUTER: ("router",), WORKER: WORKER_ROLES}

# Every series: exported name (without the prefix, as /metrics shows it) -> (owner, type, help, buckets or
# extra label). Counters are declared without "_total" (prometheus-client appends it).
SERIES: dict[str, tuple[str, str, str, Any]] = {
    # --- router: what the client sees ---
    "time_to_first_token_seconds": (ROUTER, "histogram", "Histogram of time to first token in seconds.",
                                    TTFT_BUCKETS),
    "inter_token_latency_seconds": (ROUTER, "histogram", "Histogram of inter-token latency in seconds.",
                                    ITL_BUCKETS),
    "e2e_request_latency_seconds": (ROUTER, "histogram", "Histogram of e2e request latency in seconds.",
                                    REQUEST_LATENCY_BUCKETS),
    "request_time_per_output_token_seconds": (ROUTER, "histogram",
                                              "Histogram of time_per_output_token_seconds per request.",
                                              TPOT_BUCKETS),
    "request_prompt_tokens": (ROUTER, "histogram", "Number of prefill tokens processed.", MODEL_LEN_BUCKETS),
    "request_generation_tokens": (ROUTER, "histogram", "Number of generation tokens processed.",
                                  MODEL_LEN_BUCKETS),
    "request_params_n": (ROUTER, "histogram", "Histogram of the n request parameter.", PARAMS_N_BUCKETS),
    "request_params_max_tokens": (ROUTER, "histogram", "Histogram of the max_tokens request parameter.",
                                  MODEL_LEN_BUCKETS),
    "request_success_total": (ROUTER, "counter", "Count of successfully processed requests.", "finished_reason"),
    "request_errors_total": (ROUTER, "counter", "Count of requests ended by an error, by gRPC status code.",
                             "code"),
    "prompt_tokens_total": (ROUTER, "counter", "Number of prefill tokens processed.", None),
    "generation_tokens_total": (ROUTER, "counter", "Number of generation tokens processed.", None),
    "request_migrations_total": (ROUTER, "counter",
                                 "Requests resumed on another worker after theirs failed mid-stream.", None),
    "local_prefill_requests_total": (ROUTER, "counter", "Requests the router had a decode worker prefill itself "
                                     "(conditional disaggregation).", None),
    "degraded_requests_total": (ROUTER, "counter", "Requests served on a fallback path because a pool had no live "
                                "worker (reason: no_prefill = prefilled on a decode worker; no_decode = run whole "
                                "on a colocated worker).", "reason"),
    "router_requests_in_flight": (ROUTER, "gauge", "Requests the router holds (admitted, not finished), those "
                                  "waiting for KV capacity included.", None),
    "router_requests_waiting": (ROUTER, "gauge", "Requests in the router's admission queue, waiting for KV "
                                "capacity on a decode worker.", None),
    # --- workers: what the engine sees ---
    "num_requests_running": (WORKER, "gauge", "Number of requests in model execution batches.", None),
    "num_requests_waiting": (WORKER, "gauge", "Number of requests waiting to be processed.", None),
    "kv_cache_usage_perc": (WORKER, "gauge", "KV-cache usage. 1 means 100 percent usage.", None),
    "request_queue_time_seconds": (WORKER, "histogram", "Histogram of time spent in WAITING phase for request.",
                                   REQUEST_LATENCY_BUCKETS),
    "request_prefill_time_seconds": (WORKER, "histogram", "Histogram of time spent in PREFILL phase for request.",
                                     REQUEST_LATENCY_BUCKETS),
    "request_decode_time_seconds": (WORKER, "histogram", "Histogram of time spent in DECODE phase for request.",
                                    REQUEST_LATENCY_BUCKETS),
    "kv_transfer_time_seconds": (WORKER, "histogram",
                                 "Histogram of KV-cache transfer time (prefill -> decode) in seconds.",
                                 KV_TRANSFER_BUCKETS),
    "kv_transfer_bytes_total": (WORKER, "counter", "Number of KV-cache bytes transferred.", None),
    "prefix_cache_queries_total": (WORKER, "counter",
                                   "Prefix cache queries, in terms of number of queried tokens.", None),
    "prefix_cache_hits_total": (WORKER, "counter", "Prefix cache hits, in terms of number of cached tokens.", None),
    "num_preemptions_total": (WORKER, "counter", "Cumulative number of preemption from the engine.", None),
    "iteration_tokens_total": (WORKER, "histogram", "Histogram of number of tokens per engine_step.",
                               ITERATION_TOKENS_BUCKETS),
    # --- workers: speculative decoding (vLLM's spec_decode series) ---
    "spec_decode_num_drafts_total": (WORKER, "counter", "Number of spec decoding drafts.", None),
    "spec_decode_num_draft_tokens_total": (WORKER, "counter", "Number of draft tokens.", None),
    "spec_decode_num_accepted_tokens_total": (WORKER, "counter", "Number of accepted tokens.", None),
    "spec_decode_num_accepted_tokens_per_pos_total": (WORKER, "counter",
                                                      "Accepted tokens per draft position.", "position"),
}
OWNERS: dict[str, str] = {name: spec[0] for name, spec in SERIES.items()}
"""Series name (as exported, without the prefix) -> owner: "router" or "worker"."""


def owner_of(name: str) -> str:
    """The owner ("router" or "worker") of a series, named with or without the ``pdserve:`` prefix."""
    key = name[len(PREFIX):] if name.startswith(PREFIX) else name
    if key not in OWNERS:
        raise ValueError(f"{name!r} is not a pdserve series")
    return OWNERS[key]


def series_of(role: str) -> tuple[str, ...]:
    """The series names (without the prefix) a component of ``role`` registers."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return tuple(n for n, owner in OWNERS.items() if role in OWNER_ROLES[owner])


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (inclusive)."""
    max_model_len = _check_count("max_model_len", max_model_len)
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


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
    """The pdserve series one component owns, in a registry of its own."""

    def __init__(self, model_name: str, role: str, worker: str,
                 registry: CollectorRegistry | None = None, max_model_len: int | None = None,
                 process_collectors: bool = True) -> None:
        """``max_model_len``: the model's context length, the top of the token-count buckets (vLLM's);
        None: ``DEFAULT_MAX_MODEL_LEN``. ``process_collectors``: register prometheus-client's process,
        platform and GC collectors (``process_*``, ``python_*``) too, as vLLM's server has them."""
        _check_label("model_name", model_name)
        _check_label("worker", worker)
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        tokens = token_buckets(DEFAULT_MAX_MODEL_LEN if max_model_len is None else max_model_len)
        if not tokens:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len!r}")
        self.model_name, self.role, self.worker = model_name, role, worker
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        if process_collectors:
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            GCCollector(registry=self.registry)
        self._labels = labels = (model_name, role, worker)
        # name -> the labelled child, or the parent when the series has one more label (bound per call)
        self._series: dict[str, Any] = {}
        for name in series_of(role):
            _owner, kind, doc, extra = SERIES[name]
            full = PREFIX + (name[:-len("_total")] if kind == "counter" else name)
            if kind == "histogram":
                self._series[name] = Histogram(full, doc, LABELS, buckets=tokens if extra == MODEL_LEN_BUCKETS else extra,
                                               registry=self.registry).labels(*labels)
            elif kind == "gauge":
                self._series[name] = Gauge(full, doc, LABELS, registry=self.registry).labels(*labels)
            elif extra is None:
                self._series[name] = Counter(full, doc, LABELS, registry=self.registry).labels(*labels)
            else:
                self._series[name] = Counter(full, doc, LABELS + (extra,), registry=self.registry)
        if role == "router":
            # Pre-create the usual reasons so rate() queries see 0 rather than no series (as vLLM does).
            for reason in FINISH_REASONS:
                self._series["request_success_total"].labels(*labels, reason)
        self._pc_seen = (0, 0)
        self._engine_seen = (0, 0, 0)  # preemptions, steps, scheduled tokens (set_engine_totals)
        self._spec_seen: tuple = (0, 0, 0, ())  # drafts, draft tokens, accepted, per position (set_spec_totals)

    def owns(self, name: str) -> bool:
        """Whether this component registers the series ``name`` (with or without the prefix)."""
        return self.role in OWNER_ROLES[owner_of(name)]

    def _get(self, name: str) -> Any:
        series = self._series.get(name)
        if series is None:
            owner = OWNERS[name]
            raise RuntimeError(
                f"{PREFIX}{name} is owned by the {owner} (roles: {', '.join(OWNER_ROLES[owner])}); this "
                f"{self.role!r} component ({self.worker}) must not record it (see metrics.OWNERS)")
        return series

    # --- request timings (seconds) ---
    def observe_ttft(self, seconds: float) -> None:
        self._get("time_to_first_token_seconds").observe(_check_seconds("ttft", seconds))

    def observe_itl(self, seconds: float) -> None:
        self._get("inter_token_latency_seconds").observe(_check_seconds("itl", seconds))

    def observe_e2e(self, seconds: float) -> None:
        self._get("e2e_request_latency_seconds").observe(_check_seconds("e2e", seconds))

    def observe_queue_time(self, seconds: float) -> None:
        self._get("request_queue_time_seconds").observe(_check_seconds("queue_time", seconds))

    def observe_prefill_time(self, seconds: float) -> None:
        self._get("request_prefill_time_seconds").observe(_check_seconds("prefill_time", seconds))

    def observe_decode_time(self, seconds: float) -> None:
        self._get("request_decode_time_seconds").observe(_check_seconds("decode_time", seconds))

    def observe_kv_transfer(self, seconds: float, num_bytes: int) -> None:
        """One finished KV transfer: its duration and its payload size."""
        hist, total = self._get("kv_transfer_time_seconds"), self._get("kv_transfer_bytes_total")
        seconds, num_bytes = _check_seconds("kv_transfer_time", seconds), _check_count("num_bytes", num_bytes)
        hist.observe(seconds)
        total.inc(num_bytes)

    def observe_finished_request(self, prompt_tokens: int, generation_tokens: int, tpot_s: Optional[float],
                                 n: int = 1, max_tokens: Optional[int] = None) -> None:
        """A request that finished normally, once, at its last event (vLLM records these per finished
        request): its prompt and generated token counts (every choice's), its time per output token
        (None: fewer than two output tokens, nothing to average) and its ``n`` and ``max_tokens``
        parameters (None: not given). Nothing is recorded when any value is rejected."""
        names = ("request_prompt_tokens", "request_generation_tokens", "request_time_per_output_token_seconds",
                 "request_params_n", "request_params_max_tokens")
        prompt_h, gen_h, tpot_h, n_h, max_h = (self._get(name) for name in names)
        prompt_tokens = _check_count("prompt_tokens", prompt_tokens)
        generation_tokens = _check_count("generation_tokens", generation_tokens)
        tpot = None if tpot_s is None else _check_seconds("tpot", tpot_s)
        n = _check_count("n", n)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        max_tokens = None if max_tokens is None else _check_count("max_tokens", max_tokens)
        prompt_h.observe(prompt_tokens)
        gen_h.observe(generation_tokens)
        if tpot is not None:
            tpot_h.observe(tpot)
        n_h.observe(n)
        if max_tokens:  # as vLLM: only when the request set it
            max_h.observe(max_tokens)

    # --- counters ---
    def inc_kv_transfer_bytes(self, n: int) -> None:
        self._get("kv_transfer_bytes_total").inc(_check_count("kv_transfer_bytes", n))

    def inc_prompt_tokens(self, n: int) -> None:
        self._get("prompt_tokens_total").inc(_check_count("prompt_tokens", n))

    def inc_generation_tokens(self, n: int) -> None:
        self._get("generation_tokens_total").inc(_check_count("generation_tokens", n))

    def set_prefix_cache_totals(self, queries: int, hits: int) -> None:
        """The engine's running totals of prefix-cache query and hit tokens; the counters move by
        the difference since the last call (a smaller total, e.g. a new engine, restarts the base)."""
        pc_queries, pc_hits = self._get("prefix_cache_queries_total"), self._get("prefix_cache_hits_total")
        q, h = _check_count("prefix_cache_queries", queries), _check_count("prefix_cache_hits", hits)
        q0, h0 = self._pc_seen
        if q < q0 or h < h0:
            q0 = h0 = 0
        pc_queries.inc(q - q0)
        pc_hits.inc(h - h0)
        self._pc_seen = (q, h)

    def set_engine_totals(self, preemptions: int, steps: int, scheduled_tokens: int) -> None:
        """The engine's running totals of preemptions, steps and tokens scheduled over those steps.
        ``num_preemptions_total`` moves by the difference since the last call; each new step is one
        ``iteration_tokens_total`` observation of its tokens (a worker calls this once per engine-loop
        pass, so one step at most is new; several new steps share their tokens evenly). A smaller total
        (a new engine) restarts the base, as ``set_prefix_cache_totals``."""
        preempt_c, iter_h = self._get("num_preemptions_total"), self._get("iteration_tokens_total")
        p = _check_count("num_preemptions", preemptions)
        s, t = _check_count("num_steps", steps), _check_count("num_scheduled_tokens", scheduled_tokens)
        p0, s0, t0 = self._engine_seen
        if p < p0:
            p0 = 0
        if s < s0 or t < t0:
            s0 = t0 = 0
        preempt_c.inc(p - p0)
        if s > s0:
            per_step = (t - t0) / (s - s0)
            for _ in range(s - s0):
                iter_h.observe(per_step)
        self._engine_seen = (p, s, t)

    def set_spec_decode_totals(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                               accepted_per_pos: "list[int] | tuple[int, ...]") -> None:
        """The engine's running speculative-decoding totals (``engine.speculative.SpecDecodeStats``); the
        counters move by the difference since the last call (smaller totals, a new engine, restart the base)."""
        now = (_check_count("num_drafts", num_drafts), _check_count("num_draft_tokens", num_draft_tokens),
               _check_count("num_accepted_tokens", num_accepted_tokens),
               tuple(_check_count("accepted_per_pos", v) for v in accepted_per_pos))
        before = self._spec_seen
        if any(a < b for a, b in zip(now[:3], before[:3])) or len(now[3]) < len(before[3]):
            before = (0, 0, 0, ())
        for name, a, b in zip(("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                               "spec_decode_num_accepted_tokens_total"), now[:3], before[:3]):
            if a > b:
                self._get(name).inc(a - b)
        per_pos = self._get("spec_decode_num_accepted_tokens_per_pos_total")
        for pos, a in enumerate(now[3]):
            b = before[3][pos] if pos < len(before[3]) else 0
            if a > b:
                per_pos.labels(*self._labels, str(pos)).inc(a - b)
        self._spec_seen = now

    def inc_migration(self) -> None:
        self._get("request_migrations_total").inc()

    def inc_degraded(self, reason: str) -> None:
        """A request served on a fallback path (``reason``: "no_prefill" or "no_decode")."""
        self._get("degraded_requests_total").labels(*self._labels, _check_label("reason", reason)).inc()

    def inc_local_prefill(self) -> None:
        self._get("local_prefill_requests_total").inc()

    def inc_success(self, finished_reason: str) -> None:
        """A request finished normally ("stop", "length", "abort" or another reason)."""
        counter = self._get("request_success_total")
        counter.labels(*self._labels, _check_label("finished_reason", finished_reason)).inc()

    def inc_error(self, code: Union[grpc.StatusCode, str]) -> None:
        """A request ended in an error; ``code`` is a gRPC status (enum or its name, e.g. "UNAVAILABLE")."""
        counter = self._get("request_errors_total")
        name = code.name if isinstance(code, grpc.StatusCode) else _check_label("code", code)
        counter.labels(*self._labels, name).inc()

    # --- gauges ---
    def set_running(self, n: int) -> None:
        """The engine's running requests (a worker's; the router's own queue is ``set_router_in_flight``)."""
        self._get("num_requests_running").set(_check_count("num_requests_running", n))

    def set_waiting(self, n: int) -> None:
        """The engine's waiting requests (a worker's; the router's own queue is ``set_router_waiting``)."""
        self._get("num_requests_waiting").set(_check_count("num_requests_waiting", n))

    def set_kv_cache_usage(self, fraction: float) -> None:
        """Fraction of KV blocks in use, 0..1 (vLLM's ``kv_cache_usage_perc`` is a fraction too)."""
        gauge = self._get("kv_cache_usage_perc")
        fraction = float(fraction)
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"kv_cache_usage must be within [0, 1], got {fraction!r}")
        gauge.set(fraction)

    def set_router_in_flight(self, n: int) -> None:
        """Requests the router holds, its waiting ones included (``pdserve:router_requests_in_flight``)."""
        self._get("router_requests_in_flight").set(_check_count("router_requests_in_flight", n))

    def set_router_waiting(self, n: int) -> None:
        """Requests in the router's admission queue (``pdserve:router_requests_waiting``)."""
        self._get("router_requests_waiting").set(_check_count("router_requests_waiting", n))

    # --- exposition ---
    def render(self) -> bytes:
        """The registry in Prometheus text format, as /metrics serves it."""
        return generate_latest(self.registry)

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, Callable[[], None]]:
        """Serve /metrics over HTTP; returns ("host:port", stop). Port 0 picks a free port."""
        return serve_registry(self.registry, host, port)
