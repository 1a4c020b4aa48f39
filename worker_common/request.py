"""A request held by a worker: the shared record, the error that ends it, and the set that holds it.

Lifecycle: a role's RPC handler (gRPC thread) checks the wire params (``request_params``), builds a
record (a ``WorkerRequest`` subclass with the role's own fields) and hands it to the loop thread,
where the role's ``RequestSet`` holds it by id. The loop puts the request's stream items into
``req.out``; the handler yields them until the last one, or raises the ``RequestError`` it finds
there. A request leaves its set when it finishes, fails (``drop(req, err)``: free what it holds,
end its stream with ``err``) or is aborted (``abort(id)``: the same with CANCELLED).

A worker holds one ``RequestSet`` per kind of request it serves (a decode worker: requests
prefilled elsewhere and whole requests prefilled here) and routes each engine output, poll and
abort to the set that knows the id; no set ever sees another's records. A set sees of its worker
only a ``RequestContext``: the engine, the KV endpoint and the metrics, which the worker fills in
when it loads; the RPC plumbing (accepting, streaming, ids unique across sets) stays in the worker.
"""
from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Optional, TypeVar

import grpc

if TYPE_CHECKING:
    from engine.client import EngineCore, KVEngine
    from engine.outputs import CoreOutput

log = logging.getLogger(__name__)


@dataclass
class RequestContext:
    """What a request set uses of its worker. Built empty with the worker; ``WorkerBase.load()`` fills in
    the engine, the KV endpoint and the metrics before the loop thread (their only user) starts."""

    worker_id: str
    """The worker's id, for messages."""
    engine: Optional["EngineCore"] = None
    """The worker's engine (``engine.client``): an ``EngineCore``; a ``KVEngine`` for the prefill and decode roles."""
    kv: Any = None
    """Its kvtransfer ``KVEndpoint`` (None for a colocated worker)."""
    metrics: Any = None
    """Its ``metrics.WorkerMetrics``."""
    tracing: Any = None
    """Its ``transport.tracing.Tracing`` (None, or off: no spans)."""
    lora_roots: dict = field(default_factory=dict)
    """LoRA adapter name -> prefix-cache root of each adapter its engine serves now (worker_common/lora_sync.py)."""


class RequestError(Exception):
    """A request failed on the worker; the handler ends its RPC with ``code``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def engine_tp(eng: EngineCore) -> int:
    """Ranks the engine's KV cache is split over (1 for an unsplit engine, an engine process, a stand-in)."""
    heads = getattr(eng, "kv_head_ranges", None)
    return len(heads) if isinstance(heads, list) and heads else 1


def engine_kv_shards(eng: KVEngine) -> Any:
    """The engine's KV cache as its tensor-parallel ranks hold it (``kvtransfer.KVShards``): what the worker's
    KV transfers read from and write into, every rank's cache mapped in this process."""
    from kvtransfer import KVShards

    caches, heads = getattr(eng, "rank_kv_caches", None), getattr(eng, "kv_head_ranges", None)
    if isinstance(caches, list) and isinstance(heads, list) and caches and len(caches) == len(heads):
        return KVShards(tuple(caches), tuple(heads))
    return KVShards.whole(eng.kv_caches)


def prefix_fetch_id(request_id: str) -> str:
    """The id under which a prefill worker fetches a request's cached prefix from its decode worker: its engine
    reservation there and the kvtransfer request id of the decode -> prefill send (``PrefixFetch``)."""
    return f"{request_id}|prefix"


def check_peer_tp(eng: EngineCore, value: int, field: str, request_id: str) -> int:
    """A KV peer's tensor-parallel size from a request (0: an older peer, 1); FAILED_PRECONDITION naming
    ``field`` where its layout cannot be mapped onto this engine's (the sizes and the KV heads must divide one
    another); INVALID_ARGUMENT if negative."""
    from kvtransfer import rank_heads

    if value < 0:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{field} must be >= 0, got {value} "
                                                             f"(request {request_id})")
    tp = value or 1
    try:
        rank_heads(engine_kv_shards(eng).num_kv_heads, tp)
    except ValueError as e:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"{field}: the peer's KV layout cannot be mapped onto this worker's: {e} "
                           f"(request {request_id})") from None
    return tp


def request_params(wire: Any, request_id: str, lora_roots: Optional[dict] = None) -> Any:
    """A request's wire sampling params as engine SamplingParams; INVALID_ARGUMENT naming the field if bad.
    ``lora_roots`` (the worker's adapters, name -> prefix-cache root): a request under an adapter this worker does
    not serve, or serves with other weights than the router admitted it under (``lora_root``: it was reloaded
    meanwhile), is NOT_FOUND."""
    from worker_common.wire import wire_to_params

    try:
        params = wire_to_params(wire)
    except ValueError as e:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"params: {e} (request {request_id})") from None
    name = params.lora_name
    if name is not None and lora_roots is not None:
        root = lora_roots.get(name)
        if root is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"params.lora_name: this worker serves no LoRA adapter "
                                                          f"{name!r} (request {request_id})")
        if wire.lora_root and root != wire.lora_root:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"params.lora_name: LoRA adapter {name!r} was reloaded "
                                                          f"with other weights while request {request_id} ran")
    return params


