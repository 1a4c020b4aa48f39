"""A worker's metrics: the engine-level series (vLLM's engine core records these), for the prefill, decode
and colocated roles alike.

Lifecycle: ``WorkerBase.load`` builds one ``WorkerMetrics(model_name, role, worker_id)`` with its engine.
Once per engine-loop pass (and after an RPC that changed the load) the worker hands it the engine's
``SchedulerStats`` record (``engine.stats``) through ``record_engine``: the gauges take the state now,
and the counters fed from the engine's running totals move by their difference since the last record
(``metrics.totals.RunningTotals``; a new engine's smaller totals restart the base, counters never go
back). The role's request handling records per-request phase times and KV transfers as they finish.
``serve()`` exposes them (see ``metrics.component``). Only worker-owned series exist here.
"""
from __future__ import annotations

import time
from typing import Protocol, Sequence

from prometheus_client import CollectorRegistry

from metrics.component import ComponentMetrics
from metrics.series import WORKER_ROLES, check_count, check_label, check_seconds
from metrics.totals import RunningTotals


class SpecDecodeRecord(Protocol):
    """The speculative-decoding running totals ``record_engine`` reads (``engine.stats.SpecDecodeTotals``)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: Sequence[int]


class EngineRecord(Protocol):
    """What ``record_engine`` reads of an engine's record (``engine.stats.SchedulerStats``): described here,
    not imported, since metrics knows nothing of the model runtime (shared/DESIGN.md)."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    num_steps: int
    num_scheduled_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    graph_steps: int
    piecewise_steps: int
    ahead_steps: int

    @property
    def kv_cache_usage(self) -> float: ...

    @property
    def spec_decode(self) -> SpecDecodeRecord: ...

    running_lora_adapters: tuple[str, ...]
    waiting_lora_adapters: tuple[str, ...]
    num_lora_adapters: int


