"""A multi-node Ray cluster on one machine, with Ray's fake-multinode autoscaler.

``autoscaling_head(node_types)`` runs ``ray start --head`` on a free port and a
private temp dir, with ``--autoscaling-config`` naming Ray's ``fake_multinode``
provider: the autoscaler launches each worker node as a separate raylet on this
machine (what ``ray.cluster_utils.AutoscalingCluster`` does, without its
``ray stop --force``, which would kill every Ray on the machine, the test
session's included). ``min_workers`` nodes of each type start at once; more start
when actors cannot be placed, up to ``max_workers``.

The config follows Ray's ``autoscaler/_private/fake_multi_node/example.yaml``
(Apache-2.0, github.com/ray-project/ray); the head offers no CPU, so every
worker actor lands on a worker node of its type.

Teardown kills every process whose command line names the private temp dir
(raylets, GCS, the monitor), never by name.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from typing import Iterator
from urllib.parse import unquote, urlsplit

import psutil
import redis

from tests.e2e.test_pdserve_up import _pdserve
from tests.waiting import wait_until

ENV = dict(os.environ, RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1", RAY_FAKE_CLUSTER="1",
           AUTOSCALER_UPDATE_INTERVAL_S="1")


def _config(node_types: dict, gcs_address: str) -> dict:
    types = {name: {"resources": res, "node_config": {}, "min_workers": lo, "max_workers": hi}
             for name, (res, lo, hi) in node_types.items()}
    types["ray.head.default"] = {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0}
    return {"cluster_name": "pdserve-test", "max_workers": sum(hi for _, _, hi in node_types.values()),
            "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True, "gcs_address": gcs_address},
            "available_node_types": types, "head_node_type": "ray.head.default", "auth": {},
            "upscaling_speed": 1.0, "idle_timeout_minutes": 60, "docker": {}, "initialization_commands": [],
            "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
            "head_start_ray_commands": [], "worker_start_ray_commands": [], "file_mounts": {},
            "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [],
            "rsync_filter": []}


def _ray_cli() -> str:
    return os.path.join(os.path.dirname(_pdserve()[0]), "ray")


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


@contextlib.contextmanager
def autoscaling_head(node_types: dict) -> Iterator[str]:
    """``node_types``: name -> (resources incl. CPU, min_workers, max_workers). Yields the GCS address."""
    tmp = tempfile.mkdtemp(prefix="pdm", dir="/tmp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    config = os.path.join(tmp, "autoscaling.json")
    with open(config, "w") as f:
        json.dump(_config(node_types, address), f)
    try:
        r = subprocess.run([_ray_cli(), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                            "--num-cpus=0", f"--temp-dir={tmp}", f"--autoscaling-config={config}",
                            "--include-dashboard=false", "--disable-usage-stats"],
                           capture_output=True, text=True, timeout=120, env=ENV)
        assert r.returncode == 0, r.stderr[-3000:]
        yield address
    finally:
        procs = procs_of(tmp, port)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=3)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)


_NODES = """
import json, ray
ray.init(address={address!r}, logging_level="ERROR", log_to_driver=False)
print(json.dumps([{{"id": n["NodeID"], "alive": n["Alive"], "resources": n["Resources"]}} for n in ray.nodes()]))
"""


def nodes(address: str) -> list[dict]:
    """Every node Ray knows: {"id", "alive", "resources"} (read by a short-lived driver)."""
    r = subprocess.run([sys.executable, "-c", _NODES.format(address=address)], capture_output=True, text=True,
                       timeout=120, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def wait_nodes(address: str, want: dict, timeout: float) -> list[dict]:
    """Poll until the live nodes offering each resource in ``want`` number at least ``want[resource]``;
    returns the live nodes."""
    def enough() -> list[dict] | None:
        live = [n for n in nodes(address) if n["alive"]]
        return live if all(sum(1 for n in live if n["resources"].get(r, 0) > 0) >= k for r, k in want.items()) else None

    return wait_until(enough, timeout=timeout, interval=1.0,
                      message=lambda: f"nodes {want} up: {[n for n in nodes(address) if n['alive']]}")


def raylet_of_port(port: int) -> psutil.Process:
    """The raylet hosting the worker process that listens on ``port`` (the actor's parent)."""
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            parent = psutil.Process(c.pid).parent()
            assert parent is not None and re.search(r"raylet", " ".join(parent.cmdline())), parent.cmdline()
            return parent
    raise AssertionError(f"nothing listens on port {port}")


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
        r = subprocess.run([_ray_cli(), "start", *args, "--disable-usage-stats", *auth], capture_output=True,
                           text=True, timeout=180, env=self.env)
        assert r.returncode == 0, r.stderr[-3000:].replace(self._password or "\0", "***")

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
        assert gcs is not None, "no GCS running"
        self._gcs_cmd, self._gcs_env = gcs.cmdline(), gcs.environ()
        gcs.kill()
        gcs.wait(30)
        self._head_pids.discard(gcs.pid)

    def restart_gcs(self) -> None:
        assert self._gcs_cmd, "kill_gcs() first"
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
