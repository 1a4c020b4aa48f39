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

Options for the serving-overhead benchmark: ``worker_kw`` adds worker config fields (``engine_process``),
``cores_per_worker`` pins each worker to that many consecutive cores (an engine process's threads then take
all but the last, the worker's threads the last), ``roles`` replaces the mode's two workers (e.g. one
``("colocated",)``), and ``router_process=True`` runs the router in its own (unpinned) process, as
``pdserve up`` does, so its CPU time can be read from ``/proc`` apart from the load generator's;
``pids`` names every process of the deployment.
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


def pin_threads(pid: int, cores: Sequence[int]) -> None:
    """Pin every thread of ``pid`` to ``cores`` (``sched_setaffinity`` of a pid moves its main thread only)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), set(cores))
        except (ProcessLookupError, FileNotFoundError):
            pass  # a thread that ended meanwhile


def _worker_main(role: str, worker_id: str, model: str, cores: Optional[list[int]], kv_store: str,
                 engine_kw: dict, ready_q: Any, stop_evt: Any, worker_kw: Optional[dict] = None) -> None:
    try:
        if cores:  # before torch starts any thread: every thread inherits the mask
            os.sched_setaffinity(0, set(cores))
        import torch

        torch.set_num_threads(1)
        from engine.config import EngineConfig

        if role == "prefill":  # it never decodes: no decode graphs to capture (as the cluster's prefill pools)
            engine_kw = {k: v for k, v in engine_kw.items() if k != "async_scheduling"}
            engine_kw["enforce_eager"] = True
        eng = EngineConfig(model=model, num_threads=1, **engine_kw)
        if role == "prefill":
            from prefill_worker import PrefillWorker, PrefillWorkerConfig

            w: Any = PrefillWorker(PrefillWorkerConfig(worker_id, engine=eng, kv_store=kv_store, serve_metrics=False,
                                                       **(worker_kw or {})))
        elif role == "decode":
            from decode_worker import DecodeWorker, DecodeWorkerConfig

            w = DecodeWorker(DecodeWorkerConfig(worker_id, engine=eng, kv_store=kv_store, serve_metrics=False,
                                                **(worker_kw or {})))
        else:
            from decode_worker import ColocatedWorker, ColocatedWorkerConfig

            w = ColocatedWorker(ColocatedWorkerConfig(worker_id, engine=eng, serve_metrics=False, **(worker_kw or {})))
        w.start()
    except BaseException:
        ready_q.put((role, "", traceback.format_exc(), None))
        return
    # an engine in its own process (worker_kw engine_process) is named too, so its CPU time is counted; with two
    # cores it gets the first and the worker's threads the second, each thread pinned
    engine_pid = getattr(w.engine, "pid", None)
    if engine_pid is not None and cores and len(cores) >= 2:
        pin_threads(engine_pid, cores[:-1])
        pin_threads(os.getpid(), cores[-1:])
    ready_q.put((role, w.address, sorted(os.sched_getaffinity(0)), engine_pid))
    try:
        stop_evt.wait(24 * 3600)
    finally:
        w.stop()


def _info_source(workers: Sequence[tuple[str, str]]) -> tuple[Any, list[Any]]:
    """A ``StaticWorkerSource`` whose entries ask each worker's ``GetInfo`` (live load, as a heartbeat carries)."""
    import grpc

    from proto import worker_pb2, worker_pb2_grpc
    from router import StaticWorkerSource

    stubs = {"prefill": worker_pb2_grpc.PrefillWorkerStub, "decode": worker_pb2_grpc.DecodeWorkerStub,
             "colocated": worker_pb2_grpc.ColocatedWorkerStub}
    channels, infos = [], []
    for role, addr in workers:
        ch = grpc.insecure_channel(addr)
        channels.append(ch)
        stub = stubs[role](ch)
        infos.append(lambda stub=stub: stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5))
    return StaticWorkerSource(infos), channels


def _router_main(model: str, mode: str, workers: list, router_kw: dict, ready_q: Any, stop_evt: Any) -> None:
    try:
        from router import RouterConfig, RouterServer

        source, channels = _info_source(workers)
        router = RouterServer(RouterConfig(model=model, mode=mode, serve_metrics=False, **router_kw), source).start()
    except BaseException:
        ready_q.put(("", "", traceback.format_exc()))
        return
    ready_q.put((router.address, router.http_address, os.getpid()))
    try:
        stop_evt.wait(24 * 3600)
    finally:
        router.stop()
        for ch in channels:
            ch.close()


