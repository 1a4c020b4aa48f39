"""Soak test: a cluster under steady trace load while workers and Redis are killed (issue 9, item 8).

Lifecycle: the script starts its own ``EmbeddedRedis`` on a free loopback port
(so it can ``kill -9`` it and restart it on the same port), then a ``Cluster``
(private local Ray, ``--prefill`` + ``--decode`` worker actors, the router in
this process) on that Redis, plus a ``Supervisor`` that replaces dead workers.
After a short warm-up it measures capacity (``--capacity-requests`` trace
requests, ``--capacity-concurrency`` at a time; completed / wall time) unless
``--rate`` is given, and replays the conversation trace at ``--load`` x that
rate for ``--duration-s``: a contiguous slice of the trace, its inter-arrival
gaps rescaled to the target mean rate (same burst pattern), its lengths
multiplied by ``--length-scale`` and clipped to the model's limits (both stated
in the report). Every request is greedy (temperature 0) with ``ignore_eos``, so
its output length is forced and its tokens are reproducible offline.

While the load runs, a fault thread kills a random worker (``kill -9`` of its
actor's pid) every ``--kill-every-s`` and Redis once, halfway (``kill -9``,
restarted empty on the same port after ``--redis-down-s``); after each fault it
waits (bounded) until the cluster is whole again: the supervisor has replaced
the worker and its successor is in the registry, or every worker has
re-registered into the new Redis. A sampler thread records the RSS of this
process (the router, which also hosts the load client), of every worker actor
process and of Redis (psutil). A log handler collects the router's
"request X: ... failed" warnings, so requests that were retried or migrated and
still succeeded are counted.

At the end (load stopped, in-flight requests finished) it reads each worker's
``info()`` (KV blocks not free), stops the supervisor and the cluster, SCANs
``{namespace}:*`` in Redis (keys left behind), and checks a sample of the
successful requests against the offline engine (``engine.LLM``), token for
token. It prints a rich table and writes JSON to ``--out``; exit status 1 when
requests were lost, outputs differed or blocks/keys leaked.

Usage:
    python benchmarks/soak.py                                   # the full soak: 30 min, a kill every 5 min
    python benchmarks/soak.py --duration-s 540 --kill-every-s 120 --window-s 120   # the recorded 9-min run
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import re
import signal
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the project's packages when run as a script
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
FALLBACK_TRACE = REPO / "tests" / "data" / "azure_llm_2023_conv_first400.csv"

log = logging.getLogger("soak")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="built-in model or HF dir (default: tiny)")
    ap.add_argument("--prefill", type=int, default=1, help="prefill workers")
    ap.add_argument("--decode", type=int, default=1, help="decode workers")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE if DEFAULT_TRACE.is_file() else FALLBACK_TRACE,
                    help="Azure conversation trace CSV (default: ../shared/traces/azure_llm_2023_conv.csv)")
    ap.add_argument("--trace-start", type=int, default=0, help="first trace row replayed")
    ap.add_argument("--length-scale", type=float, default=0.1,
                    help="multiply the trace's prompt/output lengths (then clipped to the model's limits)")
    ap.add_argument("--duration-s", type=float, default=1800.0, help="how long the load runs")
    ap.add_argument("--load", type=float, default=0.7, help="fraction of measured capacity to offer")
    ap.add_argument("--rate", type=float, default=None, help="offered mean rate (req/s); skips the capacity probe")
    ap.add_argument("--capacity-requests", type=int, default=48, help="requests of the capacity probe")
    ap.add_argument("--capacity-concurrency", type=int, default=16, help="in flight during the capacity probe")
    ap.add_argument("--kill-every-s", type=float, default=300.0, help="kill -9 a random worker this often")
    ap.add_argument("--redis-down-s", type=float, default=5.0, help="how long Redis stays down after its kill")
    ap.add_argument("--no-redis-kill", action="store_true", help="do not kill Redis")
    ap.add_argument("--window-s", type=float, default=300.0, help="window of the per-window latency table")
    ap.add_argument("--rss-every-s", type=float, default=15.0, help="RSS sampling period")
    ap.add_argument("--recover-timeout-s", type=float, default=120.0, help="how long a fault may take to heal")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="deadline of each request (s)")
    ap.add_argument("--check-requests", type=int, default=32, help="successful requests checked against offline")
    ap.add_argument("--seed", type=int, default=0, help="seeds prompts and the choice of victims")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "soak" / "result.json", help="JSON result file")
    return ap


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ns = build_parser().parse_args(argv)
    if ns.prefill < 1 or ns.decode < 1:
        raise SystemExit("--prefill and --decode must be >= 1")
    for name in ("duration_s", "load", "kill_every_s", "window_s", "rss_every_s", "length_scale",
                 "request_timeout", "recover_timeout_s"):
        if not getattr(ns, name) > 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0")
    if ns.rate is not None and not ns.rate > 0:
        raise SystemExit("--rate must be > 0")
    if not ns.trace.is_file():
        raise SystemExit(f"--trace: no such file {ns.trace}")
    return ns


# ---- the client -------------------------------------------------------------------------------------------
@dataclass
class Rec:
    """One request as the client saw it (times in s since the load's t0)."""

    request_id: str
    prompt: list
    max_tokens: int
    scheduled_s: float
    start_s: float = 0.0
    end_s: float = 0.0
    chunk_times_s: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    finish_reason: str = ""
    code: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.code and self.finish_reason not in ("", "abort") and bool(self.token_ids)

    @property
    def outcome(self) -> str:
        """"OK", a gRPC status name, "ABORT" or "NO_TOKENS"."""
        if self.code:
            return self.code
        if self.finish_reason == "abort":
            return "ABORT"
        if not self.token_ids or not self.finish_reason:
            return "NO_TOKENS"
        return "OK"


async def send(stub: Any, rec: Rec, t0: float, timeout_s: float) -> Rec:
    import grpc
    from proto import pdserve_pb2 as pb

    delay = t0 + rec.scheduled_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    rec.start_s = time.perf_counter() - t0
    msg = pb.GenerateRequest(request_id=rec.request_id, token_ids=rec.prompt, max_tokens=rec.max_tokens,
                             temperature=0.0, ignore_eos=True)
    call = stub.Generate(msg, timeout=timeout_s)
    try:
        async for resp in call:
            now = time.perf_counter() - t0
            if resp.token_ids:
                rec.chunk_times_s.append(now)
                rec.token_ids.extend(resp.token_ids)
            if resp.finish_reason:
                rec.finish_reason = resp.finish_reason
    except grpc.aio.AioRpcError as e:
        rec.code, rec.error = e.code().name, (e.details() or "")[:300]
    except asyncio.CancelledError:
        call.cancel()
        raise
    rec.end_s = time.perf_counter() - t0
    return rec


async def replay(target: str, recs: list[Rec], timeout_s: float, max_concurrency: Optional[int] = None,
                 t0_box: Optional[list] = None) -> float:
    """Send ``recs`` on their schedule over one channel; returns the wall duration."""
    import grpc
    from proto import pdserve_pb2_grpc as pb_grpc

    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.PDServeStub(channel)
        t0 = time.perf_counter()
        if t0_box is not None:
            t0_box.append(t0)

        async def one(r: Rec) -> None:
            if sem is None:
                await send(stub, r, t0, timeout_s)
                return
            async with sem:
                await send(stub, r, t0, timeout_s)

        # Tasks are created as their arrival nears, so a long soak never holds thousands of sleeping tasks.
        tasks: list = []
        for r in recs:
            delay = t0 + r.scheduled_s - time.perf_counter() - 1.0
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(r)))
            tasks = [t for t in tasks if not t.done()] if len(tasks) > 256 else tasks
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s + 30)
        return time.perf_counter() - t0


