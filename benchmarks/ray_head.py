"""A Ray head with GCS fault tolerance and extra raylets on one machine: the deployment soak's Ray, and the head-loss
test's (tests/multinode/test_head_loss.py loads this file by path; tests/ is not importable from benchmarks/).

Lifecycle: ``FaultTolerantHead(redis_url, namespace).start()`` runs ``ray start --head`` in a private temp dir with
``RAY_REDIS_ADDRESS`` set; ``add_node`` joins worker raylets; ``kill_gcs``/``restart_gcs`` and
``kill_head``/``restart_head`` are the faults; ``close()`` kills every process of this cluster (found by its temp
dir, never by name) and deletes Ray's keys from Redis. ``procs_of(tmp)`` finds those processes.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from urllib.parse import unquote, urlsplit

import psutil
import redis

ENV = dict(os.environ, RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1")
"""The environment of every ``ray start`` (no token auth on loopback, one OpenMP thread per Ray process)."""


def ray_cli() -> str:
    """The ``ray`` command beside this interpreter (the venv's)."""
    return os.path.join(os.path.dirname(sys.executable), "ray")


def procs_of(tmp: str, gcs_port: int = 0) -> list[psutil.Process]:
    """Every process whose command line names ``tmp`` (this head's private temp dir) and, with ``gcs_port``,
    the Ray client servers of that head (their command lines name its GCS address, not the temp dir)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if tmp in cmd or (gcs_port and "ray.util.client.server" in cmd and f":{gcs_port} " in cmd + " "):
                found.append(p)
        except psutil.Error:
            pass
    return found


class FaultTolerantHead:
    """A Ray head whose GCS keeps its tables in an external Redis (Ray's GCS fault tolerance), plus worker
    nodes joined with ``ray start --address`` (separate raylets on this machine), which the head's loss spares.

    Lifecycle: ``start()`` runs ``ray start --head`` (no CPUs, so every actor lands on a worker node) with
    ``RAY_REDIS_ADDRESS`` and ``RAY_external_storage_namespace`` set, as KubeRay's ``gcsFaultToleranceOptions``
    does; ``add_node(resources)`` joins a worker raylet; ``kill_gcs()`` SIGKILLs the GCS and
    ``restart_gcs()`` starts the same binary with the same arguments (what a restarted head does first);
    ``kill_head()`` SIGKILLs every head process (GCS, head raylet, monitor, dashboard) and leaves the worker
    nodes; ``restart_head()`` runs ``ray start --head`` again on the same port, reading the session back from
    Redis. ``close()`` kills every process of this cluster (found by its temp dir) and deletes Ray's keys
    (``RAY{namespace}@*``) from Redis.

    The Redis password reaches Ray as ``--redis-password``: Ray passes it to the GCS on its command line (KubeRay
    does the same), so on a shared host give Ray a Redis of its own or a Redis ACL user limited to Ray's keys.
    """

    def __init__(self, redis_url: str, namespace: str) -> None:
        parts = urlsplit(redis_url)
        self.namespace = namespace
        self.tmp = tempfile.mkdtemp(prefix="pdft", dir="/tmp")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._redis_url = redis_url
        self._password = unquote(parts.password or "")
        self.env = dict(ENV, RAY_REDIS_ADDRESS=f"{parts.hostname}:{parts.port}",
                        RAY_external_storage_namespace=namespace)
        self._gcs_cmd: list[str] = []
        self._gcs_env: dict = {}
        self._head_pids: set[int] = set()

    def _ray(self, *args: str) -> None:
        auth = [f"--redis-password={self._password}"] if self._password else []
        r = subprocess.run([ray_cli(), "start", *args, "--disable-usage-stats", *auth], capture_output=True,
                           text=True, timeout=180, env=self.env)
        if r.returncode != 0:
            raise RuntimeError(f"ray start {args[0]} failed: " + r.stderr[-3000:].replace(self._password or "\0", "***"))

    def start(self) -> "FaultTolerantHead":
        before = {p.pid for p in procs_of(self.tmp)}
        self._ray("--head", f"--port={self.port}", "--node-ip-address=127.0.0.1", "--num-cpus=0",
                  f"--temp-dir={self.tmp}", "--include-dashboard=false")
        self._head_pids = {p.pid for p in procs_of(self.tmp)} - before
        return self

    def add_node(self, resources: dict, cpus: int) -> None:
        self._ray(f"--address={self.address}", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}",
                  f"--resources={json.dumps(resources)}")

    def gcs(self) -> psutil.Process | None:
        for p in procs_of(self.tmp):
            with contextlib.suppress(psutil.Error):
                if os.path.basename(p.cmdline()[0]) == "gcs_server":
                    return p
        return None

    def head_procs(self) -> list[psutil.Process]:
        """The head node's processes: those ``start()`` left running (GCS, head raylet, monitor, dashboard, log
        monitor) and whatever the head raylet or GCS started since (agents, Ray workers)."""
        out: dict[int, psutil.Process] = {}
        for pid in self._head_pids:
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                out[pid] = p
                out.update((c.pid, c) for c in p.children(recursive=True))
        return list(out.values())

    def kill_gcs(self) -> None:
        gcs = self.gcs()
        if gcs is None:
            raise RuntimeError("no GCS running")
        self._gcs_cmd, self._gcs_env = gcs.cmdline(), gcs.environ()
        gcs.kill()
        gcs.wait(30)
        self._head_pids.discard(gcs.pid)

    def restart_gcs(self) -> None:
        if not self._gcs_cmd:
            raise RuntimeError("kill_gcs() first")
        gcs = subprocess.Popen(self._gcs_cmd, env=self._gcs_env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
        self._head_pids.add(gcs.pid)

    def kill_head(self) -> list[int]:
        procs = self.head_procs()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs, timeout=30)
        return [p.pid for p in procs]

    def restart_head(self) -> None:
        # `ray start --head` refuses a port that this temp dir's marker names while a raylet still points at it
        # (the surviving worker nodes do); on Kubernetes the new head is another pod and has no such marker.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.tmp, "ray_current_cluster"))
        self.start()

    def close(self) -> None:
        # The raylets' agents rename themselves (ray::DashboardAgent): found as children, not by command line.
        procs = {p.pid: p for p in procs_of(self.tmp, self.port)}
        for p in list(procs.values()):
            with contextlib.suppress(psutil.Error):
                procs.update((c.pid, c) for c in p.children(recursive=True))
        procs = list(procs.values())
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs, timeout=10)
        shutil.rmtree(self.tmp, ignore_errors=True)
        client = redis.Redis.from_url(self._redis_url)
        try:
            keys = list(client.scan_iter(match=f"RAY{self.namespace}@*"))
            if keys:
                client.delete(*keys)
        finally:
            client.close()
