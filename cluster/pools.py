"""The worker pools of one cluster: which actors serve each role, grown, shrunk and replaced.

Lifecycle of a ``Pools(config, namespace, generation, stopping)``:

1. Built with its ``Cluster``; empty and not running until ``open(config, redis_url, registry)``, which
   ``Cluster.start()`` calls once Redis and Ray are up and the device is resolved (the config it gets then
   is final).
2. While running: ``scale(role, n)`` grows a pool with new actors (started in parallel, each registers and
   heartbeats by itself) or drains the newest ones; ``replace(role, ids, floor)`` forgets failed members and
   starts new ones under new ids; ``retire([...])`` drains members and kills them; ``adopt(...)`` takes over
   live actors an earlier controller started (``cluster.ownership.find_adoptable``). Every change holds
   ``lock`` (a re-entrant lock the ``Cluster`` shares for its stop).
3. ``stop_all()`` (teardown) stops and kills every member; ``forget_all()`` (a detached controller's stop)
   only forgets them, leaving them serving. ``close()`` marks the pools not running: later scale calls raise
   ``RuntimeError``.

A long wait (a model load, a drain) polls the shared ``stopping`` event every half second, so a stop from
another thread (a signal, the planner's owner) never waits it out.

Worker ids are ``{role}-{n}``, or ``{role}-{generation}-{n}`` for detached workers, and are never reused in
one ``Pools``: a replacement always gets a fresh id.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import ray

from cluster.config import POOLS, ClusterConfig, build_role_worker, pool_tp
from cluster.registry import Registry, WorkerInfo
from cluster.worker_actor import WorkerActor, WorkerSpec, actor_options

log = logging.getLogger(__name__)


@dataclass
class Member:
    """One worker actor of a pool."""

    worker_id: str
    role: str
    handle: Any
    """The Ray actor handle."""
    info: Optional[WorkerInfo] = None
    """Its record as ``start()`` (or adoption) returned it."""


def check_role(role: str) -> None:
    """ValueError unless ``role`` is a pool name."""
    if role not in POOLS:
        raise ValueError(f"role must be one of {POOLS}, got {role!r}")


def check_count(name: str, n: Any) -> None:
    """ValueError unless ``n`` is an integer >= 0 (``name`` is the argument's name in the message)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {n!r}")


class Pools:
    """The actors of every pool of one cluster (see module docstring)."""

    def __init__(self, config: ClusterConfig, namespace: str, generation: str, stopping: threading.Event) -> None:
        self.config = config
        self.namespace = namespace
        self.generation = generation
        self.lock = threading.RLock()
        self._stopping = stopping
        self.redis_url: Optional[str] = None
        self.registry: Optional[Registry] = None
        self._members: dict[str, list[Member]] = {r: [] for r in POOLS}
        self._next_index: dict[str, int] = {r: 0 for r in POOLS}
        self._closed = False

    def open(self, config: ClusterConfig, redis_url: str, registry: Registry) -> None:
        """Start serving scale calls with the cluster's final config, Redis and registry."""
        self.config, self.redis_url, self.registry = config, redis_url, registry

    def close(self) -> None:
        """No more scale calls (they raise ``RuntimeError``)."""
        self._closed = True

    @property
    def running(self) -> bool:
        """True between ``open`` and ``close``."""
        return self.registry is not None and not self._closed

    # ---- views ----------------------------------------------------------------------------------------
    def of(self, role: str) -> list[Member]:
        """The members of one pool, oldest first (a snapshot list)."""
        return list(self._members[role])

    def all(self) -> list[Member]:
        """Every member of every pool."""
        return [m for r in POOLS for m in self._members[r]]

    # ---- actors ---------------------------------------------------------------------------------------
    @property
    def kv_store_url(self) -> Any:  # a kvtransfer.StoreConfig
        """The kvtransfer rendezvous every worker of this cluster uses (the cluster's Redis, own namespace)."""
        from kvtransfer import StoreConfig

        return StoreConfig(self.redis_url, namespace=f"{self.namespace}:kvt")

    def _spec(self, role: str, worker_id: str) -> WorkerSpec:
        factory = self.config.worker_factory or build_role_worker
        # The actor gets the config without the factories (they may hold launcher-only state).
        shipped = dataclasses.replace(self.config, worker_factory=None, router_factory=None)
        return WorkerSpec(worker_id=worker_id, role=role,
                          factory=functools.partial(factory, role, worker_id, shipped, self.kv_store_url),
                          redis_url=self.redis_url, namespace=self.namespace, ttl_s=self.config.ttl_s,
                          heartbeat_interval_s=self.config.heartbeat_interval_s,
                          num_threads=max(1, int(self.config.cpus_per_worker)))

    def kill(self, m: Member) -> None:
        """``ray.kill`` the actor and delete its registry record (both tolerate it being gone already)."""
        try:
            ray.kill(m.handle, no_restart=True)
        except Exception as e:  # already dead
            log.debug("kill %s: %s", m.worker_id, e)
        if self.registry is not None:
            try:
                self.registry.deregister(m.worker_id)
            except Exception as e:
                log.warning("deregister %s: %s", m.worker_id, e)

    # ---- changes --------------------------------------------------------------------------------------
    def scale(self, role: str, n: int) -> list[WorkerInfo]:
        """Grow or shrink one pool to ``n`` live workers (dead actors are dropped and replaced; removal
        drains first); returns the pool's records."""
        check_role(role)
        check_count("n", n)
        roles = ("colocated",) if self.config.mode == "colocated" else ("prefill", "decode")
        if n and role not in roles:
            raise ValueError(f"role {role!r} is not served in {self.config.mode} mode (pools: {roles})")
        if not self.running:
            raise RuntimeError("cluster is not running")
        with self.lock:
            self._drop_dead(role)
            pool = self._members[role]
            if n > len(pool):
                self._add(role, n - len(pool))
            elif n < len(pool):
                self.retire(self._members[role][-(len(pool) - n):])
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
                self.kill(m)
        self._members[role] = alive

    def _add(self, role: str, count: int) -> None:
        resources = ray.cluster_resources()
        new: list[Member] = []
        for _ in range(count):
            n = self._next_index[role]
            worker_id = f"{role}-{self.generation}-{n}" if self.config.detached else f"{role}-{n}"
            self._next_index[role] += 1
            # a tensor-parallel worker's ranks are processes of its own: it reserves their CPUs too
            ranks = pool_tp(self.config, role)
            opts = actor_options(role, self.config.cpus_per_worker * ranks, cluster_resources=resources,
                                 num_gpus=self.config.gpus_per_worker if self.config.device == "cuda" else 0)
            if self.config.detached:  # the deployment's, by name: a later controller adopts it
                opts.update(name=worker_id, namespace=self.namespace, lifetime="detached")
            handle = WorkerActor.options(**opts).remote(self._spec(role, worker_id))
            new.append(Member(worker_id, role, handle))
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
                self.kill(m)
            raise
        for m, info in zip(new, infos):
            m.info = info
        self._members[role].extend(new)
        log.info("cluster %s: +%d %s (%s)", self.namespace, count, role, ", ".join(m.worker_id for m in new))

    def replace(self, role: str, worker_ids: Sequence[str], floor: int = 0) -> list[str]:
        """Forget the failed members ``worker_ids`` (kill, deregister) and start new ones under new ids, so
        the pool is back at its size before the failure, and at least ``floor``; returns the new ids.

        Ids no longer in the pool (already dropped by a concurrent ``scale``) are skipped, so a failure
        seen by both the supervisor and the planner is replaced once."""
        check_role(role)
        check_count("floor", floor)
        with self.lock:
            if not self.running or self._stopping.is_set():
                raise RuntimeError("cluster is not running")
            pool = self._members[role]
            failed = set(worker_ids)
            target = max(len(pool), floor)
            gone = [m for m in pool if m.worker_id in failed]
            self._members[role] = [m for m in pool if m.worker_id not in failed]
            for m in gone:
                self.kill(m)
            before = {m.worker_id for m in self._members[role]}
            missing = target - len(self._members[role])
            if missing > 0:
                self._add(role, missing)
            new_ids = [m.worker_id for m in self._members[role] if m.worker_id not in before]
            if gone or new_ids:
                log.info("cluster %s: replaced %s %s with %s", self.namespace, role,
                         [m.worker_id for m in gone], new_ids)
            return new_ids

    def find(self, worker_id: str) -> Optional[Member]:
        """The member with this id, or None."""
        return next((m for m in self.all() if m.worker_id == worker_id), None)

    def retire(self, leaving: list[Member]) -> bool:
        """Take ``leaving`` out of their pools, drain them (each finishes its in-flight requests within
        ``drain_timeout_s``), then kill them; True when every drain finished cleanly."""
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
            self.kill(m)
        log.info("cluster %s: retired %s (clean=%s)", self.namespace, ", ".join(m.worker_id for m in leaving), clean)
        return clean

    def adopt(self, members: Sequence[Member]) -> None:
        """Take over live workers an earlier controller started (they keep their ids)."""
        for m in members:
            self._members[m.role].append(m)

    def stop_all(self, timeout_s: float = 5.0) -> None:
        """Stop every member (bounded by ``timeout_s``: a hung actor is killed anyway) and forget them."""
        members = self.all()
        if members and ray.is_initialized():
            refs = [m.handle.stop.remote() for m in members]
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            for m in members:
                self.kill(m)
        self.forget_all()

    def forget_all(self) -> None:
        """Forget every member, leaving the actors as they are (a detached controller's stop)."""
        self._members = {r: [] for r in POOLS}
