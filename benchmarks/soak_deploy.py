"""Chaos soak of the deployment shape (issue 30 item 2; today's defaults, issue 45 section 4):
``python benchmarks/soak.py --deployment ...``.

Lifecycle: ``main(ns)`` starts, each as its own process on this machine: the deployment's Redis (kill -9 and
restart target) and a second Redis that holds only Ray's GCS tables (Ray passes its Redis password on the GCS's
command line, so it gets a Redis of its own); a Ray head with GCS fault tolerance on that Redis (no CPUs) and one
worker node (a second raylet, ``--worker-cpus``, default one CPU per worker); the **disaggregated deployment**:
``pdserve controller --address`` (``--prefill`` + ``--decode`` detached workers, its supervisor) and two ``pdserve
router`` on fixed free ports; and, with ``--colocated K`` (default 1), a **colocated deployment** beside it on the
same Redis and Ray cluster: a second ``pdserve controller --colocated K --engine-process`` in a namespace of its own
and two ``pdserve router --mode colocated``. (One controller cannot mix the pools: ``ClusterConfig`` refuses
``num_colocated`` with ``num_prefill``/``num_decode``, a router serves one mode, and the controller lease is one
per namespace; so the colocated pool is a second deployment sharing Redis, Ray and the faults.) All processes of a
deployment share its namespace and one cluster secret (passed in the environment, never in argv).

Today's defaults, each on unless switched off:

- KV events and cold ties (``--no-kv-events``, ``--no-cold-ties``): the routers' defaults
  (``RouterConfig.kv_events``, ``kv_replica_sync``, ``kv_pending_s``); the soak passes no flag that turns them off
  and, at the end, reads every live router's ``/metrics`` (KV event batches applied, routing decisions by reason,
  cold ties by result, shared placements) so the JSON shows they were used.
- Per-key API quotas with two keys (``--no-quotas``): each deployment's routers get ``--api-keys-file`` (a
  throwaway TOML file, keys generated per run) and ``--quota-routers 2``. Key ``main`` carries most requests
  with limits far above its offered load (``requests_per_s`` 20x its rate, at least 20; ``tokens_per_min`` 20x
  its token rate; ``max_concurrent`` 64): its quota must never refuse, so a refusal is counted as lost (a quota
  bug, e.g. a lease not released). Key ``capped`` carries ``--capped-share`` of the requests (default 0.25) with
  ``requests_per_s`` at ``--capped-rate-factor`` (default 0.5) of its offered rate: its refusals
  (RESOURCE_EXHAUSTED naming the key and the limit) are expected, not retried, and counted as "refused by quota",
  apart from lost requests.
- Structured outputs (``--structured-every N``, default 8; 0 = off): every N-th request carries a constraint in
  ``GenerateRequest.structured_outputs``, alternately a JSON Schema and a regex; it is sent without ``ignore_eos``
  (the constraint ends it, ``finish_reason`` stop) and with ``max_tokens`` at least 48 (the schema's answer is
  about 32 tokens). Checked: a served constrained answer that stopped must validate (jsonschema / full regex
  match), and the offline check (below) includes constrained requests, compared with ``engine.LLM`` under the
  same constraint (greedy constrained decoding is deterministic offline too).
- A colocated pool with the engine in a process of its own (``--colocated K``, default 1, 0 = off;
  ``--no-engine-process``; ``--colocated-share``, default 0.25, of the requests go to it).

Load: a trace (``--trace``, gaps rescaled to ``--rate``, lengths x ``--length-scale``; greedy) is sent by client
threads that behave like real clients: a request that fails before its first token with UNAVAILABLE or
RESOURCE_EXHAUSTED (not a quota refusal) is retried with exponential backoff (0.25 s doubling, at most
``--client-retries`` times), through its deployment's other router on UNAVAILABLE (its router is gone). Every
``--fault-every-s`` a fault thread injects the next of a shuffled cycle (``--faults``) of: kill -9 of a decode
worker, of a prefill worker, of a colocated worker (with ``--colocated``), of a router (any of the deployments';
restarted on its port after ``--restart-after-s``, as a Deployment would), of a controller (either; restarted
likewise; the new one waits for the lease and adopts), of Redis (restarted empty on its port), of the GCS
(restarted with its own arguments, reloading from its Redis), and SIGSTOP of a random worker for ``--stop-s``
(then SIGCONT), and with ``--colocated`` ``kill_engine`` (kill -9 of a colocated worker's engine process, the
worker itself left alive; healed when the worker is replaced or runs a new engine process: until 29 Nov such a
worker went on reporting ready while failing every request routed to it and nothing replaced it; now its loop
ends, its probe fails and the supervisor replaces it).
After each fault it measures the time until everything is whole again (each deployment's 2 routers SERVING and
its controller up, every pool's workers ready with fresh records in its registry, the GCS up). A sampler records
every process's RSS (a colocated worker's engine process as ``<worker>.engine``) and Redis's memory and key count.

At the end: the load stops, in-flight requests finish, the workers' KV blocks must all come back (waited on,
bounded), Redis keys are counted; the routers' counters are read; then routers and controllers get SIGTERM,
``pdserve down`` removes each deployment's workers, and each namespace's keys left are counted. Requests are
classified (served; refused by the capped key's quota; lost with the reason: the router died under it, an error
after tokens, retries exhausted, a quota refusal of the main key), by deployment, key and constraint; duplicated
tokens are counted (an unconstrained output of another length than asked, or a sample's tokens differing from
the offline engine's), per-window p99 TTFT/ITL computed, and JSON, a log per process and an RSS plot written
beside ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
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
"""The cycle without a colocated deployment (as in the 26 Nov runs)."""
COLOCATED_FAULTS = ("kill_colocated", "kill_engine")
"""Added to the cycle with ``--colocated``."""
OPT_IN_FAULTS: tuple[str, ...] = ()
"""Drawn only when named in ``--faults`` (none now)."""
ALL_FAULTS = FAULTS + COLOCATED_FAULTS + OPT_IN_FAULTS
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
QUOTA_REFUSAL = re.compile(r"key '([^']*)': .*\((requests_per_s|tokens_per_min|max_concurrent)[:)]")
"""The router's message of a quota refusal (``router.quotas.QuotaBook.admit``): the key's name and the limit."""
STRUCTURED_MIN_TOKENS = 48
"""A constrained request asks at least this many tokens (the schema's answer is about 32 on ``tiny``)."""
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
REGEX = r"[0-9]{3}-[a-z]{2,5}"
CONSTRAINTS = {"json": ("json", json.dumps(PERSON)), "regex": ("regex", REGEX)}
"""Constraint kind -> (the StructuredOutputs field, its value), the same on the wire and offline."""


def add_args(ap: argparse.ArgumentParser) -> None:
    """The flags of ``--deployment`` (``--rate`` is soak.py's; this mode needs it)."""
    ap.add_argument("--fault-every-s", type=float, default=120.0, help="a fault this often")
    ap.add_argument("--faults", default=None,
                    help=f"comma-separated fault kinds drawn from, of {','.join(ALL_FAULTS)} (default: "
                         f"{','.join(FAULTS)}, plus {','.join(COLOCATED_FAULTS)} with --colocated; "
                         f"{','.join(OPT_IN_FAULTS)} only when named)")
    ap.add_argument("--restart-after-s", type=float, default=5.0, help="a killed router/controller/Redis/GCS "
                    "is restarted this long after its kill")
    ap.add_argument("--stop-s", type=float, default=10.0, help="SIGSTOP length")
    ap.add_argument("--client-retries", type=int, default=6, help="retries of a request before its first token")
    ap.add_argument("--worker-cpus", type=int, default=None,
                    help="CPUs the Ray worker node offers (default: one per worker: --prefill + --decode + "
                         "--colocated)")
    ap.add_argument("--num-kv-blocks", type=int, default=256, help="KV blocks per worker")
    # today's defaults (issue 45): each ON in --deployment; these flags turn them off or tune them (flags of the
    # --deployment group itself: argparse does not show a group nested in a group)
    d = ap
    d.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                   help="routers ignore the workers' KV events (pdserve router --no-kv-events; default: on)")
    d.add_argument("--no-cold-ties", dest="cold_ties", action="store_false",
                   help="routers neither share placements nor break cold ties through Redis "
                        "(pdserve router --no-kv-replica-sync; default: on)")
    d.add_argument("--no-quotas", dest="quotas", action="store_false",
                   help="no API keys: open routers (default: two keys with per-key quotas, see the docstring)")
    d.add_argument("--capped-share", type=float, default=0.25,
                   help="fraction of the requests sent with the capped key (default 0.25)")
    d.add_argument("--capped-rate-factor", type=float, default=0.5,
                   help="the capped key's requests_per_s as a fraction of its offered rate in each deployment: "
                        "its refusals are expected (default 0.5)")
    d.add_argument("--structured-every", type=int, default=8, metavar="N",
                   help="every N-th request carries a JSON-schema or regex constraint (default 8; 0 = none)")
    d.add_argument("--colocated", type=int, default=1, metavar="K",
                   help="colocated workers in a second deployment beside the disaggregated one (its own controller "
                        "and 2 routers --mode colocated; default 1, 0 = no colocated deployment)")
    d.add_argument("--colocated-share", type=float, default=0.25,
                   help="fraction of the requests sent to the colocated deployment (default 0.25)")
    d.add_argument("--no-engine-process", dest="engine_process", action="store_false",
                   help="colocated workers keep their engine in process (default: --engine-process)")


