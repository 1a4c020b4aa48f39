"""One request on a colocated worker (router in ``mode="colocated"``).

Lifecycle: like ``DisaggregatedFlow`` but with one worker: pick the least loaded
ready colocated worker (running + waiting + this router's in-flight count, then
queued prompt tokens), call its ``Generate`` stream and pass every chunk through
the request's ``OutputProcessor``. A failure before the first token retries on
another worker; cancel/deadline/stop-string handling is the same.
``LocalPrefillFlow`` runs the same flow on a decode worker (conditional disaggregation).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Iterator

import grpc

from engine.detokenizer import OutputProcessor
from proto import pdserve_pb2, worker_pb2
from proto.convert import logprob_from_proto, params_to_wire
from router.request_flow import DisaggregatedFlow, FlowError, _RETRIABLE

log = logging.getLogger(__name__)


class ColocatedFlow(DisaggregatedFlow):
    """Drives one request on a colocated worker (see module docstring)."""

    pool = "colocated"
    """Registry role of the workers this flow runs whole requests on."""

    def _pick(self, excluded: set[str]) -> Any:
        ws = [w for w in self.deps.source.list(self.pool) if w.ready and w.worker_id not in excluded]
        if not ws:
            raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {self.rid}: no ready {self.pool} worker")
        sel = self.deps.selector
        ranked = sorted(ws, key=lambda w: (w.num_running + w.num_waiting + sel.in_flight(w.worker_id),
                                           w.queued_prompt_tokens, w.worker_id))
        return self._route_by_prefix(ranked)[0]

    def _abort_workers(self) -> None:
        w = self.decode_worker
        if w is None:
            return
        try:
            self.deps.clients.colocated(w.grpc_address).Abort(worker_pb2.AbortRequest(request_id=self.rid),
                                                              timeout=1.0)
        except grpc.RpcError as e:
            log.info("request %s: abort on %s failed: %s", self.rid, w.worker_id, e.code())

    def _run(self) -> Iterator[pdserve_pb2.GenerateResponse]:
        deps, cfg = self.deps, self.deps.cfg
        want_lp = self.req.params.logprobs is not None
        proc = OutputProcessor(deps.tokenizer, self.req.prompt_token_ids, self.req.params)
        timings = pdserve_pb2.Timings()
        excluded: set[str] = set()
        started = False
        t_first = 0.0
        cached = 0
        for attempt in range(cfg.max_attempts):
            w = self._pick(excluded)
            self._record_prefix(w)
            self.decode_worker = w
            deps.selector.acquire(w.worker_id)
            self._d_held = True
            t_call = time.monotonic()
            stream = self._track(deps.clients.colocated(w.grpc_address).Generate(
                worker_pb2.ColocatedRequest(request_id=self.rid, prompt_token_ids=self.req.prompt_token_ids,
                                            params=params_to_wire(self.req.params)),
                timeout=self._remaining(cfg.request_timeout_s)))
            try:
                for chunk in stream:
                    now = time.monotonic()
                    if not started:
                        started = True
                        t_first = now
                        cached = chunk.num_cached_tokens
                        timings.queue_s = (t_call - self.t0) + chunk.queue_s
                        timings.prefill_s = chunk.prefill_s
                        timings.ttft_s = now - self.t0
                        if deps.metrics is not None:
                            deps.metrics.observe_ttft(timings.ttft_s)
                    lps = [logprob_from_proto(m) for m in chunk.logprobs] if want_lp and chunk.logprobs else None
                    delta = proc.process(list(chunk.token_ids), lps, chunk.finish_reason or None)
                    if proc.finished:
                        if not chunk.finish_reason:
                            stream.cancel()
                            self._abort_workers()
                        timings.total_s = now - self.t0
                        timings.decode_s = now - t_first
                        resp = self._response(delta)
                        resp.finish_reason = proc.finish_reason or ""
                        resp.usage.CopyFrom(pdserve_pb2.Usage(prompt_tokens=len(self.req.prompt_token_ids),
                                                              completion_tokens=len(proc.token_ids),
                                                              cached_tokens=cached))
                        resp.timings.CopyFrom(timings)
                        yield resp
                        return
                    if delta.token_ids or delta.text:
                        yield self._response(delta)
            except grpc.RpcError as e:
                err = self._rpc_error(e, f"generate on {w.worker_id}", w.worker_id)
                self._release_workers()
                if started or err.code not in _RETRIABLE or self._cancelled or attempt + 1 == cfg.max_attempts:
                    raise err from None
                excluded.add(w.worker_id)
                log.warning("request %s: attempt %d failed: %s", self.rid, attempt + 1, err.message)
                continue
            raise FlowError(grpc.StatusCode.INTERNAL,
                            f"request {self.rid}: stream from {w.worker_id} ended without a finish reason")


class LocalPrefillFlow(ColocatedFlow):
    """Conditional disaggregation: a disaggregated-mode request prefilled on a decode worker itself
    (its colocated ``Generate``), chosen by ``router.selection.prefill_locally``. The same flow as
    colocated mode, over the decode pool: no Reserve, no prefill worker, no KV transfer."""

    pool = "decode"
