"""Workers outlive their Redis: stopped, then restarted EMPTY on the same port, it gets every worker back.

Real parts: a private ``EmbeddedRedis`` (so the session's shared one is not
disturbed), a real local Ray, worker actors with the model-free stand-in role
and the ``Supervisor`` running (it must not mistake a Redis outage for dead
workers: its probes go to the actors, not to Redis).
"""
from __future__ import annotations

from typing import Callable

import ray

from cluster.launcher import Cluster, ClusterConfig
from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from cluster.registry import Registry
from cluster.supervisor import Supervisor, SupervisorConfig
from tests.cluster.stand_in_worker import StandInWorker
from tests.waiting import wait_until


def _wait(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    wait_until(cond, timeout=timeout_s, interval=0.1, message=f"timed out waiting for {what}")


def _stats(cluster: Cluster) -> list[dict]:
    handles = cluster.actors("prefill") + cluster.actors("decode")
    return ray.get([h.heartbeat_stats.remote() for h in handles], timeout=30)


def _listed(reg: Registry) -> list[str]:
    try:
        return [w.worker_id for w in reg.list()]
    except Exception:  # Redis still starting
        return []


def test_workers_reregister_into_a_restarted_empty_redis(ray_local):
    redis = EmbeddedRedis().start()
    port = redis.port
    cfg = ClusterConfig(redis_url=redis.url, worker_factory=StandInWorker, router_factory=False,
                        num_prefill=1, num_decode=1, ttl_s=2.0, heartbeat_interval_s=0.5, start_timeout_s=300)
    cluster = Cluster(cfg).start()
    supervisor = Supervisor(cluster, SupervisorConfig(check_interval_s=0.5)).start()
    try:
        reg = Registry(redis.url, cluster.namespace)
        ids = ["decode-0", "prefill-0"]
        assert _listed(reg) == ids

        redis.stop()
        # Every worker notices (several heartbeats fail, with backoff) and stays up.
        _wait(lambda: all(s["failing"] >= 3 for s in _stats(cluster)), 60, "failing heartbeats")
        assert all(s["alive"] for s in _stats(cluster))

        redis = EmbeddedRedis(RedisServerConfig(port=port, password=redis.password)).start()  # same port, no data
        assert redis.url == reg.redis_url
        _wait(lambda: _listed(reg) == ids, 60, "both workers back in the registry")
        # Record and index set both came back (list() reads the index, get() the record).
        assert all(reg.get(i) is not None for i in ids)
        assert sorted(k.split(":", 1)[1] for k in reg.keys()) == ["worker:decode-0", "worker:prefill-0", "workers"]
        stats = _stats(cluster)
        assert all(s["alive"] and s["failing"] == 0 and s["reregistrations"] >= 1 for s in stats), stats
        # The outage was not mistaken for dead workers.
        assert supervisor.replacements == [] and cluster.worker_ids("decode") == ["decode-0"]
    finally:
        supervisor.stop()
        cluster.stop()
        redis.stop()
