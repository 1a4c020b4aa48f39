"""The decode role: reserve KV blocks, receive a prompt's KV, decode with continuous batching.

Lifecycle of one disaggregated request (a ``_DecodeReq`` in ``DisaggregatedRequests``, loop-thread state):
1. ``Reserve`` RPC -> ``engine.reserve_prompt`` (RESOURCE_EXHAUSTED when too few free blocks) and, at
   once, ``kv.recv`` into those blocks from the named prefill peer: the receive is posted before
   the prefill worker sends a byte. Both, and holding the record, run on the RPC's thread beside the
   engine step in flight (``EngineLoop.beside``: during its forward), so the reply does not wait for
   the step to end.
   ``SendPrefix`` RPC (optional, between the two): the prefill worker holds less of the prompt than this
   worker's reservation found cached, so it fetches the difference: those reserved blocks (pinned by the
   reservation) are sent to it, beside the step as the Reserve was.
2. ``Decode`` RPC (first token from the prefill worker) -> the request waits until ``poll()``
   sees the receive DONE, then ``engine.add_prefilled_request`` puts it in the running batch.
   A FAILED receive (deadline, peer lost, store away, cancelled) ends the stream with ABORTED: the
   router resumes the request whole (on this worker too), since the worker itself is fine.
3. Each ``engine.step()`` output goes to the handler as a DecodeChunk; the last carries the
   finish reason. A Decode that never comes is freed after ``reserve_timeout_s`` (or the
   receive deadline plus a margin, when longer).
An abort (RPC, cancelled stream) cancels the receive and frees the blocks at any stage; ``AbortChoice``
ends one choice of a request with n > 1 (decode_worker.choices).

``DecodeWorker`` serves the RPCs (checks on gRPC threads, then one call onto the loop thread);
``DisaggregatedRequests`` holds the records and sees only the worker's ``RequestContext``. The worker
also serves the colocated ``Generate`` RPC: whole requests prefilled on this engine (conditional
disaggregation, migration) live in a separate ``LocalRequests`` (decode_worker.colocated).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional

import grpc

from decode_worker import choices
from decode_worker.choices import AbortChoiceServicer, ChoiceRequest, ChoiceRequestSet
from decode_worker.colocated import GenerateServicer, LocalRequests, register_colocated_service
from decode_worker.config import DecodeWorkerConfig
from kvtransfer import TransferState
from proto import worker_pb2, worker_pb2_grpc
from worker_common.embeddings import EmbedRequests, EmbedServicer
from worker_common.output_stream import OutputStreamServicer
from worker_common.request import (RequestContext, RequestError, check_peer_tp, engine_kv_shards, engine_tp,
                                   prefix_fetch_id, request_params)
from worker_common.wire import logprob_from_proto, logprobs_to_proto
from worker_common.worker_base import WorkerBase

if TYPE_CHECKING:
    from engine.client import KVEngine

log = logging.getLogger(__name__)


@dataclass
class _DecodeReq(ChoiceRequest):
    """One reserved or running sequence prefilled elsewhere (``arrived``: when it was reserved)."""

    prompt_token_ids: list[int]
    params: Any
    handle: Any
    expires_at: float = 0.0  # a reservation with no Decode call by then is freed
    decoding: bool = False  # set by Decode: a handler reads ``out``
    first_token_id: int = -1
    first_logprob: Any = None
    decode_called_at: float = 0.0
    running: bool = False
    failure: Optional[RequestError] = None  # failed before Decode came: kept to tell it why
    siblings: list = field(default_factory=list)  # n > 1: params of choices 1..n-1, started with the KV
    cached_tokens: int = 0  # prompt positions its reservation found in this worker's cache (not received)
    running_at: Optional[float] = None  # the KV was in and it joined the batch
    block_ids: list[int] = field(default_factory=list)  # what the reservation took (the Reserve reply's)
    prefix_send: Any = None  # SendPrefix: the send of its cached prefix to the prefill worker


class DisaggregatedRequests(ChoiceRequestSet[_DecodeReq]):
    """The sequences whose KV comes from a prefill worker: reserved, waiting for their KV, decoding
    (loop thread; the ``Reserve``/``Decode`` RPCs are the worker's)."""

    def __init__(self, ctx: RequestContext, reserve_timeout_s: float) -> None:
        super().__init__(ctx)
        self.reserve_timeout_s = reserve_timeout_s
        """A reservation whose Decode never comes is freed after this long (or its receive deadline + 5 s)."""

    def reserve(self, eng: KVEngine, rid: str, prompt: list[int], params: Any, peer: str,
                kv_timeout_s: float, peer_tp: int = 1, cached_prefix: bool = False,
                trace: Any = None) -> _DecodeReq:
        """Take blocks for ``prompt`` and post the KV receive into them; the caller checked ``rid`` is new.
        ``cached_prefix``: the leading blocks this worker's prefix cache holds for the prompt are reserved by
        reference and only the positions after them are received. Runs beside a step (``EngineLoop.beside``):
        returns the record (its ``block_ids`` and ``cached_tokens`` answer the RPC) for the caller to ``hold``."""
        if eng.has_request(rid):  # (a local request's id too)
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already reserved here")
        try:
            got = eng.reserve_prompt(rid, len(prompt), prompt if cached_prefix else None,
                                     lora_name=getattr(params, "lora_name", None),
                                     cache_salt=getattr(params, "cache_salt", None))
        except ValueError as e:
            field = "" if str(e).startswith("lora_name") else "prompt_token_ids: "
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}{e} (request {rid})") from None
        if got is None:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"decode worker {self.ctx.worker_id}: not enough free KV blocks for "
                               f"{len(prompt)} tokens (free {eng.num_free_blocks}) (request {rid})")
        blocks, cached = got
        try:
            handle = self.ctx.kv.recv_shards(peer, rid, engine_kv_shards(eng), peer_tp, blocks, len(prompt),
                                             deadline_s=kv_timeout_s, first_token=cached)
        except Exception as e:  # a bad peer name or a broken endpoint: free the blocks again
            eng.abort_request(rid)
            code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, ValueError) else grpc.StatusCode.UNAVAILABLE
            raise RequestError(code, f"kv recv: {e} (request {rid})") from None
        req = _DecodeReq(rid, prompt, params, handle, cached_tokens=cached, trace=trace, block_ids=list(blocks))
        # the router calls Decode only after the KV arrived, so wait at least that long for it
        req.expires_at = req.arrived + max(self.reserve_timeout_s, kv_timeout_s + 5.0)
        if cached and self.ctx.metrics is not None:
            self.ctx.metrics.inc_kv_transfer_cached_tokens(cached)
        return req

    def send_prefix(self, eng: KVEngine, rid: str, dest: str, first: int, num: int, dest_tp: int,
                    timeout_s: float) -> None:
        """Send positions ``first..num-1`` of reserved ``rid``'s cached prefix to the prefill worker ``dest`` (its
        ``PrefixFetch``). Beside a step: the blocks are the reservation's, pinned, and no forward writes them."""
        req = self.get(rid)
        if req is None or req.failure is not None or req.handle is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"request {rid} is not reserved on decode worker "
                                                          f"{self.ctx.worker_id} (expired, failed or aborted)")
        if req.decoding or req.prefix_send is not None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"request {rid}: its prefix was sent already, or it is decoding")
        if not 0 <= first < num or num > req.cached_tokens:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"first_token/num_tokens: [{first}, {num}) is not a non-empty range of the "
                               f"{req.cached_tokens} cached tokens reserved for request {rid}")
        src = req.block_ids[: -(-num // eng.block_size)]
        try:
            req.prefix_send = self.ctx.kv.send_shards(dest, prefix_fetch_id(rid), engine_kv_shards(eng), dest_tp,
                                                      src, num, deadline_s=timeout_s, layers_ready=True,
                                                      first_token=first)
        except Exception as e:  # a bad peer name or a broken endpoint
            code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, ValueError) else grpc.StatusCode.UNAVAILABLE
            raise RequestError(code, f"kv send of request {rid}'s prefix to {dest!r}: {e}") from None

    def activate(self, rid: str, first_token: int, first_logprob: Any, siblings: list) -> _DecodeReq:
        """The Decode call came for reserved ``rid``: its record, now streaming to that call."""
        req = self.get(rid)
        if req is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"request {rid} is not reserved on decode worker "
                                                          f"{self.ctx.worker_id} (expired or aborted)")
        if req.decoding:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already decoding")
        if req.failure is not None:
            self.release(req)
            raise req.failure
        req.decoding, req.first_token_id, req.first_logprob = True, first_token, first_logprob
        req.siblings = siblings
        req.decode_called_at = time.monotonic()
        return req

    def poll(self, now: float) -> bool:
        kv, eng = self.ctx.kv, self.ctx.engine
        for req in self.records():
            if req.failure is not None and now > req.expires_at:
                self.release(req)
            if req.running or req.failure is not None:
                continue
            state = kv.poll(req.handle)
            if state == TransferState.FAILED:  # ABORTED: the router resumes it (this worker is fine)
                self._fail(req, grpc.StatusCode.ABORTED,
                           f"KV for request {req.request_id} did not arrive: {kv.failure(req.handle)}")
            elif state == TransferState.DONE and req.decoding:
                try:
                    eng.add_prefilled_request(req.request_id, req.prompt_token_ids, req.first_token_id,
                                              req.params, first_logprob=req.first_logprob)
                except ValueError as e:
                    self._fail(req, grpc.StatusCode.INVALID_ARGUMENT, f"{e} (request {req.request_id})")
                    continue
                req.running, req.running_at = True, now
                try:  # n > 1: the other choices reuse the prompt's blocks that just arrived
                    self.start_siblings(eng, req, req.prompt_token_ids, req.siblings, self._sibling)
                except RequestError as e:
                    self._fail(req, e.code, e.message)
                    continue
                req.out.put(worker_pb2.DecodeChunk(kv_wait_s=now - req.decode_called_at))
            elif not req.decoding and now > req.expires_at:
                self._fail(req, grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"request {req.request_id}: no Decode call within "
                           f"{req.expires_at - req.arrived:.1f} s of its reservation")
        for st in kv.take_completed():
            if st.state != TransferState.DONE or self.ctx.metrics is None:
                continue
            if st.direction == "recv":
                self.ctx.metrics.observe_kv_transfer_phases("recv", st.phases())
            else:  # a prefix sent back to a prefill worker (SendPrefix): bytes between workers, counted by the sender
                self.ctx.metrics.observe_kv_transfer(st.seconds, st.num_bytes, st.link)
                self.ctx.metrics.observe_kv_transfer_phases("send", st.phases())
        return any(not r.running and r.failure is None for r in self.records())

    def trace_phases(self, req: _DecodeReq, now: float) -> list:
        called = req.decode_called_at or None
        return [("decode_worker.reserved", req.arrived, called, {"pdserve.kv.cached_tokens": req.cached_tokens}),
                ("decode_worker.kv_wait", called, req.running_at, {}),
                ("decode_worker.decode", req.running_at, now if req.running_at is not None else None, {})]

    def _sibling(self, request_id: str, params: Any) -> _DecodeReq:
        return _DecodeReq(request_id, [], params, None, decoding=True, running=True,
                          decode_called_at=time.monotonic())

    def on_output(self, req: _DecodeReq, o: Any, now: float) -> None:
        if not req.decoding:
            return
        # no ITL here: it is the router's series (it sees the gaps the client sees)
        chunk = worker_pb2.DecodeChunk(token_ids=o.new_token_ids, logprobs=logprobs_to_proto(o.logprobs),
                                       finish_reason=o.finish_reason or "", index=req.index)
        if req.index and req.first_token_id < 0:  # a sibling's first output: it was prefilled here
            req.first_token_id = o.new_token_ids[0] if o.new_token_ids else 0
            chunk.num_cached_tokens = o.num_cached_tokens
        if o.finish_reason:
            self.release(req)
            choices.finish_choice(req, chunk)
            self.ctx.metrics.observe_decode_time(now - req.decode_called_at)
        req.out.put(chunk)

    def _fail(self, req: _DecodeReq, code: grpc.StatusCode, message: str) -> None:
        err = RequestError(code, message)
        if req.decoding:
            self.drop(req, err)
        else:
            # keep the record so the coming Decode call learns why (dropped at expires_at)
            self.free(req)
            req.failure = err

    def free(self, req: _DecodeReq) -> None:
        if req.failure is not None:
            return  # freed when it failed
        kv = self.ctx.kv
        for h in (req.handle, req.prefix_send):
            if h is not None and kv.poll(h) not in (TransferState.DONE, TransferState.FAILED):
                kv.cancel(h)
        self.ctx.engine.abort_request(req.request_id)