def check_args(ns: argparse.Namespace) -> None:
    """SystemExit naming the flag of a bad value; fills ``ns.faults`` and ``ns.worker_cpus`` defaults."""
    if ns.colocated < 0:
        raise SystemExit("--colocated must be >= 0")
    if ns.structured_every < 0:
        raise SystemExit("--structured-every must be >= 0")
    for name in ("capped_share", "colocated_share"):
        if not 0 <= getattr(ns, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be in [0, 1)")
    if not ns.capped_rate_factor > 0:
        raise SystemExit("--capped-rate-factor must be > 0")
    if ns.faults is None:
        ns.faults = ",".join(FAULTS + (COLOCATED_FAULTS if ns.colocated else ()))
    kinds = [k for k in ns.faults.split(",") if k]
    bad = [k for k in kinds if k not in ALL_FAULTS]
    if bad:
        raise SystemExit(f"--faults: unknown {bad}; known: {','.join(ALL_FAULTS)}")
    if not ns.colocated and any(k in COLOCATED_FAULTS + OPT_IN_FAULTS for k in kinds):
        raise SystemExit("--faults: kill_colocated and kill_engine need --colocated > 0")
    if ns.worker_cpus is None:
        ns.worker_cpus = ns.prefill + ns.decode + ns.colocated


@dataclass
class Rec:
    """One client request, as the client saw it (times from the load's start)."""

    i: int
    max_tokens: int
    t_send: float
    stack: str = "pd"
    """The deployment it was sent to: pd (disaggregated) or colo (colocated)."""
    key: str = ""
    """The API key's name (main, capped; "" without quotas)."""
    constraint: str = ""
    """Its structured-output constraint (json, regex; "" none)."""
    t_first: Optional[float] = None
    t_end: Optional[float] = None
    chunk_times: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    text: str = ""
    finish: str = ""
    error: str = ""
    quota: str = ""
    """The limit that refused it (requests_per_s, tokens_per_min, max_concurrent; "" none)."""
    attempts: int = 0
    routers: list = field(default_factory=list)
    """The routers tried, in order (their process names)."""
    failed_on: Optional[str] = None
    """The router the request was lost on."""

    @property
    def ok(self) -> bool:
        return bool(self.finish) and not self.error

    @property
    def refused_by_quota(self) -> bool:
        """Refused by the capped key's quota: expected, not lost."""
        return bool(self.quota) and self.key == "capped"

    @property
    def lost(self) -> bool:
        return not self.ok and not self.refused_by_quota


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
        from soak_chaos import spawned_redis

        from ray_head import FaultTolerantHead

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
        from soak_chaos import spawned_redis

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


# ---- the client -------------------------------------------------------------------------------------------
@dataclass
class Planned:
    """What one trace request becomes: its deployment, key, constraint and max_tokens."""

    stack: str
    key: str
    constraint: str
    max_tokens: int


def plan_requests(ns: argparse.Namespace, reqs: list, limits: Any) -> list[Planned]:
    """Each request's deployment (``--colocated-share``), key (``--capped-share``) and constraint (every
    ``--structured-every``-th, alternately json and regex), drawn from ``--seed``; a constrained request's
    max_tokens raised to ``STRUCTURED_MIN_TOKENS`` within the model's limits."""
    rng = random.Random(ns.seed + 17)
    out = []
    every = ns.structured_every
    for i, q in enumerate(reqs):
        stack = "colo" if ns.colocated and rng.random() < ns.colocated_share else "pd"
        key = ("capped" if rng.random() < ns.capped_share else "main") if ns.quotas else ""
        constraint = ("json", "regex")[(i // every) % 2] if every and i % every == every - 1 else ""
        mt = q.max_tokens
        if constraint:
            mt = max(mt, STRUCTURED_MIN_TOKENS)
            if limits.max_new_tokens:
                mt = min(mt, limits.max_new_tokens)
            if limits.max_context_length:
                mt = max(1, min(mt, limits.max_context_length - len(q.prompt_token_ids)))
        out.append(Planned(stack, key, constraint, mt))
    return out


def plan_summary(plan: list[Planned]) -> dict:
    return {"by_deployment": dict(Counter(p.stack for p in plan)), "by_key": dict(Counter(p.key for p in plan)),
            "by_constraint": dict(Counter(p.constraint or "none" for p in plan))}


class Client:
    """Sends each request at its time on a thread pool; retries before the first token, fails over routers."""

    def __init__(self, dep: "Deployment", timeout_s: float, retries: int, seed: int) -> None:
        from proto import pdserve_pb2, pdserve_pb2_grpc
        from transport.auth import bearer_metadata

        self.pb, self.timeout_s, self.retries = pdserve_pb2, timeout_s, retries
        self.names = {st.label: [r.name for r in st.routers] for st in dep.stacks}
        self.channels = {st.label: [grpc.insecure_channel(t) for t in st.targets] for st in dep.stacks}
        self.stubs = {label: [pdserve_pb2_grpc.PDServeStub(c) for c in chs] for label, chs in self.channels.items()}
        self.metadata = {name: bearer_metadata(tok) for name, tok in dep.keys.items()}
        self.rng = random.Random(seed)
        self.recs: list[Rec] = []

    def run(self, reqs: list, plan: list[Planned], t0: float, stop: threading.Event) -> None:
        with ThreadPoolExecutor(max_workers=96, thread_name_prefix="client") as pool:
            for i, (q, p) in enumerate(zip(reqs, plan)):
                delay = t0 + q.arrival_s - time.perf_counter()
                if delay > 0 and stop.wait(delay):
                    break
                rec = Rec(i, p.max_tokens, time.perf_counter() - t0, stack=p.stack, key=p.key,
                          constraint=p.constraint)
                self.recs.append(rec)
                pool.submit(self._one, q, rec, t0, i % len(self.stubs[p.stack]))

    def message(self, q: Any, rec: Rec) -> Any:
        kw: dict = dict(token_ids=q.prompt_token_ids, max_tokens=rec.max_tokens, temperature=0.0,
                        ignore_eos=not rec.constraint)  # a constraint ends its answer itself
        if rec.constraint:
            fld, value = CONSTRAINTS[rec.constraint]
            kw["structured_outputs"] = self.pb.StructuredOutputs(**{fld: value})
        return self.pb.GenerateRequest(**kw)

    def _one(self, q: Any, rec: Rec, t0: float, k: int) -> None:
        req = self.message(q, rec)
        stubs, names = self.stubs[rec.stack], self.names[rec.stack]
        md = self.metadata.get(rec.key, ())
        for attempt in range(self.retries + 1):
            rec.attempts += 1
            rec.routers.append(names[k])
            try:
                for msg in stubs[k].Generate(req, timeout=self.timeout_s, metadata=md):
                    now = time.perf_counter() - t0
                    if msg.token_ids:
                        rec.t_first = rec.t_first if rec.t_first is not None else now
                        rec.chunk_times.append(now)
                        rec.tokens.extend(msg.token_ids)
                    rec.text += msg.text
                    if msg.finish_reason:
                        rec.finish = msg.finish_reason
                rec.t_end = time.perf_counter() - t0
                return
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
                quota = QUOTA_REFUSAL.search(details) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
                if quota is None and not rec.tokens and code in RETRYABLE and attempt < self.retries:
                    if code == grpc.StatusCode.UNAVAILABLE:
                        k = 1 - k  # its router may be gone: the other one
                    time.sleep(min(8.0, 0.25 * 2 ** attempt) * (0.5 + self.rng.random()))
                    continue
                if quota is not None:
                    rec.quota = quota.group(2)
                rec.error = f"{code.name}: {details[:160]}"
                rec.failed_on = names[k]
                rec.t_end = time.perf_counter() - t0
                return

    def close(self) -> None:
        for chs in self.channels.values():
            for c in chs:
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


# ---- analysis ---------------------------------------------------------------------------------------------
def classify(recs: list[Rec], faults: list[dict]) -> dict:
    """Served / refused by the capped key's quota / lost, why each lost one was lost, and the same by
    deployment, key and constraint."""
    kills = [(f["t_s"], f.get("victim")) for f in faults if f["kind"] == "kill_router"]
    why: Counter = Counter()
    for r in recs:
        if not r.lost:
            continue
        died = any(v == r.failed_on and r.t_send <= t <= (r.t_end or 1e18) for t, v in kills)
        if died and r.tokens:
            why["its router was killed mid-stream"] += 1
        elif r.quota:
            why[f"refused by the quota of key {r.key or '(none)'} ({r.quota}): a quota bug"] += 1
        elif r.tokens:
            why[f"error after {len(r.tokens)} tokens: {r.error.split(':')[0]}"] += 1
        elif r.error:
            why[f"before any token, after {r.attempts} attempts: {r.error.split(':')[0]}"] += 1
        else:
            why["unfinished at the end"] += 1

    def tally(sel: Callable[[Rec], str]) -> dict:
        out: dict = {}
        for r in recs:
            t = out.setdefault(sel(r) or "none", {"sent": 0, "served": 0, "refused_by_quota": 0, "lost": 0})
            t["sent"] += 1
            t["served"] += r.ok
            t["refused_by_quota"] += r.refused_by_quota
            t["lost"] += r.lost
        return out

    return {"sent": len(recs), "served": sum(r.ok for r in recs), "lost": sum(r.lost for r in recs),
            "refused_by_quota": sum(r.refused_by_quota for r in recs),
            "refused_by_quota_limits": dict(Counter(r.quota for r in recs if r.refused_by_quota)),
            "lost_why": dict(why), "retried_then_served": sum(r.ok and r.attempts > 1 for r in recs),
            "served_via_other_router": sum(r.ok and len(set(r.routers)) > 1 for r in recs),
            "lost_with_router_alive": sum(v for k, v in why.items() if "router was killed" not in k),
            "by_deployment": tally(lambda r: r.stack), "by_key": tally(lambda r: r.key),
            "by_constraint": tally(lambda r: r.constraint)}


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


def valid_structured(r: Rec) -> bool:
    """A served constrained answer that stopped is one the constraint accepts (one that ran out of max_tokens is
    a prefix and is not judged)."""
    if r.finish != "stop":
        return True
    if r.constraint == "regex":
        return re.fullmatch(REGEX, r.text) is not None
    import jsonschema

    try:
        jsonschema.validate(json.loads(r.text), PERSON)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def duplicates(recs: list[Rec], reqs: list, model: str, sample: int) -> dict:
    """Unconstrained requests with another number of tokens than asked (they run with ``ignore_eos``), constrained
    ones with more than asked or an answer the constraint refuses, and a sample (those retried first, a quarter
    constrained when there are some) against the offline engine: greedy, the constrained ones under the same
    constraint (``engine.LLM``, the constraint converted as the router converts it)."""
    from engine import LLM, SamplingParams
    from proto import pdserve_pb2
    from router.wire import structured_outputs_from_proto

    good = [r for r in recs if r.ok]
    over = [r.i for r in good if not r.constraint and len(r.tokens) != r.max_tokens]
    over += [r.i for r in good if r.constraint and len(r.tokens) > r.max_tokens]
    invalid = [r.i for r in good if r.constraint and not valid_structured(r)]
    pick = [r for r in good if r.attempts > 1][: sample // 2]
    constrained = [r for r in good if r.attempts == 1 and r.constraint]
    n_con = min(len(constrained), max(0, sample // 4 - sum(bool(r.constraint) for r in pick)))
    pick += constrained[:: max(1, len(constrained) // max(1, n_con))][:n_con]
    rest = [r for r in good if r.attempts == 1 and not r.constraint]
    pick += rest[:: max(1, len(rest) // max(1, sample - len(pick)))][: max(0, sample - len(pick))]

    def params(r: Rec) -> Any:
        if not r.constraint:
            return SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        fld, value = CONSTRAINTS[r.constraint]
        so = structured_outputs_from_proto(pdserve_pb2.StructuredOutputs(**{fld: value}))
        return SamplingParams(max_tokens=r.max_tokens, temperature=0.0, structured_outputs=so)

    llm = LLM(model=model, num_threads=1)
    outs = llm.generate([{"prompt_token_ids": reqs[r.i].prompt_token_ids} for r in pick], [params(r) for r in pick])
    bad = [r.i for r, o in zip(pick, outs) if list(o.token_ids) != r.tokens]
    return {"wrong_length": len(over), "wrong_length_ids": over[:20], "structured_served": sum(bool(r.constraint)
            for r in good), "structured_stopped": sum(bool(r.constraint) and r.finish == "stop" for r in good),
            "structured_invalid": len(invalid), "structured_invalid_ids": invalid[:20],
            "offline_checked": len(pick), "offline_checked_structured": sum(bool(r.constraint) for r in pick),
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

    check_args(ns)
    out_dir = ns.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = (f"controller + 2 routers + {ns.prefill} prefill + {ns.decode} decode"
             + (f"; beside it controller + 2 routers (--mode colocated) + {ns.colocated} colocated"
                + (" (--engine-process)" if ns.engine_process else "") if ns.colocated else "")
             + f"; Ray head + 1 worker node ({ns.worker_cpus} CPUs), GCS fault tolerance on its own Redis")
    res: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()},
                 "machine": machine_info(), "shape": shape}
    n = max(2, int(ns.rate * ns.duration_s))
    rows = load_rows(ns, n + 1)
    # the keys' token limits are set from the trace before the clip to the model's limits (an upper bound)
    token_cost = sum(r.prompt_len + max(r.output_len, STRUCTURED_MIN_TOKENS) for r in rows) / len(rows)
    dep = Deployment(ns, out_dir, token_cost)
    chaos = client = None
    t_start = time.monotonic()
    try:
        dep.start()
        from loadtest.client import fetch_model_info, limits_from_info
        from transport.client_auth import ClientAuth
        import asyncio

        auth = ClientAuth(api_key=dep.keys["main"]) if dep.keys else None
        limits = limits_from_info(asyncio.run(fetch_model_info(dep.targets[0], 120.0, auth)))
        print(f"deployment {dep.namespace} up in {time.monotonic() - t_start:.0f} s: routers {dep.targets}, "
              f"ray {dep.head.address}, load average {os.getloadavg()}", flush=True)
        span = rows[-1].arrival_s - rows[0].arrival_s
        factor = n / (ns.rate * span) if span > 0 else 0.0
        arrivals = [(r.arrival_s - rows[0].arrival_s) * factor for r in rows]
        reqs, clipped = make_requests(rows[:n], limits, ns.seed, "dep", arrivals[:n])
        plan = plan_requests(ns, reqs, limits)
        res["workload"] = {"trace": ns.trace.name, "requests": n, "rate": ns.rate, "length_scale": ns.length_scale,
                           "clipped": clipped, "prompt_len_median": sorted(len(q.prompt_token_ids) for q in reqs)[n // 2],
                           "output_len_median": sorted(q.max_tokens for q in reqs)[n // 2], **plan_summary(plan)}
        res["defaults"] = {"kv_events": ns.kv_events, "cold_ties": ns.cold_ties, "router_flags": dep.router_flags(),
                           "quotas": dep.limits, "quota_routers": 2 if dep.keys else None,
                           "structured_every": ns.structured_every, "constraints": CONSTRAINTS,
                           "colocated": ns.colocated, "engine_process": ns.engine_process and bool(ns.colocated),
                           "namespaces": {st.label: st.namespace for st in dep.stacks}, "faults": ns.faults}
        print(f"  {plan_summary(plan)}; quotas {dep.limits or 'off'}; router flags {dep.router_flags()}", flush=True)
        client = Client(dep, ns.request_timeout, ns.client_retries, ns.seed)
        chaos = Chaos(dep, ns)
        stop = threading.Event()
        t0 = time.perf_counter()
        chaos.start(t0)
        loader = threading.Thread(target=client.run, args=(reqs, plan, t0, stop), name="load")
        loader.start()
        last = 0.0
        while loader.is_alive():
            loader.join(timeout=5)
            el = time.perf_counter() - t0
            if el - last >= 30:
                last = el
                done = [r for r in client.recs if r.t_end is not None]
                print(f"  [{el:6.0f} s] sent {len(client.recs)}, done {len(done)}, served "
                      f"{sum(r.ok for r in done)}, refused by quota {sum(r.refused_by_quota for r in done)}, "
                      f"lost {sum(r.lost for r in done)}, load average {os.getloadavg()[0]:.2f}", flush=True)
        chaos.join()
        res["load_wall_s"] = round(time.perf_counter() - t0, 1)
        # leaks: every block back once the load is over (the registry's records are refreshed by heartbeats)
        waited = _wait(lambda: all(w.num_free_blocks == w.num_total_blocks and not w.num_running
                                   for w in dep.workers()), 120, 1.0)
        res["kv_blocks_not_free"] = {w.worker_id: w.num_total_blocks - w.num_free_blocks for w in dep.workers()}
        res["kv_free_after_s"] = waited
        res["redis_keys_before_down"] = sorted(k for st in dep.stacks if st.registry is not None
                                               for k in st.registry.keys())
        res["router_counters"] = dep.router_counters()
        res["kv_routing"] = sum_counters(res["router_counters"])
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
    for label, c in res.get("kv_routing", {}).items():
        print(f"  routers {label} (live incarnations, summed): {json.dumps(c)}")
    for name, v in sorted(res.get("rss_mib", {}).items()):
        print(f"  rss {name}: {v['first']} -> {v['last']} MiB (max {v['max']}, {v['from_s']}-{v['to_s']} s)")
    print(f"result: {ns.out} (plot {ns.out.with_suffix('.rss.png')})")
    tok = res.get("tokens", {})
    bad = (res.get("requests", {}).get("lost_with_router_alive", 1) or tok.get("wrong_length")
           or tok.get("offline_mismatched") or tok.get("structured_invalid")
           or any(res.get("kv_blocks_not_free", {}).values()) or res.get("redis_keys_left_after_down"))
    return 1 if bad else 0
