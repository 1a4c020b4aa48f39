"""The colocated role: one engine prefills and decodes (the baseline disaggregation is measured against).

``LocalGenerate`` holds the request handling; decode workers mix it in too, so a router
can have them prefill short prompts themselves (conditional disaggregation).

Lifecycle of one request (state on the loop thread in ``self.requests``):
``Generate`` RPC -> ``engine.add_request`` (batched with everything else on this
engine, prefills and decodes alike) -> every ``step()`` output goes to the handler
as a DecodeChunk (the first one also carries queue/prefill timings) -> the chunk
with a finish reason ends the stream. An abort (RPC, cancelled stream) frees the
blocks at any step. No KV moves, so no kvtransfer endpoint.
"""
from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import grpc

from worker_common.config import WorkerConfig
from worker_common.worker_base import RequestError, WorkerBase, request_params
from proto import worker_pb2, worker_pb2_grpc
from proto.convert import logprobs_to_proto

log = logging.getLogger(__name__)


@dataclass
class ColocatedWorkerConfig(WorkerConfig):
    """A colocated worker: the same fields as the other roles; kv_* are unused."""

    role = "colocated"


@dataclass
class _ColoReq:
    """One request on this worker (loop-thread state)."""

    request_id: str
    prompt_len: int
    out: "queue.Queue" = field(default_factory=queue.Queue)
    arrived: float = field(default_factory=time.monotonic)
    scheduled: Optional[float] = None
    first_at: Optional[float] = None
    last_at: float = 0.0


class LocalGenerate:
    """Whole requests (prefill + decode) on this worker's engine: the colocated role's RPC, also
    served by decode workers so the router can skip the prefill pool for short prompts
    (conditional disaggregation). Mixed into a ``WorkerBase``; requests live in ``self.requests``
    as ``_ColoReq`` beside whatever else the worker keeps there. List it before ``WorkerBase`` and
    the generated servicer classes after it (their stubs must not shadow ``WorkerBase``'s
    ``Abort``/``GetInfo``)."""

    def register_local_generate(self, server: grpc.Server) -> str:
        worker_pb2_grpc.add_ColocatedWorkerServicer_to_server(self, server)
        return worker_pb2.DESCRIPTOR.services_by_name["ColocatedWorker"].full_name

    def setup_engine(self, engine: Any) -> None:
        # the layer hook tells us when a prompt's last prefill chunk runs (its queue time ends)
        engine.layer_done_callback = self._on_layer_done

    def queued_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in list(self.requests.values())
                   if isinstance(r, _ColoReq) and r.first_at is None)

    def Generate(self, request: worker_pb2.ColocatedRequest, context: grpc.ServicerContext) -> Iterator[worker_pb2.DecodeChunk]:
        return self.guard(request.request_id, context, self._generate(request, context))

    def _generate(self, request: worker_pb2.ColocatedRequest, context: grpc.ServicerContext) -> Iterator[worker_pb2.DecodeChunk]:
        rid = request.request_id
        self.check_accepting(rid)
        params = request_params(request.params, rid)
        req = _ColoReq(rid, len(request.prompt_token_ids) + len(request.resume_token_ids))
        ids, resume = list(request.prompt_token_ids), list(request.resume_token_ids)
        self.loop.call(lambda eng: self._add_local(eng, req, ids, params, resume))
        yield from self.stream_events(rid, req.out, context, lambda ch: ch.finish_reason != "")

    # ---- loop thread ----------------------------------------------------------------
    def _add_local(self, eng: Any, req: _ColoReq, ids: list[int], params: Any, resume: list[int]) -> None:
        if req.request_id in self.requests:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request {req.request_id} is already running here")
        try:
            eng.add_request(req.request_id, ids, params, resume_token_ids=resume or None)
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{e} (request {req.request_id})") from None
        self.requests[req.request_id] = req

    def _on_layer_done(self, layer: int, request_ids: list[str]) -> None:
        if layer != 0:
            return
        now = time.monotonic()
        for rid in request_ids:
            req = self.requests.get(rid)
            if isinstance(req, _ColoReq) and req.scheduled is None:
                req.scheduled = now

    def local_output(self, req: _ColoReq, o: Any, now: float) -> None:
        """One engine output of a local request -> its stream."""
        chunk = worker_pb2.DecodeChunk(token_ids=o.new_token_ids, logprobs=logprobs_to_proto(o.logprobs),
                                       finish_reason=o.finish_reason or "")
        if req.first_at is None:
            req.first_at = now
            scheduled = req.scheduled or req.arrived
            chunk.queue_s, chunk.prefill_s = scheduled - req.arrived, now - scheduled
            chunk.num_cached_tokens = o.num_cached_tokens
            self.metrics.observe_queue_time(chunk.queue_s)
            self.metrics.observe_prefill_time(chunk.prefill_s)
        elif o.new_token_ids:
            self.metrics.observe_itl(now - req.last_at)
        req.last_at = now
        if o.finish_reason:
            del self.requests[o.request_id]
            self.metrics.observe_decode_time(now - req.first_at)
        req.out.put(chunk)

    def local_abort(self, req: _ColoReq) -> None:
        self.requests.pop(req.request_id, None)
        self.engine.abort_request(req.request_id)
        req.out.put(RequestError(grpc.StatusCode.CANCELLED, f"request {req.request_id} aborted"))


class ColocatedWorker(LocalGenerate, WorkerBase, worker_pb2_grpc.ColocatedWorkerServicer):
    """gRPC worker that serves whole requests on one engine."""

    role = "colocated"
    needs_kv = False

    def __init__(self, cfg: ColocatedWorkerConfig) -> None:
        if not isinstance(cfg, ColocatedWorkerConfig):
            raise ValueError(f"cfg must be a ColocatedWorkerConfig, got {type(cfg).__name__}")
        super().__init__(cfg)

    def register_services(self, server: grpc.Server) -> list[str]:
        return [self.register_local_generate(server)]

    def on_outputs(self, outs: list) -> None:
        now = time.monotonic()
        for o in outs:
            req = self.requests.get(o.request_id)
            if req is not None:
                self.local_output(req, o, now)

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.local_abort(req)
        return True
