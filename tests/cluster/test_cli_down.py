"""``pdserve down`` and ``pdserve up --namespace``'s start-up clean-up, on a real Redis (and real Ray for the up)."""
from __future__ import annotations

import threading

import redis

from cluster.cli import main
from cluster.launcher import Cluster, ClusterConfig
from cluster.registry import Registry, WorkerInfo
from tests.cluster.stand_in_worker import StandInWorker


def _leave_stale_keys(redis_url: str, ns: str) -> list[str]:
    """What a SIGKILLed run leaves: kvtransfer rendezvous keys (no TTL) and a worker record about to expire."""
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(f"{ns}:kvt/inc/decode-0", b"1")
        client.set(f"{ns}:kvt/inc/prefill-0", b"1")
    finally:
        client.close()
    with Registry(redis_url, ns, ttl_s=0.5) as reg:
        reg.register(WorkerInfo(worker_id="decode-0", role="decode", grpc_address="127.0.0.1:1"))
        return reg.keys()


def test_down_removes_every_key_of_a_dead_run_and_prints_them(redis_url, redis_namespace, capsys):
    left = _leave_stale_keys(redis_url, redis_namespace)
    assert len(left) == 4
    assert main(["down", "--namespace", redis_namespace, "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert Registry(redis_url, redis_namespace).keys() == []
    # The kvtransfer keys never expire, so they are always among the removed.
    for key in (f"{redis_namespace}:kvt/inc/decode-0", f"{redis_namespace}:kvt/inc/prefill-0"):
        assert f"removed {key}" in out, out
    assert main(["down", "--namespace", redis_namespace, "--redis-url", redis_url]) == 0  # nothing left: fine
    assert "removed 0 key(s)" in capsys.readouterr().out


def test_down_refuses_a_namespace_whose_workers_still_heartbeat(redis_url, redis_namespace, capsys):
    reg = Registry(redis_url, redis_namespace, ttl_s=1.0)
    info = WorkerInfo(worker_id="decode-0", role="decode", grpc_address="127.0.0.1:1")
    reg.register(info)
    stop = threading.Event()
    beat = threading.Thread(target=lambda: [reg.heartbeat(info) for _ in iter(lambda: stop.wait(0.2), True)])
    beat.start()
    try:
        rc = main(["down", "--namespace", redis_namespace, "--redis-url", redis_url, "--wait", "1.5"])
        assert rc == 1 and "live workers" in capsys.readouterr().err
        assert reg.get("decode-0") is not None
    finally:
        stop.set()
        beat.join()
    assert main(["down", "--namespace", redis_namespace, "--redis-url", redis_url, "--wait", "-1"]) == 2


def test_up_with_a_named_namespace_clears_a_dead_runs_keys_first(ray_local, redis_url, redis_namespace):
    _leave_stale_keys(redis_url, redis_namespace)
    cfg = ClusterConfig(redis_url=redis_url, namespace=redis_namespace, worker_factory=StandInWorker,
                        router_factory=False, num_prefill=0, num_decode=1, ttl_s=2.0, heartbeat_interval_s=0.5,
                        start_timeout_s=300)
    with Cluster(cfg) as cluster:
        keys = Registry(redis_url, redis_namespace).keys()
        # The new run's own worker is decode-0 again (ids restart per run); the dead run's kvt keys are gone.
        assert not [k for k in keys if ":kvt" in k], keys
        assert cluster.worker_ids("decode") == ["decode-0"]
        assert [w.worker_id for w in Registry(redis_url, redis_namespace).list()] == ["decode-0"]
