"""LoRA adapters loaded and unloaded while the cluster runs: the router's ``LoadLoRAAdapter`` / ``UnloadLoRAAdapter``
(gRPC) and vLLM's ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (HTTP).

Lifecycle: ``RouterCore`` builds one ``LoRAAdmin``; it answers only on a router started with
``allow_runtime_lora_updating`` (``--allow-runtime-lora-updating``, vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: a
load names a path on the workers' hosts, so it is off unless asked for) and with the cluster's Redis registry as
its worker source. The cluster's runtime set is one Redis hash (``cluster.registry.Registry.lora_entries``); every
worker's heartbeat follows it (worker_common/lora_sync.py), so a worker started later loads the same adapters.

- **load** (name, absolute path): checked first (name, path, not served already, some worker live); the entry is
  added (``HSETNX``: one load of a name at a time, whichever router gets there first) under a fresh load id; the
  call then waits until every live worker publishes the adapter from that load (``WorkerInfo.lora_status``) with
  the same weights (``key_root``), and answers; a worker's refusal (a missing directory, a shape that does not fit
  the model: engine/lora.py's checks) removes the entry and comes back as INVALID_ARGUMENT naming the worker and
  the reason; no answer within ``lora_update_timeout_s``, DEADLINE_EXCEEDED (the entry removed, so nothing half
  loaded stays). Every router serves an adapter once every live worker publishes it (router/core.py ``limits``).
- **unload** (name): the entry is marked ``unloading``: every router refuses new requests under it (NOT_FOUND) at
  its next view refresh, this one at once, while workers keep it; once no request runs under it (no worker
  publishes one running, none of this router's is in flight; at most ``lora_update_timeout_s``) the entry goes and
  the workers unload it (a request still running then finishes under it: the engine frees the weights after its
  last one). Adapters given at start (``--lora-modules``) are not unloaded (FAILED_PRECONDITION).
- **resolve** (``lora_resolver_dir``): a request naming an adapter nothing serves loads ``DIR/<name>`` first.
- **max_loras**: a load that takes the runtime set past the bound then unloads the least recently used idle other.

Errors are ``LoRAAdminError`` with the gRPC status (the HTTP API maps it: 400, 404, 501, 503, 504), never a bare
exception; Redis unreachable is UNAVAILABLE and changes nothing.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Optional

import grpc

from proto.worker_pb2 import LoRARuntimeEntry as LoRAEntry

if TYPE_CHECKING:
    from router.core import RouterCore

log = logging.getLogger(__name__)

POLL_S = 0.1
"""How often a load or unload re-reads the workers' records while it waits."""
RESOLVER_MISS_S = 30.0
"""How long a name the resolver could not load is answered NOT_FOUND without trying again."""
RESOLVER_CONCURRENCY = 4
"""Resolutions (loads on first use) one router runs at once; a request finding them all busy is UNAVAILABLE."""


def pick_lru(names: list[str], last_used: dict[str, float]) -> Optional[str]:
    """The least recently used of ``names`` (never used here first, then by name); None for none."""
    return min(names, key=lambda n: (last_used.get(n, float("-inf")), n), default=None)


