"""Where the router learns which workers exist and how loaded they are.

Lifecycle: the router reads a source through its ``WorkerView`` (router/worker_view.py):
the cluster passes its Redis ``Registry`` (heartbeated ``WorkerInfo`` records), which the
view polls in the background, so no request waits on Redis; tests and single-process
set-ups pass a ``StaticWorkerSource`` (``in_process``: it asks each live worker object for
``info()``, no round trip), which the view reads directly.
"""
from __future__ import annotations

import threading
from typing import Callable, Iterable, Protocol, Union, runtime_checkable

from proto.worker_pb2 import WorkerInfo

ROLES = ("prefill", "decode", "colocated")


@runtime_checkable
class WorkerSource(Protocol):
    """Anything with ``list(role) -> list[WorkerInfo]`` (cluster.registry.Registry is one)."""

    def list(self, role: str) -> list[WorkerInfo]: ...


InfoLike = Union[WorkerInfo, Callable[[], WorkerInfo]]


class StaticWorkerSource:
    """A fixed set of workers: WorkerInfo records, or callables returning live ones (``worker.info``)."""

    in_process = True
    """``list`` costs no round trip: the router's view reads it on every request instead of polling."""

    def __init__(self, workers: Iterable[InfoLike] = ()) -> None:
        self._lock = threading.Lock()
        self._workers: list[InfoLike] = list(workers)

    def add(self, worker: InfoLike) -> None:
        with self._lock:
            self._workers.append(worker)

    def remove_where(self, worker_id: str) -> None:
        with self._lock:
            self._workers = [w for w in self._workers if self._resolve(w).worker_id != worker_id]

    @staticmethod
    def _resolve(w: InfoLike) -> WorkerInfo:
        return w() if callable(w) else w

    def list(self, role: str) -> list[WorkerInfo]:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        with self._lock:
            workers = list(self._workers)
        infos = [self._resolve(w) for w in workers]
        return [i for i in infos if i.role == role]
