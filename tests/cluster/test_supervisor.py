"""The supervisor's decision rule over plain data: which workers fail, how many to start, what carries over."""
from __future__ import annotations

import pytest

from cluster.supervisor import DEAD, MISS, OK, PoolPlan, Probe, SupervisorConfig, plan_pool


def _ok(worker_id: str, ready: bool = True) -> Probe:
    return Probe(worker_id, OK, ready=ready)


def test_healthy_pool_is_left_alone():
    plan = plan_pool([_ok("decode-0"), _ok("decode-1")], {}, floor=1, max_missed=3)
    assert plan == PoolPlan(failed=[], add=0, missed={}, live_ready=["decode-0", "decode-1"])


def test_a_dead_actor_fails_at_once_and_is_replaced_one_for_one():
    plan = plan_pool([_ok("decode-0"), Probe("decode-1", DEAD), _ok("decode-2")], {}, floor=1, max_missed=3)
    assert plan.failed == ["decode-1"] and plan.add == 1
    assert plan.live_ready == ["decode-0", "decode-2"]


def test_a_pool_grown_past_its_floor_keeps_its_size():
    plan = plan_pool([Probe("p-3", DEAD), Probe("p-4", DEAD), _ok("p-5")], {}, floor=1, max_missed=3)
    assert plan.failed == ["p-3", "p-4"] and plan.add == 2


def test_a_stuck_worker_fails_only_after_max_missed_misses_in_a_row():
    missed: dict = {}
    for n in (1, 2):
        plan = plan_pool([Probe("d-0", MISS), _ok("d-1")], missed, floor=2, max_missed=3)
        assert plan.failed == [] and plan.add == 0 and plan.missed == {"d-0": n}
        assert plan.live_ready == ["d-1"]  # a silent worker is not counted live by the planner
        missed = plan.missed
    plan = plan_pool([Probe("d-0", MISS), _ok("d-1")], missed, floor=2, max_missed=3)
    assert plan.failed == ["d-0"] and plan.add == 1 and plan.missed == {}


def test_an_answer_resets_the_miss_count():
    plan = plan_pool([_ok("d-0")], {"d-0": 2}, floor=1, max_missed=3)
    assert plan.missed == {} and plan.failed == []
    plan = plan_pool([Probe("d-0", MISS)], plan.missed, floor=1, max_missed=3)
    assert plan.missed == {"d-0": 1} and plan.failed == []


def test_a_pool_below_its_floor_grows_back():
    assert plan_pool([], {}, floor=2, max_missed=3).add == 2          # every worker gone (or a failed start)
    assert plan_pool([_ok("p-0")], {}, floor=2, max_missed=3).add == 1
    assert plan_pool([Probe("p-0", DEAD)], {}, floor=0, max_missed=1).add == 1  # size 1 is kept even at floor 0
    assert plan_pool([], {}, floor=0, max_missed=1).add == 0


def test_alive_but_not_ready_is_neither_failed_nor_live_ready():
    plan = plan_pool([_ok("d-0", ready=False)], {}, floor=1, max_missed=1)
    assert plan.failed == [] and plan.add == 0 and plan.live_ready == []


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="outcome"):
        plan_pool([Probe("d-0", "zombie")], {}, floor=1, max_missed=3)
    with pytest.raises(ValueError, match="max_missed"):
        SupervisorConfig(max_missed=0)
    with pytest.raises(ValueError, match="check_interval_s"):
        SupervisorConfig(check_interval_s=0)
    with pytest.raises(ValueError, match="floors"):
        SupervisorConfig(floors={"decode": -1})
