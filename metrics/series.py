"""The table of pdserve's Prometheus series: names, types, help, buckets and owners, and the checks on values.

Lifecycle: constants and pure functions, read when a component builds its metrics (``RouterMetrics``,
``WorkerMetrics``) and by tests and dashboards that check names against the owner table.

Names are vLLM's with a ``pdserve:`` prefix instead of ``vllm:``, and histogram buckets are vLLM's
(``vllm/v1/metrics/loggers.py``), so dashboards and alerts written for vLLM carry over by swapping the
prefix. Every series carries the labels ``model_name`` (the served model name, never a filesystem path),
``role`` and ``worker``.

Each series has exactly one owner, split as vLLM splits them (``SERIES`` below): request-level series, what
the client sees, belong to the router (vLLM's API server / output processor); engine-level series belong to
the workers (vLLM's engine core). A component registers only its own role's series, so a dashboard that
sums a name over every pod counts each thing once, and never reads a 0 from a role that cannot know the
value; the role's class has recording methods for its own series only.
"""
from __future__ import annotations

import math
from typing import Any

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



class Labelled(tuple):
    """A histogram's extra slot when it carries labels beyond the identity ones: ``Labelled((buckets, labels))``."""

    @property
    def buckets(self) -> Any:
        return self[0]

    @property
    def labels(self) -> tuple[str, ...]:
        return self[1]


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
    "degraded_requests_total": (ROUTER, "counter", "Requests served on a fallback path (reason: no_prefill = no "
                                "live prefill worker, prefilled on a decode worker; no_decode = run whole on a "
                                "colocated worker; no_kv_pair = Redis away and no prefill worker paired with a decode "
                                "worker, prefilled on the decode worker; kv_transfer_failed = the KV did not reach "
                                "the decode worker, which resumed the request itself).", "reason"),
    "redis_fallbacks_total": (ROUTER, "counter", "Request-path decisions that fell back to this router's own state "
                              "because Redis did not answer within its bound (use: cold_tie = a tie drawn locally "
                              "after at most 50 ms; kv_pair = a request kept off prefill workers with no KV pair up; "
                              "routing = a prefill worker chosen by load only, the KV event index being stale).",
                              "use"),
    "router_requests_in_flight": (ROUTER, "gauge", "Requests the router holds (admitted, not finished), those "
                                  "waiting for KV capacity included.", None),
    "router_requests_waiting": (ROUTER, "gauge", "Requests in the router's admission queue, waiting for KV "
                                "capacity on a decode worker.", None),
    # --- router: cache-aware routing from KV events (router/kv/index.py) ---
    "kv_events_consumed_total": (ROUTER, "counter", "KV event batches applied to the router's index.", None),
    "kv_events_rejected_total": (ROUTER, "counter", "KV event batches the router dropped (reason: malformed, "
                                 "out_of_order, gap = a sequence number skipped, which starts a resync).", "reason"),
    "kv_events_resyncs_total": (ROUTER, "counter", "Workers whose index entries were rebuilt from a snapshot.", None),
    "kv_events_consumer_lag_seconds": (ROUTER, "gauge", "Age of the newest KV event batch the router applied when "
                                       "it applied it (publish time to index).", None),
    "kv_events_redis_errors_total": (ROUTER, "counter", "Failed reads of the KV event streams (Redis unavailable: "
                                     "routing goes load-only until a read succeeds).", None),
    "kv_replica_published_total": (ROUTER, "counter", "Placements the router shared with the other routers on "
                                   "{ns}:kvplace (replica sync: their blocks count as pending on that worker).", None),
    "kv_replica_dropped_total": (ROUTER, "counter", "Placements the router could not share (reason: queue_full, "
                                 "redis_error); routing goes on without them.", "reason"),
    "kv_replica_applied_total": (ROUTER, "counter", "Other routers' placements the router marked pending in its "
                                 "KV index.", None),
    "kv_cold_ties_total": (ROUTER, "counter", "Placements of a prefix cached nowhere with several equal candidates, "
                           "by how the tie was broken (result: shared = through {ns}:kvties, so routers deciding "
                           "at once spread; local = a local draw, Redis unavailable).", "result"),
    "kv_index_blocks": (ROUTER, "gauge", "(block, worker) pairs in the router's KV event index.", None),
    "kv_index_workers": (ROUTER, "gauge", "Workers whose KV events the router's index follows in sync.", None),
    "routing_decisions_total": (ROUTER, "counter", "Prefill/colocated worker choices by what scored them "
                                "(reason: kv_events, mirror = the router-local mirror while a candidate has no "
                                "event stream in sync, load_only = prefix routing off or Redis unavailable).",
                                "reason"),
    "ttft_phase_seconds": (ROUTER, "histogram", "Where each request's time to first token went (phase: placement = "
                           "router receive -> the call that prefills it: the router's queue, choosing workers, the "
                           "decode Reserve; worker_queue = the prefilling worker's queue; prefill = the prefill "
                           "itself; delivery = the first token's way back to the client stream). The phases of a "
                           "request add up to its TTFT.", Labelled((TTFT_BUCKETS, ("phase",)))),
    "decode_routing_decisions_total": (ROUTER, "counter", "Decode worker choices by what ranked them (reason: "
                                       "history = the prompt blocks each holds on the KV event index against its "
                                       "load, mirror = the same on this router's record of what it reserved where "
                                       "while the index does not follow every candidate, load = by load and free "
                                       "blocks alone: no candidate holds any, Redis unavailable, or decode prefix "
                                       "routing off).", "reason"),
    "decode_prefix_stale_total": (ROUTER, "counter", "Reservations on a decode worker that held fewer of the prompt's "
                                  "blocks than the KV event index said (stale events, a restarted worker): what it "
                                  "lacked was transferred instead.", None),
    "quota_rejections_total": (ROUTER, "counter", "Requests refused because their API key's name was over one of "
                               "its limits (router.quotas; limit: requests_per_s, tokens_per_min, max_concurrent).",
                               ("key_name", "limit")),
    "lora_requests_total": (ROUTER, "counter", "Requests served under each LoRA adapter (its name; the base model's "
                            "requests are not counted here): the share of the load each adapter brings.",
                            "lora_name"),
    "stream_stalls_total": (ROUTER, "counter", "Streams cut off because the client stopped reading: one response "
                            "message waited past the router's stall timeout (router.stream_stall; api: grpc, http).",
                            "api"),
    # --- workers: what the engine sees ---
    "num_requests_running": (WORKER, "gauge", "Number of requests in model execution batches.", None),
    "num_requests_waiting": (WORKER, "gauge", "Number of requests waiting to be processed.", None),
    "kv_cache_usage_perc": (WORKER, "gauge", "KV-cache usage. 1 means 100 percent usage.", None),
    "lora_requests_info": (WORKER, "gauge", "Running stats on LoRA requests (vLLM's lora_requests_info, as LoRA-aware "
                           "schedulers read it): the adapters of the requests running and waiting on this worker "
                           "(comma separated), and max_lora, the adapters this worker holds (every worker of a "
                           "pdserve cluster holds them all); the value is when the labels last changed.",
                           ("max_lora", "running_lora_adapters", "waiting_lora_adapters")),
    "tensor_parallel_rank_up": (WORKER, "gauge", "Whether each rank of the worker's engine runs (1) or its process "
                                "has exited (0); an engine of one rank has rank 0 only. A worker with a rank down "
                                "leaves routing and is replaced whole.", "rank"),
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
    "kv_transfers_total": (WORKER, "counter", "KV transfers finished (done), by the link their bytes took: socket = "
                           "gloo or NCCL, ring = a same-host pair's shared-memory slots, pull = the receiver copied "
                           "them from the sender's cache in place (kvtransfer/shm.py).", "link"),
    "kv_transfer_cached_tokens_total": (WORKER, "counter", "Prompt tokens a decode worker's reservation found in its "
                                        "own prefix cache, so they were not transferred (delta transfers).", None),
    "kv_prefix_fetches_total": (WORKER, "counter", "Prompt prefixes a prefill worker could fetch from the decode "
                                "worker that held more of them than its own cache (outcome: done = received and "
                                "reused, fallback = the fetch failed and the tokens were computed, skipped = not made: "
                                "this worker estimated computing them faster than receiving them).", "outcome"),
    "kv_prefix_fetch_tokens_total": (WORKER, "counter", "Prompt tokens a prefill worker received from a decode worker "
                                     "instead of computing them (prefix fetches done).", None),
    "kv_transfer_phase_seconds": (WORKER, "histogram",
                                  "A finished KV transfer's time by part (direction: send = prefill worker, recv = "
                                  "decode worker; phase: pair_wait = building the pair group with the peer "
                                  "(rendezvous), queue = waiting for the layers to be computed or the sender to "
                                  "start and behind other frames, wire = first payload byte to last, ack = last "
                                  "byte to done).", Labelled((KV_TRANSFER_BUCKETS, ("direction", "phase")))),
    "prefix_cache_queries_total": (WORKER, "counter",
                                   "Prefix cache queries, in terms of number of queried tokens.", None),
    "prefix_cache_hits_total": (WORKER, "counter", "Prefix cache hits, in terms of number of cached tokens.", None),
    "num_preemptions_total": (WORKER, "counter", "Cumulative number of preemption from the engine.", None),
    "engine_steps_total": (WORKER, "counter", "Engine steps by how the model ran (path: decode_graph = a decode "
                           "CUDA graph bucket, piecewise = the piecewise CUDA graphs, attention eager, eager = "
                           "neither).", "path"),
    "engine_steps_ahead_total": (WORKER, "counter", "Decode steps launched before the step in flight was read "
                                 "back (async scheduling: their host work overlapped the GPU's).", None),
    "iteration_tokens_total": (WORKER, "histogram", "Histogram of number of tokens per engine_step.",
                               ITERATION_TOKENS_BUCKETS),
    "kv_events_published_total": (WORKER, "counter", "KV event batches the worker appended to its stream.", None),
    "kv_events_dropped_total": (WORKER, "counter", "KV event batches the worker dropped (reason: queue_full = the "
                                "publisher fell behind, redis_error = the append failed); consumers resync.",
                                "reason"),
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
    max_model_len = check_count("max_model_len", max_model_len)
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def check_label(field: str, value: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field} must be a non-empty string, got {value!r}")
    return value


def check_seconds(field: str, seconds: float) -> float:
    seconds = float(seconds)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{field} must be a non-negative number of seconds, got {seconds!r}")
    return seconds


def check_count(field: str, n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{field} must be a non-negative int, got {n!r}")
    return n
