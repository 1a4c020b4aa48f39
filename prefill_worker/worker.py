"""The prefill role: prefill prompts in batches, ship each layer's KV, return the first token.

Lifecycle of one request (a ``_PrefillReq`` in ``PrefillRequests``, loop-thread state):
1. ``Prefill`` RPC -> ``_add`` on the loop: ``engine.add_request(prefill_only=True)``; the
   prompt waits in the engine's queue and is batched with other prompts.
2. Inside ``engine.step()``, ``on_layer_done(i, ids)`` fires as each layer's K/V is complete:
   the first call opens ``kv.send`` to the decode worker's endpoint, each call marks layer ``i``
   ready, so the transfer overlaps the remaining layers' compute.
   Before step 1, a prompt whose leading tokens the decode worker holds (``dest_cached_tokens``) at least
   ``fetch_min_tokens`` more of than this worker's prefix cache is first *fetched*: blocks for them are
   reserved here, their receive from the decode worker is posted and a PrefixFetch event asks the router to
   have the decode worker send them (``DecodeWorker.SendPrefix``); once they are in, they are named in this
   worker's prefix cache and the prompt is added, so only what neither side had is computed. A fetch that
   fails is computed instead (``pdserve:kv_prefix_fetches_total{outcome="fallback"}``), never a wrong token; one
   this worker estimates slower than computing the tokens (``fetch_cost.FetchCost``) is not made ("skipped").
3. ``step()`` returns ``finish_reason="prefill_done"`` with the first token: it goes to the
   handler at once (TTFT does not wait for the transfer).
4. ``poll()`` watches the send: DONE -> TransferDone event; FAILED -> an UNAVAILABLE error
   naming the request. Either way ``engine.release`` frees the blocks.
An abort (RPC, cancelled stream, drain timeout) cancels the send and frees the blocks at any step.

``PrefillWorker`` is the gRPC shell (``WorkerBase``): the ``Prefill`` RPC's checks, then one call
onto the loop thread; ``PrefillRequests`` holds the requests and does all of the above, seeing only
the worker's ``RequestContext`` (engine, KV endpoint, metrics).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional

import grpc
import torch

from kvtransfer import TransferState
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.fetch_cost import FetchCost
from proto import worker_pb2, worker_pb2_grpc
from worker_common.request import (RequestContext, RequestError, RequestSet, WorkerRequest, check_peer_tp,
                                   engine_kv_shards, engine_tp, prefix_fetch_id, request_params)
from worker_common.embeddings import EmbedRequests, EmbedServicer
from worker_common.wire import logprob_to_proto, prompt_logprobs_to_proto
from worker_common.worker_base import WorkerBase

if TYPE_CHECKING:
    from engine.client import KVEngine

log = logging.getLogger(__name__)


@dataclass
class _PrefillReq(WorkerRequest):
    """One prompt in flight on this worker."""

    prompt_token_ids: list[int]
    dest_kv_name: str
    block_size: int
    dest_tp: int = 1  # ranks of the decode worker's KV cache: the send is cut into pieces by head
    dest_cached: int = 0  # leading prompt positions the decode worker already holds: not sent (a delta transfer)
    scheduled: Optional[float] = None
    first_token_at: Optional[float] = None
    handle: Any = None
    error: Optional[RequestError] = None  # set inside step() (layer callback), reported after it
    in_engine: bool = True  # False once the first token is out (KV held for sending)
    fetch_min: int = 0  # fetch the decode worker's cached prefix when it holds this many more tokens (0: never)
    fetch: Any = None  # the prefix fetch's receive while it runs (the prompt is added to the engine after it)
    fetch_span: tuple = ()  # (first token, tokens, started, ended) of a prefix fetch made
    params: Any = None


class PrefillRequests(RequestSet[_PrefillReq]):
    """The prompts the worker prefills and ships (see module docstring; loop thread)."""

    def __init__(self, ctx: RequestContext, transfer_timeout_s: float) -> None:
        super().__init__(ctx)
        self.transfer_timeout_s = transfer_timeout_s
        """Deadline of one KV send, from its submission."""
        self.fetch_cost = FetchCost()
        """Whether receiving a prefix beats computing it, from this worker's measurements (``_start_fetch``)."""

    def queued_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.records() if r.first_token_at is None)

    def prefilled_prompt_tokens(self, req: _PrefillReq) -> int:
        return len(req.prompt_token_ids)

    def add(self, eng: KVEngine, req: _PrefillReq, params: Any, dest_blocks: list[int]) -> None:
        """Queue ``req``'s prompt in the engine and hold it; the caller checked its id is new on the worker."""
        need = -(-len(req.prompt_token_ids) // max(1, req.block_size))
        if req.block_size <= 0 or len(dest_blocks) < need:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"dest_block_ids: {len(dest_blocks)} blocks of {req.block_size} tokens cannot "
                               f"hold {len(req.prompt_token_ids)} prompt tokens (request {req.request_id})")
        req.params = params
        if not self._start_fetch(eng, req):
            self._add_to_engine(eng, req)
        self.hold(req)

    def _add_to_engine(self, eng: KVEngine, req: _PrefillReq) -> None:
        try:
            eng.add_request(req.request_id, req.prompt_token_ids, req.params, prefill_only=True)
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{e} (request {req.request_id})") from None

    # ---- prefix fetch: the decode worker's cached prefix, received instead of computed ---------------------
    def _start_fetch(self, eng: KVEngine, req: _PrefillReq) -> bool:
        """Reserve blocks for the leading whole blocks the decode worker holds, post their receive and ask for
        them (a PrefixFetch event), when it holds at least ``fetch_min`` more than this cache; False: prefill now."""
        bm = getattr(eng, "block_manager", None)
        if req.fetch_min <= 0 or req.params.prompt_logprobs is not None or bm is None or not bm.enable_caching:
            return False
        bs = eng.block_size
        held = req.dest_cached // bs * bs  # in this cache's whole blocks
        if held < req.fetch_min:
            return False
        try:  # refuse a bad request now, not after its fetch
            eng.check_request(req.request_id, req.prompt_token_ids, req.params, prefill_only=True)
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{e} (request {req.request_id})") from None
        # decided before any block is taken: a reservation given back would have evicted cached blocks for nothing
        missing = held - eng.cached_prefix_tokens(req.prompt_token_ids[:held], lora_name=req.params.lora_name,
                                                  cache_salt=req.params.cache_salt)
        if missing < req.fetch_min:
            return False
        if not self.fetch_cost.decide(missing):
            self.ctx.metrics.inc_kv_prefix_fetch("skipped")  # computing them is estimated faster here
            return False
        fid = prefix_fetch_id(req.request_id)
        try:
            got = eng.reserve_prompt(fid, held, req.prompt_token_ids[:held], prefix=True,
                                     lora_name=req.params.lora_name, cache_salt=req.params.cache_salt)
        except ValueError as e:
            log.info("prefill %s: request %s: no prefix fetch: %s", self.ctx.worker_id, req.request_id, e)
            return False
        if got is None:  # no free blocks for it: compute as before
            return False
        blocks, have = got
        try:
            req.fetch = self.ctx.kv.recv_shards(req.dest_kv_name, fid, engine_kv_shards(eng), req.dest_tp, blocks,
                                                held, deadline_s=self.transfer_timeout_s, first_token=have)
        except Exception as e:  # a bad peer name or a broken endpoint: compute it
            eng.abort_request(fid)
            log.warning("prefill %s: request %s: prefix fetch not posted: %s", self.ctx.worker_id, req.request_id, e)
            return False
        req.fetch_span = (have, held, time.monotonic(), None)
        req.out.put(worker_pb2.PrefillEvent(prefix_fetch=worker_pb2.PrefixFetch(
            first_token=have, num_tokens=held, kv_name=self.ctx.kv.name, tensor_parallel_size=engine_tp(eng),
            kv_timeout_s=self.transfer_timeout_s)))
        return True

    def _fetched(self, req: _PrefillReq, ok: bool) -> None:
        """The fetch ended: name what arrived in the prefix cache (the reservation keeps it until the request
        ends), or drop it; either way the prompt joins the engine's queue now."""
        eng, w = self.ctx.engine, self.ctx
        handle, req.fetch = req.fetch, None
        first, held, started, _ = req.fetch_span
        req.fetch_span = (first, held, started, time.monotonic())
        fid = prefix_fetch_id(req.request_id)
        why = None if ok else w.kv.failure(handle)
        if ok:
            st = w.kv.stats(handle)
            self.fetch_cost.observe_fetch(held - first, st.seconds, st.wire_seconds)
            try:
                eng.commit_reserved(fid, req.prompt_token_ids[:held])
            except ValueError as e:
                ok, why = False, f"not cached: {e}"
        if not ok:
            log.info("prefill %s: request %s: prefix fetch failed (%s); computing it", w.worker_id, req.request_id,
                     why)
            eng.abort_request(fid)
        w.metrics.inc_kv_prefix_fetch("done" if ok else "fallback", held - first if ok else 0)
        try:
            self._add_to_engine(eng, req)
        except RequestError as e:
            self.drop(req, e)

    def on_layer_done(self, layer: int, request_ids: list[str]) -> None:
        """The engine's layer hook (inside ``engine.step()``): layer ``layer`` of these prompts is in the cache."""
        # runs under torch.inference_mode: tensors kvtransfer makes here must be normal ones,
        # since its channel threads update them outside inference mode
        with torch.inference_mode(False):
            self._layers_ready(layer, request_ids)

    def _layers_ready(self, layer: int, request_ids: list[str]) -> None:
        # never raise: an exception here would fail the whole batch's step
        for rid in request_ids:
            req = self.get(rid)
            if req is None or req.error is not None:
                continue
            try:
                if req.handle is None:
                    req.scheduled = req.scheduled or time.monotonic()
                    req.handle = self._open_send(req, layers_ready=False)
                self.ctx.kv.layer_ready(req.handle, layer)
            except Exception as e:
                log.warning("prefill %s: request %s: KV send failed: %s", self.ctx.worker_id, rid, e)
                req.error = RequestError(grpc.StatusCode.UNAVAILABLE,
                                         f"KV send of request {rid} to {req.dest_kv_name} failed: {e}")

    def _open_send(self, req: _PrefillReq, layers_ready: bool) -> Any:
        eng = self.ctx.engine
        src = eng.get_block_table(req.request_id)[: -(-len(req.prompt_token_ids) // eng.block_size)]
        return self.ctx.kv.send_shards(req.dest_kv_name, req.request_id, engine_kv_shards(eng), req.dest_tp, src,
                                       len(req.prompt_token_ids), deadline_s=self.transfer_timeout_s,
                                       layers_ready=layers_ready, first_token=req.dest_cached)

    def on_output(self, req: _PrefillReq, o: Any, now: float) -> None:
        if o.finish_reason != "prefill_done" or not o.new_token_ids:
            # the engine finished it some other way (abort): the send cannot complete
            self._fail(req, grpc.StatusCode.INTERNAL,
                       f"prefill of request {req.request_id} ended with {o.finish_reason!r}")
            return
        req.first_token_at = now
        req.in_engine = False
        self.fetch_cost.observe_prefill(len(req.prompt_token_ids) - o.num_cached_tokens,
                                        now - (req.scheduled or req.arrived))
        if req.error is None and req.handle is None:
            try:  # no layer callback ran (prefix fully cached?): send every layer now
                req.handle = self._open_send(req, layers_ready=True)
            except Exception as e:
                req.error = RequestError(grpc.StatusCode.UNAVAILABLE,
                                         f"KV send of request {req.request_id} failed: {e}")
        if req.error is not None:
            self.drop(req, req.error)
            return
        scheduled = req.scheduled or req.arrived
        ft = worker_pb2.FirstToken(token_id=o.new_token_ids[0], queue_s=scheduled - req.arrived,
                                   prefill_s=now - scheduled, num_cached_tokens=o.num_cached_tokens)
        if o.logprobs:
            ft.logprob.CopyFrom(logprob_to_proto(o.logprobs[0]))
        if o.prompt_logprobs:
            ft.prompt_logprobs.extend(prompt_logprobs_to_proto(o.prompt_logprobs))
        metrics = self.ctx.metrics
        metrics.observe_queue_time(ft.queue_s)
        metrics.observe_prefill_time(ft.prefill_s)
        req.out.put(worker_pb2.PrefillEvent(first_token=ft))

    def poll(self, now: float) -> bool:
        w = self.ctx
        for req in self.records():
            if req.fetch is not None:
                state = w.kv.poll(req.fetch)
                if state in (TransferState.DONE, TransferState.FAILED):
                    self._fetched(req, state == TransferState.DONE)
                continue
            if req.in_engine or req.handle is None:
                continue
            state = w.kv.poll(req.handle)
            if state == TransferState.DONE:
                self.release(req)
                w.engine.release(req.request_id)
                w.engine.release(prefix_fetch_id(req.request_id))
                req.out.put(worker_pb2.PrefillEvent(
                    transfer_done=worker_pb2.TransferDone(kv_transfer_s=time.monotonic() - req.first_token_at)))
            elif state == TransferState.FAILED:
                self._fail(req, grpc.StatusCode.UNAVAILABLE,
                           f"KV transfer of request {req.request_id} to {req.dest_kv_name} failed: "
                           f"{w.kv.failure(req.handle)}")
        for st in w.kv.take_completed():
            if st.direction == "send" and st.state == TransferState.DONE:
                w.metrics.observe_kv_transfer(st.seconds, st.num_bytes, st.link)
                w.metrics.observe_kv_transfer_phases("send", st.phases())
        return len(self) > 0

    def _fail(self, req: _PrefillReq, code: grpc.StatusCode, message: str) -> None:
        self.drop(req, RequestError(code, message))

    def trace_phases(self, req: _PrefillReq, now: float) -> list:
        kv: dict = {"pdserve.kv.peer": req.dest_kv_name, "pdserve.kv.backend": getattr(self.ctx.kv, "backend", ""),
                    "pdserve.kv.first_token": req.dest_cached, "pdserve.kv.dest_tensor_parallel_size": req.dest_tp}
        if req.handle is not None:
            st = self.ctx.kv.stats(req.handle)
            kv.update({"pdserve.kv.bytes": st.num_bytes, "pdserve.kv.layers_done": st.layers_done,
                       "pdserve.kv.link": st.link,
                       "pdserve.kv.state": st.state.value,
                       "pdserve.kv.tokens": len(req.prompt_token_ids) - req.dest_cached})
        scheduled = req.scheduled or (req.first_token_at and req.arrived)
        fetch = []
        if req.fetch_span:
            first, held, started, ended = req.fetch_span
            fetch = [("prefill_worker.prefix_fetch", started, ended if ended is not None else now,
                      {"pdserve.kv.peer": req.dest_kv_name, "pdserve.kv.first_token": first,
                       "pdserve.kv.tokens": held - first})]
        return [*fetch, ("prefill_worker.queue", req.arrived, scheduled, {}),
                ("prefill_worker.prefill", scheduled, req.first_token_at,
                 {"gen_ai.usage.prompt_tokens": len(req.prompt_token_ids)}),
                ("kv_transfer.send", req.first_token_at, now if req.first_token_at is not None else None, kv)]

    def free(self, req: _PrefillReq) -> None:
        w = self.ctx
        if req.handle is not None:
            w.kv.cancel(req.handle)
        if req.fetch is not None:
            w.kv.cancel(req.fetch)
            req.fetch = None
        if req.in_engine:
            w.engine.abort_request(req.request_id)
        else:
            w.engine.release(req.request_id)
        w.engine.abort_request(prefix_fetch_id(req.request_id))


class PrefillWorker(EmbedServicer, WorkerBase):
    """gRPC prefill worker around one engine (see module docstring)."""

    role = "prefill"

    def __init__(self, cfg: PrefillWorkerConfig) -> None:
        if not isinstance(cfg, PrefillWorkerConfig):
            raise ValueError(f"cfg must be a PrefillWorkerConfig, got {type(cfg).__name__}")
        super().__init__(cfg)
        self.prefills = PrefillRequests(self.ctx, cfg.transfer_timeout_s)
        self.embeds = EmbedRequests(self.ctx)
        self.request_sets = [self.prefills, self.embeds]

    def register_services(self, server: grpc.Server) -> list[str]:
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(self, server)
        return [worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name]

    def setup_engine(self, engine: KVEngine) -> None:
        engine.layer_done_callback = self.prefills.on_layer_done

    def Prefill(self, request: worker_pb2.PrefillRequest,
                context: grpc.ServicerContext) -> Iterator[worker_pb2.PrefillEvent]:
        return self.guard(request.request_id, context, self._prefill(request, context))

    def _prefill(self, request: worker_pb2.PrefillRequest,
                 context: grpc.ServicerContext) -> Iterator[worker_pb2.PrefillEvent]:
        rid = request.request_id
        self.check_accepting(rid)
        if not request.prompt_token_ids:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_token_ids is empty (request {rid})")
        if not request.dest_kv_name:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"dest_kv_name is empty (request {rid})")
        params = request_params(request.params, rid, self.ctx.lora_roots)
        dest_tp = check_peer_tp(self.engine, request.dest_tensor_parallel_size, "dest_tensor_parallel_size", rid)
        if not 0 <= request.dest_cached_tokens < len(request.prompt_token_ids):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"dest_cached_tokens must be in [0, {len(request.prompt_token_ids)}) (the prompt's "
                               f"length), got {request.dest_cached_tokens} (request {rid})")
        if request.fetch_min_tokens < 0:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"fetch_min_tokens must be >= 0, got {request.fetch_min_tokens} (request {rid})")
        req = _PrefillReq(rid, list(request.prompt_token_ids), request.dest_kv_name, request.dest_block_size,
                          dest_tp=dest_tp, dest_cached=request.dest_cached_tokens,
                          fetch_min=request.fetch_min_tokens,
                          trace=self.trace_start("prefill_worker.request", context, rid))
        dest_blocks = list(request.dest_block_ids)

        def add(eng: KVEngine) -> None:
            self.check_new(rid, "prefilling")
            self.prefills.add(eng, req, params, dest_blocks)

        self.loop.call(add)
        yield from self.stream_events(rid, req.out, context, lambda ev: ev.HasField("transfer_done"))
