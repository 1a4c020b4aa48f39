"""The planner: its decision rule, and scaling a real cluster (Ray actors, Redis registry) on reported load."""
from __future__ import annotations

import json
import os

import pytest

from cluster.launcher import Cluster, ClusterConfig
from cluster.planner import Planner, PlannerConfig, decide
from cluster.registry import Registry, WorkerInfo
from tests.cluster.stand_in_worker import StandInWorker
from tests.waiting import wait_until

CFG = PlannerConfig(min_prefill=1, max_prefill=3, min_decode=1, max_decode=2,
                    prefill_tokens_high=1000, prefill_tokens_low=100, kv_usage_high=0.8, kv_usage_low=0.3)


def _p(queued: int, ready: bool = True) -> WorkerInfo:
    return WorkerInfo(worker_id="p", role="prefill", queued_prompt_tokens=queued, ready=ready)


def _d(free: int, total: int = 100, waiting: int = 0) -> WorkerInfo:
    return WorkerInfo(worker_id="d", role="decode", num_free_blocks=free, num_total_blocks=total,
                      num_waiting=waiting, ready=True)


def test_prefill_scales_on_queued_tokens_per_worker():
    assert decide("prefill", [_p(1500), _p(700)], 2, CFG) == 3        # mean 1100 > 1000
    assert decide("prefill", [_p(1500), _p(300)], 2, CFG) == 2        # mean 900: hold
    assert decide("prefill", [_p(50), _p(100)], 2, CFG) == 1          # mean 75 < 100
    assert decide("prefill", [_p(5000)] * 3, 3, CFG) == 3             # at max
    assert decide("prefill", [_p(0)], 1, CFG) == 1                    # at min
    assert decide("prefill", [_p(5000, ready=False)], 1, CFG) == 1    # nothing ready: no judgement


def test_decode_scales_on_kv_usage_and_waiting():
    assert decide("decode", [_d(free=10)], 1, CFG) == 2               # 90 % used
    assert decide("decode", [_d(free=50, waiting=1)], 1, CFG) == 2    # a request waits for blocks
    assert decide("decode", [_d(free=90), _d(free=80)], 2, CFG) == 1  # 15 % used
    assert decide("decode", [_d(free=90, waiting=2), _d(free=80)], 2, CFG) == 2  # low usage but waiting


def test_out_of_bounds_pools_snap_back_at_once():
    assert decide("decode", [], 0, CFG) == 1        # a crash left it below the floor
    assert decide("prefill", [_p(0)] * 5, 5, CFG) == 3


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="max_decode"):
        PlannerConfig(min_decode=3, max_decode=2)
    with pytest.raises(ValueError, match="kv_usage"):
        PlannerConfig(kv_usage_low=0.9, kv_usage_high=0.5)
    with pytest.raises(ValueError, match="prefill_tokens"):
        PlannerConfig(prefill_tokens_low=10, prefill_tokens_high=5)


def _set_load(path: str, **load) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(load, f)
    os.replace(path + ".tmp", path)


def _wait_registry(reg: Registry, role: str, pred, timeout_s: float = 5.0) -> list[WorkerInfo]:
    seen: list = [None]

    def matched() -> bool:
        seen[0] = reg.list(role)
        return bool(pred(seen[0]))

    wait_until(matched, timeout=timeout_s, interval=0.1, message=f"registry of {role} never matched")
    return seen[0]


def test_planner_grows_and_shrinks_a_real_pool(ray_local, redis_url, tmp_path):
    load_file = str(tmp_path / "load.json")
    _set_load(load_file, queued_prompt_tokens=5000)
    cfg = ClusterConfig(num_prefill=1, num_decode=1, redis_url=redis_url, worker_factory=StandInWorker,
                        router_factory=False, ttl_s=2.0, heartbeat_interval_s=0.3,
                        engine_overrides={"load_file": load_file})
    with Cluster(cfg) as cluster:
        reg = Registry(redis_url, cluster.namespace)
        planner = Planner(cluster, PlannerConfig(min_prefill=1, max_prefill=2, min_decode=1, max_decode=1,
                                                 prefill_tokens_high=1000, prefill_tokens_low=100,
                                                 cooldown_s=0.0, interval_s=0.2))
        _wait_registry(reg, "prefill", lambda i: i and i[0].queued_prompt_tokens == 5000)
        planner.tick()
        assert cluster.worker_ids("prefill") == ["prefill-0", "prefill-1"]
        planner.tick()  # at max: no third worker
        assert len(cluster.worker_ids("prefill")) == 2 and cluster.worker_ids("decode") == ["decode-0"]

        # Load falls: the planner thread drains one prefill worker away (the newest).
        _set_load(load_file, queued_prompt_tokens=0)
        planner.start()
        try:
            wait_until(lambda: len(cluster.worker_ids("prefill")) <= 1, timeout=20, interval=0.2,
                       message="the planner never drained a prefill worker")
        finally:
            planner.stop()
        assert cluster.worker_ids("prefill") == ["prefill-0"]
        assert [w.worker_id for w in reg.list("prefill")] == ["prefill-0"]
        assert [(role, old, new) for _t, role, old, new in planner.decisions] == [
            ("prefill", 1, 2), ("prefill", 2, 1)]
