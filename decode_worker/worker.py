"""The decode role: reserve KV blocks, receive a prompt's KV, decode with continuous batching.

Lifecycle of one request (state on the loop thread in ``self.requests``):
1. ``Reserve`` RPC -> ``engine.reserve`` (RESOURCE_EXHAUSTED when too few free blocks) and, at
   once, ``kv.recv`` into those blocks from the named prefill peer: the receive is posted before
   the prefill worker sends a byte.
2. ``Decode`` RPC (first token from the prefill worker) -> the request waits until ``poll()``
   sees the receive DONE, then ``engine.add_prefilled_request`` puts it in the running batch.
   A FAILED receive (deadline, peer lost, cancelled) ends the stream with UNAVAILABLE.
3. Each ``engine.step()`` output goes to the handler as a DecodeChunk; the last carries the
   finish reason. A Decode that never comes is freed after ``reserve_timeout_s`` (or the
   receive deadline plus a margin, when longer).
An abort (RPC, cancelled stream) cancels the receive and frees the blocks at any stage.
"""
from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import grpc

from decode_worker.colocated import LocalGenerate, _ColoReq
from decode_worker.config import DecodeWorkerConfig
from worker_common.worker_base import RequestError, WorkerBase, request_params
from kvtransfer import TransferState
from proto import worker_pb2, worker_pb2_grpc
from proto.convert import logprob_from_proto, logprobs_to_proto

log = logging.getLogger(__name__)


@dataclass
class _DecodeReq:
    """One reserved or running sequence on this worker (loop-thread state)."""

    request_id: str
    prompt_token_ids: list[int]
    params: Any
    handle: Any
    reserved_at: float = field(default_factory=time.monotonic)
    expires_at: float = 0.0  # a reservation with no Decode call by then is freed
    out: Optional["queue.Queue"] = None  # set by Decode
    first_token_id: int = -1
    first_logprob: Any = None
    decode_called_at: float = 0.0
    running: bool = False
    failure: Optional[RequestError] = None
    last_token_at: float = 0.0


