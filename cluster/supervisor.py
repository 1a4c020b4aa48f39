"""The supervisor: keeps every worker pool at its size when actors die or hang.

Lifecycle: ``Supervisor(cluster, SupervisorConfig(...)).start()`` runs a daemon
thread that every ``check_interval_s`` calls ``tick()`` (tests call it
directly). A tick, per pool the cluster serves:

1. probes every member with an ``info()`` call and waits at most
   ``probe_timeout_s`` for all answers at once (``ray.wait``);
2. ``plan_pool`` (plain data in, plain data out) judges each answer: a
   ``RayActorError`` means the actor is dead (kill -9, node loss, OOM) and it
   fails at once; a call that does not return in time, or raises, is a miss,
   and ``max_missed`` misses in a row fail a live-but-stuck worker;
3. each failed worker is taken out of routing at once: ``ray.kill(no_restart=
   True)`` (best effort: a stuck process must not heartbeat itself back) and
   ``Registry.deregister`` (routers stop seeing it without waiting for the
   TTL);
4. ``Cluster.replace_workers`` forgets the failed members and starts as many
   new actors, each under a NEW worker id (never a reused one: a new kvtransfer
   endpoint name means fresh pair groups, and the surviving pairs are left
   alone), so the pool is back at its size, and at least at ``floors[role]``.

``stop()`` ends the thread; it never touches the pools. ``live_ready(role)``
is the supervisor's view (members whose last probe answered ``ready``, minus
the failed ones); the planner counts pools with it, and both change pools only
through ``Cluster`` calls that take an absolute target under the cluster's
lock, so a dead worker is replaced once, not once by each.

Why not Ray's own actor restart (``max_restarts > 0``): Ray would re-run the
actor's constructor with the same ``WorkerSpec``, hence the same worker id and
kvtransfer endpoint name, while its peers still hold process groups with the
dead process; it would not run ``start()`` (the launcher does), so the actor
would come back unregistered; and it only reacts to a process exit, never to a
worker that hangs. Replacing the actor from the launcher's side covers death
and hangs with one path, under fresh ids, so the actors keep ``max_restarts=0``.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import ray

log = logging.getLogger(__name__)

OK, DEAD, MISS = "ok", "dead", "miss"


@dataclass
class SupervisorConfig:
    """How often and how patiently the supervisor checks the pools."""

    check_interval_s: float = 1.0
    """Seconds between ticks."""
    probe_timeout_s: float = 5.0
    """How long one tick waits for the members' info() answers."""
    max_missed: int = 3
    """Consecutive missed probes (timeout or error) after which a live but stuck worker is replaced."""
    floors: dict = field(default_factory=dict)
    """role -> fewest workers; a pool below it is grown back (default: the cluster's start sizes)."""

    def __post_init__(self) -> None:
        if not self.check_interval_s > 0:
            raise ValueError(f"check_interval_s must be > 0, got {self.check_interval_s!r}")
        if not self.probe_timeout_s > 0:
            raise ValueError(f"probe_timeout_s must be > 0, got {self.probe_timeout_s!r}")
        if not isinstance(self.max_missed, int) or isinstance(self.max_missed, bool) or self.max_missed < 1:
            raise ValueError(f"max_missed must be an integer >= 1, got {self.max_missed!r}")
        for role, n in self.floors.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"floors[{role!r}] must be an integer >= 0, got {n!r}")


@dataclass
class Probe:
    """One member's answer to a health probe."""

    worker_id: str
    outcome: str
    """"ok" (info() returned), "dead" (RayActorError) or "miss" (timed out or raised)."""
    ready: bool = False
    """The worker's own ready flag (only meaningful when outcome is "ok")."""


@dataclass
class PoolPlan:
    """What one tick does to one pool."""

    failed: list[str]
    """Members to kill, deregister and replace."""
    add: int
    """New workers to start: one per failed member, plus any shortfall below the floor."""
    missed: dict[str, int]
    """Consecutive misses per surviving member (carried to the next tick)."""
    live_ready: list[str]
    """Members that answered ready this tick."""


def plan_pool(probes: Sequence[Probe], missed: Mapping[str, int], floor: int, max_missed: int) -> PoolPlan:
    """Judge one pool's probes (plain data: the supervisor's whole decision rule)."""
    failed: list[str] = []
    carried: dict[str, int] = {}
    live_ready: list[str] = []
    for p in probes:
        if p.outcome not in (OK, DEAD, MISS):
            raise ValueError(f"probe outcome must be one of {(OK, DEAD, MISS)}, got {p.outcome!r}")
        if p.outcome == DEAD:
            failed.append(p.worker_id)
        elif p.outcome == MISS:
            n = missed.get(p.worker_id, 0) + 1
            if n >= max_missed:
                failed.append(p.worker_id)
            else:
                carried[p.worker_id] = n
        elif p.ready:
            live_ready.append(p.worker_id)
    # Keep the pool's size (a planner may have grown it past the floor), and never below the floor.
    add = max(len(probes), floor) - (len(probes) - len(failed))
    return PoolPlan(failed=failed, add=add, missed=carried, live_ready=live_ready)


