"""The deployment soak's processes: ``Proc`` (one ``pdserve`` process with its log), ``Stack`` (the two
Redis servers, the Ray head with GCS fault tolerance and its worker node) and ``Deployment`` (one controller and
two routers in a namespace, with their secret and API-keys file).

Lifecycle: ``main`` (``deployment.py``) starts a ``Stack``, then one ``Deployment`` per pool on it; faults
(``faults.py``) kill and restart their processes through ``Proc``; ``Deployment.stop`` and ``Stack.stop`` end
them (SIGTERM, then kill) and remove their temporary files.
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import grpc
import psutil


from benchmarks.harness import REPO
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
@dataclass
class Stack:
    """One deployment: a namespace, its controller and two routers (``label`` pd: prefill/decode pools; colo:
    a colocated pool)."""

    label: str
    namespace: str
    mode: str
    sizes: dict
    """role -> workers the controller keeps."""
    controller: Optional[Proc] = None
    routers: list = field(default_factory=list)
    ports: list = field(default_factory=list)
    registry: Any = None
    keys_file: Optional[Path] = None

    @property
    def targets(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]


def _engine_child(pid: int) -> Optional[int]:
    """The engine process of the colocated worker ``pid`` (``worker_common.engine_process``: a multiprocessing
    spawn child), or None."""
    try:
        for c in psutil.Process(pid).children():
            if "spawn_main" in " ".join(c.cmdline()):
                return c.pid
    except psutil.Error:
        pass
    return None


def key_limits(ns: argparse.Namespace, rate: float, token_cost: float) -> dict[str, dict]:
    """Each key's limits in a deployment offered ``rate`` req/s of requests costing ``token_cost`` tokens
    (prompt + max_tokens) on average (module docstring: main far above its load, capped below it)."""
    main_rate, capped_rate = rate * (1 - ns.capped_share), rate * ns.capped_share
    out = {"main": {"requests_per_s": round(max(20.0, 20 * main_rate), 3),
                    "tokens_per_min": int(max(100_000, 20 * 60 * main_rate * token_cost)),
                    "max_concurrent": 64}}
    if capped_rate > 0:
        out["capped"] = {"requests_per_s": round(max(1e-3, ns.capped_rate_factor * capped_rate), 4)}
    return out


class Deployment:
    """Redis x2, Ray head + worker node, and the deployments (``Stack``): pd, and colo with ``--colocated``."""

    def __init__(self, ns: argparse.Namespace, out_dir: Path, token_cost: float) -> None:
        from benchmarks.soak.chaos import spawned_redis

        from benchmarks.ray_head import FaultTolerantHead

        self.ns = ns
        self.logs = out_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        tag = uuid.uuid4().hex[:6]
        self.namespace = f"soakdep-{tag}"
        self.stacks = [Stack("pd", self.namespace, "disaggregated", {"prefill": ns.prefill, "decode": ns.decode})]
        if ns.colocated:
            self.stacks.append(Stack("colo", f"soakcolo-{tag}", "colocated", {"colocated": ns.colocated}))
        self.shares = {"pd": 1 - (ns.colocated_share if ns.colocated else 0.0), "colo": ns.colocated_share}
        self.secrets_dir = Path(tempfile.mkdtemp(prefix="soakkeys"))
        self.keys: dict[str, str] = {}
        """Key name -> the bearer token (the same tokens in every deployment; each has its own limits)."""
        self.limits: dict[str, dict] = {}
        """Deployment label -> key name -> limits."""
        if ns.quotas:
            self.keys = {name: f"pdk-{name}-{secrets.token_urlsafe(24)}" for name in ("main", "capped")}
            for st in self.stacks:
                lim = key_limits(ns, ns.rate * self.shares[st.label], token_cost)
                self.limits[st.label] = lim
                lines = []
                for name, limits in lim.items():
                    lines += ["[[key]]", f'name = "{name}"', f'key = "{self.keys[name]}"',
                              *(f"{k} = {v}" for k, v in limits.items()), ""]
                st.keys_file = self.secrets_dir / f"keys-{st.label}.toml"
                st.keys_file.write_text("\n".join(lines))
                st.keys_file.chmod(0o600)
        self.redis = spawned_redis()
        self.redis_incarnation = 1
        self.gcs_redis = spawned_redis()
        self.head = FaultTolerantHead(self.gcs_redis.url, self.namespace)
        self.env = dict(self.head.env, PDSERVE_REDIS_URL=self.redis.url,
                        PDSERVE_CLUSTER_SECRET=secrets.token_urlsafe(32), OMP_NUM_THREADS="1",
                        RAY_DEDUP_LOGS="0")

    # ---- what every deployment has ----------------------------------------------------------------------
    @property
    def routers(self) -> list[Proc]:
        return [r for st in self.stacks for r in st.routers]

    @property
    def controllers(self) -> list[Proc]:
        return [st.controller for st in self.stacks if st.controller is not None]

    @property
    def targets(self) -> list[str]:
        return [t for st in self.stacks for t in st.targets]

    def stack(self, label: str) -> Stack:
        return next(st for st in self.stacks if st.label == label)

    def router_flags(self) -> list[str]:
        out = ["--http-port", "0"]
        if not self.ns.kv_events:
            out.append("--no-kv-events")
        if not self.ns.cold_ties:
            out.append("--no-kv-replica-sync")
        return out

    def start(self) -> None:
        from cluster.registry import Registry

        self.head.start()
        self.head.add_node({"prefill": 1, "decode": 1}, cpus=self.ns.worker_cpus)
        for st in self.stacks:  # both controllers load at once
            pools = (["--colocated", str(self.ns.colocated)] + (["--engine-process"] if self.ns.engine_process else [])
                     if st.label == "colo" else ["--prefill", str(self.ns.prefill), "--decode", str(self.ns.decode)])
            argv = ["controller", "--address", self.head.address, "--namespace", st.namespace, "--model",
                    self.ns.model, *pools, "--num-kv-blocks", str(self.ns.num_kv_blocks), "--check-interval", "0.5"]
            name = "controller" if st.label == "pd" else "controller-colo"
            st.controller = Proc(name, argv, self.env, self.logs, "pdserve CONTROLLING").start()
        for st in self.stacks:
            if _wait(st.controller.ready, 600) is None:
                raise RuntimeError(f"{st.controller.name} did not start: {st.controller.log.read_text()[-3000:]}")
        for st in self.stacks:
            st.ports = [_free_port(), _free_port()]
            quota = (["--api-keys-file", str(st.keys_file), "--quota-routers", "2"] if st.keys_file else [])
            for k, port in enumerate(st.ports):
                name = f"router-{'ab'[k]}" if st.label == "pd" else f"router-colo-{'ab'[k]}"
                st.routers.append(Proc(name, ["router", "--mode", st.mode, "--namespace", st.namespace, "--model",
                                              self.ns.model, "--port", str(port), *self.router_flags(), *quota],
                                       self.env, self.logs, "pdserve SERVING").start())
        for r in self.routers:
            if _wait(r.ready, 300) is None:
                raise RuntimeError(f"{r.name} did not start: {r.log.read_text()[-3000:]}")
        for st in self.stacks:
            st.registry = Registry(self.redis.url, st.namespace)

    @property
    def registry(self) -> Any:
        """The disaggregated deployment's registry."""
        return self.stacks[0].registry

    def workers(self, role: Optional[str] = None) -> list:
        """Every deployment's registered workers (of ``role``)."""
        return [w for st in self.stacks if st.registry is not None for w in st.registry.list(role)]

    def worker_pid(self, info: Any) -> Optional[int]:
        return _listening_pid(int(info.grpc_address.rpartition(":")[2]))

    def whole(self, gone: str = "", since: float = 0.0) -> bool:
        """Everything serving again; ``gone``: a worker id that must have left the registry (a killed one);
        ``since``: unix time every counted worker's record must be newer than (after a SIGSTOP)."""
        now = time.time()
        workers = self.workers()
        if gone and any(w.worker_id == gone for w in workers):
            return False
        fresh = Counter(w.role for w in workers if w.ready and now - w.updated_at < 5 and w.updated_at > since)
        return (all(fresh[role] >= n for st in self.stacks for role, n in st.sizes.items())
                and all(c.ready() for c in self.controllers) and all(_health(t) for t in self.targets)
                and self.head.gcs() is not None)

    def processes(self) -> dict[str, int]:
        """name -> pid of every process of the deployment now."""
        out: dict[str, int] = {}
        for p in [*self.routers, *self.controllers]:
            if p.alive():
                out[f"{p.name}#{p.incarnation}"] = p.popen.pid
        try:
            for w in self.workers():
                pid = self.worker_pid(w)
                if pid:
                    out[w.worker_id] = pid
                    if w.role == "colocated":
                        child = _engine_child(pid)
                        if child:
                            out[f"{w.worker_id}.engine"] = child
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
        from benchmarks.soak.chaos import spawned_redis

        self.redis = spawned_redis(port, password)
        self.redis_incarnation += 1

    def router_counters(self) -> dict:
        """Every live router's KV-routing and quota counters (its current incarnation's, from its /metrics)."""
        return {f"{r.name}#{r.incarnation}": router_kv_counters(r.banner_value(r"metrics\s+http://(\S+)/metrics"))
                for r in self.routers if r.alive()}

    def stop(self, res: dict) -> None:
        import redis as redis_py

        for p in [*self.routers, *self.controllers]:
            res.setdefault("exit_codes", {})[p.name] = p.terminate()
        res["down"], res["redis_keys_left_after_down"] = {}, []
        for st in self.stacks:
            down = subprocess.run([*_pdserve(), "down", "--address", self.head.address, "--namespace", st.namespace],
                                  cwd=REPO, env=self.env, capture_output=True, text=True, timeout=300)
            res["down"][st.label] = {"rc": down.returncode, "stdout": down.stdout[-2000:]}
            try:
                c = redis_py.Redis.from_url(self.redis.url)
                res["redis_keys_left_after_down"] += sorted(k.decode() for k in c.scan_iter(match=f"{st.namespace}:*"))
                c.close()
            except Exception as e:
                res["redis_keys_left_after_down"].append(f"unreadable: {e}")
            if st.registry is not None:
                st.registry.close()
        self.head.close()
        self.redis.stop()
        self.gcs_redis.stop()
        shutil.rmtree(self.secrets_dir, ignore_errors=True)


