"""One serving deployment for the disaggregated-vs-colocated benchmark: pinned worker processes + a router.

Lifecycle: ``Deployment(mode, model, cores)`` as a context manager serves a
TCPStore on a free port (the KV rendezvous, disaggregated mode only), spawns one
process per worker (disaggregated: prefill on ``cores[0]``, decode on
``cores[1]``; colocated: one colocated worker on each core), each pinned with
``os.sched_setaffinity`` before torch is imported and running torch with one
thread, so "one core each" is real. When every worker reported its gRPC address,
a ``RouterServer`` starts in this process over a ``StaticWorkerSource`` whose
entries call each worker's ``GetInfo`` (live load, as a registry heartbeat would
carry). ``target`` is the router's address. Leaving the context stops the router,
signals the workers to stop, joins them (killing any that hang) and closes the
store. The router and the load generator are NOT pinned: they share the machine
with the workers.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from typing import Any, Optional, Sequence

ROLES_BY_MODE = {"disaggregated": ("prefill", "decode"), "colocated": ("colocated", "colocated")}


def usable_cores() -> list[int]:
    """The CPUs this process may run on, lowest first."""
    return sorted(os.sched_getaffinity(0))


def _worker_main(role: str, worker_id: str, model: str, core: Optional[int], kv_store: str,
                 engine_kw: dict, ready_q: Any, stop_evt: Any) -> None:
    try:
        if core is not None:  # before torch starts any thread: every thread inherits the mask
            os.sched_setaffinity(0, {core})
        import torch

        torch.set_num_threads(1)
        from engine.config import EngineConfig

        eng = EngineConfig(model=model, num_threads=1, **engine_kw)
        if role == "prefill":
            from prefill_worker import PrefillWorker, PrefillWorkerConfig

            w: Any = PrefillWorker(PrefillWorkerConfig(worker_id, engine=eng, kv_store=kv_store, serve_metrics=False))
        elif role == "decode":
            from decode_worker import DecodeWorker, DecodeWorkerConfig

            w = DecodeWorker(DecodeWorkerConfig(worker_id, engine=eng, kv_store=kv_store, serve_metrics=False))
        else:
            from decode_worker import ColocatedWorker, ColocatedWorkerConfig

            w = ColocatedWorker(ColocatedWorkerConfig(worker_id, engine=eng, serve_metrics=False))
        w.start()
    except BaseException:
        ready_q.put((role, "", traceback.format_exc()))
        return
    ready_q.put((role, w.address, sorted(os.sched_getaffinity(0))))
    try:
        stop_evt.wait(24 * 3600)
    finally:
        w.stop()


class Deployment:
    """Workers in pinned processes and a router in this one (see module docstring)."""

    def __init__(self, mode: str, model: str, cores: Sequence[int], engine_kw: Optional[dict] = None,
                 router_kw: Optional[dict] = None, start_timeout_s: float = 300.0) -> None:
        if mode not in ROLES_BY_MODE:
            raise ValueError(f"mode must be one of {tuple(ROLES_BY_MODE)}, got {mode!r}")
        self.mode, self.model = mode, model
        self.cores = list(cores)
        self.engine_kw = dict(engine_kw or {})
        self.router_kw = dict(router_kw or {})
        self.start_timeout_s = start_timeout_s
        self.router: Any = None
        self.pinning: dict[str, list[int]] = {}
        self._procs: list[Any] = []
        self._stops: list[Any] = []
        self._channels: list[Any] = []
        self._store: Any = None

    @property
    def target(self) -> str:
        return self.router.address

    def __enter__(self) -> "Deployment":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _start(self) -> None:
        import grpc
        import torch

        from proto import worker_pb2, worker_pb2_grpc
        from router import RouterConfig, RouterServer, StaticWorkerSource

        url = ""
        if self.mode == "disaggregated":
            self._store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            url = f"tcp://127.0.0.1:{self._store.port}"
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        roles = ROLES_BY_MODE[self.mode]
        for i, role in enumerate(roles):
            core = self.cores[i % len(self.cores)] if self.cores else None
            stop = ctx.Event()
            p = ctx.Process(target=_worker_main, daemon=True,
                            args=(role, f"{role}{i}", self.model, core, url, self.engine_kw, q, stop))
            p.start()
            self._procs.append(p)
            self._stops.append(stop)
        stubs = {"prefill": worker_pb2_grpc.PrefillWorkerStub, "decode": worker_pb2_grpc.DecodeWorkerStub,
                 "colocated": worker_pb2_grpc.ColocatedWorkerStub}
        infos = []
        for i in range(len(roles)):
            role, addr, extra = q.get(timeout=self.start_timeout_s)
            if not addr:
                raise RuntimeError(f"{self.mode}: a {role} worker failed to start:\n{extra}")
            self.pinning[f"{role}@{addr}"] = extra
            ch = grpc.insecure_channel(addr)
            self._channels.append(ch)
            stub = stubs[role](ch)
            infos.append(lambda stub=stub: stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5))
        cfg = RouterConfig(model=self.model, mode=self.mode, serve_metrics=False, **self.router_kw)
        self.router = RouterServer(cfg, StaticWorkerSource(infos)).start()

    def close(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        for ch in self._channels:
            ch.close()
        self._channels = []
        for stop in self._stops:
            stop.set()
        for p in self._procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
        self._procs, self._stops = [], []
        self._store = None
