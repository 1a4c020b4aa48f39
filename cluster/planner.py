"""The planner: scales each pool on its own bottleneck signal, read from the registry.

Lifecycle: ``Planner(cluster, PlannerConfig(...)).start()`` runs a daemon thread
that every ``interval_s`` reads the live ``WorkerInfo`` records of each pool the
cluster serves, asks its policy for each pool's target size and applies it
with ``Cluster.scale_pool`` (a removal drains the newest worker first). After a
change a pool waits ``cooldown_s`` before the next one, so a new worker's load
shows up in the registry before the planner judges again. ``stop()`` ends the
thread; the workers stay as they are. Given the cluster's ``Supervisor``, the
planner counts a pool as the workers the supervisor last saw live and ready,
and leaves replacing dead or stuck workers to it.

Policies, chosen by name (``PlannerConfig.policy``, ``--planner``):

- ``threshold`` (the default): ``decide`` moves a pool one worker at a time on
  its bottleneck signal. Prefill is compute-bound, so its backlog is the queued
  prompt tokens per worker; decode (and colocated) is memory-bound, so it is the
  KV cache usage, and any request waiting for blocks means the pool is full now.
- ``sla``: ``cluster.sla_planner.SlaPolicy`` sizes every pool for the SLOs from
  the offered load it measures with the workers' counters (arrival rate, prompt
  and output lengths over a sliding window) and a profile's step model; it may
  move a pool by several workers at once, within the bounds and the cooldown.

With several nodes, Ray's autoscaler adds nodes when a new actor's ``prefill``/
``decode`` resource cannot be placed.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from cluster.registry import WorkerInfo
from cluster.sla_planner import SlaConfig, SlaPolicy

log = logging.getLogger(__name__)


@dataclass
class PlannerConfig:
    """Bounds and thresholds of the planner."""

    interval_s: float = 5.0
    """Seconds between decisions."""
    cooldown_s: float = 30.0
    """After scaling a pool, wait this long before changing it again."""
    min_prefill: int = 1
    """Fewest prefill workers."""
    max_prefill: int = 4
    """Most prefill workers."""
    min_decode: int = 1
    """Fewest decode workers."""
    max_decode: int = 4
    """Most decode workers."""
    min_colocated: int = 1
    """Fewest colocated workers (colocated mode)."""
    max_colocated: int = 4
    """Most colocated workers (colocated mode)."""
    prefill_tokens_high: int = 4096
    """Queued prompt tokens per prefill worker above which one is added."""
    prefill_tokens_low: int = 256
    """Queued prompt tokens per prefill worker below which one is removed."""
    kv_usage_high: float = 0.8
    """Mean KV cache usage (fraction) of a decode/colocated pool above which a worker is added."""
    kv_usage_low: float = 0.3
    """Mean KV cache usage below which a worker is removed (if nothing waits)."""
    policy: str = "threshold"
    """Which policy sizes the pools: "threshold" (``decide``) or "sla" (``cluster.sla_planner``)."""
    sla: Optional[SlaConfig] = None
    """The profile, SLOs and knobs of the "sla" policy (required by it, unused by "threshold")."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {tuple(POLICIES)}, got {self.policy!r}")
        if self.policy == "sla" and not isinstance(self.sla, SlaConfig):
            raise ValueError("sla must be an SlaConfig (profile and SLOs) when policy is 'sla'")
        for role in ("prefill", "decode", "colocated"):
            lo, hi = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            if not isinstance(lo, int) or lo < 0:
                raise ValueError(f"min_{role} must be an integer >= 0, got {lo!r}")
            if not isinstance(hi, int) or hi < max(lo, 1):
                raise ValueError(f"max_{role} must be an integer >= max(min_{role}, 1), got {hi!r}")
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s!r}")
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {self.cooldown_s!r}")
        if not 0 <= self.prefill_tokens_low < self.prefill_tokens_high:
            raise ValueError("prefill_tokens_low must be >= 0 and < prefill_tokens_high, got "
                             f"{self.prefill_tokens_low!r} / {self.prefill_tokens_high!r}")
        if not 0.0 <= self.kv_usage_low < self.kv_usage_high <= 1.0:
            raise ValueError("kv_usage_low and kv_usage_high must satisfy 0 <= low < high <= 1, got "
                             f"{self.kv_usage_low!r} / {self.kv_usage_high!r}")

    def bounds(self, role: str) -> tuple[int, int]:
        """(min, max) workers of a pool."""
        return getattr(self, f"min_{role}"), getattr(self, f"max_{role}")


