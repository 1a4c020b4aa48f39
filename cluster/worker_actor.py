"""One worker (prefill or decode) as a Ray actor, heartbeating into the registry.

Lifecycle (driven by ``cluster.launcher.Cluster``):

1. ``WorkerActor.options(**actor_options(role, cpus)).remote(spec)``: Ray places
   the actor on a node offering the role's custom resource (when the cluster
   has such nodes) and the constructor pins torch to the actor's CPU share.
2. ``start()``: builds the role object with ``spec.factory(node_ip, node_id)``
   (e.g. a ``prefill_worker.PrefillWorker``), starts it (gRPC server up, model
   loaded), registers its ``WorkerInfo`` and starts a heartbeat thread that
   re-publishes the live ``info()`` every ``heartbeat_interval_s``. Returns the
   record (its ``grpc_address`` is what the router dials).
3. ``drain(timeout_s)``: stops heartbeating and deregisters first (routing
   stops at once), then lets the role finish its in-flight requests and stop.
4. ``stop()``: the same without waiting; the launcher then ``ray.kill``s the actor.

If Redis goes away, the heartbeat thread keeps the worker up and keeps trying
with exponential backoff (capped at ``ttl_s``); every heartbeat writes the
whole record and the index entry, so when Redis is back, even restarted empty,
the worker is registered again within about ``ttl_s``.

If the actor process dies instead, heartbeats stop and the registry drops it
within the TTL; the launcher's ``Supervisor`` notices sooner (its probe fails),
deregisters it and starts a replacement under a new id.

The role object only has to offer ``start()``, ``info() -> WorkerInfo``,
``drain(timeout_s) -> bool`` and ``stop()`` (``prefill_worker``/``decode_worker``
share this shape through their ``WorkerBase``).
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import ray
from redis.backoff import ExponentialWithJitterBackoff

from cluster.registry import Registry, WorkerInfo

log = logging.getLogger(__name__)

POOL_RESOURCES = ("prefill", "decode")
RESOURCE_SHARE = 0.01  # a sliver of the node label: it steers placement without limiting worker count


class RoleWorker(Protocol):
    """What the actor needs from a prefill/decode/colocated role object."""

    def start(self) -> Any: ...

    def info(self) -> WorkerInfo: ...

    def engine_failed(self) -> Optional[str]: ...

    def drain(self, timeout_s: float = 30.0) -> bool: ...

    def stop(self) -> None: ...


@dataclass
class WorkerSpec:
    """Everything a worker actor needs; pickled to wherever Ray places it."""

    worker_id: str
    """Unique id within the cluster (registry key, kvtransfer endpoint name)."""
    role: str
    """"prefill" | "decode" | "colocated"."""
    factory: Callable[[str, str], RoleWorker]
    """Builds the role object given (node_ip, node_id) on the actor's node."""
    redis_url: str = field(repr=False)
    """The cluster's Redis (registry); may carry its password, so it is kept out of repr."""
    namespace: str
    """The cluster's registry namespace."""
    ttl_s: float = 3.0
    """Registry TTL: a worker silent this long leaves routing."""
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats (well under ttl_s)."""
    num_threads: int = 1
    """torch threads in the actor (its CPU share)."""

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"role must be 'prefill', 'decode' or 'colocated', got {self.role!r}")
        if not (0 < self.heartbeat_interval_s < self.ttl_s):
            raise ValueError(f"heartbeat_interval_s must be in (0, ttl_s={self.ttl_s}), "
                             f"got {self.heartbeat_interval_s!r}")
        if not isinstance(self.num_threads, int) or self.num_threads < 1:
            raise ValueError(f"num_threads must be an integer >= 1, got {self.num_threads!r}")


def pool_resources(role: str, cluster_resources: Optional[dict] = None) -> dict[str, float]:
    """Custom resources that steer a role's actors to its node type, if the cluster has such nodes."""
    if role not in POOL_RESOURCES:
        return {}
    available = cluster_resources if cluster_resources is not None else ray.cluster_resources()
    return {role: RESOURCE_SHARE} if available.get(role, 0) > 0 else {}