# ---- router log capture: retried / migrated requests ---------------------------------------------------------
class RetryLog(logging.Handler):
    """Collects the router's per-request failure warnings ("request X: attempt N ... failed ...")."""

    PAT = re.compile(r"^request (\S+?): (.*)$", re.S)

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.by_request: dict[str, list[str]] = defaultdict(list)

    def emit(self, record: logging.LogRecord) -> None:
        if not record.name.startswith("router"):
            return
        m = self.PAT.match(record.getMessage())
        if m and "fail" in m.group(2):
            self.by_request[m.group(1)].append(m.group(2)[:200])


# ---- Redis: started by posix_spawn, never fork ------------------------------------------------------------
def spawned_redis(port: int = 0) -> Any:
    """An ``EmbeddedRedis`` launched without fork(): EmbeddedRedis's own launch passes a ``preexec_fn``
    (parent-death signal), so Popen forks this process; forking a process with live gRPC threads (the
    router, Ray's core worker) crashed the child in the smoke run ("Check failed: next_worker->state ==
    KICKED", SIGABRT), and the parent-death signal would also stop the restarted server when the fault
    thread that started it ends. Without preexec_fn/cwd/new session, Popen uses posix_spawn; the script
    stops the server itself (finalizer and ``finally``)."""
    import subprocess

    from cluster.redis_server import EmbeddedRedis, RedisServerConfig

    class _Spawned(EmbeddedRedis):
        def _launch(self, binary: str, p: int) -> subprocess.Popen:
            args = [binary, "--port", str(p), "--bind", self.config.host, "--dir", self._tmpdir, "--save", "",
                    "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no",
                    "--logfile", os.path.join(self._tmpdir, "redis.log")]
            return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, close_fds=False)

    kw: dict = {"host": "127.0.0.1", "port": port}
    if "password" in RedisServerConfig.__dataclass_fields__:
        kw["password"] = ""  # a loopback-only soak server; this launch does not pass requirepass
    return _Spawned(RedisServerConfig(**kw)).start()


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
        old_pid = self.redis.pid
        self.sample_rss()
        t = self.now()
        os.kill(old_pid, signal.SIGKILL)
        self.redis.stop()  # reaps the dead process, removes its dir
        time.sleep(self.ns.redis_down_s)
        self.redis = spawned_redis(self.port)
        self.redis_incarnation += 1
        t_up = self.now()

        def back() -> bool:
            want = {wid for _, wid, _ in self.members()}
            return want <= {w.worker_id for w in self.cluster.registry.list() if w.ready}

        rec = self._wait(back, self.ns.recover_timeout_s)
        return {"kind": "redis", "t_s": round(t, 1), "what": f"kill -9 redis (pid {old_pid}), restarted on port "
                f"{self.port} after {t_up - t:.1f} s (pid {self.redis.pid})", "down_s": round(t_up - t, 2),
                "recovery_s": rec, "survived": rec is not None}


