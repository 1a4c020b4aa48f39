"""Where the router learns which workers exist and how loaded they are.

Lifecycle: the router calls ``source.list(role)`` on every request it admits
(cheap for both implementations). The cluster passes its Redis ``Registry``
(heartbeated ``WorkerInfo`` records); tests and single-process set-ups pass a
``StaticWorkerSource`` that asks each live worker object for ``info()``.
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
