"""Who owns a deployment's worker pools: one controller at a time, per generation.

A *deployment* is one registry namespace (also the Ray namespace its detached
worker actors are named in). Its pools outlive every router and every
controller process: routers only read the registry, and a controller
(``pdserve controller``, a ``Cluster`` with ``detached=True``) only manages.

Lifecycle of a ``ControllerLease(redis_url, namespace, generation)``:

1. ``acquire(wait_s)``: ``SET {ns}:controller <generation> NX PX ttl``, retried
   until the key is free (the previous controller released it, or died and its
   TTL ran out) or ``wait_s`` passes (``TimeoutError`` naming the holder). A
   rolling update's new controller therefore waits for the old one to leave.
2. A daemon thread renews the lease every ``ttl/3`` while the value is still ours
   (compare-and-set in one Lua script). If it finds another owner, or cannot
   renew before the TTL runs out, ``lost`` is set: the controller stops
   managing (its supervisor and planner must not fight a successor).
3. ``release()``: deletes the key only if it is still ours.

``detached_workers(namespace)`` lists the deployment's live, named worker
actors (name = worker id), so a new controller adopts them instead of starting
new ones; ``find_adoptable(namespace, model_name)`` asks each for its record
and sorts them into those to adopt, those serving another model (retired once
replaced: a model change rolls the pools) and those to stop (dead or stuck). Worker ids carry the generation of the controller that started them
(``prefill-<generation>-<n>``), so the keys a new generation writes never
collide with the ones an older one wrote, and no controller deletes another's.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import redis

from cluster.redis_server import mask_url

log = logging.getLogger(__name__)

_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""


class ControllerLease:
    """The single-controller lease of one deployment (see module docstring)."""

    def __init__(self, redis_url: str, namespace: str, generation: str, ttl_s: float = 10.0) -> None:
        if not generation or not generation.isalnum():
            raise ValueError(f"generation must be a non-empty alphanumeric string, got {generation!r}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        self.namespace = namespace
        self.generation = generation
        self.ttl_s = float(ttl_s)
        self.key = f"{namespace}:controller"
        self.lost = threading.Event()
        """Set when the lease was taken over or could not be renewed in time."""
        self.lost_reason = ""
        """Why ``lost`` was set, for the controller's exit message (another owner, or Redis unreachable)."""
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._display = mask_url(redis_url)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def holder(self) -> Optional[str]:
        """The generation holding the lease now, or None."""
        v = self._redis.get(self.key)
        return v.decode() if v is not None else None

    def acquire(self, wait_s: float = 60.0, poll_s: float = 0.25) -> "ControllerLease":
        """Take the lease, waiting up to ``wait_s`` for the current holder to leave; starts renewing."""
        ttl_ms = max(1, int(self.ttl_s * 1000))
        deadline = time.monotonic() + wait_s
        announced = False
        redis_error: Optional[redis.RedisError] = None
        while True:
            # Redis slow or away for a moment (a restart, a starved host) delays the start; it does not end it
            try:
                if self._redis.set(self.key, self.generation, nx=True, px=ttl_ms):
                    break
                holder = self.holder()
                redis_error = None
            except redis.RedisError as e:
                if redis_error is None:
                    log.warning("deployment %s: Redis at %s did not answer (%s); trying again until the start "
                                "deadline", self.namespace, self._display, e)
                redis_error, holder = e, None
            if holder == self.generation:  # ours already (a retry after a lost reply)
                break
            if time.monotonic() >= deadline:
                if redis_error is not None:
                    raise TimeoutError(f"Redis at {self._display} did not answer for the controller lease of "
                                       f"deployment {self.namespace} within {wait_s:g} s: {redis_error}")
                raise TimeoutError(f"deployment {self.namespace} is managed by controller generation {holder} "
                                   f"(lease {self.key} on {self._display}); it did not leave within {wait_s:g} s")
            if not announced and holder is not None:
                log.warning("deployment %s: waiting for controller generation %s to leave", self.namespace, holder)
                announced = True
            time.sleep(poll_s)
        log.info("deployment %s: controller generation %s holds the lease", self.namespace, self.generation)
        self._thread = threading.Thread(target=self._renew_loop, name=f"lease-{self.namespace}", daemon=True)
        self._thread.start()
        return self

    def _renew_loop(self) -> None:
        ttl_ms = max(1, int(self.ttl_s * 1000))
        last_ok = time.monotonic()
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if not int(self._redis.eval(_RENEW, 1, self.key, self.generation, ttl_ms)):
                    # Gone (Redis restarted empty) or another owner: take it back only if nobody holds it.
                    if not self._redis.set(self.key, self.generation, nx=True, px=ttl_ms):
                        holder = self.holder()
                        log.error("deployment %s: lease taken by generation %s; generation %s stops managing",
                                  self.namespace, holder, self.generation)
                        self.lost_reason = f"controller generation {holder} took the deployment's lease"
                        self.lost.set()
                        return
                last_ok = time.monotonic()
            except redis.RedisError as e:
                if time.monotonic() - last_ok > self.ttl_s:
                    log.error("deployment %s: lease not renewed for %.0f s (%s); generation %s stops managing",
                              self.namespace, time.monotonic() - last_ok, e, self.generation)
                    # it cannot prove it still holds the lease, so another controller may take over: stop (a
                    # Deployment restarts it; it takes the lease back once Redis answers and nobody holds it)
                    self.lost_reason = (f"Redis ({self._display}) did not answer for {self.ttl_s:g} s, so the lease "
                                        f"could not be renewed: {e}")
                    self.lost.set()
                    return

    def release(self) -> None:
        """Stop renewing and give the lease up if it is still ours; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self._redis.eval(_RELEASE, 1, self.key, self.generation)
        except redis.RedisError as e:  # the TTL frees it anyway
            log.warning("deployment %s: lease release failed: %s", self.namespace, e)
        self._redis.close()


def detached_workers(namespace: str) -> dict[str, Any]:
    """worker id -> actor handle of every named actor in Ray namespace ``namespace`` (the deployment's
    detached workers; dead ones are not listed by Ray)."""
    import ray

    out: dict[str, Any] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") != namespace:
            continue
        name = entry["name"]
        try:
            out[name] = ray.get_actor(name, namespace=namespace)
        except ValueError:  # died between the listing and the lookup
            continue
    return out


@dataclass
class Adoption:
    """What a new controller finds in its deployment (``find_adoptable``)."""

    live: list[tuple[str, Any, Any]] = field(default_factory=list)
    """(worker id, actor handle, WorkerInfo) of the workers serving this controller's model: adopt them."""
    outdated: list[tuple[str, Any, Any]] = field(default_factory=list)
    """The same of workers serving another model: they keep serving until replaced, then are retired."""
    unusable: list[tuple[str, Any]] = field(default_factory=list)
    """(worker id, actor handle) of named actors that did not answer (dead, stuck, never started): stop them."""


def find_adoptable(namespace: str, model_name: str, roles: tuple[str, ...], timeout_s: float = 30.0) -> Adoption:
    """Ask every detached worker of ``namespace`` for its record (at most ``timeout_s`` in all) and sort them
    (see ``Adoption``). A named actor that reports another id or a role not in ``roles`` is left alone."""
    import ray

    out = Adoption()
    found = detached_workers(namespace)
    if not found:
        return out
    refs = {wid: h.info.remote() for wid, h in found.items()}
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    for wid, ref in sorted(refs.items()):
        handle = found[wid]
        try:
            info = ray.get(ref, timeout=0)
        except (ray.exceptions.RayError, TimeoutError) as e:  # dead, stuck or never started: replace it
            log.warning("deployment %s: not adopting %s (%s); stopping it", namespace, wid, type(e).__name__)
            out.unusable.append((wid, handle))
            continue
        if info.role not in roles or info.worker_id != wid:
            log.warning("deployment %s: named actor %s reports %s/%s; leaving it alone", namespace, wid,
                        info.worker_id, info.role)
            continue
        (out.live if info.model_name == model_name else out.outdated).append((wid, handle, info))
    return out
