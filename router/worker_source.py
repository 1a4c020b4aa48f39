"""Where the router learns which workers exist and how loaded they are.

Lifecycle: the router reads a source through its ``WorkerView`` (router/worker_view.py):
the cluster passes its Redis ``Registry`` (heartbeated ``WorkerInfo`` records), which the
view polls in the background, so no request waits on Redis; tests and single-process
set-ups pass a ``StaticWorkerSource`` (``in_process``: it asks each live worker object for
``info()``, no round trip), which the view reads directly.

Routing reads the ``WorkerView`` as a ``WorkerSource``: the lists, plus ``suspect(worker_id)`` when a
call to a worker failed as if it were gone. A ``WorkerList`` (``list`` only: the registry) is what a
router is given; the view adds ``suspect`` on top of it. Pools are the ``Pool`` enum; a source is
asked by the pool's value (``WorkerInfo.role`` on the wire).
"""
from __future__ import annotations

import enum
import threading
from typing import Callable, Iterable, Protocol, Union, runtime_checkable

from proto.worker_pb2 import WorkerInfo



class Pool(str, enum.Enum):
    """A pool of workers of one role (the value is ``WorkerInfo.role``)."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"

    def __str__(self) -> str:
        return self.value


ROLES = tuple(p.value for p in Pool)


@runtime_checkable
class WorkerList(Protocol):
    """Anything with ``list(role) -> list[WorkerInfo]`` (cluster.registry.Registry is one): what a router is given."""

    def list(self, role: str) -> list[WorkerInfo]: ...


@runtime_checkable
class WorkerSource(WorkerList, Protocol):
    """What placement reads: the lists, and ``suspect`` to take a worker out of routing after a failed call."""

    def suspect(self, worker_id: str) -> None: ...


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

    def suspect(self, worker_id: str) -> None:
        """Nothing to hide: the list is the live workers' own records (a ``WorkerView`` over it hides failed ones)."""