class Supervisor:
    """Probes a ``Cluster``'s pools and replaces dead or stuck workers (see module docstring)."""

    def __init__(self, cluster: Any, config: Optional[SupervisorConfig] = None) -> None:
        self.cluster = cluster
        self.config = config or SupervisorConfig()
        cfg = cluster.config
        self.floors: dict[str, int] = {r: getattr(cfg, f"num_{r}") for r in self.roles()}
        self.floors.update(self.config.floors)
        self._missed: dict[str, dict[str, int]] = {r: {} for r in self.roles()}
        self._live_ready: dict[str, list[str]] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.replacements: list[tuple[float, str, list[str], list[str]]] = []
        """(time, role, failed ids, new ids) of every replacement, oldest first."""

    def roles(self) -> tuple[str, ...]:
        """The pools this cluster serves."""
        return ("colocated",) if self.cluster.config.mode == "colocated" else ("prefill", "decode")

    def live_ready(self, role: str) -> list[str]:
        """Members of ``role`` that answered ready at the last tick (all members before the first tick)."""
        members = set(self.cluster.worker_ids(role))
        seen = self._live_ready.get(role)
        if seen is None:
            return sorted(members)
        return [w for w in seen if w in members]

    def _probe(self, members: Sequence[tuple[str, Any]]) -> list[Probe]:
        if not members:
            return []
        refs = [h.info.remote() for _, h in members]
        ray.wait(refs, num_returns=len(refs), timeout=self.config.probe_timeout_s)
        probes = []
        for (worker_id, _), ref in zip(members, refs):
            try:
                info = ray.get(ref, timeout=0)
                probes.append(Probe(worker_id, OK, ready=bool(info.ready)))
            except ray.exceptions.RayActorError:
                probes.append(Probe(worker_id, DEAD))
            except Exception as e:  # GetTimeoutError, or info() itself raised: a miss
                log.debug("probe %s: %s", worker_id, type(e).__name__)
                probes.append(Probe(worker_id, MISS))
        return probes

    def tick(self) -> dict[str, PoolPlan]:
        """One round of checks and replacements; returns each pool's plan."""
        plans = {}
        for role in self.roles():
            members = self.cluster.members(role)
            probes = self._probe(members)
            # Members that left meanwhile (a drain, a replacement by the planner) are not ours to judge.
            current = set(self.cluster.worker_ids(role))
            probes = [p for p in probes if p.worker_id in current]
            plan = plan_pool(probes, self._missed[role], self.floors.get(role, 0), self.config.max_missed)
            self._missed[role] = plan.missed
            self._live_ready[role] = plan.live_ready
            plans[role] = plan
            if not plan.failed and not plan.add:
                continue
            handles = dict(members)
            for worker_id in plan.failed:
                self._take_out(worker_id, handles.get(worker_id))
            new_ids = self.cluster.replace_workers(role, plan.failed, self.floors.get(role, 0))
            self.replacements.append((time.time(), role, list(plan.failed), new_ids))
            log.warning("supervisor: %s pool: replaced failed %s with %s", role, plan.failed or "-", new_ids or "-")
        return plans

    def _take_out(self, worker_id: str, handle: Any) -> None:
        # Out of routing now, before the (slow) replacement starts.
        if handle is not None:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as e:  # already gone
                log.debug("kill %s: %s", worker_id, e)
        try:
            self.cluster.registry.deregister(worker_id)
        except Exception as e:  # Redis down: the TTL removes it anyway
            log.warning("supervisor: deregister %s failed: %s", worker_id, e)

    def _run(self) -> None:
        while not self._stop.wait(self.config.check_interval_s):
            try:
                self.tick()
            except Exception as e:  # keep supervising: a failed start (no resources yet) is retried next tick
                if self._stop.is_set():
                    return
                log.warning("supervisor tick failed: %s", e)

    def start(self) -> "Supervisor":
        """Start the supervising thread."""
        if self._thread is not None:
            raise RuntimeError("supervisor already started")
        self._thread = threading.Thread(target=self._run, name="pdserve-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self, wait: bool = True) -> None:
        """Stop supervising; the pools stay as they are. ``wait=False`` returns at once (a replacement in
        progress ends when ``Cluster.stop()`` interrupts it)."""
        self._stop.set()
        if wait and self._thread is not None:
            self._thread.join(timeout=self.config.check_interval_s + self.config.probe_timeout_s + 120)
