"""The router's view of the worker pools: refreshed in the background, never a Redis call per request.

Lifecycle: ``RouterCore`` wraps the ``WorkerList`` it is given in a ``WorkerView`` (the
``WorkerSource`` placement reads) and ``start()``s it at load. For a remote source (the Redis ``Registry``: any source not marked ``in_process``) a daemon thread
re-reads every role each ``refresh_s`` and swaps in the new snapshot; requests read the
snapshot (``list(role)``), so a burst costs Redis nothing and a Redis outage does not stop
serving: the last good view stays in use (logged once per outage, with backoff between
retries) until Redis answers again; for ``rejoin_grace_s`` after that, workers the new
answer does not list yet are kept (a restarted, empty Redis hears from each live worker
at its next heartbeat). An in-process source (``StaticWorkerSource``, whose
``list`` asks live worker objects) is read directly, since it costs no round trip.

``suspect(worker_id)`` takes a worker out of routing at once when a call to it fails as if
it were gone (UNAVAILABLE): it stays hidden until a record newer than the failure arrives
(a live worker's next heartbeat), so a dead worker leaves routing without waiting for its
registry key's TTL, and a live one that hiccupped comes back within a heartbeat.
The cluster's runtime LoRA set (``lora_entries``, router/lora_admin.py) is read with the pools, when the source has
one.
``stop()`` ends the thread.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from proto.worker_pb2 import WorkerInfo
from router.worker_source import ROLES, WorkerList

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 5.0


class WorkerView:
    """A ``WorkerSource`` served from memory (see module docstring)."""

    def __init__(self, source: WorkerList, refresh_s: float = 0.25, rejoin_grace_s: float = 5.0) -> None:
        """``rejoin_grace_s``: after an outage, how long workers of the last good view that the source does not
        list yet stay routable (a restarted, empty Redis learns of live workers one heartbeat at a time)."""
        if not refresh_s > 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s!r}")
        if not rejoin_grace_s >= 0:
            raise ValueError(f"rejoin_grace_s must be >= 0, got {rejoin_grace_s!r}")
        self.rejoin_grace_s = rejoin_grace_s
        self._back_at: Optional[float] = None  # when the source answered again after an outage
        self.source = source
        self.refresh_s = refresh_s
        self.background = not getattr(source, "in_process", False)
        """True: snapshots refreshed by a thread; False: ``list`` reads the source directly."""
        self._lock = threading.Lock()
        self._snapshot: dict[str, list[WorkerInfo]] = {r: [] for r in ROLES}
        self._suspects: dict[str, float] = {}  # worker id -> wall time its call failed
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.last_refresh = 0.0
        """time.monotonic() of the last successful refresh (0: none yet)."""
        self.last_error: Optional[str] = None
        """Why the last refresh failed (None once one succeeds again)."""
        self.lora_entries: dict = {}
        """The cluster's runtime LoRA adapters (``Registry.lora_entries``: name -> entry), read with the pools."""

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "WorkerView":
        if self.background and self._thread is None:
            self.refresh()
            self._thread = threading.Thread(target=self._run, name="router-worker-view", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        wait = self.refresh_s
        while not self._stop.wait(wait):
            wait = self.refresh_s if self.refresh() else min(_MAX_BACKOFF_S, max(wait * 2, self.refresh_s))

    def refresh(self) -> bool:
        """Re-read every role from the source; False (and the old view kept) if the source failed."""
        try:
            snap = {r: list(self.source.list(r)) for r in ROLES}
            lora_entries = getattr(self.source, "lora_entries", None)
            lora = dict(lora_entries()) if lora_entries is not None else {}
        except Exception as e:  # any client error: keep serving from the last view
            if self.last_error is None:
                log.warning("worker view: source unavailable, routing from the last view: %s", type(e).__name__)
            self.last_error = f"{type(e).__name__}: {e}"
            return False
        now = time.monotonic()
        if self.last_error is not None:
            log.info("worker view: source is back")
            self._back_at = now
        with self._lock:
            if self._back_at is not None and now - self._back_at < self.rejoin_grace_s:
                # a restarted registry may not list live workers until their next heartbeat: keep the ones
                # the last good view had (a call that fails still takes one out, through suspect())
                for role in ROLES:
                    seen = {w.worker_id for w in snap[role]}
                    snap[role] += [w for w in self._snapshot[role] if w.worker_id not in seen]
            else:
                self._back_at = None
            self._snapshot = snap
            self.lora_entries = lora
            self.last_error = None
            self.last_refresh = time.monotonic()
        return True

    # ---- reads -------------------------------------------------------------------------------
    def list(self, role: str) -> list[WorkerInfo]:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if self.background:
            with self._lock:
                workers = list(self._snapshot[role])
        else:
            workers = self.source.list(role)
        with self._lock:
            if not self._suspects:
                return workers
            suspects = dict(self._suspects)
        out = []
        for w in workers:
            since = suspects.get(w.worker_id)
            if since is not None and w.updated_at <= since:
                continue
            out.append(w)
        return out

    def max_model_len(self) -> int:
        """The shortest context length a listed worker publishes (``WorkerInfo.max_model_len``); 0 when none
        does (no workers yet, or workers older than the field)."""
        lens = [w.max_model_len for role in ROLES for w in self.list(role) if w.max_model_len > 0]
        return min(lens, default=0)

    def lora_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters every listed worker publishes (``WorkerInfo.lora_adapters``), sorted: a request for one
        of them can go to any worker. () with no workers. An adapter whose workers publish different weights
        (``LoRAStatus.key_root``: reloaded, some workers not yet) is left out until they agree."""
        return tuple(sorted(self.lora_roots()))

    def lora_roots(self) -> dict[str, int]:
        """``lora_adapters``, each with the prefix-cache root its workers publish (0 where they publish none)."""
        common: Optional[dict[str, int]] = None
        for role in ROLES:
            for w in self.list(role):
                roots = {s.name: s.key_root for s in w.lora_status if not s.error}
                mine = {n: roots.get(n, 0) for n in w.lora_adapters}
                common = mine if common is None else {n: r for n, r in common.items() if mine.get(n) == r}
        return common or {}

    def suspect(self, worker_id: str) -> None:
        """A call to ``worker_id`` failed as if it were gone: hide it until a newer record arrives."""
        with self._lock:
            self._suspects[worker_id] = time.time()
            # forget suspects whose records are long gone (bounded memory)
            cutoff = time.time() - 600.0
            for wid in [w for w, t in self._suspects.items() if t < cutoff]:
                del self._suspects[wid]
        log.info("worker %s: call failed as if it were gone; out of routing until it heartbeats", worker_id)
