"""The prefill role: prefill prompts in batches, ship each layer's KV, return the first token.

Lifecycle of one request (state on the loop thread in ``self.requests``):
1. ``Prefill`` RPC -> ``_add`` on the loop: ``engine.add_request(prefill_only=True)``; the
   prompt waits in the engine's queue and is batched with other prompts.
2. Inside ``engine.step()``, ``_on_layer_done(i, ids)`` fires as each layer's K/V is complete:
   the first call opens ``kv.send`` to the decode worker's endpoint, each call marks layer ``i``
   ready, so the transfer overlaps the remaining layers' compute.
3. ``step()`` returns ``finish_reason="prefill_done"`` with the first token: it goes to the
   handler at once (TTFT does not wait for the transfer).
4. ``poll()`` watches the send: DONE -> TransferDone event; FAILED -> an UNAVAILABLE error
   naming the request. Either way ``engine.release`` frees the blocks.
An abort (RPC, cancelled stream, drain timeout) cancels the send and frees the blocks at any step.
"""
from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import grpc
import torch

from prefill_worker.config import PrefillWorkerConfig
from worker_common.worker_base import RequestError, WorkerBase, request_params
from kvtransfer import TransferState
from proto import worker_pb2, worker_pb2_grpc
from proto.convert import logprob_to_proto

log = logging.getLogger(__name__)


@dataclass
class _PrefillReq:
    """One prompt in flight on this worker (loop-thread state)."""

    request_id: str
    prompt_token_ids: list[int]
    dest_kv_name: str
    block_size: int
    out: "queue.Queue" = field(default_factory=queue.Queue)
    arrived: float = field(default_factory=time.monotonic)
    scheduled: Optional[float] = None
    first_token_at: Optional[float] = None
    handle: Any = None
    error: Optional[RequestError] = None  # set inside step() (layer callback), reported after it
    in_engine: bool = True  # False once the first token is out (KV held for sending)


