"""One request on a colocated worker (router in ``mode="colocated"``).

Lifecycle: like ``DisaggregatedFlow`` but with one worker: pick the least loaded
ready colocated worker (running + waiting + this router's in-flight count, then
queued prompt tokens), call its ``Generate`` stream and pass every chunk through
the request's ``OutputProcessor`` (``DisaggregatedFlow._run_whole``). A worker lost
before the first token is retried on another; one lost mid-stream is replaced by
another that resumes from the tokens already streamed (migration);
cancel/deadline/stop-string handling is the same.
``LocalPrefillFlow`` runs the same flow on a decode worker (conditional disaggregation).
"""
from __future__ import annotations

import logging
from typing import Iterator

import grpc

from engine.detokenizer import OutputProcessor
from proto import pdserve_pb2, worker_pb2
from router.request_flow import DisaggregatedFlow

log = logging.getLogger(__name__)


class ColocatedFlow(DisaggregatedFlow):
    """Drives one request on a colocated worker (see module docstring)."""

    pool = "colocated"
    """Registry role of the workers this flow runs whole requests on."""

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
        proc = OutputProcessor(self.deps.tokenizer, self.req.prompt_token_ids, self.req.params)
        yield from self._run_whole(self.pool, proc, pdserve_pb2.Timings(), set(), self.deps.cfg.max_attempts)


class LocalPrefillFlow(ColocatedFlow):
    """Conditional disaggregation: a disaggregated-mode request prefilled on a decode worker itself
    (its colocated ``Generate``), chosen by ``router.selection.prefill_locally``. The same flow as
    colocated mode, over the decode pool: no Reserve, no prefill worker, no KV transfer."""

    pool = "decode"
