"""Tests of WorkerMetrics' counters fed from the engine's running totals (prefix cache, preemptions and
steps, speculative decoding) and of record_engine, which takes the engine's SchedulerStats record."""
from __future__ import annotations

import pytest

from engine.stats import IterationStats, SchedulerStats, SpecDecodeTotals
from metrics import WorkerMetrics
from tests.metrics.helpers import LABELS, value


def test_prefix_cache_counters_follow_engine_totals():
    m = WorkerMetrics(**LABELS)
    m.set_prefix_cache_totals(100, 0)
    m.set_prefix_cache_totals(164, 48)
    m.set_prefix_cache_totals(164, 48)  # no new admissions: no movement
    t = m.render()
    assert value(t, "pdserve:prefix_cache_queries_total") == 164
    assert value(t, "pdserve:prefix_cache_hits_total") == 48
    m.set_prefix_cache_totals(10, 2)  # a new engine restarted its totals: counters never go back
    t = m.render()
    assert value(t, "pdserve:prefix_cache_queries_total") == 174
    assert value(t, "pdserve:prefix_cache_hits_total") == 50
    with pytest.raises(ValueError, match="prefix_cache_hits"):
        m.set_prefix_cache_totals(1, -1)


def test_engine_totals_drive_preemptions_and_iteration_tokens():
    m = WorkerMetrics(**LABELS)
    m.set_engine_totals(preemptions=0, steps=0, scheduled_tokens=0)  # a fresh engine: nothing yet
    m.set_engine_totals(preemptions=0, steps=1, scheduled_tokens=40)  # a 40-token prefill step
    m.set_engine_totals(preemptions=2, steps=2, scheduled_tokens=43)  # a 3-sequence decode step, 2 preemptions
    m.set_engine_totals(preemptions=2, steps=2, scheduled_tokens=43)  # no step since: no movement
    t = m.render()
    assert value(t, "pdserve:num_preemptions_total") == 2
    assert value(t, "pdserve:iteration_tokens_total_count") == 2
    assert value(t, "pdserve:iteration_tokens_total_sum") == 43
    # vLLM's buckets: 1, 8, 16, 32, 64, ...
    assert value(t, "pdserve:iteration_tokens_total_bucket", le="1.0") == 0
    assert value(t, "pdserve:iteration_tokens_total_bucket", le="8.0") == 1
    assert value(t, "pdserve:iteration_tokens_total_bucket", le="32.0") == 1
    assert value(t, "pdserve:iteration_tokens_total_bucket", le="64.0") == 2
    m.set_engine_totals(preemptions=1, steps=1, scheduled_tokens=1)  # a new engine: counters never go back
    t = m.render()
    assert value(t, "pdserve:num_preemptions_total") == 3
    assert value(t, "pdserve:iteration_tokens_total_count") == 3
    assert value(t, "pdserve:iteration_tokens_total_bucket", le="1.0") == 1
    with pytest.raises(ValueError, match="num_scheduled_tokens"):
        m.set_engine_totals(5, 2, -1)
    assert value(m.render(), "pdserve:num_preemptions_total") == 3  # a rejected call moves nothing
    # several steps since the last call share their tokens evenly (a worker reads once per loop pass)
    m.set_engine_totals(preemptions=1, steps=4, scheduled_tokens=31)
    t = m.render()
    assert value(t, "pdserve:iteration_tokens_total_count") == 6
    assert value(t, "pdserve:num_preemptions_total") == 3  # the rejected call's 5 was never taken as seen
    assert value(t, "pdserve:iteration_tokens_total_sum") == 43 + 1 + 30  # three steps of 10 tokens
    assert value(t, "pdserve:iteration_tokens_total_bucket", le="8.0") == 2
    assert value(t, "pdserve:iteration_tokens_total_bucket", le="16.0") == 5  # 1, 3 and the three 10s