class PrefillWorker(WorkerBase, worker_pb2_grpc.PrefillWorkerServicer):
    """gRPC prefill worker around one engine (see module docstring)."""

    role = "prefill"

    def __init__(self, cfg: PrefillWorkerConfig) -> None:
        if not isinstance(cfg, PrefillWorkerConfig):
            raise ValueError(f"cfg must be a PrefillWorkerConfig, got {type(cfg).__name__}")
        super().__init__(cfg)
        self._step_started = 0.0

    def register_services(self, server: grpc.Server) -> list[str]:
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self, server)
        return [worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name]

    def setup_engine(self, engine: Any) -> None:
        engine.layer_done_callback = self._on_layer_done

    def queued_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in list(self.requests.values()) if r.first_token_at is None)

    # ---- RPC handlers (gRPC threads) ------------------------------------------------
    def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.ServicerContext) -> Iterator[worker_pb2.PrefillEvent]:
        return self.guard(request.request_id, context, self._prefill(request, context))

    def _prefill(self, request: worker_pb2.PrefillRequest, context: grpc.ServicerContext) -> Iterator[worker_pb2.PrefillEvent]:
        rid = request.request_id
        self.check_accepting(rid)
        if not request.prompt_token_ids:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_token_ids is empty (request {rid})")
        if not request.dest_kv_name:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"dest_kv_name is empty (request {rid})")
        params = request_params(request.params, rid)
        req = _PrefillReq(rid, list(request.prompt_token_ids), request.dest_kv_name, request.dest_block_size)
        dest_blocks = list(request.dest_block_ids)
        self.loop.call(lambda eng: self._add(eng, req, params, dest_blocks))
        yield from self.stream_events(rid, req.out, context, lambda ev: ev.HasField("transfer_done"))

    # ---- loop thread ----------------------------------------------------------------
    def _add(self, eng: Any, req: _PrefillReq, params: Any, dest_blocks: list[int]) -> None:
        if req.request_id in self.requests:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request {req.request_id} is already prefilling here")
        need = -(-len(req.prompt_token_ids) // max(1, req.block_size))
        if req.block_size <= 0 or len(dest_blocks) < need:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"dest_block_ids: {len(dest_blocks)} blocks of {req.block_size} tokens cannot "
                               f"hold {len(req.prompt_token_ids)} prompt tokens (request {req.request_id})")
        try:
            eng.add_request(req.request_id, req.prompt_token_ids, params, prefill_only=True)
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{e} (request {req.request_id})") from None
        self.requests[req.request_id] = req

    def _on_layer_done(self, layer: int, request_ids: list[str]) -> None:
        # runs inside engine.step() under torch.inference_mode: tensors kvtransfer makes here must be
        # normal ones, since its channel threads update them outside inference mode
        with torch.inference_mode(False):
            self._layers_ready(layer, request_ids)

    def _layers_ready(self, layer: int, request_ids: list[str]) -> None:
        # never raise: an exception here would fail the whole batch's step
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.error is not None:
                continue
            try:
                if req.handle is None:
                    req.scheduled = req.scheduled or time.monotonic()
                    req.handle = self._open_send(req, layers_ready=False)
                self.kv.layer_ready(req.handle, layer)
            except Exception as e:
                log.warning("prefill %s: request %s: KV send failed: %s", self.cfg.worker_id, rid, e)
                req.error = RequestError(grpc.StatusCode.UNAVAILABLE,
                                         f"KV send of request {rid} to {req.dest_kv_name} failed: {e}")

    def _open_send(self, req: _PrefillReq, layers_ready: bool) -> Any:
        bs = self.engine.block_size
        src = self.engine.get_block_table(req.request_id)[: -(-len(req.prompt_token_ids) // bs)]
        return self.kv.send(req.dest_kv_name, req.request_id, self.engine.kv_caches, src,
                            len(req.prompt_token_ids), deadline_s=self.cfg.transfer_timeout_s,
                            layers_ready=layers_ready)

    def on_outputs(self, outs: list) -> None:
        now = time.monotonic()
        for o in outs:
            req = self.requests.get(o.request_id)
            if req is None:
                continue
            if o.finish_reason != "prefill_done" or not o.new_token_ids:
                # the engine finished it some other way (abort): the send cannot complete
                self._fail(req, grpc.StatusCode.INTERNAL,
                           f"prefill of request {req.request_id} ended with {o.finish_reason!r}")
                continue
            req.first_token_at = now
            req.in_engine = False
            if req.error is None and req.handle is None:
                try:  # no layer callback ran (prefix fully cached?): send every layer now
                    req.handle = self._open_send(req, layers_ready=True)
                except Exception as e:
                    req.error = RequestError(grpc.StatusCode.UNAVAILABLE,
                                             f"KV send of request {req.request_id} failed: {e}")
            if req.error is not None:
                self._fail(req, req.error.code, req.error.message)
                continue
            scheduled = req.scheduled or req.arrived
            ft = worker_pb2.FirstToken(token_id=o.new_token_ids[0], queue_s=scheduled - req.arrived,
                                       prefill_s=now - scheduled, num_cached_tokens=o.num_cached_tokens)
            if o.logprobs:
                ft.logprob.CopyFrom(logprob_to_proto(o.logprobs[0]))
            self.metrics.observe_queue_time(ft.queue_s)
            self.metrics.observe_prefill_time(ft.prefill_s)
            req.out.put(worker_pb2.PrefillEvent(first_token=ft))

    def poll(self) -> bool:
        for req in list(self.requests.values()):
            if req.in_engine or req.handle is None:
                continue
            state = self.kv.poll(req.handle)
            if state == TransferState.DONE:
                del self.requests[req.request_id]
                self.engine.release(req.request_id)
                req.out.put(worker_pb2.PrefillEvent(
                    transfer_done=worker_pb2.TransferDone(kv_transfer_s=time.monotonic() - req.first_token_at)))
            elif state == TransferState.FAILED:
                self._fail(req, grpc.StatusCode.UNAVAILABLE,
                           f"KV transfer of request {req.request_id} to {req.dest_kv_name} failed: "
                           f"{self.kv.failure(req.handle)}")
        for st in self.kv.take_completed():
            if st.direction == "send" and st.state == TransferState.DONE:
                self.metrics.observe_kv_transfer(st.seconds, st.num_bytes)
        return bool(self.requests)

    def _fail(self, req: _PrefillReq, code: grpc.StatusCode, message: str) -> None:
        self._drop(req)
        req.out.put(RequestError(code, message))

    def _drop(self, req: _PrefillReq) -> None:
        self.requests.pop(req.request_id, None)
        if req.handle is not None:
            self.kv.cancel(req.handle)
        if req.in_engine:
            self.engine.abort_request(req.request_id)
        else:
            self.engine.release(req.request_id)

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        log.info("prefill %s: abort request %s", self.cfg.worker_id, request_id)
        self._fail(req, grpc.StatusCode.CANCELLED, f"request {request_id} aborted")
        return True
