"""Cluster pool mechanics on real Ray + real Redis, with the model-free stand-in role.

The real roles are exercised end to end in tests/e2e; here the launcher's own
jobs are checked: actors placed with the pool resources, registered and
heartbeating, scaled up and drained down, silent workers expiring, and
nothing left behind.
"""
from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.launcher import Cluster, ClusterConfig
from cluster.registry import Registry
from cluster.worker_actor import actor_options, pool_resources
from tests.cluster.stand_in_worker import StandInWorker
from tests.waiting import wait_until


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _config(redis_url: str, **kw) -> ClusterConfig:
    return ClusterConfig(redis_url=redis_url, worker_factory=StandInWorker, router_factory=False,
                         ttl_s=2.0, heartbeat_interval_s=0.5, start_timeout_s=300, **kw)


def _actor_gone(handle, timeout_s: float = 10.0) -> bool:
    def gone() -> bool:
        try:
            ray.get(handle.pid.remote(), timeout=2)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return True
        return False

    try:
        return wait_until(gone, timeout=timeout_s, interval=0.2, message="actor still answers")
    except AssertionError:
        return False


def test_pools_register_scale_drain_and_leave_nothing(ray_local, redis_url):
    cluster = Cluster(_config(redis_url, num_prefill=1, num_decode=1)).start()
    try:
        reg = Registry(redis_url, cluster.namespace)
        assert [w.worker_id for w in reg.list("prefill")] == ["prefill-0"]
        assert [w.worker_id for w in reg.list("decode")] == ["decode-0"]
        for w in reg.list():
            assert w.ready and w.node_id, w
            assert _health(w.grpc_address) == health_pb2.HealthCheckResponse.SERVING
        # Each actor's torch uses exactly its CPU share.
        assert ray.get(cluster.actors("prefill")[0].torch_threads.remote()) == 1

        infos = cluster.scale_pool("decode", 2)
        assert [i.worker_id for i in infos] == ["decode-0", "decode-1"]
        assert [w.worker_id for w in reg.list("decode")] == ["decode-0", "decode-1"]

        leaving = cluster.actors("decode")[1]
        leaving_addr = reg.get("decode-1").grpc_address
        cluster.scale_pool("decode", 1)
        # Drained: out of routing at once, its server and actor gone.
        assert [w.worker_id for w in reg.list("decode")] == ["decode-0"]
        assert _actor_gone(leaving)
        with pytest.raises(grpc.RpcError):
            _health(leaving_addr)
        # New workers get fresh ids (a restarted pool never reuses a live id).
        cluster.scale_pool("prefill", 2)
        assert cluster.worker_ids("prefill") == ["prefill-0", "prefill-1"]
        handles = cluster.actors("prefill") + cluster.actors("decode")
    finally:
        cluster.stop()
    assert all(_actor_gone(h) for h in handles)
    assert reg.keys() == []
    cluster.stop()  # idempotent


def test_dead_worker_leaves_routing_within_5s_and_is_replaced(ray_local, redis_url):
    with Cluster(_config(redis_url, num_prefill=1, num_decode=0)) as cluster:
        reg = Registry(redis_url, cluster.namespace)
        assert len(reg.list("prefill")) == 1
        # A crash, not a drain: no deregister, only the missing heartbeats tell.
        ray.kill(cluster.actors("prefill")[0], no_restart=True)
        start = time.monotonic()
        wait_until(lambda: reg.list("prefill") == [], timeout=6, interval=0.1,
                   message="the dead worker's record is still listed")
        assert reg.list("prefill") == [] and time.monotonic() - start < 5.0
        # scale_pool counts live workers: the dead one is replaced under a fresh id.
        infos = cluster.scale_pool("prefill", 1)
        assert [i.worker_id for i in infos] == ["prefill-1"] == cluster.worker_ids("prefill")
        assert [w.worker_id for w in reg.list("prefill")] == ["prefill-1"]


def test_two_clusters_on_one_redis_stay_apart(ray_local, redis_url):
    with Cluster(_config(redis_url, num_prefill=1, num_decode=0)) as a, \
            Cluster(_config(redis_url, num_prefill=0, num_decode=1)) as b:
        assert a.namespace != b.namespace
        ra, rb = Registry(redis_url, a.namespace), Registry(redis_url, b.namespace)
        assert [w.role for w in ra.list()] == ["prefill"]
        assert [w.role for w in rb.list()] == ["decode"]


def test_placement_resources_follow_node_labels():
    assert pool_resources("prefill", {"CPU": 4, "prefill": 2}) == {"prefill": 0.01}
    assert pool_resources("decode", {"CPU": 4, "prefill": 2}) == {}
    assert pool_resources("colocated", {"CPU": 4, "prefill": 2, "decode": 2}) == {}
    opts = actor_options("decode", 2, cluster_resources={"decode": 1})
    assert opts["num_cpus"] == 2 and opts["resources"] == {"decode": 0.01}
    assert opts["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "2"
    with pytest.raises(ValueError, match="num_cpus"):
        actor_options("decode", 0, cluster_resources={})


def test_bad_config_and_scale_arguments(ray_local, redis_url):
    with pytest.raises(ValueError, match="num_prefill"):
        ClusterConfig(num_prefill=-1)
    with pytest.raises(ValueError, match="router_port"):
        ClusterConfig(router_port=70000)
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        ClusterConfig(ttl_s=1.0, heartbeat_interval_s=2.0)
    with Cluster(_config(redis_url, num_prefill=0, num_decode=0)) as cluster:
        with pytest.raises(ValueError, match="role"):
            cluster.scale_pool("router", 1)
        with pytest.raises(ValueError, match="n must"):
            cluster.scale_pool("decode", -1)
    with pytest.raises(RuntimeError, match="not running"):
        cluster.scale_pool("decode", 1)


def test_stop_interrupts_a_slow_scale_up(ray_local, redis_url, tmp_path):
    load_file = str(tmp_path / "load.json")
    cluster = Cluster(_config(redis_url, num_prefill=0, num_decode=0,
                              engine_overrides={"load_file": load_file})).start()
    starting = tmp_path / "starting"
    with open(load_file, "w") as f:  # every new worker "loads a model" for a minute
        json.dump({"start_delay_s": 60, "starting_file": str(starting)}, f)
    errors: list = []
    scaler = threading.Thread(target=lambda: _catch(errors, cluster.scale_pool, "prefill", 1))
    scaler.start()
    wait_until(starting.exists, timeout=30, interval=0.05, message="the actor never entered its slow start")
    t0 = time.monotonic()
    cluster.stop()
    scaler.join(30)
    assert time.monotonic() - t0 < 15, "stop() waited for the slow start"
    assert len(errors) == 1 and "stopping" in str(errors[0]), errors
    assert Registry(redis_url, cluster.namespace).keys() == []


def _catch(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as e:
        errors.append(e)
