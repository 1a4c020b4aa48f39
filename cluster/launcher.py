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
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import psutil
import ray

from cluster.config import POOLS, ClusterConfig, build_role_worker, build_router, resolve_device
from cluster.ownership import ControllerLease, detached_workers
from cluster.redis_server import EmbeddedRedis, RedisServerConfig, mask_url, url_with_password
from cluster.registry import Registry, WorkerInfo
from cluster.worker_actor import WorkerActor, WorkerSpec, actor_options

log = logging.getLogger(__name__)

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_WILDCARD = ("0.0.0.0", "::", "")

__all__ = ["Cluster", "ClusterConfig", "POOLS"]


@dataclass
class _Member:
    worker_id: str
    role: str
    handle: Any
    info: Optional[WorkerInfo] = None


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
        self._lease: Optional[ControllerLease] = None
        self._outdated: list[_Member] = []  # live workers of another model, retired once replaced
        self.redis_url: Optional[str] = None
        self.registry: Optional[Registry] = None
        self.router: Any = None
        self._redis: Optional[EmbeddedRedis] = None
        self._owns_ray = False
        self._ray_tmp: Optional[str] = None
        self._ray_procs: list = []
        self._members: dict[str, list[_Member]] = {r: [] for r in POOLS}
        self._next_index: dict[str, int] = {r: 0 for r in POOLS}
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._started = False
        self._stopped = False

    # ---- start ----------------------------------------------------------------------
    def start(self) -> "Cluster":
        """Bring up Redis, Ray, the pools and the router; on any failure, tear down what started."""
        if self._started:
            raise RuntimeError("cluster already started")
        self._started = True
        try:
            self._start_redis()
            self._start_ray()
            self._resolve_device()
            if self.config.detached:
                self._adopt()
            for role in POOLS:
                # adoption never shrinks a pool: the planner that grew it (or its successor) decides that
                self.scale_pool(role, max(getattr(self.config, f"num_{role}"), len(self._members[role])))
            if self._outdated:
                log.warning("cluster %s: retiring workers of another model: %s", self.namespace,
                            [m.worker_id for m in self._outdated])
                self._retire(self._outdated)
                self._outdated = []
            self._start_router()
        except BaseException:
            self.stop()
            raise
        log.info("cluster %s up: router %s, workers %s", self.namespace, self.router_address,
                 {r: len(m) for r, m in self._members.items() if m})
        return self

    def _start_redis(self) -> None:
        if self.config.redis_url:
            self.redis_url = self.config.redis_url
        else:
            # Bound to `host` only, never widened behind the user's back; password-protected either way.
            host = self.config.host
            if self.config.ray_address is not None and host in _LOOPBACK:
                log.warning("embedded Redis binds %s: workers on other nodes cannot reach it (give --host "
                            "this node's address, or --redis-url)", host)
            if host in _WILDCARD:
                log.warning("embedded Redis binds every interface (host %s was given explicitly)", host)
            self._redis = EmbeddedRedis(RedisServerConfig(host=host)).start()
            self.redis_url = self._redis.url
            if host in _WILDCARD and self.config.ray_address is not None:
                self.redis_url = url_with_password("redis", ray.util.get_node_ip_address(), self._redis.port,
                                                   self._redis.password)
        self.registry = Registry(self.redis_url, self.namespace, ttl_s=self.config.ttl_s)
        self.registry.ping()
        if self.config.detached:
            # The deployment's workers (and their keys) belong to it, not to us: take the lease, clear nothing.
            self._lease = ControllerLease(self.redis_url, self.namespace, self.generation,
                                          ttl_s=max(10.0, 3 * self.config.ttl_s))
            self._lease.acquire(wait_s=self.config.start_timeout_s)
        elif self.config.namespace:
            # A named namespace may hold what a killed run left (kvtransfer rendezvous keys live 10 min);
            # a running cluster's live workers make this raise instead of taking its keys.
            self.registry.clear_stale(wait_s=2 * self.config.ttl_s + 5)

    def _start_ray(self) -> None:
        if ray.is_initialized():  # this process already has Ray (tests, an embedding app): share, never shut down
            return
        if self.config.detached and self.config.ray_address is None:
            raise ValueError("detached workers need a Ray that outlives this process: give ray_address (pdserve "
                             "controller --address), or join Ray before start()")
        if self.config.ray_address is not None:
            ray.init(address=self.config.ray_address, namespace=self.namespace, log_to_driver=False)
            self._owns_ray = True  # our driver connection; the Ray cluster itself outlives us
            return
        want = self.config.num_prefill + self.config.num_decode + self.config.num_colocated
        num_cpus = self.config.ray_num_cpus or max(os.cpu_count() or 1, int(want * self.config.cpus_per_worker) + 2)
        # A short private temp dir: Ray's unix sockets live under it, and it keeps two clusters apart.
        self._ray_tmp = tempfile.mkdtemp(prefix="pdray", dir="/tmp")
        before = {p.pid for p in psutil.Process().children()}
        ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=self._ray_tmp,
                 namespace=self.namespace, logging_level="WARNING", log_to_driver=False)
        self._owns_ray = True
        # The processes ray.init just spawned (GCS, raylet, ...): stop() makes sure they and theirs are gone.
        self._ray_procs = [p for p in psutil.Process().children() if p.pid not in before]

    def _resolve_device(self) -> None:
        gpus = ray.cluster_resources().get("GPU", 0)
        device = resolve_device(self.config.device, gpus)
        if device != self.config.device:
            self.config = dataclasses.replace(self.config, device=device)
            log.info("cluster %s: device auto -> %s (%g GPUs in the Ray cluster)", self.namespace, device, gpus)

    def _adopt(self) -> None:
        """Take over the deployment's live detached workers (an earlier controller started them)."""
        found = detached_workers(self.namespace)
        if not found:
            return
        refs = {wid: h.info.remote() for wid, h in found.items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=30)
        for wid, ref in sorted(refs.items()):
            handle = found[wid]
            try:
                info = ray.get(ref, timeout=0)
            except (ray.exceptions.RayError, TimeoutError) as e:  # dead, stuck or never started: replace it
                log.warning("cluster %s: not adopting %s (%s); stopping it", self.namespace, wid, type(e).__name__)
                self._kill(_Member(wid, "", handle))
                continue
            if info.role not in POOLS or info.worker_id != wid:
                log.warning("cluster %s: named actor %s reports %s/%s; leaving it alone", self.namespace, wid,
                            info.worker_id, info.role)
                continue
            member = _Member(wid, info.role, handle, info)
            if info.model_name != self.config.served_model_name:
                self._outdated.append(member)
                continue
            self._members[info.role].append(member)
            self.adopted.append(wid)
        if self.adopted:
            log.info("cluster %s: generation %s adopted %s", self.namespace, self.generation, self.adopted)

    def _start_router(self) -> None:
        factory = self.config.router_factory
        if factory is False:
            return
        self.router = (factory or build_router)(self.config, self.registry)
        self.router.start()

    # ---- pools ----------------------------------------------------------------------
    def _spec(self, role: str, worker_id: str) -> WorkerSpec:
        factory = self.config.worker_factory or build_role_worker
        # The actor gets the config without the factories (they may hold launcher-only state).
        shipped = dataclasses.replace(self.config, worker_factory=None, router_factory=None)
        return WorkerSpec(worker_id=worker_id, role=role,
                          factory=functools.partial(factory, role, worker_id, shipped, self.kv_store_url),
                          redis_url=self.redis_url, namespace=self.namespace, ttl_s=self.config.ttl_s,
                          heartbeat_interval_s=self.config.heartbeat_interval_s,
                          num_threads=max(1, int(self.config.cpus_per_worker)))

    @property
    def kv_store_url(self) -> Any:  # a kvtransfer.StoreConfig
        """The kvtransfer rendezvous every worker of this cluster uses (the cluster's Redis, own namespace)."""
        from kvtransfer import StoreConfig

        return StoreConfig(self.redis_url, namespace=f"{self.namespace}:kvt")

    def scale_pool(self, role: str, n: int) -> list[WorkerInfo]:
        """Grow or shrink one pool to ``n`` live workers (dead actors are dropped and replaced; removal
        drains first); returns the pool's records."""
        if role not in POOLS:
            raise ValueError(f"role must be one of {POOLS}, got {role!r}")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        roles = ("colocated",) if self.config.mode == "colocated" else ("prefill", "decode")
        if n and role not in roles:
            raise ValueError(f"role {role!r} is not served in {self.config.mode} mode (pools: {roles})")
        if self.registry is None or self._stopped:
            raise RuntimeError("cluster is not running")
        with self._lock:
            self._drop_dead(role)
            pool = self._members[role]
            if n > len(pool):
                self._add(role, n - len(pool))
            elif n < len(pool):
                self._remove(role, len(pool) - n)
            return [m.info for m in self._members[role]]

    def _drop_dead(self, role: str) -> None:
        # A crashed actor is already out of routing (its key expired); forget it so the pool size is live workers.
        pool = self._members[role]
        if not pool:
            return
        refs = [m.handle.pid.remote() for m in pool]
        ray.wait(refs, num_returns=len(refs), timeout=10)
        alive = []
        for m, ref in zip(pool, refs):
            try:
                ray.get(ref, timeout=0)
                alive.append(m)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                log.warning("cluster %s: %s is gone (%s); dropping it", self.namespace, m.worker_id,
                            type(e).__name__)
                self._kill(m)
        self._members[role] = alive

    def _add(self, role: str, count: int) -> None:
        resources = ray.cluster_resources()
        new: list[_Member] = []
        for _ in range(count):
            n = self._next_index[role]
            worker_id = f"{role}-{self.generation}-{n}" if self.config.detached else f"{role}-{n}"
            self._next_index[role] += 1
            opts = actor_options(role, self.config.cpus_per_worker, cluster_resources=resources,
                                 num_gpus=1 if self.config.device == "cuda" else 0)
            if self.config.detached:  # the deployment's, by name: a later controller adopts it
                opts.update(name=worker_id, namespace=self.namespace, lifetime="detached")
            handle = WorkerActor.options(**opts).remote(self._spec(role, worker_id))
            new.append(_Member(worker_id, role, handle))
        refs = [m.handle.start.remote() for m in new]
        try:
            # Short waits, so stop() (a signal, the planner's owner) never waits out a slow model load.
            deadline = time.monotonic() + self.config.start_timeout_s
            pending = refs
            while pending and time.monotonic() < deadline and not self._stopping.is_set():
                _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            if self._stopping.is_set():
                raise RuntimeError("cluster is stopping")
            if pending:
                raise TimeoutError(f"{len(pending)} {role} worker(s) not started within "
                                   f"{self.config.start_timeout_s}s (not enough resources to place them?)")
            infos = ray.get(refs)
        except BaseException:
            for m in new:
                self._kill(m)
            raise
        for m, info in zip(new, infos):
            m.info = info
        self._members[role].extend(new)
        log.info("cluster %s: +%d %s (%s)", self.namespace, count, role, ", ".join(m.worker_id for m in new))

    def replace_workers(self, role: str, worker_ids: Sequence[str], floor: int = 0) -> list[str]:
        """Forget the failed members ``worker_ids`` (kill, deregister) and start new ones under new ids, so
        the pool is back at its size before the failure, and at least ``floor``; returns the new ids.

        Ids no longer in the pool (already dropped by a concurrent ``scale_pool``) are skipped, so a failure
        seen by both the supervisor and the planner is replaced once."""
        if role not in POOLS:
            raise ValueError(f"role must be one of {POOLS}, got {role!r}")
        if not isinstance(floor, int) or isinstance(floor, bool) or floor < 0:
            raise ValueError(f"floor must be an integer >= 0, got {floor!r}")
        with self._lock:
            if self.registry is None or self._stopped or self._stopping.is_set():
                raise RuntimeError("cluster is not running")
            pool = self._members[role]
            failed = set(worker_ids)
            target = max(len(pool), floor)
            gone = [m for m in pool if m.worker_id in failed]
            self._members[role] = [m for m in pool if m.worker_id not in failed]
            for m in gone:
                self._kill(m)
            before = {m.worker_id for m in self._members[role]}
            missing = target - len(self._members[role])
            if missing > 0:
                self._add(role, missing)
            new_ids = [m.worker_id for m in self._members[role] if m.worker_id not in before]
            if gone or new_ids:
                log.info("cluster %s: replaced %s %s with %s", self.namespace, role,
                            [m.worker_id for m in gone], new_ids)
            return new_ids

    def _remove(self, role: str, count: int) -> None:
        self._retire(self._members[role][-count:])

    def remove_worker(self, worker_id: str) -> bool:
        """Drain one worker (out of routing at once, in-flight requests finish) and stop it.

        Returns True if all its requests finished within ``drain_timeout_s``; ValueError for an unknown id."""
        with self._lock:
            for role in POOLS:
                for m in self._members[role]:
                    if m.worker_id == worker_id:
                        return self._retire([m])
        raise ValueError(f"worker_id {worker_id!r} is not a worker of cluster {self.namespace}")

    def _retire(self, leaving: list[_Member]) -> bool:
        gone = {id(m) for m in leaving}
        for role in POOLS:
            self._members[role] = [m for m in self._members[role] if id(m) not in gone]
        refs = [m.handle.drain.remote(self.config.drain_timeout_s) for m in leaving]
        deadline = time.monotonic() + self.config.drain_timeout_s + 10
        pending = refs
        while pending and time.monotonic() < deadline and not self._stopping.is_set():
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
        ready = [r for r in refs if r not in pending]
        clean = not pending
        for ref in ready:
            try:
                clean = bool(ray.get(ref)) and clean
            except ray.exceptions.RayError:
                clean = False
        for m in leaving:
            self._kill(m)
        log.info("cluster %s: retired %s (clean=%s)", self.namespace, ", ".join(m.worker_id for m in leaving), clean)
        return clean

    def _kill(self, m: _Member) -> None:
        try:
            ray.kill(m.handle, no_restart=True)
        except Exception as e:  # already dead
            log.debug("kill %s: %s", m.worker_id, e)
        if self.registry is not None:
            try:
                self.registry.deregister(m.worker_id)
            except Exception as e:
                log.warning("deregister %s: %s", m.worker_id, e)

    # ---- views ----------------------------------------------------------------------
    @property
    def display_redis_url(self) -> str:
        """The cluster's Redis URL with its password masked (for logs and banners)."""
        return mask_url(self.redis_url)

    @property
    def router_address(self) -> Optional[str]:
        """host:port of the public gRPC API (None without a router)."""
        return getattr(self.router, "address", None) if self.router is not None else None

    def actors(self, role: str) -> list[Any]:
        """Ray actor handles of one pool (oldest first)."""
        return [m.handle for m in self._members[role]]

    def worker_ids(self, role: str) -> list[str]:
        """Worker ids of one pool (oldest first)."""
        return [m.worker_id for m in self._members[role]]

    def members(self, role: str) -> list[tuple[str, Any]]:
        """(worker id, actor handle) of one pool, oldest first; a snapshot read without the cluster's lock
        (a scale in progress holds it for a model load), so health probes never wait behind one."""
        return [(m.worker_id, m.handle) for m in list(self._members[role])]

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
        """Detached mode: another controller took the deployment over (this one must stop managing)."""
        return self._lease is not None and self._lease.lost.is_set()

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
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            if self.router is not None:
                try:
                    self.router.stop()
                except Exception as e:
                    log.warning("router stop: %s", e)
            if not teardown:
                self._leave_workers()
                return
            members = [m for r in POOLS for m in self._members[r]]
            if members and ray.is_initialized():
                refs = [m.handle.stop.remote() for m in members]
                # Bounded: `pdserve up` must exit within seconds of SIGTERM; a hung actor is killed anyway.
                ray.wait(refs, num_returns=len(refs), timeout=5)
                for m in members:
                    self._kill(m)
            self._members = {r: [] for r in POOLS}
            if self.registry is not None:
                try:
                    self.registry.clear()  # worker records and kvtransfer rendezvous keys
                except Exception as e:
                    log.warning("registry clear: %s", e)
            self._close()
            log.info("cluster %s stopped", self.namespace)

    def _leave_workers(self) -> None:
        # Detached: the workers and their keys stay; only this process's connections go.
        log.info("cluster %s: controller generation %s leaves %s serving", self.namespace, self.generation,
                 {r: [m.worker_id for m in ms] for r, ms in self._members.items() if ms})
        self._members = {r: [] for r in POOLS}
        self._close()

    def _close(self) -> None:
        if self._lease is not None:
            self._lease.release()
        if self.registry is not None:
            self.registry.close()
        if self._owns_ray:
            self._shutdown_ray()
        if self._ray_tmp:
            shutil.rmtree(self._ray_tmp, ignore_errors=True)
        if self._redis is not None:
            self._redis.stop()

    def _shutdown_ray(self) -> None:
        # Collect descendants before shutdown: once the raylet exits its workers lose their parent link.
        procs: list[psutil.Process] = []
        for p in self._ray_procs:
            try:
                procs += [p, *p.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        ray.shutdown()
        # Ray's workers exit on their own shortly after the raylet; wait, then kill stragglers, so
        # `pdserve up` never leaves a process behind.
        _, alive = psutil.wait_procs(procs, timeout=5)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=2)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
