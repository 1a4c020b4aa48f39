"""In-process fakes of the router's worker transport, for unit tests of the flow, the core and the HTTP front end.

Lifecycle: a test builds ``FakeWorker``s (one per address; each scripts what its ``Reserve``, ``Prefill``,
``Decode`` and ``Generate`` answer, and records every call and abort), puts them in ``FakeClients`` (what
``router.clients.WorkerClients`` is to a real router: stubs by address), and builds the router's own objects
over them with ``router_parts``. A ``FakeStream`` is a server stream: it yields its messages, then raises its
error, ends, or (``block=True``) waits until cancelled, as a gRPC call would. Nothing here opens a socket.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import grpc

from proto import worker_pb2
from proto.worker_pb2 import WorkerInfo
from router.admission import AdmissionQueue
from router.config import RouterConfig
from router.placement import Placer
from router.kv.prefix_index import PrefixIndex
from router.request_flow import FlowDeps
from router.selection import WorkerSelector
from router.worker_calls import WorkerCalls
from router.worker_source import StaticWorkerSource
from router.worker_view import WorkerView
from transport.errors import StatusRpcError


class FakeStream:
    """A server-streaming call: ``msgs``, then ``error`` (or the end; ``block``: wait for a cancel)."""

    def __init__(self, msgs: Sequence[Any] = (), error: Optional[grpc.RpcError] = None, block: bool = False,
                 block_s: float = 30.0) -> None:
        self._msgs, self._error, self._block, self._block_s = list(msgs), error, block, block_s
        self._cancelled = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> bool:
        self._cancelled.set()
        return True

    def __iter__(self) -> "FakeStream":
        return self

    def __next__(self) -> Any:
        if self.cancelled:
            raise StatusRpcError(grpc.StatusCode.CANCELLED, "cancelled")
        if self._msgs:
            return self._msgs.pop(0)
        if self._error is not None:
            raise self._error
        if self._block:
            self._cancelled.wait(self._block_s)
            raise StatusRpcError(grpc.StatusCode.CANCELLED, "cancelled")
        raise StopIteration


Script = Union[Callable[[Any], Any], Any]
"""What a fake RPC answers: a value, an exception to raise, or a function of the request."""


def _answer(script: Script, req: Any) -> Any:
    out = script(req) if callable(script) and not isinstance(script, FakeStream) else script
    if isinstance(out, BaseException):
        raise out
    return out


@dataclass
class FakeWorker:
    """One worker's stub: scripted answers, and a log of what the router asked of it."""

    info: WorkerInfo
    reserve: Script = None
    prefill: Script = None
    decode: Script = None
    generate: Script = None
    send_prefix: Script = None
    calls: list[tuple[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    choices_aborted: list[tuple[str, int]] = field(default_factory=list)

    def Reserve(self, req: Any, timeout: float = 0.0) -> Any:
        self.calls.append(("Reserve", req))
        out = _answer(self.reserve, req)
        return out if out is not None else worker_pb2.ReserveResponse(block_ids=[1, 2, 3], block_size=16,
                                                                        kv_name=self.info.kv_name)

    def Prefill(self, req: Any, timeout: float = 0.0) -> Any:
        self.calls.append(("Prefill", req))
        return _answer(self.prefill, req)

    def SendPrefix(self, req: Any, timeout: float = 0.0) -> Any:
        self.calls.append(("SendPrefix", req))
        out = _answer(self.send_prefix, req)
        return out if out is not None else worker_pb2.SendPrefixResponse()

    def Decode(self, req: Any, timeout: float = 0.0) -> Any:
        self.calls.append(("Decode", req))
        return _answer(self.decode, req)

    def Generate(self, req: Any, timeout: float = 0.0) -> Any:
        self.calls.append(("Generate", req))
        return _answer(self.generate, req)

    def Abort(self, req: Any, timeout: float = 0.0) -> Any:
        self.aborted.append(req.request_id)
        return worker_pb2.AbortResponse(found=True)

    def AbortChoice(self, req: Any, timeout: float = 0.0) -> Any:
        self.choices_aborted.append((req.request_id, req.choice_index))
        return worker_pb2.AbortResponse(found=True)

    def called(self, method: str) -> list[Any]:
        return [r for m, r in self.calls if m == method]


class FakeClients:
    """Stubs by address, as ``WorkerClients`` hands them out."""

    def __init__(self, workers: Sequence[FakeWorker]) -> None:
        self.by_address = {w.info.grpc_address: w for w in workers}

    def _get(self, address: str) -> FakeWorker:
        if address not in self.by_address:
            raise StatusRpcError(grpc.StatusCode.UNAVAILABLE, f"no worker at {address}")
        return self.by_address[address]

    prefill = decode = colocated = _get

    def close(self) -> None:
        pass


def info(wid: str, role: str, running: int = 0, queued: int = 0, ready: bool = True, free: int = 64) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role=role, num_running=running, queued_prompt_tokens=queued, ready=ready,
                      block_size=16, num_total_blocks=64, num_free_blocks=free, grpc_address=f"{wid}:1",
                      kv_name=f"kv-{wid}")


def first_token(token_id: int, cached: int = 0) -> worker_pb2.PrefillEvent:
    return worker_pb2.PrefillEvent(first_token=worker_pb2.FirstToken(token_id=token_id, queue_s=0.01, prefill_s=0.02,
                                                                     num_cached_tokens=cached))


def transfer_done(s: float = 0.003) -> worker_pb2.PrefillEvent:
    return worker_pb2.PrefillEvent(transfer_done=worker_pb2.TransferDone(kv_transfer_s=s))


def chunk(tokens: Sequence[int], finish: str = "", index: int = 0, cached: int = 0) -> worker_pb2.DecodeChunk:
    return worker_pb2.DecodeChunk(token_ids=list(tokens), finish_reason=finish, index=index,
                                  num_cached_tokens=cached)


class FakeMetrics:
    """Records the router metrics a flow reports: ``counts[name]`` and the arguments of each call."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.args: dict[str, list[tuple]] = {}

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("_"):
            raise AttributeError(name)

        def record(*a: Any) -> None:
            self.counts[name] = self.counts.get(name, 0) + 1
            self.args.setdefault(name, []).append(a)
        return record


def router_parts(workers: Sequence[FakeWorker], tokenizer: Any = None, admission: bool = True,
                 metrics: Any = None, **cfg: Any) -> FlowDeps:
    """The router's own Placer, WorkerCalls, selector and worker view over fake workers, as ``RouterCore``
    builds them (the view over a StaticWorkerSource of the fakes' records)."""
    rcfg = RouterConfig(serve_metrics=False, **cfg)
    calls = WorkerCalls(rcfg, FakeClients(workers))
    view = WorkerView(StaticWorkerSource([w.info for w in workers]))
    placer = Placer(rcfg, view, WorkerSelector(), calls, AdmissionQueue() if admission else None, PrefixIndex())
    return FlowDeps(rcfg, placer, calls, tokenizer, metrics)
