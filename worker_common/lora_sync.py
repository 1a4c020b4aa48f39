"""A worker's LoRA adapters loaded and unloaded while it runs: it follows the cluster's runtime set in Redis.

Lifecycle: ``WorkerBase.load`` builds one ``LoRASync`` once its engine and loop run, reading the adapters the engine
started with (``--lora-modules``: never unloaded here). The worker's heartbeat (cluster/worker_actor.py) reads the
cluster's runtime set (``cluster.registry.Registry.lora_entries``: name -> path, load id, state; written by a
router's ``LoadLoRAAdapter`` / ``UnloadLoRAAdapter``, router/lora_admin.py) and hands it to ``sync``, which returns
at once: one thread of its own then brings the engine to it, each change a command on the engine loop
(``LLMEngine.add_lora`` / ``remove_lora``, between two steps): an entry not yet loaded (or loaded by an earlier
load id: reloaded) is loaded, a runtime adapter no entry names is unloaded (its running requests finish under it).
A load the engine refuses is published (``status``: the router's load call reports it) and tried again only after
``RETRY_FAILED_S``. A worker that lacks an adapter of the set takes it out of every router's service (they serve
what every live worker holds) until it loads it. Entries naming an adapter given at start are left alone. ``roots`` (name ->
prefix-cache root of what the engine serves now) is what the worker checks each request's ``lora_root`` against
and publishes; the KV event publisher's ids follow each change.

A Redis outage changes nothing here: the heartbeat hands nothing over while it cannot read the set, so the worker
keeps serving what it has.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Mapping, Optional

from proto import worker_pb2

if TYPE_CHECKING:
    from worker_common.worker_base import WorkerBase

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 600.0
"""Longest one adapter's load may hold the sync thread (it waits for the engine loop, then reads the files)."""
RETRY_FAILED_S = 30.0
"""A load the engine refused is tried again (same load id) this long after: its files may have arrived on this host
since (a volume mounted late); the router's load call has long answered, but the adapter, out of service while this
worker lacks it, comes back."""


LoRAEntry = worker_pb2.LoRARuntimeEntry
"""One adapter of the cluster's runtime set: path, load id, state ("serving" or "unloading": routers admit no new
request under it while those running finish; workers keep it loaded until the entry is gone)."""


class LoRASync:
    """One worker's side of the runtime LoRA set (see module docstring)."""

    def __init__(self, worker: "WorkerBase") -> None:
        self.worker = worker
        eng = worker.engine
        self.static = frozenset(getattr(worker.cfg.engine, "lora_modules", None) or ())
        self.roots: dict[str, int] = dict(eng.lora_adapters()) if eng is not None else {}
        """Name -> prefix-cache root of every adapter the engine serves now (read by request checks: replaced, never
        changed in place)."""
        self.loaded: dict[str, str] = {}
        """Runtime adapters loaded here -> the load id they came from."""
        self.failed: dict[str, tuple[str, str, float]] = {}
        """Name -> (load id, message, monotonic time) of loads the engine refused."""
        self._want: Optional[Mapping[str, LoRAEntry]] = None
        self._lock = threading.Lock()
        self._apply_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def sync(self, entries: Mapping[str, LoRAEntry], wait: bool = False) -> None:
        """Bring the engine to ``entries`` (the cluster's runtime set), in the background; returns at once, or, with
        ``wait``, once done (a worker starting up, before it registers: it joins serving the cluster's adapters)."""
        if not entries and not self.loaded and not self.failed:
            return  # (the common case, a cluster with no runtime adapters: no thread, no pass)
        if wait:
            self._apply(dict(entries))
            return
        with self._lock:
            self._want = dict(entries)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"lora-sync-{self.worker.cfg.worker_id}",
                                                daemon=True)
                self._thread.start()
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                want, self._want = self._want, None
            if want is None or self._stop.is_set():
                continue
            try:
                self._apply(want)
            except Exception as e:  # noqa: BLE001 - the loop stopped (worker stopping) or died: tried again next beat
                log.warning("worker %s: LoRA sync stopped: %s", self.worker.cfg.worker_id, e)

    def _apply(self, want: Mapping[str, LoRAEntry]) -> None:
        with self._apply_lock:
            self._apply_locked(want)

    def _apply_locked(self, want: Mapping[str, LoRAEntry]) -> None:
        loop = self.worker.loop
        if loop is None or not loop.alive:
            return
        changed = False
        for name in sorted(set(self.loaded) - set(want)):
            self._unload(loop, name)
            changed = True
        for name, e in sorted(want.items()):
            if name in self.static or self.loaded.get(name) == e.load_id:
                continue
            failed = self.failed.get(name)
            if failed is not None and failed[0] == e.load_id and time.monotonic() - failed[2] < RETRY_FAILED_S:
                continue
            if name in self.loaded:  # loaded again under the same name (another load id): the new weights
                self._unload(loop, name)
                changed = True
            try:
                loop.call(lambda eng, n=name, p=e.path: eng.add_lora(n, p), timeout_s=LOAD_TIMEOUT_S)
            except ValueError as err:
                self.failed[name] = (e.load_id, str(err), time.monotonic())
                log.warning("worker %s: LoRA adapter %r (load %s) refused: %s", self.worker.cfg.worker_id, name,
                            e.load_id, err)
                continue
            self.failed.pop(name, None)
            self.loaded[name] = e.load_id
            changed = True
        for name in [n for n in self.failed if n not in want]:
            del self.failed[name]
        if changed:
            def settle(eng: Any) -> dict[str, int]:
                if self.worker.kv_events is not None:
                    self.worker.kv_events.lora_roots = eng.lora_event_ids()
                return eng.lora_adapters()

            self.roots = dict(loop.call(settle, timeout_s=LOAD_TIMEOUT_S))
            self.worker.ctx.lora_roots = self.roots
            log.info("worker %s: LoRA adapters served: %s", self.worker.cfg.worker_id, sorted(self.roots) or "none")

    def _unload(self, loop: Any, name: str) -> None:
        """Unload a runtime adapter: requests naming it are refused here first (``roots``), then the engine lets it go
        (those running finish under it)."""
        self.roots = {n: r for n, r in self.roots.items() if n != name}
        self.worker.ctx.lora_roots = self.roots
        try:
            loop.call(lambda eng: eng.remove_lora(name), timeout_s=LOAD_TIMEOUT_S)
        except ValueError as e:  # (not served there: nothing to let go)
            log.warning("worker %s: LoRA adapter %r not unloaded: %s", self.worker.cfg.worker_id, name, e)
        del self.loaded[name]

    def status(self) -> list[worker_pb2.LoRAStatus]:
        """What ``WorkerInfo.lora_status`` publishes: each adapter served (with the requests held under it) and each
        refused load."""
        if not self.roots and not self.failed:
            return []  # (no adapter: no pass over the requests, which info() would pay every heartbeat)
        running: dict[str, int] = {}
        for rs in self.worker.request_sets:
            for r in rs.snapshot().values():
                name = getattr(getattr(r, "params", None), "lora_name", None)
                if name is not None:
                    running[name] = running.get(name, 0) + 1
        out = [worker_pb2.LoRAStatus(name=n, key_root=root, load_id=self.loaded.get(n, ""),
                                     running=running.get(n, 0))
               for n, root in sorted(self.roots.items())]
        out += [worker_pb2.LoRAStatus(name=n, load_id=lid, error=msg)
                for n, (lid, msg, _) in sorted(self.failed.items())]
        return out
