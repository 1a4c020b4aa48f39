"""The router: the public ``pdserve.v1.PDServe`` gRPC service in front of the worker pools.

Lifecycle: ``RouterServer(cfg, workers)`` -> ``start()`` loads the tokenizer and
limits (no weights), binds (port 0 = free), serves health (SERVING once loaded) and
reflection. Each ``Generate`` is validated (INVALID_ARGUMENT naming the field),
admitted against ``max_queue`` (RESOURCE_EXHAUSTED at once when the router already holds
that many, running or waiting), then driven by a flow (``DisaggregatedFlow``, which
waits in the router's ``AdmissionQueue`` while no decode worker has KV room, or
``ColocatedFlow`` in colocated mode, where the worker queues) whose responses
stream to the client; a client cancel or deadline cancels the flow, which aborts
the request on its workers. ``stop()`` (or ``drain``) ends serving.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterator, Optional

import grpc

from worker_common.serving import GrpcServing
from proto import pdserve_pb2, pdserve_pb2_grpc
from router.admission import AdmissionQueue
from router.clients import WorkerClients
from router.config import RouterConfig
from router.model_info import load_model_view
from router.prefix_index import PrefixIndex
from router.request_flow import DisaggregatedFlow, FlowDeps, FlowError
from router.selection import WorkerSelector, prefill_locally
from router.validation import ModelLimits, validate_generate
from router.worker_source import WorkerSource

log = logging.getLogger(__name__)


class RouterServer(pdserve_pb2_grpc.PDServeServicer):
    """Public gRPC front end (see module docstring)."""

    def __init__(self, cfg: RouterConfig, workers: WorkerSource) -> None:
        if not isinstance(cfg, RouterConfig):
            raise ValueError(f"cfg must be a RouterConfig, got {type(cfg).__name__}")
        if not callable(getattr(workers, "list", None)):
            raise ValueError("workers must have a list(role) method (a WorkerSource)")
        self.cfg = cfg
        self.workers = workers
        self._serving = GrpcServing("router", cfg.host, cfg.port, cfg.max_rpc_threads)
        self.selector = WorkerSelector()
        self.prefixes = PrefixIndex()  # which worker was sent which prompt prefix (prefix-aware routing)
        self.clients = WorkerClients()
        self.tokenizer: Any = None
        self.limits: Optional[ModelLimits] = None
        self.metrics: Any = None
        self.metrics_address = ""
        self._metrics_stop: Optional[Callable[[], None]] = None
        self._lock = threading.Lock()
        self._in_flight = 0
        self._draining = False
        self.admission = AdmissionQueue(on_change=lambda n: self._update_gauges())

    @property
    def address(self) -> str:
        return self._serving.address

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the admission queue for decode KV capacity."""
        return len(self.admission)

    def _update_gauges(self) -> None:
        # num_requests_waiting: queued for KV capacity; num_requests_running: the rest the router holds
        if self.metrics is None:
            return
        with self._lock:
            waiting = len(self.admission)
            self.metrics.set_waiting(waiting)
            self.metrics.set_running(max(0, self._in_flight - waiting))

    def start(self) -> "RouterServer":
        self.bind()
        self.load()
        return self

    def bind(self) -> str:
        """Start the gRPC server (health NOT_SERVING until ``load`` finishes)."""
        return self._serving.start(self._register)

    def load(self) -> None:
        """Load the tokenizer and limits, start metrics, then report SERVING."""
        from metrics import PDServeMetrics

        self.tokenizer, self.limits = load_model_view(self.cfg)
        self.metrics = PDServeMetrics(self.cfg.served_model_name, "router", "router")
        if self.cfg.serve_metrics:
            self.metrics_address, self._metrics_stop = self.metrics.serve(host=self.cfg.host, port=0)
        if not self._draining:
            self._serving.set_serving(True)
        log.info("router on %s (%s mode)", self.address, self.cfg.mode)

    def _register(self, server: grpc.Server) -> list[str]:
        pdserve_pb2_grpc.add_PDServeServicer_to_server(self, server)
        return [pdserve_pb2.DESCRIPTOR.services_by_name["PDServe"].full_name]

    def drain(self, timeout_s: float = 30.0) -> bool:
        """NOT_SERVING, refuse new requests, wait for in-flight ones, stop. True if all finished."""
        self._draining = True
        self._serving.set_serving(False)
        deadline = time.monotonic() + timeout_s
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        clean = self._in_flight == 0
        self.stop()
        return clean

    def stop(self) -> None:
        self._serving.stop(0.5)
        self.clients.close()
        if self._metrics_stop is not None:
            self._metrics_stop()
            self._metrics_stop = None

    # ---- public RPCs ----------------------------------------------------------------
    def _tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; send token_ids")
        return self.tokenizer.encode(text)

    def Generate(self, request: pdserve_pb2.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[pdserve_pb2.GenerateResponse]:
        t0 = time.monotonic()
        if self.limits is None or self._draining:
            self._error(context, grpc.StatusCode.UNAVAILABLE, "router is not serving")
        try:
            vreq = validate_generate(request, self.limits, self._tokenize)
        except ValueError as e:
            self._error(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        with self._lock:
            if self._in_flight >= self.cfg.max_queue:
                admitted = False
            else:
                self._in_flight += 1
                admitted = True
        if not admitted:
            self._error(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"request {vreq.request_id}: router queue is full ({self.cfg.max_queue} requests "
                        f"in flight, {len(self.admission)} of them waiting for KV capacity)")
        self._update_gauges()
        try:
            yield from self._serve(vreq, context, t0)
        finally:
            with self._lock:
                self._in_flight -= 1
            self._update_gauges()

    def _local_prefill(self, prompt_tokens: int) -> bool:
        cfg = self.cfg
        if cfg.local_prefill_max_tokens == 0 and cfg.prefill_queue_max_tokens is None:
            return False
        backlog = None
        if cfg.prefill_queue_max_tokens is not None and prompt_tokens > cfg.local_prefill_max_tokens:
            backlog = self.selector.prefill_backlog(self.workers.list("prefill"))
        return prefill_locally(cfg.local_prefill_max_tokens, cfg.prefill_queue_max_tokens, prompt_tokens, backlog)

    def _serve(self, vreq: Any, context: grpc.ServicerContext, t0: float) -> Iterator[pdserve_pb2.GenerateResponse]:
        remaining = context.time_remaining()
        budget = self.cfg.request_timeout_s if remaining is None else min(remaining, self.cfg.request_timeout_s)
        deps = FlowDeps(self.cfg, self.workers, self.selector, self.clients, self.tokenizer, self.metrics,
                        self.admission, self.prefixes)
        if self.cfg.mode == "colocated":
            from router.colocated_flow import ColocatedFlow

            flow: Any = ColocatedFlow(deps, vreq, t0, t0 + budget)
        elif self._local_prefill(len(vreq.prompt_token_ids)):
            from router.colocated_flow import LocalPrefillFlow

            log.debug("request %s: prefilled on a decode worker (conditional disaggregation)", vreq.request_id)
            self.metrics.inc_local_prefill()
            flow = LocalPrefillFlow(deps, vreq, t0, t0 + budget)
        else:
            flow = DisaggregatedFlow(deps, vreq, t0, t0 + budget)
        context.add_callback(flow.cancel)  # client cancel / deadline: stop the worker calls at once
        self.metrics.inc_prompt_tokens(len(vreq.prompt_token_ids))
        n_out = 0
        try:
            for resp in flow.run():
                n_out += len(resp.token_ids)
                if resp.finish_reason:
                    self.metrics.observe_e2e(time.monotonic() - t0)
                    self.metrics.inc_success(resp.finish_reason)
                yield resp
        except FlowError as e:
            log.warning("request %s: %s %s", vreq.request_id, e.code.name, e.message)
            self._error(context, e.code, e.message)
        finally:
            self.metrics.inc_generation_tokens(n_out)

    def _error(self, context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        if self.metrics is not None:
            self.metrics.inc_error(code)
        context.abort(code, message)

    def Tokenize(self, request: pdserve_pb2.TokenizeRequest, context: grpc.ServicerContext) -> pdserve_pb2.TokenizeResponse:
        if self.tokenizer is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "text: this model has no tokenizer")
        ids = self.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        toks = self.tokenizer.convert_ids_to_tokens(ids)
        return pdserve_pb2.TokenizeResponse(token_ids=ids, tokens=[t or "" for t in toks])

    def GetModelInfo(self, request: pdserve_pb2.GetModelInfoRequest, context: grpc.ServicerContext) -> pdserve_pb2.ModelInfo:
        lim = self.limits
        if lim is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "router is not serving")
        from engine.sampling_params import SamplingParams

        roles = ("colocated", "colocated") if self.cfg.mode == "colocated" else ("prefill", "decode")
        n_p = len([w for w in self.workers.list(roles[0]) if w.ready])
        n_d = n_p if self.cfg.mode == "colocated" else len([w for w in self.workers.list(roles[1]) if w.ready])
        return pdserve_pb2.ModelInfo(
            model_name=lim.model_name, max_context_length=lim.max_context_length, vocab_size=lim.vocab_size,
            max_new_tokens=lim.max_tokens_limit, max_prompt_tokens=lim.max_context_length - 1,
            max_logprobs=SamplingParams.MAX_LOGPROBS, eos_token_id=lim.eos_token_id,
            num_prefill_workers=n_p, num_decode_workers=n_d, mode=self.cfg.mode)
