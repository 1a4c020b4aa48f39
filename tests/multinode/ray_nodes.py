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
from typing import Callable, Iterator, Optional

import psutil

from cluster.ray_lifecycle import NO_PRESTART
from tests.e2e.test_pdserve_up import _pdserve
from tests.waiting import wait_until

ENV = dict(os.environ, RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1", RAY_FAKE_CLUSTER="1",
           AUTOSCALER_UPDATE_INTERVAL_S="1",
           # the GCS declares a raylet dead after 3 failed health checks a second apart, not Ray's 5 three seconds
           # apart: a killed node's actors fail (and the supervisor replaces them) in ~3 s instead of ~15 s, the
           # knobs a deployment that wants faster failover turns too. The checks' 10 s timeout stays: a raylet
           # merely slow on this loaded box is not declared dead.
           RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3")


def _load_ray_head():
    """``benchmarks.ray_head`` (the soak's fault-tolerant Ray head)."""
    from benchmarks import ray_head

    return ray_head


_ray_head = _load_ray_head()
procs_of = _ray_head.procs_of
FaultTolerantHead = _ray_head.FaultTolerantHead


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


_PORT_TAKEN = ("Failed to start the grpc server", "already in use", "Address already in use")


def start_head(tmp: str, args_for: Callable[[int], list[str]], env: Optional[dict] = None, tries: int = 4) -> int:
    """``ray start --head`` with its GCS on a free port (``args_for(port)``: the rest of the command line); returns
    the port. A free port is only free until someone binds it: another test's process may take it between our pick
    and Ray's bind, so a start that failed for its port (Ray says so) is cleaned up and retried on a new one."""
    for attempt in range(tries):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # no prestarted idle workers: pdserve's actors never use them (cluster.ray_lifecycle.NO_PRESTART)
        r = subprocess.run([_ray_cli(), "start", "--head", f"--port={port}", *args_for(port),
                            f"--system-config={json.dumps(NO_PRESTART)}"], capture_output=True,
                           text=True, timeout=120, env=ENV if env is None else env)
        if r.returncode == 0:
            return port
        stop_head(tmp, port, keep_dir=True)
        if attempt == tries - 1 or not any(m in r.stderr for m in _PORT_TAKEN):
            raise AssertionError(r.stderr[-3000:])
    raise AssertionError("unreachable")


def stop_head(tmp: str, port: int, keep_dir: bool = False) -> None:
    """End the processes of the head started in ``tmp`` on ``port`` (ours, by their temp dir, never by name)."""
    procs = procs_of(tmp, port)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=3)
    for p in alive:  # some Ray daemons linger on SIGTERM
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    if not keep_dir:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def autoscaling_head(node_types: dict) -> Iterator[str]:
    """``node_types``: name -> (resources incl. CPU, min_workers, max_workers). Yields the GCS address."""
    tmp = tempfile.mkdtemp(prefix="pdm", dir="/tmp")
    config = os.path.join(tmp, "autoscaling.json")

    def args_for(port: int) -> list[str]:
        with open(config, "w") as f:  # the autoscaler's config names the head's address
            json.dump(_config(node_types, f"127.0.0.1:{port}"), f)
        return ["--node-ip-address=127.0.0.1", "--num-cpus=0", f"--temp-dir={tmp}",
                f"--autoscaling-config={config}", "--include-dashboard=false", "--disable-usage-stats"]

    port = 0
    try:
        port = start_head(tmp, args_for)
        yield f"127.0.0.1:{port}"
    finally:
        stop_head(tmp, port)


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
