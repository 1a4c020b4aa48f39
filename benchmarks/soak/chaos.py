"""The soak's faults: a private Redis it can kill and restart, worker kills, and RSS sampling.

Lifecycle: ``spawned_redis()`` starts the soak's Redis (``EmbeddedRedis`` with ``spawn=True``) before the
cluster; ``Chaos(ns, cluster, supervisor, redis)`` owns it from then on. ``start(t0)`` (t0: the load's clock)
starts two daemon threads: the fault thread follows ``schedule()`` (a random worker ``kill -9`` every
``--kill-every-s``, Redis once, halfway, restarted empty on the same port with the same password after
``--redis-down-s``) and after each fault waits, bounded by ``--recover-timeout-s``, until the cluster is whole
again; the sampler records the RSS of this process, every worker actor and Redis, and what Redis holds, every
``--rss-every-s``. ``join()`` stops both; ``faults``, ``rss`` and ``redis_stats`` hold what happened, and
``redis`` the live incarnation (the caller stops it).
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import threading
import time
from collections import defaultdict
from typing import Any, Optional

import psutil

log = logging.getLogger("soak")


# ---- Redis: started by posix_spawn, never fork ------------------------------------------------------------
def spawned_redis(port: int = 0, password: Optional[str] = None) -> Any:
    """An ``EmbeddedRedis`` on loopback launched without fork() (``spawn=True``): forking a process with live
    gRPC threads (the router, Ray's core worker) crashed the child in the smoke run ("Check failed:
    next_worker->state == KICKED", SIGABRT), and the parent-death signal would stop the restarted server when
    the fault thread that started it ends. ``password``: the old server's, for a restart its clients survive."""
    from cluster.redis_server import EmbeddedRedis, RedisServerConfig

    return EmbeddedRedis(RedisServerConfig(host="127.0.0.1", port=port, password=password, spawn=True)).start()


# ---- faults and RSS --------------------------------------------------------------------------------------
class Chaos:
    """Owns the Redis process and injects the faults; samples RSS on a second thread."""

    def __init__(self, ns: argparse.Namespace, cluster: Any, supervisor: Any, redis_srv: Any) -> None:
        self.ns, self.cluster, self.supervisor, self.redis = ns, cluster, supervisor, redis_srv
        self.port = redis_srv.port
        self.rng = random.Random(ns.seed)
        self.faults: list[dict] = []
        self.rss: dict[str, list[tuple[float, int]]] = defaultdict(list)
        self.redis_stats: list[tuple[float, int, int, int]] = []
        """(t, redis incarnation, used_memory bytes, keys): what Redis holds, beside its RSS."""
        self._redis_client: Any = None
        self.pids: dict[str, int] = {}
        self.redis_incarnation = 1
        self.stop = threading.Event()
        self.t0 = 0.0
        self._threads: list[threading.Thread] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def members(self) -> list[tuple[str, str, Any]]:
        return [(role, wid, h) for role in ("prefill", "decode") for wid, h in self.cluster.members(role)]

    def worker_pid(self, wid: str, handle: Any) -> Optional[int]:
        import ray

        if wid not in self.pids:
            try:
                self.pids[wid] = int(ray.get(handle.pid.remote(), timeout=10))
            except Exception:
                return None
        return self.pids[wid]

    def sample_rss(self) -> None:
        t = self.now()
        procs = {"router (this process)": os.getpid(), f"redis#{self.redis_incarnation}": self.redis.pid}
        for _, wid, h in self.members():
            pid = self.worker_pid(wid, h)
            if pid:
                procs[f"{wid} (pid {pid})"] = pid
        for name, pid in procs.items():
            if not pid:  # Redis between kill and restart: psutil.Process(None) would be this process
                continue
            try:
                self.rss[name].append((round(t, 1), psutil.Process(pid).memory_info().rss))
            except (psutil.NoSuchProcess, TypeError):
                pass
        try:
            import redis as redis_py

            if self._redis_client is None or self._redis_client[0] != self.redis_incarnation:
                self._redis_client = (self.redis_incarnation, redis_py.Redis.from_url(self.redis.url, socket_timeout=2))
            r = self._redis_client[1]
            self.redis_stats.append((round(t, 1), self.redis_incarnation, int(r.info("memory")["used_memory"]),
                                     int(r.dbsize())))
        except Exception:  # Redis down (a fault): no sample
            pass

    def start(self, t0: float) -> None:
        self.t0 = t0
        self.t0_wall = time.time()
        for target, name in ((self._faults, "soak-faults"), (self._sampler, "soak-rss")):
            th = threading.Thread(target=target, name=name, daemon=True)
            th.start()
            self._threads.append(th)

    def join(self) -> None:
        self.stop.set()
        for th in self._threads:
            th.join(timeout=self.ns.recover_timeout_s + 30)

    def _sampler(self) -> None:
        while not self.stop.is_set():
            try:
                self.sample_rss()
            except Exception as e:
                log.warning("rss sample failed: %s", e)
            self.stop.wait(self.ns.rss_every_s)

    def schedule(self) -> list[tuple[float, str]]:
        ev = [(k * self.ns.kill_every_s, "worker") for k in range(1, int(self.ns.duration_s // self.ns.kill_every_s) + 1)
              if k * self.ns.kill_every_s < self.ns.duration_s - 10]
        if not self.ns.no_redis_kill:
            half = self.ns.duration_s / 2
            # never in the same second as a worker kill: each fault is judged alone
            if any(abs(t - half) < 20 for t, _ in ev):
                half += min(self.ns.kill_every_s / 2, 30)
            ev.append((half, "redis"))
        return sorted(ev)

    def _faults(self) -> None:
        for at, kind in self.schedule():
            if self.stop.wait(max(0.0, at - self.now())):
                return
            try:
                self.faults.append(self.kill_worker() if kind == "worker" else self.kill_redis())
            except Exception as e:
                log.exception("fault %s failed", kind)
                self.faults.append({"kind": kind, "t_s": round(self.now(), 1), "error": repr(e), "survived": False})
            f = self.faults[-1]
            print(f"  [{f['t_s']:6.1f} s] fault: {f.get('what', kind)}; survived={f.get('survived')} "
                  f"recovery {f.get('recovery_s')} s", flush=True)

    def _wait(self, cond: Any, timeout_s: float) -> Optional[float]:
        start = time.perf_counter()
        while time.perf_counter() - start < timeout_s:
            try:
                if cond():
                    return round(time.perf_counter() - start, 2)
            except Exception:
                pass
            time.sleep(0.2)
        return None

    def kill_worker(self) -> dict:
        role, wid, handle = self.rng.choice(self.members())
        pid = self.worker_pid(wid, handle)
        self.sample_rss()  # its last RSS before it dies
        t = self.now()
        os.kill(pid, signal.SIGKILL)
        n_before = len(self.supervisor.replacements)

        def healed() -> bool:
            reps = [r for r in self.supervisor.replacements[n_before:] if wid in r[2]]
            if not reps or not reps[-1][3]:
                return False
            listed = {w.worker_id for w in self.cluster.registry.list(role) if w.ready}
            return set(reps[-1][3]) <= listed

        rec = self._wait(healed, self.ns.recover_timeout_s)
        reps = [r for r in self.supervisor.replacements[n_before:] if wid in r[2]]
        return {"kind": "worker", "t_s": round(t, 1), "what": f"kill -9 {role} worker {wid} (pid {pid})",
                "role": role, "worker_id": wid, "pid": pid, "replaced_by": reps[-1][3] if reps else [],
                "recovery_s": rec, "survived": rec is not None}

    def kill_redis(self) -> dict:
        old_pid, password = self.redis.pid, self.redis.password
        self.sample_rss()
        t = self.now()
        os.kill(old_pid, signal.SIGKILL)
        self.redis.stop()  # reaps the dead process, removes its dir
        time.sleep(self.ns.redis_down_s)
        self.redis = spawned_redis(self.port, password)
        self.redis_incarnation += 1
        t_up = self.now()

        def back() -> bool:
            want = {wid for _, wid, _ in self.members()}
            return want <= {w.worker_id for w in self.cluster.registry.list() if w.ready}

        rec = self._wait(back, self.ns.recover_timeout_s)
        return {"kind": "redis", "t_s": round(t, 1), "what": f"kill -9 redis (pid {old_pid}), restarted on port "
                f"{self.port} after {t_up - t:.1f} s (pid {self.redis.pid})", "down_s": round(t_up - t, 2),
                "recovery_s": rec, "survived": rec is not None}
