"""A trace looped to fill a probe of a given duration (simulator.plan.loop_requests, Planner.requests_at).

benchmarks/capacity.py sizes each probe by seconds of arrivals (``--probe-seconds``): at hundreds of
requests per second a trace runs out, so it is replayed end to end. These tests pin what a looped request
keeps (lengths, order, shared prefixes within a pass), what it must not keep (a prefix-cache hit on its
earlier copy when the trace's prompts are each their own), that arrivals never go back in time, and how
many requests a probe of a given duration replays; and that the pruned search capacity.py runs
(``Planner(prune=True)``) picks the winners a full search picks. No simulation runs here (the pruning test
fakes the probe).
"""
from __future__ import annotations

import math

import pytest

from engine.block_manager import prefix_block_hashes
from simulator.cluster_sim import SimConfig, SimRequest
from simulator.costs import Profile, StepModel
from simulator.plan import Planner, at_rate, loop_requests

BLOCK = 16


def trace(lengths: list[tuple[int, int]], arrivals: list[float]) -> list[SimRequest]:
    """Requests with distinct prompts, except that requests 0 and 2 share their first two blocks."""
    out = []
    for i, ((p, o), t) in enumerate(zip(lengths, arrivals)):
        prompt = [(1000 * i + j) % 32000 for j in range(p)]
        out.append(SimRequest(f"r{i}", t, prompt, o))
    out[2].prompt_token_ids[:2 * BLOCK] = out[0].prompt_token_ids[:2 * BLOCK]
    return out


LENGTHS = [(40, 5), (17, 3), (64, 9), (33, 1)]
ARRIVALS = [0.0, 0.5, 0.5, 2.0]


def test_looped_requests_keep_lengths_order_and_arrive_in_order():
    reqs = trace(LENGTHS, ARRIVALS)
    out = loop_requests(reqs, 11)
    assert len(out) == 11
    assert out[:4] == reqs  # the first pass is the trace itself
    for i, r in enumerate(out):
        src = reqs[i % 4]
        assert (len(r.prompt_token_ids), r.max_tokens) == (len(src.prompt_token_ids), src.max_tokens)
        assert r.prompt_token_ids[1:] == src.prompt_token_ids[1:]
    assert len({r.request_id for r in out}) == 11
    # span 2 s, mean gap 2/3 s: pass k is shifted by k * 8/3 s, so pass 1 starts one mean gap after the last
    period = 2.0 + 2.0 / 3
    assert [r.arrival_s for r in out[4:8]] == pytest.approx([t + period for t in ARRIVALS])
    assert [r.arrival_s for r in out[8:]] == pytest.approx([t + 2 * period for t in ARRIVALS[:3]])
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(out, out[1:]))
    assert out[4].arrival_s > out[3].arrival_s
    assert loop_requests(reqs, 3) == reqs[:3] and loop_requests(reqs, 0) == []


def test_a_looped_prompt_is_new_but_keeps_its_shared_prefix_within_the_pass():
    reqs = trace(LENGTHS, ARRIVALS)
    out = loop_requests(reqs, 8)
    first = [prefix_block_hashes(r.prompt_token_ids, BLOCK) for r in out[:4]]
    second = [prefix_block_hashes(r.prompt_token_ids, BLOCK) for r in out[4:]]
    seen = {h for hs in first for h in hs}
    assert not seen & {h for hs in second for h in hs}  # no prefix-cache hit on an earlier pass
    assert first[0][:2] == first[2][:2] and second[0][:2] == second[2][:2]  # the shared prefix stays shared
    kept = loop_requests(reqs, 8, new_prompts=False)  # a trace with hash_ids: the very prompt again
    assert all(r.prompt_token_ids == reqs[i % 4].prompt_token_ids for i, r in enumerate(kept))
    assert [r.arrival_s for r in kept] == [r.arrival_s for r in out]


def test_loop_requests_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n must be >= 0"):
        loop_requests(trace(LENGTHS, ARRIVALS), -1)
    with pytest.raises(ValueError, match="reqs is empty"):
        loop_requests([], 3)