class LoRAAdminError(Exception):
    """A refused or failed load/unload: ``code`` (a gRPC status) and a message naming the field or the cause."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class LoRAAdmin:
    """The router's runtime LoRA calls (see module docstring)."""

    def __init__(self, core: "RouterCore") -> None:
        self.core = core
        self.unloading: set[str] = set()
        """Adapters this router is unloading now: refused at once, before the view shows the entry's state."""
        self._lock = threading.Lock()
        self._last_used: dict[str, float] = {}
        self._room_lock = threading.Lock()
        self._misses: dict[str, float] = {}  # name -> monotonic time until which the resolver does not retry it
        self._resolving = threading.BoundedSemaphore(RESOLVER_CONCURRENCY)

    # ---- checks -------------------------------------------------------------------------------
    def _registry(self) -> Any:
        if not self.core.cfg.allow_runtime_lora_updating:
            raise LoRAAdminError(grpc.StatusCode.UNIMPLEMENTED, "loading LoRA adapters at run time is off: start the "
                                 "router with --allow-runtime-lora-updating")
        reg = self.core.view.source
        if not callable(getattr(reg, "lora_add", None)):
            raise LoRAAdminError(grpc.StatusCode.UNIMPLEMENTED, "loading LoRA adapters at run time needs the "
                                 "cluster's Redis registry as the router's worker source")
        return reg

    @staticmethod
    def _name(name: object) -> str:
        from engine import check_lora_name

        try:
            return check_lora_name(name, "lora_name")  # type: ignore[arg-type]
        except ValueError as e:
            raise LoRAAdminError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None

    def _redis(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except LoRAAdminError:
            raise
        except Exception as e:  # redis-py's connection and timeout errors (after its retries)
            raise LoRAAdminError(grpc.StatusCode.UNAVAILABLE, f"{what}: the cluster registry (Redis) did not answer: "
                                 f"{type(e).__name__}") from None

    # ---- load ---------------------------------------------------------------------------------
    def load(self, name: object, path: object) -> str:
        """Load adapter ``name`` from ``path`` on every worker; the success message (vLLM's words)."""
        reg = self._registry()
        name = self._name(name)
        if not isinstance(path, str) or not path:
            raise LoRAAdminError(grpc.StatusCode.INVALID_ARGUMENT, "lora_path: a PEFT LoRA adapter directory is "
                                 "required")
        if not os.path.isabs(path) or "\0" in path:
            raise LoRAAdminError(grpc.StatusCode.INVALID_ARGUMENT, f"lora_path must be an absolute path (each worker "
                                 f"reads it on its own host), got {path!r}")
        limits = self.core.limits
        if limits is not None and name == limits.model_name:
            raise LoRAAdminError(grpc.StatusCode.INVALID_ARGUMENT, f"lora_name: {name!r} is the served model's "
                                 "name")
        if limits is not None and name in limits.lora_adapters:  # (one being loaded: HSETNX below says so)
            raise LoRAAdminError(grpc.StatusCode.ALREADY_EXISTS, f"The lora adapter '{name}' has already been "
                                 "loaded.")
        if not self._redis("load", reg.list):
            raise LoRAAdminError(grpc.StatusCode.UNAVAILABLE, "no live worker to load the adapter on")
        load_id = uuid.uuid4().hex[:16]
        if not self._redis("load", reg.lora_add, name, LoRAEntry(path=path, load_id=load_id, state="serving")):
            raise LoRAAdminError(grpc.StatusCode.ALREADY_EXISTS, f"The lora adapter '{name}' has already been "
                                 "loaded.")
        log.info("router: loading LoRA adapter %r from %s (load %s)", name, path, load_id)
        deadline = time.monotonic() + self.core.cfg.lora_update_timeout_s
        try:
            while True:
                workers = self._redis("load", reg.list)
                ours = [[s for s in w.lora_status if s.name == name and s.load_id == load_id] for w in workers]
                for w, st in zip(workers, ours):
                    if st and st[0].error:
                        raise LoRAAdminError(grpc.StatusCode.INVALID_ARGUMENT,
                                             f"lora_path: worker {w.worker_id} could not load adapter {name!r}: "
                                             f"{st[0].error}")
                if workers and all(st for st in ours) and len({st[0].key_root for st in ours}) == 1:
                    break
                if len({st[0].key_root for st in ours if st}) > 1:
                    raise LoRAAdminError(grpc.StatusCode.FAILED_PRECONDITION,
                                         f"lora_path: the workers read different files at {path} (the adapter's "
                                         "weights differ between hosts)")
                if time.monotonic() > deadline:
                    missing = [w.worker_id for w, st in zip(workers, ours) if not st]
                    raise LoRAAdminError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                         f"adapter {name!r} not loaded on {missing} within "
                                         f"{self.core.cfg.lora_update_timeout_s:g} s")
                time.sleep(POLL_S)
        except BaseException:
            try:
                reg.lora_remove(name, load_id)
            except Exception as e:  # noqa: BLE001 - the workers keep whatever they loaded until Redis answers
                log.warning("router: LoRA adapter %r (load %s) not removed after a failed load: %s", name, load_id,
                            type(e).__name__)
            self.core.refresh_workers()
            raise
        self.core.refresh_workers()
        self.touch(name)  # (a fresh load is not the first one max_loras evicts)
        log.info("router: LoRA adapter %r loaded on %d worker(s)", name, len(workers))
        if self.core.cfg.max_loras is not None:
            # room is made once the new adapter loaded (a directory the workers refuse evicts nothing): the set
            # holds one more than max_loras for as long as that takes
            with self._room_lock:
                try:
                    self._make_room(reg, name)
                except LoRAAdminError as e:
                    if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        self.unload(name)
                    raise
        return f"Success: LoRA adapter '{name}' added successfully."

    def _running(self, reg: Any, what: str) -> dict[str, int]:
        """Requests the live workers hold now under each adapter (``LoRAStatus.running``, summed)."""
        running: dict[str, int] = {}
        for w in self._redis(what, reg.list):
            for s in w.lora_status:
                running[s.name] = running.get(s.name, 0) + s.running
        return running

    # ---- the bound on runtime adapters (max_loras) -------------------------------------------------
    def touch(self, name: str) -> None:
        """A request under adapter ``name`` was admitted here (what ``max_loras`` evicts by: least recently used)."""
        self._last_used[name] = time.monotonic()

    def _make_room(self, reg: Any, name: str) -> None:
        """With more than ``max_loras`` runtime adapters loaded (``name``, just loaded, among them), unload the least
        recently used others no request runs under until the set is within the bound; RESOURCE_EXHAUSTED when every
        one is in use (the caller then unloads ``name`` again)."""
        cap = self.core.cfg.max_loras
        while True:
            loaded = [n for n, e in self._redis("load", reg.lora_entries).items() if n != name]
            if len(loaded) < cap:
                return
            running = self._running(reg, "load")
            idle = [n for n in loaded if not running.get(n) and not self.core.lora_in_flight(n)
                    and n not in self.unloading]
            victim = pick_lru(idle, self._last_used)
            if victim is None:
                raise LoRAAdminError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"lora_name: max_loras={cap} LoRA adapters are loaded and every one has requests "
                                     f"running; unload one, or retry (adapters: {', '.join(sorted(loaded))})")
            log.info("router: max_loras=%d reached: unloading %r (least recently used) to load %r", cap, victim, name)
            try:
                self.unload(victim)
            except LoRAAdminError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:  # (gone meanwhile: another router made room)
                    raise

    # ---- load on first use (the resolver) ---------------------------------------------------------
    def resolvable(self, model: str) -> bool:
        """Whether a request for ``model`` should wait for ``resolve``: the resolver is on
        (``lora_resolver_dir``), ``model`` is a valid adapter name that is neither the served model nor served now,
        and it has not failed to load within ``RESOLVER_MISS_S``."""
        cfg, limits = self.core.cfg, self.core.limits
        if not cfg.lora_resolver_dir or not cfg.allow_runtime_lora_updating or not model or limits is None:
            return False
        if model == limits.model_name or model in limits.lora_adapters or model in self.unloading:
            return False
        try:
            self._name(model)
        except LoRAAdminError:
            return False
        if self._resolver_path(model) is None:
            return False
        with self._lock:
            until = self._misses.get(model)
            if until is not None and until <= time.monotonic():
                del self._misses[model]
                until = None
        return until is None

    def _resolver_path(self, model: str) -> Optional[str]:
        """``lora_resolver_dir/model``, or None where the name would lead out of that directory ('..' parts)."""
        root = os.path.normpath(self.core.cfg.lora_resolver_dir)
        path = os.path.normpath(os.path.join(root, model))
        return path if path.startswith(root + os.sep) else None

    def resolve(self, model: str) -> None:
        """Load adapter ``model`` from ``lora_resolver_dir/model`` on every worker before its first request is
        checked (vLLM's filesystem LoRA resolver): when this returns the adapter is served, or the request's check
        answers NOT_FOUND as for any unknown model (a directory the workers cannot load is not tried again for
        ``RESOLVER_MISS_S``). A load of the name already in progress (another request, another router) is waited
        for. LoRAAdminError: UNAVAILABLE (Redis, or this router busy resolving others), DEADLINE_EXCEEDED."""
        if not self._resolving.acquire(timeout=self.core.cfg.lora_update_timeout_s):
            raise LoRAAdminError(grpc.StatusCode.UNAVAILABLE, f"model {model!r}: the router is busy loading other "
                                 "LoRA adapters; retry")
        try:
            path = self._resolver_path(model)
            if path is None:
                return
            try:
                self.load(model, path)
                return
            except LoRAAdminError as e:
                if e.code == grpc.StatusCode.INVALID_ARGUMENT:
                    log.info("router: LoRA resolver: no adapter %r loaded from %s: %s", model, path, e.message)
                    with self._lock:
                        self._misses[model] = time.monotonic() + RESOLVER_MISS_S
                    return
                if e.code != grpc.StatusCode.ALREADY_EXISTS:
                    raise
            # a load of it is in progress elsewhere: served once it is done, or its entry goes
            deadline = time.monotonic() + self.core.cfg.lora_update_timeout_s
            reg = self._registry()
            while time.monotonic() < deadline:
                self.core.refresh_workers()
                limits = self.core.limits
                if limits is not None and model in limits.lora_adapters:
                    return
                if model not in self._redis("resolve", reg.lora_entries):
                    return
                time.sleep(POLL_S)
        finally:
            self._resolving.release()

    # ---- unload -------------------------------------------------------------------------------
    def unload(self, name: object) -> str:
        """Stop serving adapter ``name`` once its requests are done; the success message (vLLM's words)."""
        reg = self._registry()
        name = self._name(name)
        entry = self._redis("unload", reg.lora_entries).get(name)
        if entry is None:
            limits = self.core.limits
            if limits is not None and name in limits.lora_adapters:
                raise LoRAAdminError(grpc.StatusCode.FAILED_PRECONDITION, f"lora_name: adapter {name!r} was given at "
                                     "start (--lora-modules); it is not unloaded at run time")
            raise LoRAAdminError(grpc.StatusCode.NOT_FOUND, f"The lora adapter '{name}' cannot be found.")
        with self._lock:
            self.unloading.add(name)
        try:
            self.core.refresh_workers()
            if entry.state != "unloading":
                self._redis("unload", reg.lora_update, name, LoRAEntry(path=entry.path, load_id=entry.load_id,
                                                                       state="unloading"))
            deadline = time.monotonic() + self.core.cfg.lora_update_timeout_s
            while time.monotonic() < deadline:
                if not self._running(reg, "unload").get(name) and not self.core.lora_in_flight(name):
                    break
                time.sleep(POLL_S)
            else:
                log.warning("router: LoRA adapter %r still has requests after %g s: unloading it anyway (they "
                            "finish under it where they run)", name, self.core.cfg.lora_update_timeout_s)
            self._redis("unload", reg.lora_remove, name, entry.load_id)
            while time.monotonic() < deadline:  # the workers let it go at their next heartbeat
                if not any(name in w.lora_adapters for w in self._redis("unload", reg.list)):
                    break
                time.sleep(POLL_S)
            self.core.refresh_workers()
        finally:
            with self._lock:
                self.unloading.discard(name)
        self._last_used.pop(name, None)
        log.info("router: LoRA adapter %r unloaded", name)
        return f"Success: LoRA adapter '{name}' removed successfully."
