"""The deployment soak's faults and sampling: ``Chaos`` injects a shuffled cycle of kills, restarts and
SIGSTOPs every ``--fault-every-s``, measures each one's recovery, and samples every process's RSS and Redis.

Lifecycle: ``Chaos.start`` runs the fault and sampler threads beside the load; ``Chaos.stop`` ends them and
leaves the fault list and RSS samples for the report.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import threading
import time
from collections import defaultdict

import psutil

from benchmarks.soak.stack import Deployment, Proc, _engine_child, _wait


FAULTS = ("kill_decode", "kill_prefill", "kill_router", "kill_controller", "kill_redis", "kill_gcs", "stop_worker")
"""The cycle without a colocated deployment (as in the 26 Nov runs)."""
COLOCATED_FAULTS = ("kill_colocated", "kill_engine")
"""Added to the cycle with ``--colocated``."""
OPT_IN_FAULTS: tuple[str, ...] = ()
"""Drawn only when named in ``--faults`` (none now)."""
ALL_FAULTS = FAULTS + COLOCATED_FAULTS + OPT_IN_FAULTS
# ---- faults and sampling ----------------------------------------------------------------------------------
class Chaos:
    """The fault thread and the sampler thread (module docstring)."""

    def __init__(self, dep: Deployment, ns: argparse.Namespace) -> None:
        self.dep, self.ns = dep, ns
        self.rng = random.Random(ns.seed)
        self.faults: list[dict] = []
        self.exits: list[dict] = []
        """Routers or controllers that exited on their own (restarted by ``_orchestrator``)."""
        self.rss: dict[str, list] = defaultdict(list)
        self.redis_stats: list = []
        self.stop = threading.Event()
        self.t0 = 0.0
        self._threads: list[threading.Thread] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def start(self, t0: float) -> None:
        self.t0 = t0
        for target in (self._fault_loop, self._sampler, self._orchestrator):
            t = threading.Thread(target=target, daemon=True, name=target.__name__)
            t.start()
            self._threads.append(t)

    def join(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=self.ns.recover_timeout_s + 60)

    def _orchestrator(self) -> None:
        """What a Deployment does: a router or controller that exits on its own (not killed by a fault) is
        restarted after ``--restart-after-s``; each such exit is recorded in ``exits``."""
        while not self.stop.wait(1.0):
            for proc in [*self.dep.routers, *self.dep.controllers]:
                if proc.held or proc.alive() or proc.popen is None:
                    continue
                rc = proc.popen.returncode
                tail = proc.log.read_text(errors="replace")[-400:] if proc.log else ""
                t = self.now()
                if self.stop.wait(self.ns.restart_after_s):
                    return
                proc.start()
                self.exits.append({"t_s": round(t, 1), "process": proc.name, "rc": rc, "log_tail": tail})
                print(f"  [{t:6.0f} s] {proc.name} exited (rc {rc}); restarted", flush=True)

    def _sampler(self) -> None:
        import redis as redis_py

        while True:
            t = self.now()
            for name, pid in self.dep.processes().items():
                try:
                    self.rss[name].append((t, psutil.Process(pid).memory_info().rss))
                except psutil.Error:
                    pass
            try:
                c = redis_py.Redis.from_url(self.dep.redis.url, socket_timeout=2)
                self.redis_stats.append((t, self.dep.redis_incarnation, c.info("memory")["used_memory"], c.dbsize()))
                c.close()
            except Exception:
                pass
            if self.stop.wait(self.ns.rss_every_s):
                return

    def _fault_loop(self) -> None:
        kinds = [k for k in self.ns.faults.split(",") if k]
        cycle: list[str] = []
        n = 0
        while not self.stop.wait(max(0.0, (n + 1) * self.ns.fault_every_s - self.now())):
            if self.now() > self.ns.duration_s - 10:
                return
            if not cycle:
                cycle = kinds[:]
                self.rng.shuffle(cycle)
            kind = cycle.pop()
            n += 1
            t = self.now()
            try:
                info = getattr(self, kind)()
            except Exception as e:  # a fault that could not be injected is reported, the soak goes on
                info = {"error": f"{type(e).__name__}: {e}"}
            gone = info.get("victim", "") if kind in ("kill_decode", "kill_prefill", "kill_colocated") else ""
            since = info.get("resumed_at", 0.0)
            back = (lambda: self.engine_back(info)) if kind == "kill_engine" and "victim" in info else (lambda: True)
            healed = _wait(lambda: back() and self.dep.whole(gone, since), self.ns.recover_timeout_s, 0.5)
            rec = {"t_s": round(t, 1), "kind": kind, **info,
                   "recovered_s": None if healed is None else round(self.now() - t, 1)}
            self.faults.append(rec)
            print(f"  [{t:6.0f} s] {kind}: {info} -> whole again after {rec['recovered_s']} s", flush=True)

    def _kill_role(self, role: str) -> dict:
        victims = [w for w in self.dep.workers(role) if w.ready]
        w = self.rng.choice(victims)
        pid = self.dep.worker_pid(w)
        os.kill(pid, signal.SIGKILL)
        return {"victim": w.worker_id, "pid": pid}

    def kill_decode(self) -> dict:
        return self._kill_role("decode")

    def kill_prefill(self) -> dict:
        return self._kill_role("prefill")

    def kill_colocated(self) -> dict:
        return self._kill_role("colocated")

    def kill_engine(self) -> dict:
        """kill -9 of a colocated worker's engine process (``--engine-process``), the worker left alive."""
        w = self.rng.choice([w for w in self.dep.workers("colocated") if w.ready])
        pid = self.dep.worker_pid(w)
        child = _engine_child(pid) if pid else None
        if child is None:
            raise RuntimeError(f"{w.worker_id} (pid {pid}) has no engine process (--no-engine-process?)")
        os.kill(child, signal.SIGKILL)
        return {"victim": w.worker_id, "pid": child, "worker_pid": pid}

    def engine_back(self, info: dict) -> bool:
        """After ``kill_engine``: the victim left the registry (replaced) or runs a new engine process. (Its own
        record is no guide: on 29 Nov a worker whose engine process died went on reporting ready.)"""
        if not any(w.worker_id == info["victim"] for w in self.dep.workers("colocated")):
            return True
        child = _engine_child(info["worker_pid"])
        return child is not None and child != info["pid"]

    def _kill_restart(self, proc: Proc) -> dict:
        """kill -9, then restarts as an orchestrator would: after ``--restart-after-s``, and again (5 s later) each
        time the new process exits before it is ready (a crash loop), until ``--recover-timeout-s``."""
        proc.held = True
        try:
            return self._kill_restart_held(proc)
        finally:
            proc.held = False

    def _kill_restart_held(self, proc: Proc) -> dict:
        pid = proc.popen.pid
        proc.kill()
        starts, deadline = 0, time.monotonic() + self.ns.recover_timeout_s
        time.sleep(self.ns.restart_after_s)  # the orchestrator's restart delay, by design
        while True:
            proc.start()
            starts += 1
            _wait(lambda: proc.ready() or not proc.alive(), max(1.0, deadline - time.monotonic()), 0.25)
            if proc.alive() or time.monotonic() > deadline:
                break
            time.sleep(5.0)  # back-off before the next start, by design
        out = {"victim": proc.name, "pid": pid, "starts": starts}
        if starts > 1:
            out["failed_starts"] = [p.read_text(errors="replace")[-300:] for p in
                                    sorted(self.dep.logs.glob(f"{proc.name}.*.log"))[-starts:-1]]
        return out

    def kill_router(self) -> dict:
        return self._kill_restart(self.rng.choice(self.dep.routers))

    def kill_controller(self) -> dict:
        return self._kill_restart(self.rng.choice(self.dep.controllers))

    def kill_redis(self) -> dict:
        pid, port, password = self.dep.redis.pid, self.dep.redis.port, self.dep.redis.password
        os.kill(pid, signal.SIGKILL)
        self.dep.redis.stop()  # reaps the dead process, removes its dir
        time.sleep(self.ns.restart_after_s)
        self.dep.restart_redis(port, password)
        return {"victim": "redis", "pid": pid}

    def kill_gcs(self) -> dict:
        pid = self.dep.head.gcs().pid
        self.dep.head.kill_gcs()
        time.sleep(self.ns.restart_after_s)
        self.dep.head.restart_gcs()
        return {"victim": "gcs", "pid": pid}

    def stop_worker(self) -> dict:
        w = self.rng.choice([w for w in self.dep.workers() if w.ready])
        pid = self.dep.worker_pid(w)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(self.ns.stop_s)  # the hang's length, by design
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:  # replaced (killed) by the supervisor meanwhile
                pass
        return {"victim": w.worker_id, "pid": pid, "stopped_s": self.ns.stop_s, "resumed_at": time.time()}