class DecodeWorker(GenerateServicer, EmbedServicer, AbortChoiceServicer, OutputStreamServicer, WorkerBase):
    """gRPC decode worker around one engine (see module docstring).

    Two request sets: ``disagg`` (Reserve/Decode: KV from a prefill worker) and ``local`` (the
    colocated ``Generate``: a router doing conditional disaggregation sends short prompts here to
    be prefilled in this engine, skipping the prefill pool and the KV transfer).
    """

    role = "decode"

    def __init__(self, cfg: DecodeWorkerConfig) -> None:
        if not isinstance(cfg, DecodeWorkerConfig):
            raise ValueError(f"cfg must be a DecodeWorkerConfig, got {type(cfg).__name__}")
        super().__init__(cfg)
        self.disagg = DisaggregatedRequests(self.ctx, cfg.reserve_timeout_s)
        self.local = LocalRequests(self.ctx)
        self.embeds = EmbedRequests(self.ctx)
        self.request_sets = [self.disagg, self.local, self.embeds]

    def register_services(self, server: grpc.Server) -> list[str]:
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self, server)
        return [worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name,
                register_colocated_service(self, server)]

    def setup_engine(self, engine: KVEngine) -> None:
        # only local requests prefill here; the layer hook times their queue wait
        engine.layer_done_callback = self.local.on_layer_done

    # ---- RPCs (gRPC threads) ----------------------------------------------------------
    def Reserve(self, request: worker_pb2.ReserveRequest, context: grpc.ServicerContext) -> worker_pb2.ReserveResponse:
        rid = request.request_id
        trace = None
        try:
            self.check_accepting(rid)
            if not request.prompt_token_ids:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_token_ids is empty (request {rid})")
            if not request.prefill_kv_name:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"prefill_kv_name is empty (request {rid})")
            params = request_params(request.params, rid, self.ctx.lora_roots)
            mine = self.engine.kv_cache_dtype
            if request.prefill_kv_cache_dtype and request.prefill_kv_cache_dtype != mine:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"kv_cache_dtype mismatch: prefill peer {request.prefill_kv_name!r} caches KV as "
                                   f"{request.prefill_kv_cache_dtype}, decode worker {self.cfg.worker_id} as {mine}; "
                                   f"start both pools with the same --kv-cache-dtype and --dtype (request {rid})")
            if request.kv_timeout_s < 0:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"kv_timeout_s must be >= 0, got {request.kv_timeout_s} (request {rid})")
            kv_timeout = request.kv_timeout_s or self.cfg.transfer_timeout_s
            prompt, peer = list(request.prompt_token_ids), request.prefill_kv_name
            peer_tp = check_peer_tp(self.engine, request.prefill_tensor_parallel_size,
                                    "prefill_tensor_parallel_size", rid)

            trace = self.trace_start("decode_worker.request", context, rid)

            def reserve(eng: KVEngine) -> _DecodeReq:
                # beside the step in flight (EngineLoop.beside): the loop thread is in the forward or idle, so the
                # engine's requests and this worker's records are ours until we return
                self.check_new(rid, "reserved")
                req = self.disagg.reserve(eng, rid, prompt, params, peer, kv_timeout, peer_tp,
                                          request.accept_cached_prefix, trace)
                self.disagg.hold(req)
                self.refresh_load(beside=True)  # the reply's caller sees the blocks taken in info()
                return req

            try:
                req = self.loop.beside(reserve)
            except (RuntimeError, TimeoutError) as e:  # the loop stopped, or stayed in the engine past the wait
                raise RequestError(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.cfg.worker_id}: {e} "
                                                                f"(request {rid})") from None
        except RequestError as e:
            if trace is not None:  # refused: the span ends here, with the refusal
                self.ctx.tracing.end(trace, error=f"{e.code.name}: {e.message}")
            context.abort(e.code, e.message)
        return worker_pb2.ReserveResponse(block_ids=req.block_ids, block_size=self.engine.block_size,
                                          kv_name=self.cfg.kv_name, tensor_parallel_size=engine_tp(self.engine),
                                          num_cached_tokens=req.cached_tokens)

    def SendPrefix(self, request: worker_pb2.SendPrefixRequest,
                   context: grpc.ServicerContext) -> worker_pb2.SendPrefixResponse:
        rid = request.request_id
        try:
            if self.loop is None or not self.loop.alive:  # (a draining worker still serves what it reserved)
                raise RequestError(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.cfg.worker_id} is not serving "
                                                                f"(request {rid})")
            if not request.dest_kv_name:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"dest_kv_name is empty (request {rid})")
            if request.kv_timeout_s < 0:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"kv_timeout_s must be >= 0, got {request.kv_timeout_s} (request {rid})")
            dest_tp = check_peer_tp(self.engine, request.dest_tensor_parallel_size, "dest_tensor_parallel_size", rid)
            timeout = request.kv_timeout_s or self.cfg.transfer_timeout_s

            def send(eng: KVEngine) -> None:
                self.disagg.send_prefix(eng, rid, request.dest_kv_name, request.first_token, request.num_tokens,
                                        dest_tp, timeout)

            try:
                self.loop.beside(send)
            except (RuntimeError, TimeoutError) as e:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.cfg.worker_id}: {e} "
                                                                f"(request {rid})") from None
        except RequestError as e:
            context.abort(e.code, e.message)
        return worker_pb2.SendPrefixResponse()

    def Decode(self, request: worker_pb2.DecodeRequest,
               context: grpc.ServicerContext) -> Iterator[worker_pb2.DecodeChunk]:
        return self.guard(request.request_id, context, self._decode(request, context))

    def _decode(self, request: worker_pb2.DecodeRequest,
                context: grpc.ServicerContext) -> Iterator[worker_pb2.DecodeChunk]:
        rid = request.request_id
        # no check_accepting: a draining worker still decodes what it reserved
        if self.loop is None or not self.loop.alive:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.cfg.worker_id} is not serving "
                                                            f"(request {rid})")
        lp = logprob_from_proto(request.first_logprob) if request.HasField("first_logprob") else None
        siblings = choices.sibling_params(request.siblings, rid)
        req = choices.start_request(self, request.output_stream, rid,
                                    lambda eng: self.disagg.activate(rid, request.first_token_id, lp, siblings))
        yield from self.stream_events(rid, req.out, context, choices.is_last(req))
