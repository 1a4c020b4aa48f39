"""Whole requests on one engine: the colocated role (the baseline disaggregation is measured against).

``LocalRequests`` holds them; the colocated worker serves nothing else, and decode workers hold
one too, beside their disaggregated requests, so a router can have them prefill short prompts
themselves (conditional disaggregation) or resume a migrated request.

Lifecycle of one request (a ``_LocalReq`` in ``LocalRequests``, loop-thread state):
``Generate`` RPC -> ``engine.add_request`` (batched with everything else on this
engine, prefills and decodes alike) -> every ``step()`` output goes to the handler
as a DecodeChunk (the first one also carries queue/prefill timings) -> the chunk
with a finish reason ends the stream. An abort (RPC, cancelled stream) frees the
blocks at any step. No KV moves, so no kvtransfer endpoint. ``GenerateServicer`` is the
RPC (the colocated and the decode worker both serve it); ``LocalRequests`` holds the
records on the loop thread and sees only the worker's ``RequestContext``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional

import grpc

from decode_worker import choices
from decode_worker.choices import AbortChoiceServicer, ChoiceRequest, ChoiceRequestSet
from proto import worker_pb2, worker_pb2_grpc
from worker_common.config import WorkerConfig
from worker_common.embeddings import EmbedRequests, EmbedServicer
from worker_common.output_stream import OutputStreamServicer
from worker_common.request import RequestError, request_params
from worker_common.wire import logprobs_to_proto, prompt_logprobs_to_proto
from worker_common.worker_base import WorkerBase

if TYPE_CHECKING:
    from engine.client import EngineCore

log = logging.getLogger(__name__)


@dataclass
class ColocatedWorkerConfig(WorkerConfig):
    """A colocated worker: the same fields as the other roles; kv_* are unused."""

    role = "colocated"


@dataclass
class _LocalReq(ChoiceRequest):
    """One whole request (prefill + decode) on this worker's engine."""

    prompt_len: int = 0
    scheduled: Optional[float] = None  # its prompt's first prefill chunk ran (queue time ends)
    first_at: Optional[float] = None
    prompt: list = field(default_factory=list)  # kept while siblings wait to start
    siblings: list = field(default_factory=list)  # n > 1: params of choices 1..n-1, started after its prefill


class LocalRequests(ChoiceRequestSet[_LocalReq]):
    """The whole requests on its worker's engine (loop thread; the ``Generate`` RPC is ``GenerateServicer``'s)."""

    def queued_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.records() if r.first_at is None)

    def prefilled_prompt_tokens(self, req: _LocalReq) -> int:
        return req.prompt_len if req.index == 0 else 0  # a sibling reuses choice 0's prompt

    def add(self, eng: EngineCore, req: _LocalReq, ids: list[int], params: Any, resume: list[int]) -> None:
        """Put ``req`` in the engine and hold it; the caller checked its id is new on the worker."""
        try:
            eng.add_request(req.request_id, ids, params, resume_token_ids=resume or None)
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{e} (request {req.request_id})") from None
        self.hold(req)

    def on_layer_done(self, layer: int, request_ids: list[str], at: Optional[float] = None) -> None:
        """The engine's layer hook: layer 0 of a prompt's chunk running ends its queue time (``at``: when, for an
        engine in its own process, which reports it after the step)."""
        if layer != 0:
            return
        now = time.monotonic() if at is None else at
        for rid in request_ids:
            req = self.get(rid)
            if req is not None and req.scheduled is None:
                req.scheduled = now

    def on_output(self, req: _LocalReq, o: Any, now: float) -> None:
        chunk = worker_pb2.DecodeChunk(token_ids=o.new_token_ids, logprobs=logprobs_to_proto(o.logprobs),
                                       finish_reason=o.finish_reason or "", index=req.index)
        if o.prompt_logprobs:
            chunk.prompt_logprobs.extend(prompt_logprobs_to_proto(o.prompt_logprobs))
        if req.siblings:  # its prompt is prefilled (its blocks are in the prefix cache): start the others
            siblings, req.siblings = req.siblings, []
            try:
                self.start_siblings(self.ctx.engine, req, req.prompt, siblings,
                                    lambda cid, p: _LocalReq(cid, prompt_len=len(req.prompt)))
            except RequestError as e:
                self.drop(req, e)
                return
            req.prompt = []
        metrics = self.ctx.metrics
        if req.first_at is None:
            req.first_at = now
            scheduled = req.scheduled or req.arrived
            chunk.queue_s, chunk.prefill_s = scheduled - req.arrived, now - scheduled
            chunk.num_cached_tokens = o.num_cached_tokens
            metrics.observe_queue_time(chunk.queue_s)
            metrics.observe_prefill_time(chunk.prefill_s)
        # no ITL here: it is the router's series (it sees the gaps the client sees)
        if o.finish_reason:
            self.release(req)
            choices.finish_choice(req, chunk)
            metrics.observe_decode_time(now - req.first_at)
        req.out.put(chunk)

    def free(self, req: _LocalReq) -> None:
        self.ctx.engine.abort_request(req.request_id)

    def trace_phases(self, req: _LocalReq, now: float) -> list:
        scheduled = req.scheduled or (req.first_at and req.arrived)
        return [("worker.queue", req.arrived, scheduled, {}),
                ("worker.prefill", scheduled, req.first_at, {"gen_ai.usage.prompt_tokens": req.prompt_len}),
                ("worker.decode", req.first_at, now if req.first_at is not None else None, {})]