def sum_counters(by_router: dict) -> dict:
    """The routers' counters summed over the live routers (last incarnations), per deployment (pd, colo)."""
    out: dict = {}
    for name, counters in by_router.items():
        label = "colo" if name.startswith("router-colo") else "pd"
        for k, v in counters.items():
            if k != "error":
                out.setdefault(label, {})[k] = out.get(label, {}).get(k, 0.0) + v
    return out


def router_kv_counters(metrics_address: Optional[str]) -> dict:
    """A router's cache-aware routing and quota counters from its Prometheus /metrics (``host:port``)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    if not metrics_address:
        return {"error": "no metrics address in its log"}
    wanted = ("kv_events_consumed", "kv_events_rejected", "kv_events_resyncs", "kv_events_redis_errors",
              "kv_replica_published", "kv_replica_applied", "kv_replica_dropped", "kv_cold_ties",
              "routing_decisions", "quota_rejections", "request_success", "request_errors", "request_migrations")
    out: dict = {}
    try:
        with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                name = s.name.removeprefix("pdserve:").removesuffix("_total")
                if not s.name.endswith("_total") or name not in wanted:
                    continue
                label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                 if k not in ("model_name", "role", "worker"))
                key = f"{name}{{{label}}}" if label else name
                out[key] = out.get(key, 0.0) + s.value
    except Exception as e:
        out["error"] = repr(e)
    return out