# ---- analysis ---------------------------------------------------------------------------------------------
def pct(xs: list, q: float) -> Optional[float]:
    return float(np.percentile(xs, q)) if xs else None


def windows(recs: list[Rec], window_s: float, duration_s: float) -> list[dict]:
    n = max(1, int(np.ceil(duration_s / window_s)))
    out = []
    for w in range(n):
        lo, hi = w * window_s, (w + 1) * window_s
        sent = [r for r in recs if lo <= r.start_s < hi]
        ttft = [(r.chunk_times_s[0] - r.start_s) * 1e3 for r in sent if r.ok]
        itl = [(b - a) * 1e3 for r in recs if r.ok for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:]) if lo <= b < hi]
        out.append({"window": f"{lo:.0f}-{min(hi, duration_s):.0f} s", "sent": len(sent),
                    "ok": sum(r.ok for r in sent), "failed": sum(not r.ok for r in sent),
                    "p50_ttft_ms": pct(ttft, 50), "p99_ttft_ms": pct(ttft, 99),
                    "p50_itl_ms": pct(itl, 50), "p99_itl_ms": pct(itl, 99)})
    return out


def rss_summary(rss: dict) -> list[dict]:
    out = []
    for name, series in rss.items():
        if not series:
            continue
        first, last = series[0][1], series[-1][1]
        out.append({"process": name, "from_s": series[0][0], "to_s": series[-1][0], "samples": len(series),
                    "rss_first_mib": first / 2**20, "rss_last_mib": last / 2**20,
                    "rss_max_mib": max(v for _, v in series) / 2**20, "growth_mib": (last - first) / 2**20})
    return out


