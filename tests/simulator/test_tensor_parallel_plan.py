"""Tensor parallelism in the simulator and the planner (issue 44 part 4), against hand-computed cases.

A pool at TP k is priced by the profile taken at k (``ProfileSet``); its KV blocks are one rank's budget over one
rank's bytes per block; a transfer from TP p to TP d runs on min(p, d) rank pairs at once; ``pdserve plan``
counts its budget in ranks and searches each pool's TP with the P:D split. The profiles have round numbers, so
every expected value below is worked out from those rules, not read off the simulator.
"""
from __future__ import annotations

import json
import pytest

from loadtest.stats import ttft_s
from simulator import plan
from simulator.cluster_sim import SimConfig, SimRequest, Simulation
from simulator.costs import LinkModel, Profile, ProfileSet, StepModel
from tests.simulator.test_simulate import KVB, R_REQ, R_TOK, decode_s, make_profile, prefill_s

HALF = StepModel(knots=[1, 1001], knot_s=[0.005, 0.505], per_sampled_row_s=0.0, per_prefill_pair_s=5e-7,
                 per_decode_ctx_s=5e-6)
"""The TP 2 profile's steps: every term half the TP 1 profile's (lin(t) = 0.005 + 0.0005 (t - 1))."""


def half_prefill_s(n: int) -> float:
    return 0.005 + 0.0005 * (n - 1) + 5e-7 * n * (n + 1) / 2 + R_TOK


