"""The front-end-neutral router: what every public API (gRPC, HTTP) shares.

Lifecycle: one ``RouterCore(cfg, workers)`` per router process. ``load()`` reads the
tokenizer and the model's limits (no weights), builds the metrics and starts the
``WorkerView`` (the pools as routing sees them, refreshed in the background) and, over the Redis
registry, the ``KVEventConsumer`` that keeps the global ``KVIndex`` of the workers' caches. Each front end
validates its own request format into a ``ValidatedRequest`` and iterates
``core.generate(vreq, t0, time_remaining, on_cancel)``: the core admits it against
``max_num_requests`` (RESOURCE_EXHAUSTED at once past it), builds a ``RequestFlow`` (a ``BeamFlow`` for beam
search, which runs its steps as sub-flows), hands its
``cancel`` to the front end's transport (``on_cancel``), yields the flow's ``FlowEvent``s and
keeps the request metrics (tokens, success, end-to-end latency, in-flight gauges). A front end
reports every error it answers with through ``count_error`` so ``request_errors_total``
sees them all. ``draining`` makes ``generate`` refuse new requests (UNAVAILABLE).
``limits`` is the model's, shortened to the smallest context length a live worker publishes
(``WorkerInfo.max_model_len``, re-read at most every view refresh): a router started without the workers'
``--max-model-len`` still refuses a prompt they would refuse, by name, before placing it.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Iterator, Optional

import grpc

from router.admission import AdmissionQueue, RequestBound
from router.clients import WorkerClients
from router.config import RouterConfig
from router.events import FlowError, FlowEvent
from router.flow_pump import HANDOFF, Wait
from router.kv.index import KVEventConsumer, KVIndex
from router.model_info import load_model_view, within_workers_context
from router.output_streams import OutputStreams
from router.placement import Placer
from router.kv.prefix_index import PrefixIndex
from router.request_flow import FlowDeps, RequestFlow
from router.selection import WorkerSelector
from router.validation import ModelLimits, ValidatedRequest
from router.worker_calls import WorkerCalls
from router.response_store import ResponseStore
from router.worker_source import ROLES, WorkerList
from router.worker_view import WorkerView

log = logging.getLogger(__name__)


class RouterCore:
    """Admission, flows and request metrics, shared by every front end (see module docstring)."""

    def __init__(self, cfg: RouterConfig, workers: WorkerList) -> None:
        if not isinstance(cfg, RouterConfig):
            raise ValueError(f"cfg must be a RouterConfig, got {type(cfg).__name__}")
        if not callable(getattr(workers, "list", None)):
            raise ValueError("workers must have a list(role) method (a WorkerList)")
        self.cfg = cfg
        self.view = WorkerView(workers, cfg.worker_view_refresh_s)
        """The pools as routing sees them: refreshed in the background, failed workers out at once."""
        self.selector = WorkerSelector()
        self.prefixes = PrefixIndex()  # which worker this router sent which prefix: the fallback of the KV index
        self.clients = WorkerClients(cfg.cluster_secret, cfg.cluster_tls)
        self.streams = OutputStreams(self.clients.colocated) if cfg.output_streams else None
        """One output stream per decode/colocated worker: its tokens for this router, a message per step."""
        self.calls = WorkerCalls(cfg, self.clients, self.streams)
        """Every worker RPC of a request (Reserve for the placer; streams and aborts for the flows)."""
        self.admission = AdmissionQueue(on_change=lambda n: self._update_gauges())
        self.kv_index = KVIndex()
        """What every worker's prefix cache holds, from their KV events (filled by ``kv_events``)."""
        self.kv_events: Optional[KVEventConsumer] = None
        redis_url, namespace = getattr(workers, "redis_url", None), getattr(workers, "namespace", None)
        if cfg.kv_events and isinstance(redis_url, str) and isinstance(namespace, str):
            self.kv_events = KVEventConsumer(self.kv_index, redis_url, namespace, self._worker_ids,
                                             lambda: self.metrics, pending_s=cfg.kv_pending_s,
                                             replica_sync=cfg.kv_replica_sync)
        self.placer = Placer(cfg, self.view, self.selector, self.calls, self.admission, self.prefixes,
                             self.kv_events, lambda: self.metrics)
        from transport.tracing import Tracing

        self.tracing = Tracing(cfg.otlp_traces_endpoint, "pdserve-router")
        """Request traces (``transport.tracing``; off without ``cfg.otlp_traces_endpoint``)."""
        self.tokenizer: Any = None
        self.reasoning: Any = None
        """(``router.openai.reasoning.ReasoningFormat``, its ``ReasoningMarkers``) of ``cfg.reasoning_parser``, made
        at ``load``; None: no reasoning parser."""
        self._model_limits: Optional[ModelLimits] = None
        """The model's limits as the router's config gives them (``limits`` adds the workers' context length)."""
        self._limits: Optional[ModelLimits] = None
        self._limits_at = float("-inf")
        self.metrics: Any = None
        self.draining = False
        self._lock = threading.Lock()
        self.bound = RequestBound(cfg.max_num_requests)
        """The ``max_num_requests`` bound (requests held, running or waiting for KV capacity)."""
        from router.lora_admin import LoRAAdmin

        self.lora_admin = LoRAAdmin(self)
        """Runtime LoRA loads and unloads (router/lora_admin.py)."""
        self._lora_in_flight: dict[str, int] = {}
        self._lora_lock = threading.Lock()
        self.responses: Optional[ResponseStore] = None
        """Stored responses of the Responses API (router/response_store.py): in the cluster's Redis when the
        worker source is the registry, else in memory; None when ``cfg.responses_store_ttl_s`` is not set."""
        if cfg.responses_store_ttl_s is not None:
            shared = isinstance(redis_url, str) and isinstance(namespace, str)
            self.responses = ResponseStore(cfg.responses_store_ttl_s, redis_url if shared else None,
                                           namespace if shared else None)

    @property
    def num_in_flight(self) -> int:
        return self.bound.held

    @property
    def limits(self) -> Optional[ModelLimits]:
        """What requests are checked against (None before ``load``): the model's limits, with the context length
        of the shortest-context live worker where that is shorter (see module docstring)."""
        base = self._model_limits
        if base is None:
            return None
        now = time.monotonic()
        if now - self._limits_at >= self.view.refresh_s:
            self._limits_at = now
            n = self.view.max_model_len()
            before = self._limits or base
            roots = {k: v for k, v in self.view.lora_roots().items() if k not in self.lora_unloading}
            self._limits = dataclasses.replace(within_workers_context(base, n), lora_adapters=tuple(sorted(roots)),
                                               lora_roots=tuple(sorted(roots.items())))
            if self._limits.max_context_length != before.max_context_length:
                log.warning("router: requests are now checked against a context of %d tokens (the model's %d%s)",
                            self._limits.max_context_length, base.max_context_length,
                            f"; a worker serves {n}" if n else "")
            if self._limits.lora_adapters != before.lora_adapters:
                log.info("router: LoRA adapters served: %s", list(self._limits.lora_adapters) or "none")
        return self._limits

    @property
    def lora_unloading(self) -> set[str]:
        """Adapters being unloaded (router/lora_admin.py): refused from now on, though workers still serve them."""
        return {n for n, e in self.view.lora_entries.items() if e.state == "unloading"} | self.lora_admin.unloading

    def lora_in_flight(self, name: str) -> int:
        """This router's requests under adapter ``name`` now."""
        with self._lora_lock:
            return self._lora_in_flight.get(name, 0)

    def refresh_workers(self) -> None:
        """Re-read the pools now and recompute ``limits`` at the next read (after a runtime LoRA change)."""
        self.view.refresh()
        self._limits_at = float("-inf")

    def load(self) -> None:
        """Tokenizer, limits and metrics (no model weights)."""
        from metrics import RouterMetrics

        self.tokenizer, self._model_limits = load_model_view(self.cfg)
        if self.cfg.reasoning_parser is not None:
            from router.openai.reasoning import format_of

            if self.tokenizer is None:
                raise ValueError("reasoning_parser needs the model's tokenizer, and this model has none")
            fmt = format_of(self.cfg.reasoning_parser)
            self.reasoning = (fmt, fmt.markers(self.tokenizer))
        self.metrics = RouterMetrics(self.cfg.served_model_name, "router",
                                     max_model_len=self._model_limits.max_context_length)
        self.view.start()
        if self.kv_events is not None:
            self.kv_events.start()

    def _worker_ids(self) -> list[str]:
        """Every worker routing sees now (the KV event consumer follows exactly these)."""
        return [w.worker_id for role in ROLES for w in self.view.list(role)]

    def close(self) -> None:
        if self.kv_events is not None:
            self.kv_events.stop()
        self.view.stop()
        if self.streams is not None:
            self.streams.close()
        self.clients.close()
        self.tracing.shutdown()
        if self.responses is not None:
            self.responses.close()

    @property
    def reasoning_markers(self) -> Any:
        """The reasoning parser's markers as token ids (``validate_generate``'s ``reasoning``); None without one."""
        return self.reasoning[1] if self.reasoning is not None else None

    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; send token_ids")
        return self.tokenizer.encode(text)

    def count_error(self, code: grpc.StatusCode) -> None:
        if self.metrics is not None:
            self.metrics.inc_error(code)

    def _update_gauges(self) -> None:
        # The router's own queue, under names of its own (num_requests_running/waiting are the engines'):
        # in flight = every request it holds, the waiting ones included; waiting = queued for KV capacity.
        if self.metrics is None:
            return
        with self._lock:
            self.metrics.set_router_in_flight(self.bound.held)
            self.metrics.set_router_waiting(len(self.admission))

    def generate(self, vreq: ValidatedRequest, t0: float, time_remaining: Optional[float],
                 on_cancel: Callable[[Callable[[], None]], Any], push: bool = False,
                 trace_carrier: Optional[dict] = None) -> Iterator[FlowEvent]:
        """Run one validated request: its events, or FlowError (overload, placement, worker failures). ``push``:
        the events come with the ``router.flow_pump`` markers, for a ``FlowPump`` to drive (beam search has none:
        its steps run as plain sub-flows). ``trace_carrier``: the client's W3C trace context (its request's span
        continues that trace)."""
        if self.limits is None or self.draining:
            raise FlowError(grpc.StatusCode.UNAVAILABLE, "router is not serving")
        if not self.bound.try_take():
            raise FlowError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"request {vreq.request_id}: router queue is full ({self.cfg.max_num_requests} requests "
                            f"in flight, {len(self.admission)} of them waiting for KV capacity)")
        self._update_gauges()
        try:
            budget = self.cfg.request_timeout_s if time_remaining is None else min(time_remaining,
                                                                                 self.cfg.request_timeout_s)
            deps = FlowDeps(self.cfg, self.placer, self.calls, self.tokenizer, self.metrics)
            flow: Any
            if vreq.beam is not None:
                from router.beam_search import BeamFlow

                eos = self.limits.eos_token_id
                flow = BeamFlow(deps, vreq, t0, t0 + budget, self.admission.next_seq, self.limits.vocab_size,
                                None if eos < 0 else eos)
            else:
                flow = RequestFlow(deps, vreq, t0, t0 + budget, self.admission.next_seq(), push=push)
            on_cancel(flow.cancel)  # client cancel / deadline: stop the worker calls at once
            span = self.tracing.start("llm_request", trace_carrier, start=t0, attributes={
                "gen_ai.request.id": vreq.request_id, "gen_ai.response.model": self.limits.model_name,
                "gen_ai.request.max_tokens": vreq.params.max_tokens, "gen_ai.request.temperature":
                vreq.params.temperature, "gen_ai.request.top_p": vreq.params.top_p, "gen_ai.request.n": vreq.n,
                "gen_ai.usage.prompt_tokens": len(vreq.prompt_token_ids)})
            scope = getattr(flow, "scope", None)
            if span is not None and scope is not None:
                scope.trace_span, scope.trace_metadata = span, self.tracing.metadata(span)
            yield from self._counted(flow, vreq, t0, span)
        finally:
            self.bound.give_back()
            self._update_gauges()

    def _counted(self, flow: Any, vreq: ValidatedRequest, t0: float, span: Any = None) -> Iterator[FlowEvent]:
        m = self.metrics
        m.inc_prompt_tokens(len(vreq.prompt_token_ids))
        lora = vreq.params.lora_name
        if lora is not None:
            m.inc_lora_request(lora)
            self.lora_admin.touch(lora)
            with self._lora_lock:
                self._lora_in_flight[lora] = self._lora_in_flight.get(lora, 0) + 1
        n_out = 0
        per_choice: dict[int, int] = {}
        reasons: list[str] = []
        timings: Any = None
        error: Optional[str] = None
        try:
            for ev in flow.run():
                if ev is HANDOFF or type(ev) is Wait:  # a pushed flow's markers, for its pump
                    yield ev
                    continue
                n_out += len(ev.token_ids)
                per_choice[ev.index] = per_choice.get(ev.index, 0) + len(ev.token_ids)
                if ev.finish_reason:
                    m.observe_e2e(time.monotonic() - t0)
                    m.inc_success(ev.finish_reason)
                    reasons.append(ev.finish_reason)
                if ev.usage is not None:  # the request's last event: TPOT over its longest choice's decode
                    timings = ev.timings
                    longest = max(per_choice.values())
                    tpot = ev.timings.decode_s / (longest - 1) if ev.timings is not None and longest > 1 else None
                    m.observe_finished_request(len(vreq.prompt_token_ids), n_out, tpot, vreq.n,
                                               vreq.params.max_tokens)
                yield ev
        except FlowError as e:
            log.warning("request %s: %s %s", vreq.request_id, e.code.name, e.message)
            error = f"{e.code.name}: {e.message}"
            raise
        except GeneratorExit:
            error = "CANCELLED: the client went away"
            raise
        finally:
            m.inc_generation_tokens(n_out)
            if lora is not None:
                with self._lora_lock:
                    left = self._lora_in_flight[lora] - 1
                    if left:
                        self._lora_in_flight[lora] = left
                    else:
                        del self._lora_in_flight[lora]
            if span is not None:
                self._end_trace(span, t0, timings, n_out, reasons, error)

    def _end_trace(self, span: Any, t0: float, t: Any, n_out: int, reasons: list[str], error: Optional[str]) -> None:
        """The request's phases as child spans of its root (from its measured ``Timings``), then the root ends."""
        tr = self.tracing
        if t is not None and t.ttft_s:
            placed, queued = t0 + t.placement_s, t0 + t.placement_s + t.worker_queue_s
            first = t0 + t.ttft_s
            tr.child(span, "router.placement", t0, placed)
            tr.child(span, "worker.queue", placed, queued)
            tr.child(span, "prefill", queued, queued + t.prefill_s)
            tr.child(span, "first_token.delivery", queued + t.prefill_s, first)
            if t.kv_transfer_s:
                tr.child(span, "kv_transfer", queued + t.prefill_s, queued + t.prefill_s + t.kv_transfer_s)
            tr.child(span, "decode", first, first + t.decode_s)
        tr.end(span, {"gen_ai.usage.completion_tokens": n_out,
                      "gen_ai.response.finish_reasons": list(reasons) or None,
                      "gen_ai.latency.time_to_first_token": t.ttft_s if t is not None else None,
                      "gen_ai.latency.time_in_queue": t.queue_s if t is not None else None,
                      "gen_ai.latency.time_in_model_prefill": t.prefill_s if t is not None else None,
                      "gen_ai.latency.time_in_model_decode": t.decode_s if t is not None else None,
                      "gen_ai.latency.e2e": time.monotonic() - t0}, error=error)