def router_counters(router: Any) -> dict:
    """The router's own request_errors (by code), request_success and request_migrations totals."""
    out: dict = {"errors": {}, "success": 0.0, "migrations": 0.0}
    try:
        for fam in router.metrics.registry.collect():
            for s in fam.samples:
                if not s.name.endswith("_total"):
                    continue
                if "request_errors" in s.name:
                    out["errors"][s.labels.get("code", "?")] = s.value
                elif "request_success" in s.name:
                    out["success"] += s.value
                elif "request_migrations" in s.name:
                    out["migrations"] += s.value
    except Exception as e:
        out["error"] = repr(e)
    return out


def check_offline(model: str, recs: list[Rec]) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model=model)
    outs = llm.generate([{"prompt_token_ids": r.prompt} for r in recs],
                        [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in recs])
    bad = [r.request_id for r, o in zip(recs, outs) if list(o.token_ids) != list(r.token_ids)]
    return {"checked": len(recs), "matched": len(recs) - len(bad), "mismatched_ids": bad,
            "checked_ids": [r.request_id for r in recs]}


def pick_check_sample(recs: list[Rec], retried: set, n: int) -> list[Rec]:
    ok = [r for r in recs if r.ok]
    first = [r for r in ok if r.request_id in retried][: n // 2]  # retried/migrated ones matter most
    rest = [r for r in ok if r.request_id not in retried]
    k = n - len(first)
    step = max(1, len(rest) // max(1, k))
    return first + rest[::step][:k]


# ---- report -----------------------------------------------------------------------------------------------
def print_report(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=150)
    s = res["summary"]
    con.print(f"[bold]soak[/bold]: {res['settings']['model']}, {res['settings']['prefill']}P+{res['settings']['decode']}D, "
              f"{s['offered_rate']:.2f} req/s offered ({res['settings']['load']:g} x capacity "
              f"{res['capacity'].get('req_per_s', float('nan')):.2f} req/s) for {res['settings']['duration_s']:g} s; "
              f"trace {res['workload']['trace']} lengths x{res['workload']['length_scale']:g} "
              f"({res['workload']['num_clipped_to_model_limits']} clipped)")
    t = Table(title="summary")
    t.add_column("what")
    t.add_column("value", justify="right")
    rows = [("requests sent", s["requests"]), ("succeeded", s["succeeded"]), ("lost (failed)", s["lost"]),
            ("errors by code", json.dumps(s["errors_by_code"]) or "{}"),
            ("retried/migrated and succeeded", s["retried_and_succeeded"]),
            ("retried/migrated and failed", s["retried_and_failed"]),
            ("router counters", json.dumps(res["router_counters"])),
            ("faults injected / survived", f"{s['faults_injected']} / {s['faults_survived']}"),
            ("KV blocks not free at end", s["blocks_not_free"]), ("Redis keys left after stop", s["keys_left"]),
            ("greedy outputs = offline", f"{res['offline_check']['matched']}/{res['offline_check']['checked']}"),
            ("load average start / end", f"{res['machine']['loadavg_start']} / {res['machine']['loadavg_end']}")]
    for k, v in rows:
        t.add_row(k, str(v))
    con.print(t)
    t = Table(title="faults")
    for col in ("t (s)", "fault", "survived", "recovery (s)"):
        t.add_column(col)
    for f in res["faults"]:
        t.add_row(f"{f['t_s']:.0f}", f.get("what", f.get("error", "")), str(f["survived"]), str(f.get("recovery_s")))
    con.print(t)
    t = Table(title=f"per window ({res['settings']['window_s']:g} s, by send time)")
    for col in ("window", "sent", "ok", "failed", "p50 TTFT ms", "p99 TTFT ms", "p50 ITL ms", "p99 ITL ms"):
        t.add_column(col, justify="right")
    f1 = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for w in res["windows"]:
        t.add_row(w["window"], str(w["sent"]), str(w["ok"]), str(w["failed"]), f1(w["p50_ttft_ms"]),
                  f1(w["p99_ttft_ms"]), f1(w["p50_itl_ms"]), f1(w["p99_itl_ms"]))
    con.print(t)
    t = Table(title="RSS")
    for col in ("process", "from s", "to s", "first MiB", "last MiB", "max MiB", "growth MiB"):
        t.add_column(col, justify="right")
    for r in res["rss"]:
        t.add_row(r["process"], f"{r['from_s']:.0f}", f"{r['to_s']:.0f}", f"{r['rss_first_mib']:.1f}",
                  f"{r['rss_last_mib']:.1f}", f"{r['rss_max_mib']:.1f}", f"{r['growth_mib']:+.1f}")
    con.print(t)
    t = Table(title="workers at the end")
    for col in ("worker", "total blocks", "free", "not free", "running", "waiting"):
        t.add_column(col, justify="right")
    for b in res["blocks_at_end"]:
        t.add_row(b["worker_id"], *(str(b.get(k)) for k in ("total", "free", "not_free", "running", "waiting")))
    con.print(t)


# ---- main -------------------------------------------------------------------------------------------------
def machine_info() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()]}