class Deployment:
    """Workers in pinned processes and a router in this one or its own (see module docstring)."""

    def __init__(self, mode: str, model: str, cores: Sequence[int], engine_kw: Optional[dict] = None,
                 router_kw: Optional[dict] = None, start_timeout_s: float = 300.0,
                 roles: Optional[Sequence[str]] = None, router_process: bool = False,
                 worker_kw: Optional[dict] = None, cores_per_worker: int = 1,
                 role_worker_kw: Optional[dict[str, dict]] = None) -> None:
        """``worker_kw``: config fields of every worker; ``role_worker_kw``: of one role's workers, over those."""
        if mode not in ROLES_BY_MODE:
            raise ValueError(f"mode must be one of {tuple(ROLES_BY_MODE)}, got {mode!r}")
        self.roles = tuple(roles) if roles is not None else ROLES_BY_MODE[mode]
        self.router_process = router_process
        self.pids: dict[str, int] = {}
        """Process id by name (``router``, ``prefill0``, ``decode1``, ...)."""
        self._router_addr = ("", "")
        self.mode, self.model = mode, model
        self.cores = list(cores)
        self.engine_kw = dict(engine_kw or {})
        self.router_kw = dict(router_kw or {})
        self.worker_kw = dict(worker_kw or {})
        self.role_worker_kw = {role: dict(kw) for role, kw in (role_worker_kw or {}).items()}
        self.cores_per_worker = cores_per_worker
        self.start_timeout_s = start_timeout_s
        self.router: Any = None
        self.pinning: dict[str, list[int]] = {}
        self._procs: list[Any] = []
        self._stops: list[Any] = []
        self._channels: list[Any] = []
        self._store: Any = None

    @property
    def target(self) -> str:
        return self._router_addr[0] if self.router_process else self.router.address

    @property
    def http_target(self) -> str:
        """The OpenAI HTTP API's HOST:PORT ("" unless ``router_kw`` set ``http_port``)."""
        return self._router_addr[1] if self.router_process else self.router.http_address

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
        import torch

        url = ""
        if "prefill" in self.roles:
            self._store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            url = f"tcp://127.0.0.1:{self._store.port}"
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        names = {}
        k = self.cores_per_worker
        for i, role in enumerate(self.roles):
            mine = ([self.cores[(i * k + j) % len(self.cores)] for j in range(k)] if self.cores else None)
            stop = ctx.Event()
            # a worker with an engine process has a child: multiprocessing allows none to a daemonic process
            # (close() stops and joins every worker either way)
            kw = {**self.worker_kw, **self.role_worker_kw.get(role, {})}
            p = ctx.Process(target=_worker_main, daemon=not kw.get("engine_process"),
                            args=(role, f"{role}{i}", self.model, mine, url, self.engine_kw, q, stop, kw))
            p.start()
            names[p.pid] = f"{role}{i}"
            self._procs.append(p)
            self._stops.append(stop)
        workers = []
        engines = []
        for _ in self.roles:
            role, addr, extra, engine_pid = q.get(timeout=self.start_timeout_s)
            if not addr:
                raise RuntimeError(f"{self.mode}: a {role} worker failed to start:\n{extra}")
            self.pinning[f"{role}@{addr}"] = extra
            workers.append((role, addr))
            if engine_pid is not None:
                engines.append(engine_pid)
        self.pids = {name: pid for pid, name in names.items()}
        self.pids.update((f"engine{n}", pid) for n, pid in enumerate(engines))
        if self.router_process:
            stop = ctx.Event()
            p = ctx.Process(target=_router_main, daemon=True,
                            args=(self.model, self.mode, workers, self.router_kw, q, stop))
            p.start()
            self._procs.append(p)
            self._stops.append(stop)
            addr, http_addr, extra = q.get(timeout=self.start_timeout_s)
            if not addr:
                raise RuntimeError(f"{self.mode}: the router failed to start:\n{extra}")
            self._router_addr = (addr, http_addr)
            self.pids["router"] = p.pid
            return
        from router import RouterConfig, RouterServer

        source, self._channels = _info_source(workers)
        cfg = RouterConfig(model=self.model, mode=self.mode, serve_metrics=False, **self.router_kw)
        self.router = RouterServer(cfg, source).start()
        self.pids["router"] = os.getpid()

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
