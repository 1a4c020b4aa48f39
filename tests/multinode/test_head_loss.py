"""Ray head loss with GCS fault tolerance: detached workers on another raylet keep serving, the controller adopts.

Real processes throughout: a Ray head started with ``RAY_REDIS_ADDRESS`` (its GCS tables in the session's
Redis, under the test's namespace), one worker node joined with ``ray start --address`` (a second raylet,
offering ``prefill`` and ``decode``; the head offers no CPU, so both detached workers land there), a
``pdserve controller --address`` (a Ray driver) and a ``pdserve router`` (no Ray), and greedy requests
streaming through the router on two client threads the whole time.

1. ``kill -9`` of the GCS: requests go on being served while it is down (the router reads the registry and
   talks to the workers over gRPC; the workers heartbeat to Redis, not to Ray); the GCS is restarted with
   its own arguments and reloads its tables from Redis: the worker node is still alive in it, and the
   controller is still the same process (its driver reconnected).
2. ``kill -9`` of the whole head node (GCS, head raylet, monitor, dashboard) and of the controller (a Ray
   driver, as after a head pod's loss): requests are still served; ``ray start --head`` on the same port
   reloads the session from Redis; a new controller takes the lease and adopts both workers (same ids, same
   gRPC addresses: the same processes), then serves through the router.

No request may fail (no worker process dies, so nothing is in flight on a dead process) and every result
equals the offline engine's. What this does not cover: a Redis lost together with the head (the tables are
gone; docs/reliability.md), and KubeRay's own restart of a head pod (the head here is restarted by the test).
"""
from __future__ import annotations

import re
import secrets
import subprocess
import sys
import uuid

from cluster.registry import Registry
from tests.e2e.helpers import mixed_prompts
from tests.e2e.test_pdserve_up import UpProcess
from tests.multinode.ray_nodes import FaultTolerantHead
from tests.multinode.test_multinode import Load
from tests.waiting import wait_until

GREEDY = dict(max_tokens=16, temperature=0.0, ignore_eos=True)

_NODES = """
import json, ray
ray.init(address={address!r}, logging_level="ERROR", log_to_driver=False)
print(json.dumps([[n["NodeID"], n["Alive"], sorted(n["Resources"])] for n in ray.nodes()]))
"""


def _live_worker_nodes(head: FaultTolerantHead) -> set[str]:
    """The ids of the live nodes offering ``decode``, read by a short-lived driver through the GCS."""
    import json

    r = subprocess.run([sys.executable, "-c", _NODES.format(address=head.address)], capture_output=True, text=True,
                       timeout=60, env=head.env)
    assert r.returncode == 0, r.stderr[-2000:]
    return {n for n, alive, res in json.loads(r.stdout.strip().splitlines()[-1]) if alive and "decode" in res}


def _served_more(load: Load, more: int, what: str) -> None:
    served = len(load.results)
    wait_until(lambda: len(load.results) >= served + more or load.errors, timeout=120, interval=0.1,
               message=f"{more} requests served {what}")
    assert not load.errors, load.errors[:3]


def test_head_loss_spares_workers_on_other_nodes_and_a_new_controller_adopts_them(redis_url):
    ns = f"ha-{uuid.uuid4().hex[:8]}"
    env = dict(PDSERVE_REDIS_URL=redis_url, PDSERVE_CLUSTER_SECRET=secrets.token_urlsafe(32))
    head = FaultTolerantHead(redis_url, ns)
    registry = Registry(redis_url, ns)
    procs: list[UpProcess] = []
    load = None

    def spawn(command: str, *args: str) -> UpProcess:
        p = UpProcess(*args, env=dict(head.env, **env), command=command)
        procs.append(p)
        return p

    try:
        head.start()
        head.add_node({"prefill": 1, "decode": 1}, cpus=2)
        pool = ("--address", head.address, "--namespace", ns, "--num-kv-blocks", "64", "--check-interval", "0.5")
        c1 = spawn("controller", *pool)
        c1.wait_serving(240)
        router = spawn("router", "--namespace", ns)
        router.wait_serving(120)
        workers = {w.worker_id: w.grpc_address for w in registry.list()}
        assert len(workers) == 2, workers
        worker_node = _live_worker_nodes(head)
        assert len(worker_node) == 1

        load = Load(router.router, 2, mixed_prompts(10), **GREEDY)
        _served_more(load, 4, "before the fault")

        # 1. The GCS alone.
        head.kill_gcs()
        _served_more(load, 6, "while the GCS is down")
        assert head.gcs() is None
        head.restart_gcs()
        wait_until(lambda: _live_worker_nodes(head) == worker_node, timeout=120, interval=1.0,
                   message="the worker node alive in the restarted GCS")
        _served_more(load, 4, "after the GCS restart")
        assert c1.proc.poll() is None, c1.tail()  # the controller's driver reconnected to the new GCS

        # 2. The whole head node, and the controller with it.
        head.kill_head()
        c1.proc.kill()
        c1.proc.wait(30)
        _served_more(load, 6, "while the head and the controller are down")
        head.restart_head()
        wait_until(lambda: _live_worker_nodes(head) == worker_node, timeout=120, interval=1.0,
                   message="the worker node alive under the new head")
        c2 = spawn("controller", *pool)
        c2.wait_serving(240)
        adopted = re.search(r"adopted  (.*)", "\n".join(c2.lines)).group(1)
        assert sorted(adopted.split(", ")) == sorted(workers), c2.lines
        assert {w.worker_id: w.grpc_address for w in registry.list()} == workers  # the same processes
        _served_more(load, 4, "after the new controller adopted")
        load.stop()
        load.check_equal_offline()
        load = None
    finally:
        if load is not None:
            load.stop()
        for p in reversed(procs):
            p.close()
        subprocess.run([sys.executable, "-m", "cluster.cli", "down", "--address", head.address, "--namespace", ns],
                       env=dict(head.env, **env), capture_output=True, timeout=180)
        head.close()
        registry.close()
