"""Embedding requests on a worker: the ``Embed`` RPC of the prefill, colocated and decode roles.

Lifecycle of one request (an ``_EmbedReq`` in ``EmbedRequests``, loop-thread state): ``Embed`` RPC (gRPC thread:
``check_accepting``, the wire params checked) -> one call onto the loop thread: ``engine.add_request(pooling=True)``
(the prompt is scheduled with everything else on this engine: batched, chunked, prefix-cached) -> the output that
carries ``embedding`` (the step that computed the last prompt token) becomes the ``EmbedResponse`` and the request
leaves the set (its blocks are freed by the engine as it finishes). An abort (RPC cancelled, deadline, drain)
removes it from the engine at any step. Nothing is sampled for the client and no KV moves. The router cuts and
normalises the vector (engine/pooling.py), so one worker answer serves every ``dimensions`` and ``normalize``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from proto import worker_pb2
from worker_common.request import RequestError, RequestSet, WorkerRequest, request_params

if TYPE_CHECKING:
    from engine.client import EngineCore
    from engine.outputs import CoreOutput


@dataclass
class _EmbedReq(WorkerRequest):
    """One embedding request on this worker."""

    prompt_len: int = 0
    done: bool = False


class EmbedRequests(RequestSet[_EmbedReq]):
    """The embedding requests a worker holds (loop thread)."""

    def add(self, eng: "EngineCore", req: _EmbedReq, prompt_token_ids: list[int], params: Any) -> None:
        try:
            eng.add_request(req.request_id, prompt_token_ids, params, pooling=True)
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{e} (request {req.request_id})") from None
        self.hold(req)

    def on_output(self, req: _EmbedReq, out: "CoreOutput", now: float) -> None:
        if out.embedding is None:  # (never: a pooling request's one output carries it; a bug ends it, not the loop)
            self.drop(req, RequestError(grpc.StatusCode.UNAVAILABLE, f"request {req.request_id}: the engine ended "
                                                                      "it without its embedding"))
            return
        req.done = True
        self.release(req)
        req.out.put(worker_pb2.EmbedResponse(embedding=out.embedding.tolist(), num_prompt_tokens=out.num_prompt_tokens,
                                             num_cached_tokens=out.num_cached_tokens))

    def free(self, req: _EmbedReq) -> None:
        if not req.done and self.ctx.engine is not None:
            self.ctx.engine.abort_request(req.request_id)

    def queued_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self._reqs.values())

    def prefilled_prompt_tokens(self, req: _EmbedReq) -> int:
        return req.prompt_len

    def trace_phases(self, req: _EmbedReq, now: float) -> list:
        return [("worker.embed", req.arrived, now, {"gen_ai.usage.prompt_tokens": req.prompt_len})]


class EmbedServicer:
    """The ``Embed`` RPC, for a ``WorkerBase`` with an ``embeds: EmbedRequests`` among its request sets."""

    embeds: EmbedRequests

    def Embed(self, request: worker_pb2.EmbedRequest, context: grpc.ServicerContext) -> worker_pb2.EmbedResponse:
        w: Any = self
        items = list(w.guard(request.request_id, context, self._embed(request, context)))
        if not items:  # (the caller went away: nothing to answer)
            context.abort(grpc.StatusCode.CANCELLED, f"request {request.request_id} cancelled")
        return items[-1]

    def _embed(self, request: worker_pb2.EmbedRequest, context: grpc.ServicerContext) -> Any:
        w: Any = self
        rid = request.request_id
        w.check_accepting(rid)
        if not request.prompt_token_ids:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_token_ids is empty (request {rid})")
        if request.HasField("params"):
            params = request_params(request.params, rid, w.ctx.lora_roots)
        else:
            from engine import SamplingParams

            params = SamplingParams()
        ids = list(request.prompt_token_ids)
        req = _EmbedReq(rid, prompt_len=len(ids), trace=w.trace_start(f"{w.role}_worker.embed", context, rid))

        def add(eng: "EngineCore") -> None:
            w.check_new(rid, "embedding")
            self.embeds.add(eng, req, ids, params)

        w.loop.call(add)
        yield from w.stream_events(rid, req.out, context, lambda item: True)