def _profile() -> Profile:
    return Profile(model="loop-test", dtype="float32", quantization=None, kv_cache_dtype="auto", device="cpu",
                   threads=1, block_size=BLOCK, num_layers=1, kv_bytes_per_token=1000, max_model_len=4096,
                   step=StepModel(knots=[1, 1001], knot_s=[0.01, 1.01]))


@pytest.mark.parametrize("burstiness", [None, 1.0, 0.25])
def test_a_probe_replays_duration_times_rate_requests(burstiness):
    reqs = trace(LENGTHS, ARRIVALS)
    planner = Planner(_profile(), reqs, {"ttft": 1000.0}, 0.9, burstiness, 0, SimConfig(), duration_s=30.0)
    for rate in (0.1, 1.0, 7.31, 250.0):
        got = planner.requests_at(rate)
        assert len(got) == max(2, math.ceil(rate * 30.0))
        assert [len(r.prompt_token_ids) for r in got] == [len(reqs[i % 4].prompt_token_ids) for i in range(len(got))]
        timed = at_rate(got, rate, burstiness, 0)
        ts = [r.arrival_s for r in timed]
        assert all(b >= a for a, b in zip(ts, ts[1:]))
        if len(got) > 50:  # about duration_s of arrivals (a Poisson or gamma draw: loosely)
            assert 30.0 * 0.6 <= ts[-1] <= 30.0 * 1.4
    assert Planner(_profile(), reqs, {"ttft": 1000.0}, 0.9, None, 0, SimConfig()).requests_at(500.0) == reqs
    with pytest.raises(ValueError, match="duration_s"):
        Planner(_profile(), reqs, {"ttft": 1000.0}, 0.9, None, 0, SimConfig(), duration_s=0.0)


def test_a_pruned_search_keeps_the_winner_and_drops_losers_after_one_probe(monkeypatch):
    """``Planner(prune=True).best_of``: each candidate starts at 0.75x the best of its mode so far; one that misses
    there costs one probe and is marked, and the winners are those a full search finds (a fake probe: a
    candidate passes up to its capacity)."""
    import simulator.plan as plan
    from simulator.plan import Point

    cap = {("colocated", 0): 400.0, ("disaggregated", 4): 300.0, ("disaggregated", 3): 100.0,
           ("disaggregated", 5): 330.0}
    calls: list[tuple[str, int, float]] = []

    def fake(profile, cfg, reqs, rate, slos, burstiness, seed):
        calls.append((cfg.mode, cfg.prefill, rate))
        return Point(rate, 1.0 if rate <= cap[(cfg.mode, cfg.prefill)] else 0.0, 0.0, 0.0, {})

    monkeypatch.setattr(plan, "simulate_point", fake)
    reqs = trace(LENGTHS, ARRIVALS)
    base = SimConfig()
    cfgs = [SimConfig(mode="colocated", colocated=8, prefill=0, decode=0)] + [
        SimConfig(mode="disaggregated", prefill=p, decode=8 - p) for p in (4, 3, 5)]
    full = Planner(_profile(), reqs, {"ttft": 1.0}, 0.9, 1.0, 0, base, rel_tol=0.02)
    _, want = full.best_of(cfgs)
    pruned = Planner(_profile(), reqs, {"ttft": 1.0}, 0.9, 1.0, 0, base, rel_tol=0.02, prune=True)
    done, got = pruned.best_of(cfgs)
    assert {m: c.cfg for m, c in got.items()} == {m: c.cfg for m, c in want.items()}
    assert got["disaggregated"].cfg.prefill == 5 and 330 * 0.97 <= got["disaggregated"].goodput <= 330
    assert 400 * 0.97 <= got["colocated"].goodput <= 400
    loser = next(c for c in done if c.cfg.prefill == 3)
    assert len(loser.probes) == 1 and loser.goodput == 0 and loser.pruned_below == pytest.approx(0.75 * 300, rel=0.03)
    assert pruned.simulations < full.simulations
    # another budget's hint that overshoots (0.6 x 100 x 8 = 480 > 400): the first candidate starts again cold
    hinted = Planner(_profile(), reqs, {"ttft": 1.0}, 0.9, 1.0, 0, base, rel_tol=0.02, prune=True)
    hinted.hints = {"colocated": 100.0}
    _, got = hinted.best_of(cfgs[:1])
    assert 400 * 0.97 <= got["colocated"].goodput <= 400