def make_recs(rows: list, limits: Any, seed: int, prefix: str, arrivals: list) -> tuple[list[Rec], int]:
    from loadtest.workload import build_workload, trace_lengths

    wl = build_workload(trace_lengths(rows), arrivals, limits, seed=seed, id_prefix=prefix)
    return [Rec(r.request_id, r.prompt_token_ids, r.max_tokens, r.arrival_s) for r in wl.requests], wl.num_clipped


def load_rows(ns: argparse.Namespace, n: int) -> list:
    """``n`` trace rows from ``--trace-start``, wrapping around the file (arrivals kept increasing)."""
    from loadtest.trace import load_trace, scale_trace

    rows = scale_trace(load_trace(ns.trace, ns.trace_start, None), ns.length_scale, 1.0)
    if not rows:
        raise SystemExit(f"--trace: no rows from {ns.trace_start}")
    span = rows[-1].arrival_s + (rows[-1].arrival_s / max(1, len(rows) - 1))
    out = []
    for i in range(n):
        r = rows[i % len(rows)]
        out.append(type(r)(r.arrival_s + (i // len(rows)) * span, r.prompt_len, r.output_len))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ns = parse_args(argv)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    log_path = ns.out.with_suffix(".log")
    logging.basicConfig(level=logging.WARNING, filename=str(log_path), filemode="w",
                        format="%(asctime)s %(levelname)s %(name)s %(threadName)s: %(message)s")
    retry_log = RetryLog()
    logging.getLogger().addHandler(retry_log)

    import ray
    import redis as redis_py

    from cluster.launcher import Cluster, ClusterConfig
    from cluster.supervisor import Supervisor, SupervisorConfig
    from loadtest.client import fetch_model_info, limits_from_info

    info = machine_info()
    t_all = time.monotonic()
    redis_srv = spawned_redis()
    cfg = ClusterConfig(model=ns.model, num_prefill=ns.prefill, num_decode=ns.decode, redis_url=redis_srv.url,
                        router_host="127.0.0.1", worker_host="127.0.0.1", start_timeout_s=300)
    cluster = Cluster(cfg)
    supervisor = None
    chaos = None
    res: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()},
                 "machine": info}
    try:
        cluster.start()
        supervisor = Supervisor(cluster, SupervisorConfig()).start()
        target = cluster.router_address
        limits = limits_from_info(asyncio.run(fetch_model_info(target, 120.0)))
        print(f"cluster {cluster.namespace} up at {target} in {time.monotonic() - t_all:.1f} s "
              f"(redis {redis_srv.url}); limits {limits}; load average {info['loadavg_start']}", flush=True)

        # warm-up, then capacity: a closed loop of trace requests
        warm, _ = make_recs(load_rows(ns, 4), limits, ns.seed + 1, "warm", [0.0] * 4)
        asyncio.run(replay(target, warm, ns.request_timeout))
        cap: dict = {}
        if ns.rate is None:
            rows = load_rows(ns, ns.capacity_requests)
            probe, _ = make_recs(rows, limits, ns.seed + 2, "cap", [0.0] * len(rows))
            dur = asyncio.run(replay(target, probe, ns.request_timeout, ns.capacity_concurrency))
            done = sum(r.ok for r in probe)
            cap = {"requests": len(probe), "concurrency": ns.capacity_concurrency, "ok": done,
                   "wall_s": dur, "req_per_s": done / dur if dur > 0 else 0.0}
            rate = ns.load * cap["req_per_s"]
            print(f"capacity: {done}/{len(probe)} in {dur:.1f} s = {cap['req_per_s']:.2f} req/s "
                  f"-> offering {rate:.2f} req/s ({ns.load:g} x)", flush=True)
            if not rate > 0:
                raise RuntimeError(f"capacity probe completed nothing: {Counter(r.outcome for r in probe)}")
        else:
            rate = ns.rate
        res["capacity"] = cap

        # the soak's schedule: a contiguous trace slice, gaps rescaled to the mean rate
        n = max(2, int(rate * ns.duration_s))
        rows = load_rows(ns, n + 1)
        span = rows[-1].arrival_s - rows[0].arrival_s
        factor = n / (rate * span) if span > 0 else 0.0
        arrivals = [(r.arrival_s - rows[0].arrival_s) * factor for r in rows]
        recs, clipped = make_recs(rows[:n], limits, ns.seed, "soak", arrivals[:n])
        plens = [len(r.prompt) for r in recs]
        olens = [r.max_tokens for r in recs]
        res["workload"] = {"trace": ns.trace.name, "trace_start": ns.trace_start, "length_scale": ns.length_scale,
                           "requests": n, "num_clipped_to_model_limits": clipped,
                           "prompt_len": {"median": float(np.median(plens)), "p90": pct(plens, 90), "max": max(plens)},
                           "output_len": {"median": float(np.median(olens)), "p90": pct(olens, 90), "max": max(olens)},
                           "model_limits": vars(limits) if hasattr(limits, "__dict__") else str(limits)}
        print(f"soak: {n} requests over {ns.duration_s:g} s ({rate:.2f} req/s), prompt median "
              f"{res['workload']['prompt_len']['median']:.0f} / max {max(plens)}, output median "
              f"{res['workload']['output_len']['median']:.0f} / max {max(olens)}, {clipped} clipped", flush=True)

        chaos = Chaos(ns, cluster, supervisor, redis_srv)
        t0_box: list = []

        async def run_load() -> float:
            task = asyncio.ensure_future(replay(target, recs, ns.request_timeout, None, t0_box))
            while not t0_box:
                await asyncio.sleep(0.01)
            chaos.start(t0_box[0])
            last = 0.0
            while not task.done():
                await asyncio.sleep(1.0)
                el = time.perf_counter() - t0_box[0]
                if el - last >= 30:
                    last = el
                    started = [r for r in recs if r.start_s > 0]
                    done = [r for r in started if r.end_s > 0]
                    print(f"  [{el:6.1f} s] sent {len(started)}, done {len(done)}, failed "
                          f"{sum(not r.ok for r in done)}, load average {os.getloadavg()[0]:.2f}", flush=True)
            return task.result()

        wall = asyncio.run(run_load())
        chaos.join()
        chaos.sample_rss()
        redis_srv = chaos.redis  # the live incarnation
        # in-flight requests are done; let the workers free their last blocks
        end = time.monotonic() + 15
        while cluster.router.num_in_flight and time.monotonic() < end:
            time.sleep(0.1)
        time.sleep(2.0)
        blocks = []
        for role in ("prefill", "decode"):
            for wid, h in cluster.members(role):
                try:
                    wi = ray.get(h.info.remote(), timeout=30)
                    blocks.append({"worker_id": wid, "role": role, "total": wi.num_total_blocks,
                                   "free": wi.num_free_blocks, "not_free": wi.num_total_blocks - wi.num_free_blocks,
                                   "running": wi.num_running, "waiting": wi.num_waiting})
                except Exception as e:
                    blocks.append({"worker_id": wid, "role": role, "error": repr(e)})
        res["router_counters"] = router_counters(cluster.router)
        res["router_in_flight_at_end"] = cluster.router.num_in_flight
        supervisor.stop()
        cluster.stop()
        try:
            r = redis_py.Redis.from_url(redis_srv.url, socket_timeout=10)
            keys_left = sorted(k.decode() for k in r.scan_iter(match=f"{cluster.namespace}:*", count=1000))
            r.close()
        except Exception as e:  # Redis gone: say so instead of claiming zero keys
            res["keys_scan_error"] = repr(e)
            keys_left = ["<SCAN failed: %r>" % e]
        info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]

        retried = set(retry_log.by_request)
        outcomes = Counter(r.outcome for r in recs)
        t = time.monotonic()
        sample = pick_check_sample(recs, retried, ns.check_requests)
        res["offline_check"] = check_offline(ns.model, sample) if sample else {"checked": 0, "matched": 0}
        res["offline_check"]["wall_s"] = time.monotonic() - t
        res["faults"] = chaos.faults
        res["windows"] = windows(recs, ns.window_s, ns.duration_s)
        res["rss"] = rss_summary(chaos.rss)
        res["redis_stats"] = chaos.redis_stats
        if chaos.redis_stats:
            peak = max(chaos.redis_stats, key=lambda x: x[2])
            print(f"redis used_memory peak {peak[2] / 2**20:.1f} MiB ({peak[3]} keys) at t={peak[0]} s; "
                  f"last {chaos.redis_stats[-1][2] / 2**20:.1f} MiB ({chaos.redis_stats[-1][3]} keys)", flush=True)
        res["rss_series"] = {k: v for k, v in chaos.rss.items()}
        res["blocks_at_end"] = blocks
        res["keys_left"] = keys_left
        res["replacements"] = [{"t_s": round(ts - chaos.t0_wall, 1), "role": role,
                                "failed": f, "new": nw} for ts, role, f, nw in supervisor.replacements]
        failed = [r for r in recs if not r.ok]
        res["failures"] = [{"request_id": r.request_id, "start_s": round(r.start_s, 2), "outcome": r.outcome,
                            "error": r.error, "tokens": len(r.token_ids), "router_log": retry_log.by_request.get(r.request_id, [])}
                           for r in failed[:200]]
        res["retried"] = {rid: msgs for rid, msgs in list(retry_log.by_request.items())[:200]}
        ok_ids = {r.request_id for r in recs if r.ok}
        res["summary"] = {
            "requests": len(recs), "succeeded": outcomes.get("OK", 0), "lost": len(failed),
            "errors_by_code": {k: v for k, v in outcomes.items() if k != "OK"},
            "retried_and_succeeded": len(retried & ok_ids),
            "retried_and_failed": len(retried & {r.request_id for r in failed}),
            "router_retry_warnings_total": sum(len(v) for v in retry_log.by_request.values()),
            "offered_rate": rate, "achieved_rate": outcomes.get("OK", 0) / wall if wall else 0.0, "wall_s": wall,
            "faults_injected": len(chaos.faults), "faults_survived": sum(bool(f.get("survived")) for f in chaos.faults),
            "blocks_not_free": sum(b.get("not_free", 0) for b in blocks), "keys_left": len(keys_left),
            "unchecked_worker_infos": sum("error" in b for b in blocks)}
        res["wall_s_total"] = time.monotonic() - t_all
        print_report(res)
        if ns.out.is_dir():  # a folder was given: the result goes inside it
            ns.out = ns.out / "result.json"
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps(res, indent=1, default=str))
        print(f"wrote {ns.out} (log {log_path}); {res['wall_s_total']:.0f} s in all")
        s = res["summary"]
        good = (s["lost"] == 0 and s["blocks_not_free"] == 0 and s["keys_left"] == 0
                and res["offline_check"]["matched"] == res["offline_check"]["checked"]
                and s["faults_survived"] == s["faults_injected"])
        return 0 if good else 1
    finally:
        if chaos is not None:
            chaos.stop.set()
            redis_srv = chaos.redis
        if supervisor is not None:
            supervisor.stop(wait=False)
        cluster.stop()
        redis_srv.stop()


if __name__ == "__main__":
    sys.exit(main())
