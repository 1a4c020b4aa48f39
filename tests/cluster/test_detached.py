"""Detached mode (the controller's ``Cluster``) on real Ray + real Redis, with the model-free stand-in role.

The split deployment runs end to end in tests/e2e/test_deployment.py (processes, real roles). Here the
launcher's own rules are checked quickly, in one process: a detached controller's stop leaves its named
workers serving; the next one adopts them (same ids, same actors), grows a pool under its own generation
and never shrinks one; workers of another model are replaced, then retired; a second controller cannot
take the lease while the first holds it; teardown stops every worker and deletes every key.
"""
from __future__ import annotations

import threading
import time

import pytest
import ray

from cluster.launcher import Cluster, ClusterConfig
from cluster.ownership import ControllerLease, detached_workers
from cluster.registry import Registry
from tests.cluster.stand_in_worker import StandInWorker
from tests.waiting import wait_until


def _cfg(redis_url: str, ns: str, **kw) -> ClusterConfig:
    return ClusterConfig(**{"redis_url": redis_url, "namespace": ns, "detached": True, "worker_factory": StandInWorker,
                            "router_factory": False, "ttl_s": 2.0, "heartbeat_interval_s": 0.5,
                            "start_timeout_s": 600, "num_prefill": 1, "num_decode": 1, **kw})


def test_controllers_come_and_go_workers_stay(ray_local, redis_url, redis_namespace):
    ns = redis_namespace
    reg = Registry(redis_url, ns)
    c1 = Cluster(_cfg(redis_url, ns)).start()
    first = {w.worker_id: w.grpc_address for w in reg.list()}
    assert sorted(first) == [f"decode-{c1.generation}-0", f"prefill-{c1.generation}-0"]
    handles = detached_workers(ns)
    assert sorted(handles) == sorted(first)
    pids = {wid: ray.get(h.pid.remote()) for wid, h in handles.items()}
    c1.stop()  # detached: the workers stay, and so do their keys
    assert {w.worker_id: w.grpc_address for w in reg.list()} == first

    c2 = Cluster(_cfg(redis_url, ns, num_decode=2)).start()
    try:
        assert c2.generation != c1.generation
        assert sorted(c2.adopted) == sorted(first)
        assert c2.worker_ids("decode") == [f"decode-{c1.generation}-0", f"decode-{c2.generation}-0"]
        assert {wid: ray.get(h.pid.remote()) for wid, h in detached_workers(ns).items() if wid in pids} == pids
        # a second controller waits for the lease, then gives up naming the holder
        with pytest.raises(TimeoutError, match=f"generation {c2.generation}"):
            ControllerLease(redis_url, ns, "other1").acquire(wait_s=1.0)
    finally:
        c2.stop()
    # fewer wanted than there are: adoption never shrinks a pool
    c3 = Cluster(_cfg(redis_url, ns, num_decode=1)).start()
    try:
        assert len(c3.worker_ids("decode")) == 2 and not [w for w in c3.worker_ids("decode") if c3.generation in w]
    finally:
        c3.teardown()
    assert detached_workers(ns) == {}
    assert reg.keys() == []
    reg.close()


def test_workers_of_another_model_are_replaced_then_retired(ray_local, redis_url, redis_namespace):
    ns = redis_namespace
    reg = Registry(redis_url, ns)
    c1 = Cluster(_cfg(redis_url, ns, num_decode=0, served_model_name="old-model")).start()
    old = c1.worker_ids("prefill")
    old_handle = detached_workers(ns)[old[0]]
    c1.stop()
    c2 = Cluster(_cfg(redis_url, ns, num_decode=0, served_model_name="new-model")).start()
    try:
        assert c2.adopted == []
        assert c2.worker_ids("prefill") == [f"prefill-{c2.generation}-0"]
        assert [(w.worker_id, w.model_name) for w in reg.list()] == [(f"prefill-{c2.generation}-0", "new-model")]
        def old_gone() -> bool:
            try:
                ray.get(old_handle.pid.remote(), timeout=2)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return True
            return False

        wait_until(old_gone, timeout=30, interval=0.2, message="the old model's worker still runs")
    finally:
        c2.teardown()
    assert reg.keys() == []
    reg.close()


def test_detached_needs_a_namespace_and_a_lasting_ray():
    with pytest.raises(ValueError, match="namespace must be set"):
        ClusterConfig(detached=True)


def test_a_lost_lease_says_why(redis_url, redis_namespace):
    """The lease is lost to another owner (the message names its generation) or because Redis stopped answering (the
    message names Redis, not a successor that does not exist: the soak's controller said "another controller took
    the deployment's lease" while Redis was down)."""
    import redis as redis_lib

    from cluster.redis_server import EmbeddedRedis

    taken = ControllerLease(redis_url, redis_namespace, "mine1", ttl_s=0.6).acquire(wait_s=1.0)
    try:
        r = redis_lib.Redis.from_url(redis_url)
        r.set(taken.key, "thief1")  # another owner, as a split brain would leave it
        assert taken.lost.wait(10.0)
        assert "generation thief1" in taken.lost_reason
        r.delete(taken.key)
        r.close()
    finally:
        taken.release()
    server = EmbeddedRedis().start()
    try:
        lease = ControllerLease(server.url, redis_namespace, "mine2", ttl_s=0.6).acquire(wait_s=1.0)
    finally:
        server.stop()  # Redis goes away while the lease is held
    try:
        assert lease.lost.wait(15.0)
        assert "did not answer" in lease.lost_reason and "took" not in lease.lost_reason
    finally:
        lease._stop.set()


def test_a_lease_taken_while_redis_is_paused_waits_for_it_and_says_so_when_it_never_answers(redis_namespace):
    """A controller started while its Redis stalls (paused, as a starved host or a failover leaves it) waits for it
    until the start deadline instead of exiting on the first socket timeout (a controller of the head-loss test
    died so beside busy cores: "failed: TimeoutError: Timeout reading from socket"); one that never answers ends at
    the deadline with a message naming Redis."""
    import os
    import signal

    from cluster.redis_server import EmbeddedRedis

    server = EmbeddedRedis().start()
    resumed = None
    try:
        os.kill(server.pid, signal.SIGSTOP)
        # 12 s: past the client's own retries (4 tries of a 2 s socket timeout), so only the lease's waiting helps
        resumed = threading.Timer(12.0, os.kill, (server.pid, signal.SIGCONT))
        resumed.start()
        t0 = time.monotonic()
        lease = ControllerLease(server.url, redis_namespace, "paused1", ttl_s=5.0).acquire(wait_s=120.0)
        try:
            assert time.monotonic() - t0 >= 11.0 and lease.holder() == "paused1"
        finally:
            lease.release()
        resumed.join()
        os.kill(server.pid, signal.SIGSTOP)
        with pytest.raises(TimeoutError, match=r"Redis at .* did not answer for the controller lease"):
            ControllerLease(server.url, redis_namespace, "paused2", ttl_s=5.0).acquire(wait_s=3.0)
    finally:
        if resumed is not None:
            resumed.cancel()
        os.kill(server.pid, signal.SIGCONT)
        server.stop()