def decide(role: str, workers: Sequence[WorkerInfo], current: int, cfg: PlannerConfig) -> int:
    """The next size of a pool of ``current`` workers, given their live records (one step at a time)."""
    lo, hi = cfg.bounds(role)
    if current < lo:
        return lo  # below the floor (a crash, a fresh start): restore at once
    if current > hi:
        return hi
    ready = [w for w in workers if w.ready]
    if not ready:
        return current  # nothing to judge yet (workers starting): no flapping
    if role == "prefill":
        per_worker = sum(w.queued_prompt_tokens for w in ready) / len(ready)
        high, low = per_worker > cfg.prefill_tokens_high, per_worker < cfg.prefill_tokens_low
    else:
        usage = sum(1.0 - w.num_free_blocks / max(1, w.num_total_blocks) for w in ready) / len(ready)
        waiting = sum(w.num_waiting for w in ready)
        high = usage > cfg.kv_usage_high or waiting > 0
        low = usage < cfg.kv_usage_low and waiting == 0
    if high and current < hi:
        return current + 1
    if low and current > lo:
        return current - 1
    return current


class ThresholdPolicy:
    """The ``threshold`` policy: ``decide`` for each pool, one step at a time."""

    name = "threshold"

    def __init__(self, cfg: PlannerConfig, mode: str) -> None:
        self.cfg = cfg

    def targets(self, infos: dict[str, list[WorkerInfo]], current: dict[str, int], now: float) -> dict[str, int]:
        return {role: decide(role, infos[role], n, self.cfg) for role, n in current.items()}


def _sla_policy(cfg: PlannerConfig, mode: str) -> SlaPolicy:
    return SlaPolicy(cfg.sla, mode, cfg.bounds)


POLICIES: dict[str, Callable[[PlannerConfig, str], Any]] = {"threshold": ThresholdPolicy, "sla": _sla_policy}
"""Planner policies by name: ``(config, cluster mode) -> object with targets(infos, current, now)``."""


class Planner:
    """Runs its policy for each pool of a ``Cluster`` on a timer (see module docstring)."""

    def __init__(self, cluster: Any, config: Optional[PlannerConfig] = None, supervisor: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster = cluster
        self.config = config or PlannerConfig()
        self.supervisor = supervisor
        """A ``cluster.supervisor.Supervisor`` whose view of live ready workers sizes the pools; None counts
        the cluster's members, live or not."""
        self.clock = clock
        """Seconds for cooldowns and the policy's windows (a simulation passes its virtual clock)."""
        self.policy = POLICIES[self.config.policy](self.config, self.cluster.config.mode)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._last_change: dict[str, float] = {}
        self.decisions: list[tuple[float, str, int, int]] = []
        """(time, role, old size, new size) of every change made, oldest first."""

    def roles(self) -> tuple[str, ...]:
        """The pools this cluster serves."""
        return ("colocated",) if self.cluster.config.mode == "colocated" else ("prefill", "decode")

    def live(self, role: str) -> list[str]:
        """Worker ids of ``role`` the planner counts (the supervisor's live ready view when it has one)."""
        if self.supervisor is not None:
            return self.supervisor.live_ready(role)
        return self.cluster.worker_ids(role)

    def tick(self) -> None:
        """One round of decisions (the thread calls this every interval_s; tests may call it directly)."""
        now = self.clock()
        roles = self.roles()
        # Live ready workers only: a dead actor the supervisor is about to replace must not count (else a
        # pool at its floor never grows back), and both act through absolute targets: one replacement.
        current = {role: len(self.live(role)) for role in roles}
        targets = self.policy.targets({role: self.cluster.registry.list(role) for role in roles}, current, now)
        for role in roles:
            target = targets[role]
            cooling = now - self._last_change.get(role, -1e18) < self.config.cooldown_s
            lo, hi = self.config.bounds(role)
            if target == current[role] or (cooling and lo <= current[role] <= hi):
                continue
            log.info("planner (%s): %s pool %d -> %d", self.policy.name, role, current[role], target)
            self.cluster.scale_pool(role, target)
            self._last_change[role] = self.clock()
            self.decisions.append((time.time(), role, current[role], target))

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.tick()
            except Exception as e:  # keep planning: a failed scale (no resources yet) is retried next tick
                log.warning("planner tick failed: %s", e)

    def start(self) -> "Planner":
        """Start the planning thread."""
        if self._thread is not None:
            raise RuntimeError("planner already started")
        self._thread = threading.Thread(target=self._run, name="pdserve-planner", daemon=True)
        self._thread.start()
        return self

    def stop(self, wait: bool = True) -> None:
        """Stop planning; the pools keep their size. ``wait=False`` returns at once (a tick in progress
        ends when ``Cluster.stop()`` interrupts its scaling)."""
        self._stop.set()
        if wait and self._thread is not None:
            self._thread.join(timeout=self.config.interval_s + 120)
