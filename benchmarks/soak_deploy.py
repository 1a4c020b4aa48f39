"""Chaos soak of the deployment shape (issue 30 item 2): ``python benchmarks/soak.py --deployment ...``.

Lifecycle: ``main(argv)`` starts, each as its own process on this machine: the deployment's Redis (kill -9 and
restart target) and a second Redis that holds only Ray's GCS tables (Ray passes its Redis password on the GCS's
command line, so it gets a Redis of its own); a Ray head with GCS fault tolerance on that Redis (no CPUs) and one
worker node (a second raylet, ``--worker-cpus``); ``pdserve controller --address`` (``--prefill`` + ``--decode``
detached workers, its supervisor) and two ``pdserve router`` on fixed free ports, all sharing the namespace and a
cluster secret (passed in the environment, never in argv). Then a trace-driven load (``--trace``, gaps rescaled to
``--rate``, lengths x ``--length-scale``; greedy, ``ignore_eos``) is sent by client threads that behave like real
clients: a request that fails before its first token with UNAVAILABLE or RESOURCE_EXHAUSTED is retried with
exponential backoff (0.25 s doubling, at most ``--client-retries`` times), through the other router on UNAVAILABLE
(its router is gone). Every ``--fault-every-s`` a fault thread injects the next of a shuffled cycle of: kill -9 of a
decode worker, of a prefill worker, of a router (restarted on its port after ``--restart-after-s``, as a
Deployment would), of the controller (restarted likewise; the new one waits for the lease and adopts), of Redis
(restarted empty on its port), of the GCS (restarted with its own arguments, reloading from its Redis), and
SIGSTOP of a random worker for ``--stop-s`` (then SIGCONT). After each it measures the time until the deployment
is whole again (2 routers SERVING, the controller up, ``--prefill`` + ``--decode`` ready and fresh workers in the
registry, the GCS up). A sampler records every process's RSS and Redis's memory and key count.

At the end: the load stops, in-flight requests finish, the workers' KV blocks must all come back (waited on,
bounded), Redis keys are counted; then routers and controller get SIGTERM, ``pdserve down`` removes the workers,
and the namespace's keys left are counted. Requests are classified (served; lost with the reason: the router
died under it, an error after tokens, retries exhausted), duplicated tokens are counted (more tokens than asked,
or a sample's tokens differing from the offline engine's), per-window p99 TTFT/ITL computed, and JSON, a log
per process and an RSS plot written beside ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import grpc
import psutil

REPO = Path(__file__).resolve().parents[1]
FAULTS = ("kill_decode", "kill_prefill", "kill_router", "kill_controller", "kill_redis", "kill_gcs", "stop_worker")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


def add_args(ap: argparse.ArgumentParser) -> None:
    """The flags of ``--deployment`` (``--rate`` is soak.py's; this mode needs it)."""
    ap.add_argument("--fault-every-s", type=float, default=120.0, help="a fault this often")
    ap.add_argument("--faults", default=",".join(FAULTS), help="comma-separated fault kinds drawn from")
    ap.add_argument("--restart-after-s", type=float, default=5.0, help="a killed router/controller/Redis/GCS "
                    "is restarted this long after its kill")
    ap.add_argument("--stop-s", type=float, default=10.0, help="SIGSTOP length")
    ap.add_argument("--client-retries", type=int, default=6, help="retries of a request before its first token")
    ap.add_argument("--worker-cpus", type=int, default=4, help="CPUs the Ray worker node offers")
    ap.add_argument("--num-kv-blocks", type=int, default=256, help="KV blocks per worker")


@dataclass
class Rec:
    """One client request, as the client saw it (times from the load's start)."""

    i: int
    max_tokens: int
    t_send: float
    t_first: Optional[float] = None
    t_end: Optional[float] = None
    chunk_times: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    finish: str = ""
    error: str = ""
    attempts: int = 0
    routers: list = field(default_factory=list)
    """The routers tried, in order (0 or 1)."""
    failed_on: Optional[int] = None
    """The router the request was lost on."""

    @property
    def ok(self) -> bool:
        return bool(self.finish) and not self.error


# ---- processes --------------------------------------------------------------------------------------------
def _pdserve() -> list[str]:
    script = Path(sys.executable).parent / "pdserve"
    return [str(script)] if os.access(script, os.X_OK) else [sys.executable, "-m", "cluster.cli"]


class Proc:
    """One pdserve process (router or controller); restartable; its output in a log file per incarnation."""

    def __init__(self, name: str, argv: list[str], env: dict, logs: Path, banner: str) -> None:
        self.name, self.argv, self.env, self.logs, self.banner = name, argv, env, logs, banner
        self.incarnation = 0
        self.popen: Optional[subprocess.Popen] = None
        self.log: Optional[Path] = None
        self.held = False
        """True while a fault owns its restart (the orchestrator thread leaves it alone)."""

    def start(self) -> "Proc":
        self.incarnation += 1
        self.log = self.logs / f"{self.name}.{self.incarnation}.log"
        with open(self.log, "w") as f:
            self.popen = subprocess.Popen([*_pdserve(), *self.argv], cwd=REPO, env=self.env, stdout=f,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def ready(self) -> bool:
        return self.alive() and self.log is not None and self.banner in self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
            self.popen.wait(30)

    def terminate(self, timeout: float = 60) -> Optional[int]:
        if not self.alive():
            return None if self.popen is None else self.popen.returncode
        self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait(30)

    def banner_value(self, pattern: str) -> Optional[str]:
        import re

        m = re.search(pattern, self.log.read_text(errors="replace")) if self.log else None
        return m.group(1) if m else None


def _free_port() -> int:
    from cluster.redis_server import pick_free_port

    return pick_free_port("127.0.0.1")


def _listening_pid(port: int) -> Optional[int]:
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return c.pid
    return None


def _health(address: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _wait(cond: Callable[[], Any], timeout: float, interval: float = 0.25) -> Optional[float]:
    """Seconds until ``cond()`` held, or None after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if cond():
                return time.monotonic() - t0
        except Exception:  # not yet (a server not listening, Redis down)
            pass
        time.sleep(interval)
    return None


# ---- the deployment ---------------------------------------------------------------------------------------
class Deployment:
    """Redis x2, Ray head + worker node, controller, two routers (module docstring)."""

    def __init__(self, ns: argparse.Namespace, out_dir: Path) -> None:
        from soak_chaos import spawned_redis

        from ray_head import FaultTolerantHead

        self.ns = ns
        self.logs = out_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.namespace = f"soakdep-{uuid.uuid4().hex[:6]}"
        self.redis = spawned_redis()
        self.redis_incarnation = 1
        self.gcs_redis = spawned_redis()
        self.head = FaultTolerantHead(self.gcs_redis.url, self.namespace)
        self.env = dict(self.head.env, PDSERVE_REDIS_URL=self.redis.url,
                        PDSERVE_CLUSTER_SECRET=secrets.token_urlsafe(32), OMP_NUM_THREADS="1",
                        RAY_DEDUP_LOGS="0")
        self.registry: Any = None
        self.router_ports = [_free_port(), _free_port()]
        self.routers: list[Proc] = []
        self.controller: Optional[Proc] = None

    def start(self) -> None:
        from cluster.registry import Registry

        self.head.start()
        self.head.add_node({"prefill": 1, "decode": 1}, cpus=self.ns.worker_cpus)
        pool = ["controller", "--address", self.head.address, "--namespace", self.namespace, "--model",
                self.ns.model, "--prefill", str(self.ns.prefill), "--decode", str(self.ns.decode),
                "--num-kv-blocks", str(self.ns.num_kv_blocks), "--check-interval", "0.5"]
        self.controller = Proc("controller", pool, self.env, self.logs, "pdserve CONTROLLING").start()
        if _wait(self.controller.ready, 600) is None:
            raise RuntimeError(f"controller did not start: {self.controller.log.read_text()[-3000:]}")
        for k, port in enumerate(self.router_ports):
            self.routers.append(Proc(f"router-{'ab'[k]}", ["router", "--namespace", self.namespace, "--model",
                                                            self.ns.model, "--port", str(port), "--http-port", "0"],
                                     self.env, self.logs, "pdserve SERVING").start())
        for r in self.routers:
            if _wait(r.ready, 300) is None:
                raise RuntimeError(f"{r.name} did not start: {r.log.read_text()[-3000:]}")
        self.registry = Registry(self.redis.url, self.namespace)

    @property
    def targets(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.router_ports]

    def workers(self, role: Optional[str] = None) -> list:
        return self.registry.list(role)

    def worker_pid(self, info: Any) -> Optional[int]:
        return _listening_pid(int(info.grpc_address.rpartition(":")[2]))

    def whole(self, gone: str = "", since: float = 0.0) -> bool:
        """Everything serving again; ``gone``: a worker id that must have left the registry (a killed one);
        ``since``: unix time every counted worker's record must be newer than (after a SIGSTOP)."""
        now = time.time()
        fresh = [w for w in self.workers() if w.ready and now - w.updated_at < 5 and w.updated_at > since]
        if gone and any(w.worker_id == gone for w in self.workers()):
            return False
        roles = Counter(w.role for w in fresh)
        return (roles["prefill"] >= self.ns.prefill and roles["decode"] >= self.ns.decode
                and self.controller.ready() and all(_health(t) for t in self.targets)
                and self.head.gcs() is not None)

    def processes(self) -> dict[str, int]:
        """name -> pid of every process of the deployment now."""
        out: dict[str, int] = {}
        for r in self.routers:
            if r.alive():
                out[f"{r.name}#{r.incarnation}"] = r.popen.pid
        if self.controller.alive():
            out[f"controller#{self.controller.incarnation}"] = self.controller.popen.pid
        try:
            for w in self.workers():
                pid = self.worker_pid(w)
                if pid:
                    out[w.worker_id] = pid
        except Exception:  # Redis down: the workers are sampled next time
            pass
        if self.redis.pid:
            out[f"redis#{self.redis_incarnation}"] = self.redis.pid
        if self.gcs_redis.pid:
            out["gcs-redis"] = self.gcs_redis.pid
        gcs = self.head.gcs()
        if gcs is not None:
            out["gcs"] = gcs.pid
        return out

    def restart_redis(self, port: int, password: str) -> None:
        """A new Redis on the killed one's ``port``, with its ``password`` (read them before its ``stop()``)."""
        from soak_chaos import spawned_redis

        self.redis = spawned_redis(port, password)
        self.redis_incarnation += 1

    def stop(self, res: dict) -> None:
        import redis as redis_py

        for r in self.routers:
            res.setdefault("exit_codes", {})[r.name] = r.terminate()
        if self.controller is not None:
            res.setdefault("exit_codes", {})["controller"] = self.controller.terminate()
        down = subprocess.run([*_pdserve(), "down", "--address", self.head.address, "--namespace", self.namespace],
                              cwd=REPO, env=self.env, capture_output=True, text=True, timeout=300)
        res["down"] = {"rc": down.returncode, "stdout": down.stdout[-2000:]}
        try:
            c = redis_py.Redis.from_url(self.redis.url)
            res["redis_keys_left_after_down"] = sorted(k.decode() for k in c.scan_iter(match=f"{self.namespace}:*"))
            c.close()
        except Exception as e:
            res["redis_keys_left_after_down"] = f"unreadable: {e}"
        if self.registry is not None:
            self.registry.close()
        self.head.close()
        self.redis.stop()
        self.gcs_redis.stop()


# ---- the client -------------------------------------------------------------------------------------------
class Client:
    """Sends each request at its time on a thread pool; retries before the first token, fails over routers."""

    def __init__(self, targets: list[str], timeout_s: float, retries: int, seed: int) -> None:
        from proto import pdserve_pb2, pdserve_pb2_grpc

        self.pb, self.targets, self.timeout_s, self.retries = pdserve_pb2, targets, timeout_s, retries
        self.channels = [grpc.insecure_channel(t) for t in targets]
        self.stubs = [pdserve_pb2_grpc.PDServeStub(c) for c in self.channels]
        self.rng = random.Random(seed)
        self.recs: list[Rec] = []

    def run(self, reqs: list, t0: float, stop: threading.Event) -> None:
        with ThreadPoolExecutor(max_workers=96, thread_name_prefix="client") as pool:
            for i, q in enumerate(reqs):
                delay = t0 + q.arrival_s - time.perf_counter()
                if delay > 0 and stop.wait(delay):
                    break
                rec = Rec(i, q.max_tokens, time.perf_counter() - t0)
                self.recs.append(rec)
                pool.submit(self._one, q, rec, t0, i % len(self.stubs))

    def _one(self, q: Any, rec: Rec, t0: float, k: int) -> None:
        req = self.pb.GenerateRequest(token_ids=q.prompt_token_ids, max_tokens=q.max_tokens, temperature=0.0,
                                      ignore_eos=True)
        for attempt in range(self.retries + 1):
            rec.attempts += 1
            rec.routers.append(k)
            try:
                for msg in self.stubs[k].Generate(req, timeout=self.timeout_s):
                    now = time.perf_counter() - t0
                    if msg.token_ids:
                        rec.t_first = rec.t_first if rec.t_first is not None else now
                        rec.chunk_times.append(now)
                        rec.tokens.extend(msg.token_ids)
                    if msg.finish_reason:
                        rec.finish = msg.finish_reason
                rec.t_end = time.perf_counter() - t0
                return
            except grpc.RpcError as e:
                code = e.code()
                if not rec.tokens and code in RETRYABLE and attempt < self.retries:
                    if code == grpc.StatusCode.UNAVAILABLE:
                        k = 1 - k  # its router may be gone: the other one
                    time.sleep(min(8.0, 0.25 * 2 ** attempt) * (0.5 + self.rng.random()))
                    continue
                rec.error = f"{code.name}: {(e.details() or '')[:160]}"
                rec.failed_on = k
                rec.t_end = time.perf_counter() - t0
                return

    def close(self) -> None:
        for c in self.channels:
            c.close()


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
            for proc in [*self.dep.routers, self.dep.controller]:
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
            gone = info.get("victim", "") if kind in ("kill_decode", "kill_prefill") else ""
            since = info.get("resumed_at", 0.0)
            healed = _wait(lambda: self.dep.whole(gone, since), self.ns.recover_timeout_s, 0.5)
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
        return self._kill_restart(self.dep.controller)

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


# ---- analysis ---------------------------------------------------------------------------------------------
def classify(recs: list[Rec], faults: list[dict]) -> dict:
    """Served / lost, and why each lost one was lost."""
    kills = [(f["t_s"], f.get("victim")) for f in faults if f["kind"] == "kill_router"]
    why: Counter = Counter()
    for r in recs:
        if r.ok:
            continue
        router = f"router-{'ab'[r.failed_on]}" if r.failed_on is not None else None
        died = any(v == router and r.t_send <= t <= (r.t_end or 1e18) for t, v in kills)
        if died and r.tokens:
            why["its router was killed mid-stream"] += 1
        elif r.tokens:
            why[f"error after {len(r.tokens)} tokens: {r.error.split(':')[0]}"] += 1
        elif r.error:
            why[f"before any token, after {r.attempts} attempts: {r.error.split(':')[0]}"] += 1
        else:
            why["unfinished at the end"] += 1
    return {"sent": len(recs), "served": sum(r.ok for r in recs), "lost": sum(not r.ok for r in recs),
            "lost_why": dict(why), "retried_then_served": sum(r.ok and r.attempts > 1 for r in recs),
            "served_via_other_router": sum(r.ok and len(set(r.routers)) > 1 for r in recs),
            "lost_with_router_alive": sum(v for k, v in why.items() if "router was killed" not in k)}


def windows(recs: list[Rec], window_s: float, duration_s: float) -> list[dict]:
    import numpy as np

    def p(xs: list, q: float) -> Optional[float]:
        return round(float(np.percentile(xs, q)), 1) if xs else None

    out = []
    for w in range(max(1, int(np.ceil(duration_s / window_s)))):
        lo, hi = w * window_s, (w + 1) * window_s
        sent = [r for r in recs if lo <= r.t_send < hi]
        ttft = [(r.t_first - r.t_send) * 1e3 for r in sent if r.ok and r.t_first is not None]
        itl = [(b - a) * 1e3 for r in recs if r.ok for a, b in zip(r.chunk_times, r.chunk_times[1:]) if lo <= b < hi]
        out.append({"window": f"{lo:.0f}-{hi:.0f} s", "sent": len(sent), "served": sum(r.ok for r in sent),
                    "p50_ttft_ms": p(ttft, 50), "p99_ttft_ms": p(ttft, 99), "p50_itl_ms": p(itl, 50),
                    "p99_itl_ms": p(itl, 99)})
    return out


def duplicates(recs: list[Rec], reqs: list, model: str, sample: int) -> dict:
    """Requests with more tokens than asked, and a sample (those retried first) against the offline engine."""
    from engine import LLM, SamplingParams

    over = [r.i for r in recs if r.ok and len(r.tokens) != r.max_tokens]
    good = [r for r in recs if r.ok]
    pick = [r for r in good if r.attempts > 1][: sample // 2]
    rest = [r for r in good if r.attempts == 1]
    pick += rest[:: max(1, len(rest) // max(1, sample - len(pick)))][: sample - len(pick)]
    llm = LLM(model=model, num_threads=1)
    outs = llm.generate([{"prompt_token_ids": reqs[r.i].prompt_token_ids} for r in pick],
                        [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in pick])
    bad = [r.i for r, o in zip(pick, outs) if list(o.token_ids) != r.tokens]
    return {"wrong_length": len(over), "wrong_length_ids": over[:20], "offline_checked": len(pick),
            "offline_mismatched": len(bad), "offline_mismatched_ids": bad[:20]}


def plot_rss(rss: dict, faults: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 6))
    colors = plt.cm.tab20.colors
    for k, (name, series) in enumerate(sorted(rss.items())):
        if series:
            ax.plot([t for t, _ in series], [v / 2**20 for _, v in series], label=name, lw=1,
                    color=colors[k % len(colors)], ls=("-", "--", ":")[(k // len(colors)) % 3])
    for f in faults:
        ax.axvline(f["t_s"], color="grey", ls=":", lw=0.8)
        ax.text(f["t_s"], ax.get_ylim()[1], f["kind"].replace("kill_", "-9 "), rotation=90, va="top", fontsize=7)
    ax.set_xlabel("time since load start (s)")
    ax.set_ylabel("RSS (MiB)")
    ax.legend(fontsize=6, ncol=3, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main -------------------------------------------------------------------------------------------------
def main(ns: argparse.Namespace) -> int:
    from soak import load_rows, machine_info, make_requests

    out_dir = ns.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()},
                 "machine": machine_info(), "shape": f"controller + 2 routers + {ns.prefill} prefill + "
                 f"{ns.decode} decode, Ray head + 1 worker node, GCS fault tolerance on its own Redis"}
    dep = Deployment(ns, out_dir)
    chaos = client = None
    t_start = time.monotonic()
    try:
        dep.start()
        from loadtest.client import fetch_model_info, limits_from_info
        import asyncio

        limits = limits_from_info(asyncio.run(fetch_model_info(dep.targets[0], 120.0)))
        print(f"deployment {dep.namespace} up in {time.monotonic() - t_start:.0f} s: routers {dep.targets}, "
              f"ray {dep.head.address}, load average {os.getloadavg()}", flush=True)
        n = max(2, int(ns.rate * ns.duration_s))
        rows = load_rows(ns, n + 1)
        span = rows[-1].arrival_s - rows[0].arrival_s
        factor = n / (ns.rate * span) if span > 0 else 0.0
        arrivals = [(r.arrival_s - rows[0].arrival_s) * factor for r in rows]
        reqs, clipped = make_requests(rows[:n], limits, ns.seed, "dep", arrivals[:n])
        res["workload"] = {"trace": ns.trace.name, "requests": n, "rate": ns.rate, "length_scale": ns.length_scale,
                           "clipped": clipped, "prompt_len_median": sorted(len(q.prompt_token_ids) for q in reqs)[n // 2],
                           "output_len_median": sorted(q.max_tokens for q in reqs)[n // 2]}
        client = Client(dep.targets, ns.request_timeout, ns.client_retries, ns.seed)
        chaos = Chaos(dep, ns)
        stop = threading.Event()
        t0 = time.perf_counter()
        chaos.start(t0)
        loader = threading.Thread(target=client.run, args=(reqs, t0, stop), name="load")
        loader.start()
        last = 0.0
        while loader.is_alive():
            loader.join(timeout=5)
            el = time.perf_counter() - t0
            if el - last >= 30:
                last = el
                done = [r for r in client.recs if r.t_end is not None]
                print(f"  [{el:6.0f} s] sent {len(client.recs)}, done {len(done)}, served "
                      f"{sum(r.ok for r in done)}, load average {os.getloadavg()[0]:.2f}", flush=True)
        chaos.join()
        res["load_wall_s"] = round(time.perf_counter() - t0, 1)
        # leaks: every block back once the load is over (the registry's records are refreshed by heartbeats)
        waited = _wait(lambda: all(w.num_free_blocks == w.num_total_blocks and not w.num_running
                                   for w in dep.workers()), 120, 1.0)
        res["kv_blocks_not_free"] = {w.worker_id: w.num_total_blocks - w.num_free_blocks for w in dep.workers()}
        res["kv_free_after_s"] = waited
        res["redis_keys_before_down"] = sorted(dep.registry.keys()) if dep.registry else []
        res["faults"] = chaos.faults
        res["exits"] = chaos.exits
        res["requests"] = classify(client.recs, chaos.faults)
        res["windows"] = windows(client.recs, ns.window_s, ns.duration_s)
        res["rss_mib"] = {k: {"first": round(v[0][1] / 2**20, 1), "last": round(v[-1][1] / 2**20, 1),
                              "max": round(max(x for _, x in v) / 2**20, 1), "from_s": round(v[0][0]),
                              "to_s": round(v[-1][0])} for k, v in chaos.rss.items() if v}
        res["redis_stats"] = chaos.redis_stats
        res["rss_series"] = {k: [(round(t, 1), x) for t, x in v] for k, v in chaos.rss.items()}
        plot_rss(chaos.rss, chaos.faults, ns.out.with_suffix(".rss.png"))
    finally:
        if client is not None:
            client.close()
        if chaos is not None:
            chaos.stop.set()
        dep.stop(res)
        res["loadavg_end"] = os.getloadavg()
    if client is not None and client.recs:
        res["tokens"] = duplicates(client.recs, reqs, ns.model, ns.check_requests)
    ns.out.write_text(json.dumps(res, indent=1, default=str))
    with open(ns.out.with_suffix(".requests.jsonl"), "w") as f:
        for r in client.recs if client is not None else []:
            f.write(json.dumps(asdict(r)) + "\n")
    summary = {k: res.get(k) for k in ("requests", "tokens", "kv_blocks_not_free", "redis_keys_left_after_down",
                                       "loadavg_end")}
    print(json.dumps(summary, indent=1, default=str))
    for f in res.get("faults", []):
        print(f"  fault {f}")
    for w in res.get("windows", []):
        print(f"  window {w}")
    print(f"result: {ns.out} (plot {ns.out.with_suffix('.rss.png')})")
    bad = (res.get("requests", {}).get("lost_with_router_alive", 1) or res.get("tokens", {}).get("wrong_length")
           or res.get("tokens", {}).get("offline_mismatched") or any(res.get("kv_blocks_not_free", {}).values())
           or res.get("redis_keys_left_after_down"))
    return 1 if bad else 0
