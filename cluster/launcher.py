"""Start and stop a whole pdserve cluster: Redis, Ray, worker pools, router.

Lifecycle of a ``Cluster(ClusterConfig(...))``:

``start()``
  0. ``__init__``: a ``cluster_secret`` is generated unless the config has one; the
     router presents it to every worker, which refuses callers without it.
  1. Redis: the given ``redis_url`` (may carry a password, or ``rediss://``), or a
     private ``EmbeddedRedis`` on a free port of ``config.host`` with a generated
     password. The URL with its password (``redis_url``) is a secret: logs and
     banners show ``display_redis_url``.
     With a given ``namespace``, what a killed run left there is deleted first
     (``Registry.clear_stale``; refused while live workers still heartbeat in it).
  2. Ray: the given ``ray_address`` (``"auto"`` joins ``ray start``/KubeRay), an
     already-initialized Ray in this process (tests share one), or a private
     local instance (own temp dir, no dashboard) that this cluster owns.
  3. Pools: ``num_prefill`` + ``num_decode`` worker actors (``cluster.worker_actor``),
     or ``num_colocated`` colocated workers (the non-disaggregated baseline),
     started in parallel; each registers itself in the Redis registry under
     this cluster's namespace and heartbeats. The kvtransfer rendezvous is the
     same Redis under ``{namespace}:kvt``, so it needs no extra port.
  4. Router: in this process, reading the pools from the registry.
``scale_pool(role, n)``
  adds actors, or drains the newest ones (deregister first, finish in-flight
  requests) and then kills them.
``replace_workers(role, ids, floor)``
  forgets failed members (kill, deregister) and starts as many new actors
  under new ids; ``cluster.supervisor.Supervisor`` calls it when a probe finds
  an actor dead or stuck (``pdserve up`` always runs one).
``stop()``
  router, actors (stop + kill), the namespace's Redis keys, then Ray and Redis
  if this cluster started them. Idempotent; also run by ``with Cluster(...)``.

With ``detached=True`` (``pdserve controller``) this object is the deployment's
controller, not the owner of its workers' lives: ``start()`` takes the
deployment's lease (``cluster.ownership.ControllerLease``; a second controller
waits), adopts the live named workers an earlier controller started (pools are
grown to the configured sizes, never shrunk at adoption) and starts new ones as
detached actors named by their worker ids ``{role}-{generation}-{n}``. A live
worker serving another model than this controller's is not adopted: it keeps
serving until its replacement is up, then it is drained and stopped (a model
change rolls the pools).
``stop()`` then only stops this process's router and releases the lease: the
workers keep serving and heartbeating. ``teardown()`` stops them and deletes the
namespace's keys (``pdserve down --address`` does it from outside).

``device`` "auto" resolves at start: "cuda" when the Ray cluster offers GPUs.
On cuda each worker actor asks Ray for one GPU.

Everything is per instance (namespace, ports, temp dirs): two clusters run
side by side on one machine, even on one Redis.

This class composes four parts, each with its own lifecycle: the Redis and its
registry (``cluster.redis_lifecycle.ClusterRedis``), Ray
(``cluster.ray_lifecycle.ClusterRay``), the pools of worker actors
(``cluster.pools.Pools``) and, in detached mode, ownership (the lease and the
adoption in ``cluster.ownership``). It decides their order and owns the router.
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import uuid
from typing import Any, Optional, Sequence

from cluster.config import POOLS, ClusterConfig, build_router
from cluster.ownership import ControllerLease, find_adoptable
from cluster.pools import Member, Pools
from cluster.ray_lifecycle import ClusterRay
from cluster.redis_lifecycle import ClusterRedis
from cluster.registry import Registry, WorkerInfo

log = logging.getLogger(__name__)

__all__ = ["Cluster", "ClusterConfig", "POOLS"]


class Cluster:
    """One running pdserve cluster (see module docstring)."""

    def __init__(self, config: Optional[ClusterConfig] = None) -> None:
        config = config or ClusterConfig()
        if config.cluster_secret is None:  # the cluster plane is never open: members share a fresh secret
            config = dataclasses.replace(config, cluster_secret=secrets.token_urlsafe(32))
        self.config = config
        self.namespace = self.config.namespace or f"pdserve-{uuid.uuid4().hex[:10]}"
        self.generation = uuid.uuid4().hex[:6]
        """This controller's generation: in detached mode, the ids of the workers it starts carry it."""
        self.adopted: list[str] = []
        """Worker ids taken over from an earlier controller at start (detached mode)."""
        self.router: Any = None
        self._redis = ClusterRedis(self.config, self.namespace)
        self._ray = ClusterRay()
        self._stopping = threading.Event()
        self._pools = Pools(self.config, self.namespace, self.generation, self._stopping)
        self._lease: Optional[ControllerLease] = None
        self._outdated: list[Member] = []  # live workers of another model, retired once replaced
        self._started = False
        self._stopped = False

    @property
    def redis_url(self) -> Optional[str]:
        """The cluster's Redis URL, password included (a secret: log ``display_redis_url``); None before start."""
        return self._redis.url

    @property
    def registry(self) -> Optional[Registry]:
        """The cluster's worker registry (None before start)."""
        return self._redis.registry

    # ---- start ----------------------------------------------------------------------
    def start(self) -> "Cluster":
        """Bring up Redis, Ray, the pools and the router; on any failure, tear down what started."""
        if self._started:
            raise RuntimeError("cluster already started")
        self._started = True
        try:
            self._redis.start()
            if self.config.detached:
                # The deployment's workers (and their keys) belong to it, not to us: take the lease, clear nothing.
                self._lease = ControllerLease(self.redis_url, self.namespace, self.generation,
                                              ttl_s=max(10.0, 3 * self.config.ttl_s))
                self._lease.acquire(wait_s=self.config.start_timeout_s)
            elif self.config.namespace:
                # A named namespace may hold what a killed run left (kvtransfer rendezvous keys live 10 min);
                # a running cluster's live workers make this raise instead of taking its keys.
                self._redis.clear_stale(wait_s=2 * self.config.ttl_s + 5)
            self._ray.start(self.config, self.namespace)
            self._resolve_device()
            self._pools.open(self.config, self.redis_url, self.registry)
            if self.config.detached:
                self._adopt()
            for role in POOLS:
                # adoption never shrinks a pool: the planner that grew it (or its successor) decides that
                self.scale_pool(role, max(getattr(self.config, f"num_{role}"), len(self._pools.of(role))))
            if self._outdated:
                log.warning("cluster %s: retiring workers of another model: %s", self.namespace,
                            [m.worker_id for m in self._outdated])
                self._pools.retire(self._outdated)
                self._outdated = []
            self._start_router()
        except BaseException:
            self.stop()
            raise
        log.info("cluster %s up: router %s, workers %s", self.namespace, self.router_address,
                 {r: len(self._pools.of(r)) for r in POOLS if self._pools.of(r)})
        return self

    def _resolve_device(self) -> None:
        device, gpus = self._ray.resolve_device(self.config.device)
        if device != self.config.device:
            self.config = dataclasses.replace(self.config, device=device)
            log.info("cluster %s: device auto -> %s (%g GPUs in the Ray cluster)", self.namespace, device, gpus)

    def _adopt(self) -> None:
        """Take over the deployment's live detached workers (an earlier controller started them)."""
        found = find_adoptable(self.namespace, self.config.served_model_name, POOLS)
        for wid, handle in found.unusable:
            self._pools.kill(Member(wid, "", handle))
        self._pools.adopt([Member(wid, info.role, handle, info) for wid, handle, info in found.live])
        self._outdated = [Member(wid, info.role, handle, info) for wid, handle, info in found.outdated]
        self.adopted = [wid for wid, _, _ in found.live]
        if self.adopted:
            log.info("cluster %s: generation %s adopted %s", self.namespace, self.generation, self.adopted)

    def _start_router(self) -> None:
        factory = self.config.router_factory
        if factory is False:
            return
        self.router = (factory or build_router)(self.config, self.registry)
        self.router.start()

    # ---- pools ----------------------------------------------------------------------
    @property
    def kv_store_url(self) -> Any:  # a kvtransfer.StoreConfig
        """The kvtransfer rendezvous every worker of this cluster uses (the cluster's Redis, own namespace)."""
        return self._pools.kv_store_url

    def scale_pool(self, role: str, n: int) -> list[WorkerInfo]:
        """Grow or shrink one pool to ``n`` live workers (dead actors are dropped and replaced; removal
        drains first); returns the pool's records."""
        return self._pools.scale(role, n)

    def replace_workers(self, role: str, worker_ids: Sequence[str], floor: int = 0) -> list[str]:
        """Forget the failed members ``worker_ids`` (kill, deregister) and start new ones under new ids, so
        the pool is back at its size before the failure, and at least ``floor``; returns the new ids.

        Ids no longer in the pool (already dropped by a concurrent ``scale_pool``) are skipped, so a failure
        seen by both the supervisor and the planner is replaced once."""
        return self._pools.replace(role, worker_ids, floor)

    def remove_worker(self, worker_id: str) -> bool:
        """Drain one worker (out of routing at once, in-flight requests finish) and stop it.

        Returns True if all its requests finished within ``drain_timeout_s``; ValueError for an unknown id."""
        with self._pools.lock:
            m = self._pools.find(worker_id)
            if m is not None:
                return self._pools.retire([m])
        raise ValueError(f"worker_id {worker_id!r} is not a worker of cluster {self.namespace}")

    # ---- views ----------------------------------------------------------------------
    @property
    def display_redis_url(self) -> str:
        """The cluster's Redis URL with its password masked (for logs and banners)."""
        return self._redis.display_url

    @property
    def router_address(self) -> Optional[str]:
        """host:port of the public gRPC API (None without a router)."""
        return getattr(self.router, "address", None) if self.router is not None else None

    def actors(self, role: str) -> list[Any]:
        """Ray actor handles of one pool (oldest first)."""
        return [m.handle for m in self._pools.of(role)]

    def worker_ids(self, role: str) -> list[str]:
        """Worker ids of one pool (oldest first)."""
        return [m.worker_id for m in self._pools.of(role)]

    def members(self, role: str) -> list[tuple[str, Any]]:
        """(worker id, actor handle) of one pool, oldest first; a snapshot read without the cluster's lock
        (a scale in progress holds it for a model load), so health probes never wait behind one."""
        return [(m.worker_id, m.handle) for m in self._pools.of(role)]

    def metrics_addresses(self) -> dict[str, str]:
        """component -> host:port serving /metrics (router and every worker that serves one)."""
        out: dict[str, str] = {}
        addr = getattr(self.router, "metrics_address", "") if self.router is not None else ""
        if addr:
            out["router"] = addr
        for info in self.registry.list() if self.registry is not None else []:
            if info.metrics_address:
                out[info.worker_id] = info.metrics_address
        return out

    # ---- stop -----------------------------------------------------------------------
    @property
    def lease_lost(self) -> bool:
        """Detached mode: another controller took the deployment over, or Redis stopped answering long enough that
        one could have (this one must stop managing)."""
        return self._lease is not None and self._lease.lost.is_set()

    @property
    def lease_lost_reason(self) -> str:
        """Why the lease was lost ("" while it is held)."""
        return self._lease.lost_reason if self._lease is not None and self._lease.lost.is_set() else ""

    def teardown(self) -> None:
        """Stop the workers too (and delete the namespace's keys), even in detached mode."""
        self.stop(teardown=True)

    def stop(self, teardown: Optional[bool] = None) -> None:
        """Stop everything this cluster started; safe to call twice.

        ``teardown`` (default: not ``detached``): also stop the workers and delete the namespace's keys. A
        detached controller's plain stop leaves the workers serving for the next controller and the routers."""
        if teardown is None:
            teardown = not self.config.detached
        self._stopping.set()  # a scale in progress (another thread) gives up and releases the lock
        with self._pools.lock:
            if self._stopped:
                return
            self._stopped = True
            self._pools.close()
            if self.router is not None:
                try:
                    self.router.stop()
                except Exception as e:
                    log.warning("router stop: %s", e)
            if not teardown:
                # Detached: the workers and their keys stay; only this process's connections go.
                log.info("cluster %s: controller generation %s leaves %s serving", self.namespace,
                         self.generation, {r: [m.worker_id for m in self._pools.of(r)] for r in POOLS
                                           if self._pools.of(r)})
                self._pools.forget_all()
                self._close()
                return
            # Bounded: `pdserve up` must exit within seconds of SIGTERM; a hung actor is killed anyway.
            self._pools.stop_all(timeout_s=5)
            if self.registry is not None:
                try:
                    self.registry.clear()  # worker records and kvtransfer rendezvous keys
                except Exception as e:
                    log.warning("registry clear: %s", e)
            self._close()
            log.info("cluster %s stopped", self.namespace)

    def _close(self) -> None:
        if self._lease is not None:
            self._lease.release()
        self._ray.shutdown()
        self._redis.close()

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