def actor_options(role: str, num_cpus: float, name: Optional[str] = None,
                  cluster_resources: Optional[dict] = None, num_gpus: float = 0) -> dict[str, Any]:
    """Ray ``.options()`` for one worker actor of ``role`` (``num_gpus``: 1 on a CUDA deployment)."""
    if not num_cpus > 0:
        raise ValueError(f"num_cpus must be > 0, got {num_cpus!r}")
    if not num_gpus >= 0:
        raise ValueError(f"num_gpus must be >= 0, got {num_gpus!r}")
    threads = str(max(1, int(num_cpus)))
    opts: dict[str, Any] = {
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "resources": pool_resources(role, cluster_resources),
        # Several calls at once: info() and heartbeats must not wait behind a long drain().
        "max_concurrency": 8,
        "max_restarts": 0,
        "runtime_env": {"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}},
    }
    if name:
        opts["name"] = name
    return opts


class _WorkerActor:
    """The actor body (see module docstring); wrapped by ``ray.remote`` as ``WorkerActor``."""

    def __init__(self, spec: WorkerSpec) -> None:
        import torch

        # The actor's CPU share, not the node's core count: many actors share a node.
        torch.set_num_threads(spec.num_threads)
        self.spec = spec
        self.worker: Optional[RoleWorker] = None
        self.registry = Registry(spec.redis_url, spec.namespace, ttl_s=spec.ttl_s)
        self._stop_beat = threading.Event()
        self._beat: Optional[threading.Thread] = None
        self.reregistrations = 0
        """Times the heartbeat got through again after failing (Redis down, restarted)."""
        self.failing = 0
        """Heartbeats failed in a row right now (0 while Redis answers)."""
        self._lock = threading.Lock()
        self._node_id = ray.get_runtime_context().get_node_id()
        self._node_ip = ray.util.get_node_ip_address()

    def start(self) -> WorkerInfo:
        """Build and start the role, register it, start heartbeats; returns its record."""
        with self._lock:
            if self.worker is not None:
                raise RuntimeError(f"worker {self.spec.worker_id} already started")
            self.worker = self.spec.factory(self._node_ip, self._node_id)
            self.worker.start()
            self._follow_lora(wait=True)  # (a joining worker serves the cluster's adapters before it registers)
            info = self._info()
            self.registry.register(info)
            self._beat = threading.Thread(target=self._heartbeat_loop, name=f"heartbeat-{self.spec.worker_id}",
                                          daemon=True)
            self._beat.start()
            return info

    def _info(self) -> WorkerInfo:
        info = self.worker.info()
        if info.worker_id != self.spec.worker_id or info.role != self.spec.role:
            raise RuntimeError(f"role object reports {info.worker_id}/{info.role}, "
                               f"expected {self.spec.worker_id}/{self.spec.role}")
        if not info.node_id:
            info.node_id = self._node_id
        return info

    def _heartbeat_loop(self) -> None:
        interval = self.spec.heartbeat_interval_s
        # While Redis is away, retry less and less often, but never slower than the TTL: once it is back
        # (even restarted empty) the worker re-enters routing within about ttl_s.
        backoff = ExponentialWithJitterBackoff(cap=max(interval, self.spec.ttl_s), base=interval / 2)
        failures = 0
        wait = interval
        while not self._stop_beat.wait(wait):
            try:
                # A full write (record + index set), so it also re-registers into a restarted, empty Redis.
                self.registry.heartbeat(self._info())
            except Exception as e:  # never let Redis (or a role hiccup) end the loop: the worker stays up
                failures += 1
                self.failing = failures
                wait = backoff.compute(failures)
                if failures == 1 or failures % 30 == 0:
                    log.warning("worker %s heartbeat failed (%d in a row, next try in %.1f s): %s",
                                self.spec.worker_id, failures, wait, e)
                continue
            if failures:
                log.warning("worker %s re-registered after %d failed heartbeats", self.spec.worker_id, failures)
                self.reregistrations += 1
                failures = self.failing = 0
            wait = interval
            self._follow_lora()

    def _follow_lora(self, wait: bool = False) -> None:
        """Hand the cluster's runtime LoRA set to the worker (worker_common/lora_sync.py): after each heartbeat that
        got through, and with ``wait`` once at start, before the worker registers, so a worker that joins (scaled
        up, replaced) never takes an adapter out of what the routers serve. A failed read is not a failed heartbeat:
        the worker keeps what it serves (at start: none) and the next beat reads the set again."""
        sync_lora = getattr(self.worker, "sync_lora", None)
        if sync_lora is None:
            return
        try:
            entries = self.registry.lora_entries()
            if not wait:
                sync_lora(entries)  # (returns at once: a thread of the worker's loads)
                return
        except Exception as e:  # noqa: BLE001 - Redis went away between two calls; never ends the heartbeat
            (log.warning if wait else log.debug)("worker %s: the cluster's LoRA adapters not read: %s",
                                                 self.spec.worker_id, e)
            return
        sync_lora(entries, wait=True)

    def info(self) -> WorkerInfo:
        """The live record (what the next heartbeat will publish). Raises once the worker's engine loop has died
        (its record says not ready meanwhile): the supervisor counts that as a missed probe and replaces the
        worker, as it does a hung one."""
        if self.worker is None:
            raise RuntimeError(f"worker {self.spec.worker_id} not started")
        engine_failed = getattr(self.worker, "engine_failed", None)  # role objects without an engine have none
        failed = engine_failed() if engine_failed is not None else None
        if failed is not None:
            raise RuntimeError(f"worker {self.spec.worker_id}: engine loop died: {failed}")
        return self._info()

    def torch_threads(self) -> int:
        """torch's intra-op thread count in this actor (should equal its CPU share)."""
        import torch

        return torch.get_num_threads()

    def heartbeat_stats(self) -> dict[str, Any]:
        """{"alive": the heartbeat thread runs, "failing": heartbeats failed in a row now,
        "reregistrations": recoveries after failed heartbeats}."""
        return {"alive": self._beat is not None and self._beat.is_alive(), "failing": self.failing,
                "reregistrations": self.reregistrations}

    def pid(self) -> int:
        """The actor's process id (tests check it is gone after stop)."""
        return os.getpid()

    def _leave_registry(self) -> None:
        self._stop_beat.set()
        if self._beat is not None:
            self._beat.join(timeout=self.spec.heartbeat_interval_s + 5)
        try:
            self.registry.deregister(self.spec.worker_id)
        except Exception as e:  # the TTL removes it anyway
            log.warning("worker %s deregister failed: %s", self.spec.worker_id, e)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Leave routing, finish in-flight requests (up to timeout_s), stop. True if all finished."""
        self._leave_registry()
        if self.worker is None:
            return True
        clean = bool(self.worker.drain(timeout_s))
        log.info("worker %s drained (clean=%s)", self.spec.worker_id, clean)
        return clean

    def stop(self) -> None:
        """Leave routing and stop at once (in-flight requests fail)."""
        self._leave_registry()
        if self.worker is not None:
            self.worker.stop()
        self.registry.close()


WorkerActor = ray.remote(_WorkerActor)
