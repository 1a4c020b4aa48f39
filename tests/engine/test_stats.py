"""engine/stats.py: the per-step IterationStats each step emits and the SchedulerStats record, checked
against the engine's own running totals over real runs of the built-in tiny model."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.speculative import SpeculativeConfig
from engine.stats import IterationStats, SchedulerStats

BS = 16


def _engine(**kw) -> LLMEngine:
    torch.set_num_threads(1)
    return LLMEngine(EngineConfig(model="tiny", block_size=BS, **{"num_kv_blocks": 64, **kw}))


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _run(eng: LLMEngine, prompts: dict[str, list[int]], n: int) -> list[IterationStats]:
    """Add the prompts, step to completion; every step's record, checked to be a new one per batch run."""
    for rid, p in prompts.items():
        eng.add_request(rid, p, _params(n))
    records = []
    for _ in range(10_000):
        if not eng.has_unfinished_requests():
            return records
        steps = eng.num_steps
        eng.step()
        if eng.num_steps > steps:
            records.append(eng.last_step_stats)
    raise AssertionError("engine did not finish")


def _prompt(n: int, start: int = 100) -> list[int]:
    return [start + (i * 37) % 4000 for i in range(n)]


def test_a_fresh_engine_has_an_empty_record():
    eng = _engine()
    s = eng.make_stats()
    assert isinstance(s, SchedulerStats) and eng.last_step_stats is None
    assert (s.num_running, s.num_waiting, s.num_steps, s.num_scheduled_tokens, s.num_preemptions) == (0, 0, 0, 0, 0)
    assert (s.num_free_blocks, s.num_total_blocks, s.kv_cache_usage) == (64, 64, 0.0)
    assert s.last_step is None and s.spec_decode.num_drafts == 0 and s.spec_decode.accepted_per_pos == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_running = 3  # type: ignore[misc]


def test_steps_split_prefill_and_decode_and_sum_to_the_totals():
    """A 40-token prompt in chunks of 16 (16, 16, then 8), then one decode position per step; a second
    request with the same prompt reuses two cached blocks and prefills the rest."""
    eng = _engine(max_num_batched_tokens=16)
    prompt = _prompt(40)
    first = _run(eng, {"a": prompt}, 4)
    assert [(r.num_prefill_tokens, r.num_decode_tokens, r.num_running) for r in first] == \
        [(16, 0, 1), (16, 0, 1), (8, 0, 1), (0, 1, 1), (0, 1, 1), (0, 1, 1)]
    assert first[0].prefix_cache_queries == 40 and first[0].prefix_cache_hits == 0
    assert sum(r.prefix_cache_queries for r in first[1:]) == 0
    second = _run(eng, {"b": prompt}, 2)
    assert second[0].prefix_cache_queries == 40 and second[0].prefix_cache_hits == 2 * BS
    assert [(r.num_prefill_tokens, r.num_decode_tokens) for r in second] == [(8, 0), (0, 1)]
    # 33 tokens with 32 cached: the one left is a one-token step, still prompt (prefill) work
    third = _run(eng, {"c": prompt[:33]}, 2)
    assert (third[0].prefix_cache_queries, third[0].prefix_cache_hits) == (33, 32)
    assert [(r.num_prefill_tokens, r.num_decode_tokens) for r in third] == [(1, 0), (0, 1)]
    s = eng.make_stats()
    records = first + second + third
    assert s.num_steps == len(records) and s.last_step == records[-1] == eng.last_step_stats
    assert s.num_scheduled_tokens == sum(r.num_scheduled_tokens for r in records) == 40 + 3 + 8 + 1 + 1 + 1
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (113, 64)
    assert (s.num_running, s.num_waiting, s.num_free_blocks) == (0, 0, 64)


def test_the_record_reads_the_load_now():
    """Between steps, make_stats reads the live state: waiting, running, blocks in use."""
    eng = _engine()
    eng.add_request("a", _prompt(20), _params(8))
    eng.add_request("b", _prompt(20, 900), _params(8))
    s = eng.make_stats()
    assert (s.num_waiting, s.num_running, s.num_free_blocks) == (2, 0, 64)
    eng.step()
    s = eng.make_stats()
    assert (s.num_waiting, s.num_running) == (0, 2)
    assert s.num_free_blocks == 64 - 4 and s.kv_cache_usage == pytest.approx(4 / 64)
    assert (s.last_step.num_prefill_tokens, s.last_step.num_decode_tokens, s.last_step.num_running) == (40, 0, 2)


def test_preemptions_are_counted_in_the_steps_that_made_them():
    """Too few blocks for four long requests: the engine preempts; a recompute is prefill work again."""
    eng = _engine(num_kv_blocks=8)
    records = _run(eng, {f"r{i}": _prompt(30, 100 + 500 * i) for i in range(4)}, 40)
    s = eng.make_stats()
    assert s.num_preemptions > 0
    # a preemption in a schedule that then ran nothing is in the total only (no step, no record)
    assert 0 < sum(r.num_preemptions for r in records) <= s.num_preemptions
    assert s.num_scheduled_tokens == sum(r.num_scheduled_tokens for r in records)
    # every output token but those sampled at the end of a prefill is one decode position; a prefill ends each
    # request's first admission, and each readmission after a preemption (which recomputes the outputs too)
    decoded = sum(r.num_decode_tokens for r in records)
    assert 4 * 40 - 4 - s.num_preemptions <= decoded <= 4 * 40 - 4
    assert sum(r.num_prefill_tokens for r in records) == s.num_scheduled_tokens - decoded > 4 * 30


def test_speculative_counts_per_step_sum_to_the_totals():
    eng = _engine(num_kv_blocks=128, speculative_config=SpeculativeConfig(num_speculative_tokens=3))
    loop = [11, 12, 13, 14, 15, 16] * 6  # a repeating prompt: prompt lookup finds drafts
    records = _run(eng, {"a": loop, "b": loop[3:]}, 24)
    sd = eng.make_stats().spec_decode
    live = eng.spec_stats
    assert sd.num_drafts > 0
    assert (sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens, sd.accepted_per_pos) == \
        (live.num_drafts, live.num_draft_tokens, live.num_accepted_tokens, tuple(live.accepted_per_pos))
    assert sum(r.spec_num_drafts for r in records) == sd.num_drafts
    assert sum(r.spec_num_draft_tokens for r in records) == sd.num_draft_tokens
    assert sum(r.spec_num_accepted_tokens for r in records) == sd.num_accepted_tokens
    # a verify step computes its drafts too (decode positions) and emits its accepted ones without a step of
    # their own: the 2 x 23 tokens after the first take 46 - accepted + drafted decode positions
    assert sum(r.num_scheduled_tokens for r in records) == eng.num_scheduled_tokens
    assert 0 < sd.num_accepted_tokens < sd.num_draft_tokens
    assert sum(r.num_decode_tokens for r in records) == 2 * 23 - sd.num_accepted_tokens + sd.num_draft_tokens