def tp2(**kw) -> Profile:
    """A TP 2 profile as `pdserve profile --tensor-parallel-size 2` writes one: no router costs or co-run, one
    rank's KV bytes per token half the worker's."""
    base = dict(step=HALF, tensor_parallel_size=2, router_per_request_s=0.0, router_per_token_s=0.0, links={},
                kv_bytes_per_token_rank=KVB // 2, meta={"router": {}})
    base.update(kw)
    return make_profile(**base)


def pair() -> ProfileSet:
    return ProfileSet([tp2(), make_profile()])


def test_a_pool_is_priced_by_the_profile_at_its_tp_with_the_hosts_serving_costs():
    sim = Simulation(pair(), SimConfig(mode="colocated", colocated=1, tensor_parallel_size=2))
    [rec] = sim.run([SimRequest("a", 0.0, list(range(100)), 2)])
    # the TP 2 profile measured no router: the TP 1 profile's R_REQ and R_TOK price the serving path
    assert ttft_s(rec) == pytest.approx(R_REQ + half_prefill_s(100), abs=1e-12)
    sim1 = Simulation(pair(), SimConfig(mode="colocated", colocated=1))
    [rec1] = sim1.run([SimRequest("a", 0.0, list(range(100)), 2)])
    assert ttft_s(rec1) == pytest.approx(R_REQ + prefill_s(100), abs=1e-12)


def test_prefill_and_decode_pools_take_their_own_tp_and_the_transfer_splits_over_rank_pairs():
    slow = LinkModel(0.0, 1e4)  # 100 tokens x 1000 B at 10 KB/s: 10 s whole, far beyond any step
    profiles = ProfileSet([tp2(), make_profile(links={"gloo": slow})])
    for ptp, dtp, ranks in ((2, 2, 2), (2, 1, 1), (1, 2, 1)):
        sim = Simulation(profiles, SimConfig(prefill_tp=ptp, decode_tp=dtp))
        [rec] = sim.run([SimRequest("a", 0.0, list(range(100)), 2)])
        first = R_REQ + (half_prefill_s(100) if ptp == 2 else prefill_s(100))
        assert ttft_s(rec) == pytest.approx(first, abs=1e-12)
        kv = R_REQ + 100 * KVB / ranks / 1e4  # each of min(p, d) rank pairs carries its share of the bytes
        dec = decode_s(101) if dtp == 1 else 0.005 + 5e-6 * 101 + R_TOK
        assert rec.chunk_times_s[1] == pytest.approx(kv + dec, abs=1e-9), (ptp, dtp)
        assert sim.transfer_ranks == ranks


def test_kv_blocks_are_a_ranks_budget_over_a_ranks_bytes_and_rank_memory_leaves_room_for_weights():
    one, two = make_profile(weight_bytes_per_rank=1_000_000), tp2(weight_bytes_per_rank=500_000)
    cfg = SimConfig(kv_cache_memory_bytes=1_600_000)
    assert cfg.kv_blocks(one) == 100  # 1,600,000 / (1000 B x 16)
    assert cfg.kv_blocks(two) == 200  # each rank holds half the heads: twice the blocks from the same budget
    mem = SimConfig(rank_memory_bytes=1_320_000)
    assert mem.kv_blocks(two) == 102  # (1,320,000 - 500,000) // (500 x 16)
    assert mem.kv_blocks(one) == 20  # (1,320,000 - 1,000,000) // (1000 x 16)
    tight = SimConfig(rank_memory_bytes=1_010_000)
    assert tight.kv_blocks(two) == 63  # 510,000 // 8,000
    with pytest.raises(ValueError, match="needs more tensor parallelism"):
        tight.kv_blocks(one)  # 10,000 B left beside the weights: not one 16,000 B block
    assert not tight.fits(one) and tight.fits(two)
    with pytest.raises(ValueError, match="weight_bytes_per_rank"):
        mem.kv_blocks(make_profile())  # a profile that did not record its weights cannot be priced by memory


def test_a_missing_tp_profile_or_a_mixed_set_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--decode-tp 4: no profile at tensor-parallel size 4"):
        Simulation(pair(), SimConfig(decode_tp=4))
    with pytest.raises(ValueError, match="--tensor-parallel-size 2"):
        Simulation(ProfileSet([make_profile()]), SimConfig(mode="colocated", colocated=1, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="differ in model"):
        ProfileSet([make_profile(), tp2(model="other")])
    with pytest.raises(ValueError, match="two profiles at tensor-parallel size 1"):
        ProfileSet([make_profile(), make_profile()])
    with pytest.raises(ValueError, match="--workers-per-host"):
        SimConfig(workers_per_host=2, decode_tp=2)


def test_up_flags_and_label_carry_each_pools_tp():
    profiles = pair()
    cfg = SimConfig(prefill=3, decode=1, prefill_tp=1, decode_tp=2)
    assert cfg.num_workers == 4 and cfg.num_ranks == 5
    assert cfg.label() == "disaggregated 3P(TP1)+1D(TP2) (chunk 2048)"
    assert cfg.up_flags(profiles) == "--prefill 3 --decode 1 --prefill-tp 1 --decode-tp 2 --max-num-batched-tokens 2048"
    col = SimConfig(mode="colocated", colocated=2, tensor_parallel_size=2, kv_cache_memory_bytes=1_600_000)
    # the budget is per rank: the TP 2 profile's 500 B a rank a token give 200 blocks
    assert col.up_flags(profiles) == ("--colocated 2 --tensor-parallel-size 2 --max-num-batched-tokens 2048 "
                                      "--num-kv-blocks 200")
    assert SimConfig(prefill_tp=1, decode_tp=1).up_flags(profiles) == "--prefill 1 --decode 1 --max-num-batched-tokens 2048"
    mixed = SimConfig(prefill_tp=1, decode_tp=2, kv_cache_memory_bytes=1_600_000)
    assert mixed.up_flags(profiles).endswith("--prefill-num-kv-blocks 100 --decode-num-kv-blocks 200")


def test_candidates_split_a_budget_of_ranks_into_whole_workers_at_each_tp():
    got = plan.candidates(4, [512], [0], SimConfig(), ["colocated", "disaggregated"], tps=[1, 2])
    shapes = sorted((c.mode, c.colocated, c.prefill, c.decode, c.pool_tp(c.roles[0]), c.pool_tp(c.roles[-1]))
                    for c in got)
    assert shapes == sorted([
        ("colocated", 4, 0, 0, 1, 1), ("colocated", 2, 0, 0, 2, 2),
        ("disaggregated", 0, 1, 3, 1, 1), ("disaggregated", 0, 2, 2, 1, 1), ("disaggregated", 0, 3, 1, 1, 1),
        ("disaggregated", 0, 2, 1, 1, 2),  # 2 x 1 + 1 x 2
        ("disaggregated", 0, 1, 2, 2, 1),  # 1 x 2 + 2 x 1
        ("disaggregated", 0, 1, 1, 2, 2),  # 1 x 2 + 1 x 2
    ])
    assert all(c.num_ranks == 4 for c in got)
    assert plan.candidates(3, [512], [0], SimConfig(), ["colocated"], tps=[2]) == []  # 3 ranks: no TP 2 workers


def _write(tmp_path, name: str, prof: Profile):
    p = tmp_path / name
    p.write_text(json.dumps(prof.to_dict()))
    return str(p)


def _plan(tmp_path, capsys, profiles: list[str], *extra: str) -> tuple[int, dict, str]:
    out = tmp_path / "plan.json"
    args = [a for p in profiles for a in ("--profile", p)]
    rc = plan.main([*args, "--dataset-name", "random", "--input-len", "200", "--output-len", "20",
                    "--num-prompts", "40", "--chunk-sizes", "512", "--local-prefill", "0", "--workers", "4",
                    "--ttft-slo-ms", "2000", "--tpot-slo-ms", "100", "--save-result", str(out), "--jobs", "1",
                    *extra])
    captured = capsys.readouterr()
    return rc, (json.loads(out.read_text()) if out.exists() else {}), captured.out + captured.err


def test_plan_searches_tp_per_pool_and_picks_what_the_profiles_make_faster(tmp_path, capsys):
    one = _write(tmp_path, "tp1.json", make_profile(weight_bytes_per_rank=1_000_000))
    # a TP 2 whose steps cost half: per rank no better than TP 1, and the search must weigh it so
    fast = _write(tmp_path, "tp2.json", tp2(weight_bytes_per_rank=500_000))
    rc, d, _ = _plan(tmp_path, capsys, [one, fast])
    assert rc == 0 and d["tp_sizes"] == [1, 2]
    tps = {(c["tensor_parallel"].get("prefill"), c["tensor_parallel"].get("decode"),
            c["tensor_parallel"].get("colocated")) for c in d["candidates"]}
    assert {(None, None, 1), (None, None, 2), (1, 1, None), (1, 2, None), (2, 1, None), (2, 2, None)} <= tps
    assert all(c["ranks"] == 4 for c in d["candidates"])
    # a TP 2 that is as slow as TP 1 per step halves the goodput per rank: the plan must not choose it
    slow = _write(tmp_path, "tp2slow.json", tp2(step=make_profile().step, weight_bytes_per_rank=500_000))
    rc, d, _ = _plan(tmp_path, capsys, [one, slow])
    assert rc == 0
    for best in d["best"].values():
        assert set(best["tensor_parallel"].values()) == {1}, best["deployment"]


def test_plan_leaves_out_a_tp_whose_weights_do_not_fit_a_rank(tmp_path, capsys):
    one = _write(tmp_path, "tp1.json", make_profile(weight_bytes_per_rank=1_000_000))
    two = _write(tmp_path, "tp2.json", tp2(weight_bytes_per_rank=500_000))
    # 900,000 B a rank: TP 1's weights alone exceed it; TP 2 keeps 400,000 B = 50 blocks of 8,000 B
    rc, d, text = _plan(tmp_path, capsys, [one, two], "--rank-memory-bytes", "900000")
    assert rc == 0 and d["tp_sizes"] == [2]
    assert "TP 1 left out" in text and "needs more tensor parallelism" in text
    for best in d["best"].values():
        assert set(best["tensor_parallel"].values()) == {2}
        assert "--tensor-parallel-size 2" in best["pdserve_up_flags"] and "--num-kv-blocks 50" in best["pdserve_up_flags"]
    # nothing fits: exit 2 naming the flag; a budget no TP divides: exit 2 naming --workers
    rc, _, text = _plan(tmp_path, capsys, [one, two], "--rank-memory-bytes", "400000")
    assert rc == 2 and "no tensor-parallel size fits" in text
    rc, _, text = _plan(tmp_path, capsys, [two], "--workers", "3", "--modes", "colocated")
    assert rc == 2 and "--workers 3" in text


def test_profile_round_trips_its_tp_fields():
    p = tp2(weight_bytes_per_rank=123)
    q = Profile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert (q.tensor_parallel_size, q.kv_bytes_per_token_rank, q.weight_bytes_per_rank) == (2, KVB // 2, 123)
    old = make_profile().to_dict()
    for k in ("tensor_parallel_size",):
        old.pop(k)
    q = Profile.from_dict(old)  # a profile from before TP: one rank holding everything
    assert q.tensor_parallel_size == 1 and q.rank_kv_bytes_per_token == KVB and q.weight_bytes_per_rank is None
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        Profile.from_dict({**p.to_dict(), "tensor_parallel_size": 0})


def test_simulate_cli_takes_one_profile_per_tp(tmp_path, capsys):
    from simulator import cli

    one, two = _write(tmp_path, "tp1.json", make_profile()), _write(tmp_path, "tp2.json", tp2())
    out = tmp_path / "r.json"
    common = ["--dataset-name", "random", "--input-len", "100", "--output-len", "4", "--num-prompts", "6",
              "--request-rate", "2"]
    assert cli.main(["--profile", one, "--profile", two, *common, "--decode-tp", "2", "--save-result", str(out)]) == 0
    sim = json.loads(out.read_text())["simulation"]
    assert sim["tensor_parallel"] == {"prefill": 1, "decode": 2} and sim["num_ranks"] == 3
    assert "--prefill-tp 1 --decode-tp 2" in sim["pdserve_up_flags"]
    capsys.readouterr()
    assert cli.main(["--profile", one, *common, "--decode-tp", "2"]) == 2  # no TP 2 profile given
    assert "--decode-tp 2: no profile at tensor-parallel size 2" in capsys.readouterr().err
    assert cli.main(["--profile", one, "--profile", two, *common, "--prefill-tp", "0"]) == 2
    assert "--prefill-tp must be an integer >= 1" in capsys.readouterr().err


def test_a_prompt_longer_than_a_short_kv_cache_fails_as_the_engines_would():
    # 1,010,000 B a rank beside TP 2's 500,000 B of weights: 63 blocks of 8,000 B = 1,008 tokens
    profiles = ProfileSet([tp2(weight_bytes_per_rank=500_000), make_profile(weight_bytes_per_rank=1_000_000)])
    sim = Simulation(profiles, SimConfig(mode="colocated", colocated=1, tensor_parallel_size=2,
                                         rank_memory_bytes=1_010_000))
    assert sim.max_model_len == 63 * 16
    ok, long = sim.run([SimRequest("ok", 0.0, list(range(100)), 2), SimRequest("long", 0.0, list(range(1008)), 2)])
    assert ok.success and not long.success and "max_model_len is 1008" in long.error