@dataclass
class WorkerRequest:
    """What every role keeps of a request (loop-thread state); roles subclass it with their own fields."""

    request_id: str
    out: "queue.Queue[Any]" = field(default_factory=queue.Queue, kw_only=True)
    """The request's stream: items for the handler to yield, or the RequestError that ends it."""
    arrived: float = field(default_factory=time.monotonic, kw_only=True)
    """When the worker took the request (monotonic seconds): queue times and deadlines count from here."""
    trace: Any = field(default=None, kw_only=True)
    """Its span on this worker (``transport.tracing``: under the router's, from the RPC's trace context), ended with
    its phases as child spans when the request leaves its set; None while tracing is off."""

    def fail(self, err: RequestError) -> None:
        """End the request's stream with ``err`` (the handler raises it)."""
        self.out.put(err)

    def cancel(self) -> None:
        """End the request's stream as aborted."""
        self.fail(RequestError(grpc.StatusCode.CANCELLED, f"request {self.request_id} aborted"))


R = TypeVar("R", bound=WorkerRequest)


class RequestSet(Generic[R]):
    """The requests of one kind a worker holds, by id (touched on its loop thread only).

    Built by its worker with the worker's ``RequestContext`` (engine, KV endpoint, metrics: filled in
    by ``load()``). Subclasses say how to free a request (``free``), what an engine output means for
    it (``on_output``) and, if they wait on something besides the engine, how to advance it (``poll``)."""

    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx
        self._reqs: dict[str, R] = {}
        self.requests_total = 0
        """Requests held so far that this worker prefills (``prefilled_prompt_tokens`` > 0): WorkerInfo's counter."""
        self.prompt_tokens_total = 0
        """Their prompt tokens."""

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._reqs

    def _take(self, request_id: str, error: Optional[str] = None) -> Optional[R]:
        req = self._reqs.pop(request_id, None)
        if req is not None and req.trace is not None:
            self._end_trace(req, error)
        return req

    def _end_trace(self, req: R, error: Optional[str]) -> None:
        """The request's span on this worker: its phases (``trace_phases``) as child spans, then its end."""
        tr, now = self.ctx.tracing, time.monotonic()
        span, req.trace = req.trace, None
        try:
            for name, start, end, attrs in self.trace_phases(req, now):
                tr.child(span, name, start, end, attrs)
            tr.end(span, self.trace_attributes(req), error=error)
        except Exception as e:  # noqa: BLE001 - a trace must never fail a request
            log.warning("request %s: trace not recorded: %s", req.request_id, e)

    def get(self, request_id: str) -> Optional[R]:
        return self._reqs.get(request_id)

    def records(self) -> list[R]:
        """The held records (a copy: callers may drop requests while iterating)."""
        return list(self._reqs.values())

    def snapshot(self) -> dict[str, R]:
        """A copy of the id -> record map (safe to read from any thread)."""
        return dict(self._reqs)

    def hold(self, req: R) -> None:
        """Start holding ``req``; the caller has checked its id is new on the worker."""
        if req.request_id in self._reqs:
            raise ValueError(f"request {req.request_id} is already held")
        self._reqs[req.request_id] = req
        n = self.prefilled_prompt_tokens(req)
        if n > 0:
            self.requests_total += 1
            self.prompt_tokens_total += n

    def release(self, req: R) -> None:
        """Stop holding ``req`` (it finished); its engine state is the caller's to settle."""
        self._take(req.request_id)

    def drop(self, req: R, err: Optional[RequestError]) -> None:
        """Stop holding ``req``, free what it holds, and end its stream with ``err`` (if any)."""
        self._take(req.request_id, None if err is None else f"{err.code.name}: {err.message}")
        self.free(req)
        if err is not None:
            req.fail(err)

    def abort_quietly(self, request_id: str) -> bool:
        """Drop a request and free what it holds without touching its stream (True if held)."""
        req = self._take(request_id, "CANCELLED: aborted")
        if req is None:
            return False
        self.free(req)
        return True

    def abort(self, request_id: str) -> bool:
        """Drop the request and end its stream as CANCELLED; True if this set held it."""
        req = self._reqs.get(request_id)
        if req is None:
            return False
        self.abort_quietly(request_id)
        req.cancel()
        return True

    # ---- hooks (loop thread) --------------------------------------------------------
    def trace_phases(self, req: R, now: float) -> list[tuple[str, Optional[float], Optional[float], dict]]:
        """(name, start, end, attributes) of ``req``'s phases on this worker, monotonic seconds (None: did not
        happen): child spans of its trace."""
        return []

    def trace_attributes(self, req: R) -> dict:
        """Attributes of ``req``'s span on this worker, set when it ends."""
        return {"gen_ai.request.id": req.request_id}

    def free(self, req: R) -> None:
        """Give back what ``req`` holds in the engine and the KV endpoint."""
        raise NotImplementedError

    def on_output(self, req: R, out: "CoreOutput", now: float) -> None:
        """One engine output of a request this set holds."""
        raise NotImplementedError

    def poll(self, now: float) -> bool:
        """Advance what the engine does not (KV transfers, deadlines); True while something is pending."""
        return False

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens of held requests not yet prefilled (the router's load signal)."""
        return 0

    def prefilled_prompt_tokens(self, req: R) -> int:
        """The prompt tokens this worker will prefill for ``req``, counted once when it is held (the SLA
        planner's arrival counters); 0: not a new request here (KV prefilled elsewhere, a sibling choice)."""
        return 0

    def ends_request(self, req: R) -> bool:
        """Whether ``req`` finishing finishes a client request (WorkerInfo's ``requests_finished_total``);
        a set whose records may be one choice of several counts one of them only."""
        return True