def test_spec_decode_totals_move_by_their_differences():
    m = WorkerMetrics(**LABELS)
    m.set_spec_decode_totals(2, 8, 5, [2, 2, 1, 0])
    m.set_spec_decode_totals(3, 12, 6, [3, 2, 1, 0])
    text = m.render()
    assert value(text, "pdserve:spec_decode_num_drafts_total") == 3
    assert value(text, "pdserve:spec_decode_num_draft_tokens_total") == 12
    assert value(text, "pdserve:spec_decode_num_accepted_tokens_total") == 6
    assert [value(text, "pdserve:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
            for i in range(3)] == [3, 2, 1]
    m.set_spec_decode_totals(1, 4, 4, [1, 1, 1, 1])  # a new engine: its totals count from zero again
    assert value(m.render(), "pdserve:spec_decode_num_accepted_tokens_total") == 10
    with pytest.raises(ValueError):
        m.set_spec_decode_totals(-1, 0, 0, [])


def test_record_engine_takes_the_engines_record():
    """A worker hands its metrics the engine's SchedulerStats: gauges take the state, counters the running
    totals' differences (the same as the set_*_totals calls), each new step one iteration_tokens observation."""
    m = WorkerMetrics(**LABELS)

    def record(**kw) -> SchedulerStats:
        base = dict(num_running=0, num_waiting=0, num_free_blocks=10, num_total_blocks=10, num_steps=0,
                    num_scheduled_tokens=0, num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0)
        return SchedulerStats(**{**base, **kw})

    m.record_engine(record())
    m.record_engine(record(graph_steps=0, piecewise_steps=1, ahead_steps=0, num_running=3, num_waiting=2, num_free_blocks=6,
                           num_steps=1, num_scheduled_tokens=40,
                           prefix_cache_queries=48, prefix_cache_hits=16,
                           last_step=IterationStats(num_prefill_tokens=40, num_running=3)))
    t = m.render()
    assert value(t, "pdserve:num_requests_running") == 3
    assert value(t, "pdserve:num_requests_waiting") == 2
    assert value(t, "pdserve:kv_cache_usage_perc") == pytest.approx(0.4)
    assert value(t, "pdserve:prefix_cache_queries_total") == 48
    assert value(t, "pdserve:prefix_cache_hits_total") == 16
    assert value(t, "pdserve:iteration_tokens_total_count") == 1
    assert value(t, "pdserve:iteration_tokens_total_sum") == 40
    assert value(t, "pdserve:engine_steps_total", path="piecewise") == 1
    m.record_engine(record(num_running=3, num_free_blocks=0, num_steps=2, num_scheduled_tokens=43,
                           num_preemptions=1, prefix_cache_queries=48, prefix_cache_hits=16, ahead_steps=1,
                           spec_decode=SpecDecodeTotals(2, 6, 4, (2, 2, 0))))
    t = m.render()
    assert value(t, "pdserve:engine_steps_ahead_total") == 1
    assert value(t, "pdserve:num_requests_waiting") == 0
    assert value(t, "pdserve:kv_cache_usage_perc") == 1.0
    assert value(t, "pdserve:num_preemptions_total") == 1
    assert value(t, "pdserve:iteration_tokens_total_count") == 2
    assert value(t, "pdserve:iteration_tokens_total_sum") == 43
    assert value(t, "pdserve:spec_decode_num_draft_tokens_total") == 6
    assert value(t, "pdserve:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 2
    assert value(t, "pdserve:prefix_cache_queries_total") == 48  # unchanged totals: no movement
    # a record with no blocks at all reads as full (nothing free), not a division by zero
    m.record_engine(record(num_free_blocks=0, num_total_blocks=0, num_steps=2, num_scheduled_tokens=43,
                           num_preemptions=1, prefix_cache_queries=48, prefix_cache_hits=16,
                           spec_decode=SpecDecodeTotals(2, 6, 4, (2, 2, 0))))
    assert value(m.render(), "pdserve:kv_cache_usage_perc") == 1.0


def test_steps_are_counted_by_how_the_model_ran():
    """engine_steps_total{path}: decode graph and piecewise replays from the engine's totals, the other steps
    eager; a new engine's smaller totals restart the base; a record that counts more replays than steps moves
    eager by nothing (never a negative increment, never an error in the worker's loop)."""
    m = WorkerMetrics(**LABELS)
    m.set_step_path_totals(10, 6, 3)
    m.set_step_path_totals(15, 8, 5)
    t = m.render()
    assert [value(t, "pdserve:engine_steps_total", path=p) for p in ("decode_graph", "piecewise", "eager")] == [8, 5, 2]
    m.set_step_path_totals(4, 4, 0)  # a restarted engine
    m.set_step_path_totals(5, 5, 1)
    t = m.render()
    paths = ("decode_graph", "piecewise", "eager")
    assert [value(t, "pdserve:engine_steps_total", path=p) for p in paths] == [13, 6, 2]
