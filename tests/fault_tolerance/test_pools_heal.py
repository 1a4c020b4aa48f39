"""Pools heal: a worker killed with SIGKILL is replaced under a new id and the cluster serves again.

One real cluster (Ray actors, the Redis registry, gRPC on loopback, KV over
gloo, the tiny model) with 1 prefill + 1 decode worker and a ``Supervisor``
checking every 0.5 s. Each test SIGKILLs one worker's process (a crash: no
drain, no deregister) and waits, on conditions with a deadline, for the pool
to be back at one live ready worker under a NEW id, the dead id gone from the
registry, and a greedy request through the router equal to the offline
engine's output.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch

from cluster.launcher import Cluster, ClusterConfig
from cluster.registry import Registry
from cluster.supervisor import Supervisor, SupervisorConfig
from engine.sampling_params import SamplingParams
from tests.e2e.helpers import generate, offline
from tests.fault_tolerance.load import heal_deadline_s
from tests.waiting import wait_until

PROMPT = "def main(argv=None) -> int:"


@pytest.fixture(scope="module")
def healing(ray_local, redis_url):
    torch.set_num_threads(1)
    cfg = ClusterConfig(model="tiny", num_prefill=1, num_decode=1, redis_url=redis_url,
                        engine_overrides=dict(num_kv_blocks=256), start_timeout_s=600)
    t0 = time.monotonic()
    cluster = Cluster(cfg).start()
    deadline = heal_deadline_s(time.monotonic() - t0)  # 30 s, or more where this machine starts workers slower
    supervisor = Supervisor(cluster, SupervisorConfig(check_interval_s=0.5, probe_timeout_s=10.0)).start()
    try:
        yield cluster, supervisor, deadline
    finally:
        supervisor.stop()
        cluster.stop()


def _greedy_matches_offline(address: str) -> None:
    ref = offline([PROMPT], [SamplingParams(max_tokens=12, temperature=0.0)])[0]
    got = generate(address, prompt=PROMPT, max_tokens=12, temperature=0.0)
    assert got[:3] == ref, (got[:3], ref)


def _healed(cluster: Cluster, supervisor: Supervisor, reg: Registry, role: str, dead: str) -> bool:
    ids = cluster.worker_ids(role)
    listed = [w.worker_id for w in reg.list(role)]
    return (len(ids) == 1 and ids[0] != dead and supervisor.live_ready(role) == ids
            and listed == ids and reg.get(dead) is None)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_sigkilled_worker_is_replaced_under_a_new_id(healing, redis_url, role):
    cluster, supervisor, deadline = healing
    reg = Registry(redis_url, cluster.namespace)
    _greedy_matches_offline(cluster.router_address)  # serving before the crash

    [(dead, handle)] = cluster.members(role)
    pid = ray.get(handle.pid.remote(), timeout=30)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: _healed(cluster, supervisor, reg, role, dead), timeout=deadline, interval=0.1,
               message=lambda: (f"{role} pool not healed within {deadline:.0f} s: members "
                                f"{cluster.worker_ids(role)}, registry {[w.worker_id for w in reg.list(role)]}, "
                                f"live {supervisor.live_ready(role)}"))
    healed_s = time.monotonic() - t0
    print(f"\n{role}: {dead} (pid {pid}) SIGKILLed, replaced by {cluster.worker_ids(role)[0]} "
          f"in {healed_s:.1f} s")

    [(_, _, failed, new)] = [r for r in supervisor.replacements if dead in r[2]]
    assert failed == [dead] and new == cluster.worker_ids(role)
    # The other pool was left alone.
    other = "prefill" if role == "decode" else "decode"
    assert len(cluster.worker_ids(other)) == 1
    _greedy_matches_offline(cluster.router_address)