class DecodeWorker(LocalGenerate, WorkerBase, worker_pb2_grpc.DecodeWorkerServicer,
                   worker_pb2_grpc.ColocatedWorkerServicer):
    """gRPC decode worker around one engine (see module docstring).

    It also serves the colocated ``Generate`` RPC (``LocalGenerate``): a router doing conditional
    disaggregation sends short prompts here to be prefilled in this engine, skipping the prefill
    pool and the KV transfer. Those requests sit in ``self.requests`` as ``_ColoReq``.
    """

    role = "decode"

    def __init__(self, cfg: DecodeWorkerConfig) -> None:
        if not isinstance(cfg, DecodeWorkerConfig):
            raise ValueError(f"cfg must be a DecodeWorkerConfig, got {type(cfg).__name__}")
        super().__init__(cfg)

    def register_services(self, server: grpc.Server) -> list[str]:
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self, server)
        return [worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name,
                self.register_local_generate(server)]

    # ---- RPC handlers (gRPC threads) ------------------------------------------------
    def Reserve(self, request: worker_pb2.ReserveRequest, context: grpc.ServicerContext) -> worker_pb2.ReserveResponse:
        rid = request.request_id
        try:
            self.check_accepting(rid)
            if not request.prompt_token_ids:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_token_ids is empty (request {rid})")
            if not request.prefill_kv_name:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"prefill_kv_name is empty (request {rid})")
            params = request_params(request.params, rid)
            if request.kv_timeout_s < 0:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"kv_timeout_s must be >= 0, got {request.kv_timeout_s} (request {rid})")
            kv_timeout = request.kv_timeout_s or self.cfg.transfer_timeout_s
            blocks = self.loop.call(lambda eng: self._reserve(eng, rid, list(request.prompt_token_ids),
                                                              params, request.prefill_kv_name, kv_timeout))
        except RequestError as e:
            context.abort(e.code, e.message)
        return worker_pb2.ReserveResponse(block_ids=blocks, block_size=self.engine.block_size,
                                          kv_name=self.cfg.kv_name)

    def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.ServicerContext) -> Iterator[worker_pb2.DecodeChunk]:
        return self.guard(request.request_id, context, self._decode(request, context))

    def _decode(self, request: worker_pb2.DecodeRequest, context: grpc.ServicerContext) -> Iterator[worker_pb2.DecodeChunk]:
        rid = request.request_id
        if self.loop is None or not self.loop.alive:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.cfg.worker_id} is not serving "
                                                            f"(request {rid})")
        out: queue.Queue = queue.Queue()
        lp = logprob_from_proto(request.first_logprob) if request.HasField("first_logprob") else None
        self.loop.call(lambda eng: self._activate(rid, request.first_token_id, lp, out))
        yield from self.stream_events(rid, out, context, lambda ch: ch.finish_reason != "")

    # ---- loop thread ----------------------------------------------------------------
    def _reserve(self, eng: Any, rid: str, prompt: list[int], params: Any, peer: str,
                 kv_timeout_s: float) -> list[int]:
        if rid in self.requests:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already reserved here")
        try:
            blocks = eng.reserve(rid, len(prompt))
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_token_ids: {e} (request {rid})") from None
        if blocks is None:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"decode worker {self.cfg.worker_id}: not enough free KV blocks for "
                               f"{len(prompt)} tokens (free {eng.num_free_blocks}) (request {rid})")
        try:
            handle = self.kv.recv(peer, rid, eng.kv_caches, blocks, len(prompt),
                                  deadline_s=kv_timeout_s)
        except Exception as e:  # a bad peer name or a broken endpoint: free the blocks again
            eng.abort_request(rid)
            code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, ValueError) else grpc.StatusCode.UNAVAILABLE
            raise RequestError(code, f"kv recv: {e} (request {rid})") from None
        req = _DecodeReq(rid, prompt, params, handle)
        # the router calls Decode only after the KV arrived, so wait at least that long for it
        req.expires_at = req.reserved_at + max(self.cfg.reserve_timeout_s, kv_timeout_s + 5.0)
        self.requests[rid] = req
        return list(blocks)

    def _activate(self, rid: str, first_token: int, first_logprob: Any, out: "queue.Queue") -> None:
        req = self.requests.get(rid)
        if req is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"request {rid} is not reserved on decode worker "
                                                          f"{self.cfg.worker_id} (expired or aborted)")
        if req.out is not None:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already decoding")
        if req.failure is not None:
            self.requests.pop(rid, None)
            raise req.failure
        req.out, req.first_token_id, req.first_logprob = out, first_token, first_logprob
        req.decode_called_at = time.monotonic()

    def poll(self) -> bool:
        now = time.monotonic()
        for req in list(self.requests.values()):
            if isinstance(req, _ColoReq):
                continue  # prefilled here: the engine runs it like any other request
            if req.failure is not None and now > req.expires_at:
                self.requests.pop(req.request_id, None)
            if req.running or req.failure is not None:
                continue
            state = self.kv.poll(req.handle)
            if state == TransferState.FAILED:
                self._fail(req, grpc.StatusCode.UNAVAILABLE,
                           f"KV for request {req.request_id} did not arrive: {self.kv.failure(req.handle)}")
            elif state == TransferState.DONE and req.out is not None:
                try:
                    self.engine.add_prefilled_request(req.request_id, req.prompt_token_ids, req.first_token_id,
                                                      req.params, first_logprob=req.first_logprob)
                except ValueError as e:
                    self._fail(req, grpc.StatusCode.INVALID_ARGUMENT, f"{e} (request {req.request_id})")
                    continue
                req.running = True
                req.last_token_at = now
                req.out.put(worker_pb2.DecodeChunk(kv_wait_s=now - req.decode_called_at))
            elif req.out is None and now > req.expires_at:
                self._fail(req, grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"request {req.request_id}: no Decode call within "
                           f"{req.expires_at - req.reserved_at:.1f} s of its reservation")
        self.kv.take_completed()
        return any(isinstance(r, _DecodeReq) and not r.running and r.failure is None
                   for r in self.requests.values())

    def on_outputs(self, outs: list) -> None:
        now = time.monotonic()
        for o in outs:
            req = self.requests.get(o.request_id)
            if isinstance(req, _ColoReq):
                self.local_output(req, o, now)
                continue
            if req is None or req.out is None:
                continue
            if o.new_token_ids:
                self.metrics.observe_itl(now - req.last_token_at)
                req.last_token_at = now
            chunk = worker_pb2.DecodeChunk(token_ids=o.new_token_ids, logprobs=logprobs_to_proto(o.logprobs),
                                           finish_reason=o.finish_reason or "")
            if o.finish_reason:
                del self.requests[o.request_id]
                self.metrics.observe_decode_time(now - req.decode_called_at)
            req.out.put(chunk)

    def _fail(self, req: _DecodeReq, code: grpc.StatusCode, message: str) -> None:
        err = RequestError(code, message)
        self._free(req)
        if req.out is not None:
            self.requests.pop(req.request_id, None)
            req.out.put(err)
        else:
            # keep the record so the coming Decode call learns why (dropped at expires_at)
            req.failure = err

    def _free(self, req: _DecodeReq) -> None:
        if self.kv.poll(req.handle) not in (TransferState.DONE, TransferState.FAILED):
            self.kv.cancel(req.handle)
        self.engine.abort_request(req.request_id)

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        log.info("decode %s: abort request %s", self.cfg.worker_id, request_id)
        if isinstance(req, _ColoReq):
            self.local_abort(req)
            return True
        del self.requests[request_id]
        if req.failure is None:
            self._free(req)
        if req.out is not None:
            req.out.put(RequestError(grpc.StatusCode.CANCELLED, f"request {request_id} aborted"))
        return True