class GenerateServicer:
    """The colocated ``Generate`` RPC, for a ``WorkerBase`` with a ``local: LocalRequests`` (the colocated and
    the decode worker): checks on the gRPC thread, one call onto the loop thread, then the stream."""

    local: LocalRequests

    def Generate(self, request: worker_pb2.ColocatedRequest,
                 context: grpc.ServicerContext) -> Iterator[worker_pb2.DecodeChunk]:
        return self.guard(request.request_id, context, self._generate(request, context))  # type: ignore[attr-defined]

    def _generate(self, request: worker_pb2.ColocatedRequest,
                  context: grpc.ServicerContext) -> Iterator[worker_pb2.DecodeChunk]:
        w: Any = self
        rid = request.request_id
        w.check_accepting(rid)
        params = request_params(request.params, rid, w.ctx.lora_roots)
        siblings = choices.sibling_params(request.siblings, rid)
        if siblings and request.resume_token_ids:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"siblings cannot be combined with resume_token_ids (request {rid})")
        req = _LocalReq(rid, prompt_len=len(request.prompt_token_ids) + len(request.resume_token_ids),
                        trace=w.trace_start(f"{w.role}_worker.generate", context, rid))
        ids, resume = list(request.prompt_token_ids), list(request.resume_token_ids)
        if siblings:
            req.prompt, req.siblings = ids, siblings

        def add(eng: EngineCore) -> _LocalReq:
            w.check_new(rid, "running")
            self.local.add(eng, req, ids, params, resume)
            return req

        choices.start_request(w, request.output_stream, rid, add)
        yield from w.stream_events(rid, req.out, context, choices.is_last(req))


def register_colocated_service(servicer: Any, server: grpc.Server) -> str:
    """Serve ``servicer`` (a worker with ``Generate``, ``Abort``, ``AbortChoice``, ``GetInfo``) as the
    ColocatedWorker service."""
    worker_pb2_grpc.add_ColocatedWorkerServicer_to_server(servicer, server)
    return worker_pb2.DESCRIPTOR.services_by_name["ColocatedWorker"].full_name


class ColocatedWorker(GenerateServicer, EmbedServicer, AbortChoiceServicer, OutputStreamServicer, WorkerBase):
    """gRPC worker that serves whole requests on one engine (see module docstring)."""

    role = "colocated"
    needs_kv = False

    def __init__(self, cfg: ColocatedWorkerConfig) -> None:
        if not isinstance(cfg, ColocatedWorkerConfig):
            raise ValueError(f"cfg must be a ColocatedWorkerConfig, got {type(cfg).__name__}")
        super().__init__(cfg)
        self.local = LocalRequests(self.ctx)
        self.embeds = EmbedRequests(self.ctx)
        self.request_sets = [self.local, self.embeds]

    def register_services(self, server: grpc.Server) -> list[str]:
        return [register_colocated_service(self, server)]

    def setup_engine(self, engine: EngineCore) -> None:
        engine.layer_done_callback = self.local.on_layer_done
