"""The calls a request makes to its workers: the messages, the stubs and the deadlines, in one place.

Lifecycle: one ``WorkerCalls(cfg, clients)`` per router, shared by every request. The ``Placer``
ranks workers and asks ``reserve`` to hold a prompt's blocks on a decode worker; the request flow
opens the streams of a placement (``prefill``, ``decode``, ``generate``), and its ``Attempt``
ends a placement that must not go on with ``abort`` (each worker drops the request and frees its
blocks) or one finished choice with ``abort_choice``. Streams come back untracked: the caller
tracks them (``Attempt.track``) so a cancel reaches them. Every call is bounded by the request's
deadline (``RequestScope.remaining``) and the config's per-phase timeouts, so nothing hangs.
Aborts are best effort: a worker that cannot be reached is logged and skipped.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import grpc

from proto import worker_pb2
from proto.worker_pb2 import WorkerInfo
from router.config import RouterConfig
from router.placement_records import Placement, Route
from router.scope import RequestScope

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 1.0
"""An abort is best effort: a worker that does not answer within this is left to its own deadlines."""


class WorkerCalls:
    """Builds and sends every worker RPC of a request (see module docstring)."""

    def __init__(self, cfg: RouterConfig, clients: Any, streams: Any = None) -> None:
        """``clients``: stubs by address (``router.clients.WorkerClients``, or a fake with the same methods);
        ``streams``: the router's ``OutputStreams`` (None: every request streams on its own call)."""
        self.cfg = cfg
        self.clients = clients
        self.streams = streams
        self._no_send_prefix: set[str] = set()
        """Decode workers older than ``SendPrefix`` (UNIMPLEMENTED): their pairs' prefill workers never fetch."""

    # ---- placing -----------------------------------------------------------------------------------
    def reserve(self, scope: RequestScope, request_id: str, decode: WorkerInfo,
                prefill: WorkerInfo) -> worker_pb2.ReserveResponse:
        """Hold the prompt's blocks on ``decode`` for a transfer from ``prefill`` (raises ``grpc.RpcError``)."""
        cfg = self.cfg
        return self.clients.decode(decode.grpc_address).Reserve(
            worker_pb2.ReserveRequest(request_id=request_id, prompt_token_ids=scope.prompt_token_ids,
                                      params=scope.wire_params, prefill_kv_name=prefill.kv_name,
                                      prefill_kv_cache_dtype=prefill.kv_cache_dtype,
                                      prefill_tensor_parallel_size=prefill.tensor_parallel_size,
                                      accept_cached_prefix=cfg.kv_delta_transfers,
                                      kv_timeout_s=scope.remaining(cfg.first_token_timeout_s + cfg.transfer_timeout_s)),
            timeout=scope.remaining(cfg.reserve_timeout_s), **scope.rpc_kw)

    # ---- streams -----------------------------------------------------------------------------------
    def prefill(self, scope: RequestScope, pl: Placement) -> Any:
        """``Prefill`` on the pair's prefill worker, writing into the blocks reserved on its decode worker."""
        cfg, resv = self.cfg, pl.reservation
        return self.clients.prefill(pl.prefill.grpc_address).Prefill(
            worker_pb2.PrefillRequest(request_id=pl.request_id, prompt_token_ids=scope.prompt_token_ids,
                                      params=scope.wire_params, dest_kv_name=resv.kv_name,
                                      dest_block_ids=resv.block_ids, dest_block_size=resv.block_size,
                                      dest_tensor_parallel_size=resv.tensor_parallel_size,
                                      dest_cached_tokens=resv.num_cached_tokens,
                                      fetch_min_tokens=self._fetch_min(pl)),
            timeout=scope.remaining(cfg.first_token_timeout_s + cfg.transfer_timeout_s), **scope.rpc_kw)

    def _fetch_min(self, pl: Placement) -> int:
        cfg = self.cfg
        if not cfg.kv_delta_transfers or pl.decode is None or pl.decode.worker_id in self._no_send_prefix:
            return 0
        return cfg.kv_prefix_fetch_min_tokens

    def lacks_send_prefix(self, worker_id: str) -> None:
        """``worker_id`` answered SendPrefix with UNIMPLEMENTED (an older decode worker, mid-upgrade): no prefill
        worker is asked to fetch from it again (this router's lifetime; it is a fetch not made, nothing else)."""
        self._no_send_prefix.add(worker_id)

    def send_prefix(self, scope: RequestScope, pl: Placement, fetch: worker_pb2.PrefixFetch) -> None:
        """The pair's prefill worker asked for the prompt prefix its decode worker holds (raises ``grpc.RpcError``)."""
        self.clients.decode(pl.decode.grpc_address).SendPrefix(
            worker_pb2.SendPrefixRequest(request_id=pl.request_id, dest_kv_name=fetch.kv_name,
                                         first_token=fetch.first_token, num_tokens=fetch.num_tokens,
                                         dest_tensor_parallel_size=fetch.tensor_parallel_size,
                                         kv_timeout_s=fetch.kv_timeout_s),
            timeout=scope.remaining(self.cfg.reserve_timeout_s), **scope.rpc_kw)

    def decode(self, scope: RequestScope, pl: Placement, first: worker_pb2.FirstToken) -> Any:
        """``Decode`` on the pair's decode worker, from the prefill worker's first token."""
        msg = worker_pb2.DecodeRequest(request_id=pl.request_id, first_token_id=first.token_id,
                                       siblings=scope.sibling_wires)
        if first.HasField("logprob"):
            msg.first_logprob.CopyFrom(first.logprob)
        address, timeout = pl.decode.grpc_address, scope.remaining(self.cfg.request_timeout_s)
        kw = scope.rpc_kw

        def send(stream_id: str) -> Any:
            msg.output_stream = stream_id
            return self.clients.decode(address).Decode(msg, timeout=timeout, **kw)

        return self._start(address, pl.request_id, send)

    def generate(self, scope: RequestScope, pl: Placement, resume_token_ids: Sequence[int]) -> Any:
        """``Generate`` on the worker running the whole request, resuming after ``resume_token_ids``."""
        msg = worker_pb2.ColocatedRequest(request_id=pl.request_id, prompt_token_ids=scope.prompt_token_ids,
                                          params=scope.wire_params, resume_token_ids=resume_token_ids,
                                          siblings=scope.sibling_wires)
        address, timeout = pl.decode.grpc_address, scope.remaining(self.cfg.request_timeout_s)
        kw = scope.rpc_kw

        def send(stream_id: str) -> Any:
            msg.output_stream = stream_id
            return self.clients.colocated(address).Generate(msg, timeout=timeout, **kw)

        return self._start(address, pl.request_id, send)

    def _start(self, address: str, request_id: str, send: Any) -> Any:
        """Send through the worker's output stream when there is one (``router.output_streams``)."""
        if self.streams is None:
            return send("")
        return self.streams.start(address, request_id, send)

    # ---- ending ------------------------------------------------------------------------------------
    def _stub(self, pl: Placement, w: WorkerInfo) -> Any:
        if pl.route is not Route.PAIR:
            return self.clients.colocated(w.grpc_address)
        return self.clients.prefill(w.grpc_address) if w is pl.prefill else self.clients.decode(w.grpc_address)

    def abort(self, pl: Placement) -> None:
        """Best effort: every worker of ``pl`` drops the request and frees its blocks."""
        msg = worker_pb2.AbortRequest(request_id=pl.request_id)
        for w in pl.workers():
            try:
                self._stub(pl, w).Abort(msg, timeout=ABORT_TIMEOUT_S)
            except grpc.RpcError as e:
                log.info("request %s: abort on %s failed: %s", pl.request_id, w.worker_id, e.code())

    def abort_choice(self, pl: Placement, index: int) -> None:
        """Best effort: the worker streaming ``pl``'s tokens ends choice ``index`` alone (a stop string ended it)."""
        w = pl.decode
        if w is None:
            return
        try:
            self._stub(pl, w).AbortChoice(worker_pb2.AbortChoiceRequest(request_id=pl.request_id, choice_index=index),
                                          timeout=ABORT_TIMEOUT_S)
        except grpc.RpcError as e:
            log.info("request %s: abort of choice %d on %s failed: %s", pl.request_id, index, w.worker_id, e.code())