class WorkerMetrics(ComponentMetrics):
    """The worker-owned series (``series_of(role)``) of one prefill, decode or colocated worker."""

    def __init__(self, model_name: str, role: str, worker: str, *, registry: CollectorRegistry | None = None,
                 process_collectors: bool = True) -> None:
        if role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {WORKER_ROLES} for a worker, got {role!r}")
        super().__init__(model_name, role, worker, registry, (), process_collectors)
        self._prefix_cache = RunningTotals("prefix_cache_queries", "prefix_cache_hits")
        self._preemptions = RunningTotals("num_preemptions")
        self._steps = RunningTotals("num_steps", "num_scheduled_tokens")
        self._paths = RunningTotals("num_steps", "graph_steps", "piecewise_steps")
        self._ahead = RunningTotals("ahead_steps")
        self._lora_key: tuple[str, str, str] | None = None
        self._spec = RunningTotals("num_drafts", "num_draft_tokens", "num_accepted_tokens", tail="accepted_per_pos")

    def record_engine(self, stats: EngineRecord) -> None:
        """The engine's record now (``LLMEngine.make_stats()``): its load gauges and running totals."""
        self.set_running(stats.num_running)
        self.set_waiting(stats.num_waiting)
        self.set_kv_cache_usage(stats.kv_cache_usage)
        self.set_prefix_cache_totals(stats.prefix_cache_queries, stats.prefix_cache_hits)
        # once per loop pass, so each engine step is one iteration_tokens_total observation
        self.set_engine_totals(stats.num_preemptions, stats.num_steps, stats.num_scheduled_tokens)
        self.set_step_path_totals(stats.num_steps, stats.graph_steps, stats.piecewise_steps)
        self.set_ahead_steps_total(stats.ahead_steps)
        self.set_lora_requests(stats.num_lora_adapters, stats.running_lora_adapters, stats.waiting_lora_adapters)
        sd = stats.spec_decode
        self.set_spec_decode_totals(sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens, sd.accepted_per_pos)

    # --- request phases (seconds) ---
    def observe_queue_time(self, seconds: float) -> None:
        self._series["request_queue_time_seconds"].observe(check_seconds("queue_time", seconds))

    def observe_prefill_time(self, seconds: float) -> None:
        self._series["request_prefill_time_seconds"].observe(check_seconds("prefill_time", seconds))

    def observe_decode_time(self, seconds: float) -> None:
        self._series["request_decode_time_seconds"].observe(check_seconds("decode_time", seconds))

    # --- KV transfer ---
    def observe_kv_transfer(self, seconds: float, num_bytes: int, link: str = "") -> None:
        """One finished KV transfer: its duration, its payload size and the link its bytes took (``kvtransfer``'s
        ``TransferStats.link``; "" counts no link)."""
        seconds, num_bytes = check_seconds("kv_transfer_time", seconds), check_count("num_bytes", num_bytes)
        if link not in ("", "socket", "ring", "pull"):
            raise ValueError(f"link must be socket, ring or pull, got {link!r}")
        self._series["kv_transfer_time_seconds"].observe(seconds)
        self._series["kv_transfer_bytes_total"].inc(num_bytes)
        if link:
            self._child("kv_transfers_total", link).inc()

    def observe_kv_transfer_phases(self, direction: str, phases: dict[str, float]) -> None:
        """One finished KV transfer's parts (``phase`` -> seconds), on its ``direction`` ("send" or "recv")."""
        if direction not in ("send", "recv"):
            raise ValueError(f"direction must be 'send' or 'recv', got {direction!r}")
        for phase, seconds in phases.items():
            self._child("kv_transfer_phase_seconds", direction, check_label("phase", phase)).observe(
                check_seconds(f"kv_transfer_{phase}", seconds))

    def inc_kv_transfer_bytes(self, n: int) -> None:
        self._series["kv_transfer_bytes_total"].inc(check_count("kv_transfer_bytes", n))

    def inc_kv_transfer_cached_tokens(self, n: int) -> None:
        """A decode reservation's prompt tokens already in this worker's prefix cache (not transferred)."""
        self._series["kv_transfer_cached_tokens_total"].inc(check_count("kv_transfer_cached_tokens", n))

    def inc_kv_prefix_fetch(self, outcome: str, tokens: int = 0) -> None:
        """A prefill worker's prefix fetch ended (``outcome``: "done" with the ``tokens`` it received, "fallback":
        it failed and they were computed, "skipped": not made, computing them being estimated faster)."""
        if outcome not in ("done", "fallback", "skipped"):
            raise ValueError(f"outcome must be 'done', 'fallback' or 'skipped', got {outcome!r}")
        tokens = check_count("kv_prefix_fetch_tokens", tokens)  # (checked before anything moves)
        self._child("kv_prefix_fetches_total", outcome).inc()
        self._series["kv_prefix_fetch_tokens_total"].inc(tokens)

    # --- counters fed from the engine's running totals ---
    def set_prefix_cache_totals(self, queries: int, hits: int) -> None:
        """The engine's running totals of prefix-cache query and hit tokens; the counters move by
        the difference since the last call (a smaller total, e.g. a new engine, restarts the base)."""
        dq, dh = self._prefix_cache.advance((queries, hits))
        self._series["prefix_cache_queries_total"].inc(dq)
        self._series["prefix_cache_hits_total"].inc(dh)

    def set_engine_totals(self, preemptions: int, steps: int, scheduled_tokens: int) -> None:
        """The engine's running totals of preemptions, steps and tokens scheduled over those steps.
        ``num_preemptions_total`` moves by the difference since the last call; each new step is one
        ``iteration_tokens_total`` observation of its tokens (a worker calls this once per engine-loop
        pass, so one step at most is new; several new steps share their tokens evenly). A smaller total
        (a new engine) restarts the base, as ``set_prefix_cache_totals``."""
        check_count("num_preemptions", preemptions)  # all checked before anything moves
        check_count("num_steps", steps)
        check_count("num_scheduled_tokens", scheduled_tokens)
        (dp,) = self._preemptions.advance((preemptions,))
        ds, dt = self._steps.advance((steps, scheduled_tokens))
        self._series["num_preemptions_total"].inc(dp)
        if ds:
            per_step = dt / ds
            hist = self._series["iteration_tokens_total"]
            for _ in range(ds):
                hist.observe(per_step)

    def set_step_path_totals(self, steps: int, graph_steps: int, piecewise_steps: int) -> None:
        """The engine's running totals of steps and of those that ran through its decode graphs and its piecewise
        graphs: ``engine_steps_total{path}`` moves by the differences (path ``eager``: the other steps, never
        below zero); smaller totals (a new engine) restart the base."""
        ds, dg, dp = self._paths.advance((steps, graph_steps, piecewise_steps))
        for path, d in (("decode_graph", dg), ("piecewise", dp), ("eager", ds - dg - dp)):
            if d > 0:
                self._child("engine_steps_total", path).inc(d)

    def set_ahead_steps_total(self, ahead_steps: int) -> None:
        """The engine's running total of steps launched ahead of the one in flight (async scheduling):
        ``engine_steps_ahead_total`` moves by the difference (a smaller total, a new engine, restarts the base)."""
        (d,) = self._ahead.advance((ahead_steps,))
        if d:
            self._series["engine_steps_ahead_total"].inc(d)

    def set_spec_decode_totals(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                               accepted_per_pos: Sequence[int]) -> None:
        """The engine's running speculative-decoding totals (``engine.speculative.SpecDecodeStats``); the
        counters move by the difference since the last call (smaller totals, a new engine, restart the base)."""
        deltas = self._spec.advance((num_drafts, num_draft_tokens, num_accepted_tokens, *accepted_per_pos))
        for name, d in zip(("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                            "spec_decode_num_accepted_tokens_total"), deltas):
            if d:
                self._series[name].inc(d)
        for pos, d in enumerate(deltas[3:]):
            if d:
                self._child("spec_decode_num_accepted_tokens_per_pos_total", str(pos)).inc(d)

    # --- gauges: the engine's load ---
    def set_running(self, n: int) -> None:
        """The engine's running requests (the router's own queue is ``RouterMetrics.set_router_in_flight``)."""
        self._series["num_requests_running"].set(check_count("num_requests_running", n))

    def set_waiting(self, n: int) -> None:
        """The engine's waiting requests (the router's own queue is ``RouterMetrics.set_router_waiting``)."""
        self._series["num_requests_waiting"].set(check_count("num_requests_waiting", n))

    def set_kv_cache_usage(self, fraction: float) -> None:
        """Fraction of KV blocks in use, 0..1 (vLLM's ``kv_cache_usage_perc`` is a fraction too)."""
        fraction = float(fraction)
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"kv_cache_usage must be within [0, 1], got {fraction!r}")
        self._series["kv_cache_usage_perc"].set(fraction)

    def set_lora_requests(self, max_lora: int, running: Sequence[str], waiting: Sequence[str]) -> None:
        """vLLM's ``lora_requests_info``: one series whose labels name the adapters of the running and waiting
        requests (comma-separated) and the adapters held (``max_lora``), its value the time they were last seen
        changed. Only the current label set is exposed (the old one is removed), so the series count stays one."""
        key = (str(check_count("max_lora", max_lora)), ",".join(running), ",".join(waiting))
        if key == self._lora_key:
            return
        gauge = self._series["lora_requests_info"]
        gauge.clear()
        gauge.labels(*self._labels, *key).set(time.time())
        self._lora_key = key

    def set_ranks_up(self, ups: Sequence[bool]) -> None:
        """Each tensor-parallel rank's liveness, rank 0 first (``LLMEngine.ranks_up``)."""
        for rank, up in enumerate(ups):
            self._child("tensor_parallel_rank_up", str(rank)).set(1 if up else 0)

    # --- KV events (worker_common/kv_events.py) ---
    def inc_kv_events_published(self, n: int = 1) -> None:
        self._series["kv_events_published_total"].inc(check_count("kv_events_published", n))

    def inc_kv_events_dropped(self, reason: str) -> None:
        """A KV event batch dropped (``reason``: "queue_full" or "redis_error")."""
        self._child("kv_events_dropped_total", reason).inc()
