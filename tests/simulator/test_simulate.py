"""The simulator against hand-computed cases, and proof that it drives pdserve's own policy objects.

The profile here has round numbers, so every latency below is worked out by hand from the module
docstring of simulator/cluster_sim.py and the step model of simulator/costs.py, not copied from the
simulator's output.
"""
from __future__ import annotations

import json

import pytest

from engine.llm_engine import LLMEngine
from engine.scheduler import Scheduler
from loadtest.stats import itls_s, ttft_s
from router.placement import Placer
from router.selection import WorkerSelector
from simulator import cli
from simulator.cluster_sim import SimConfig, SimRequest, Simulation
from simulator.costs import CorunModel, LinkModel, Profile, StepModel

R_REQ, R_TOK = 0.005, 0.001
KVB = 1000  # bytes per token
LAYERS = 4


def lin(t: int) -> float:
    return 0.01 + 0.001 * (t - 1)


def make_profile(**kw) -> Profile:
    base = dict(model="sim-test", dtype="float32", quantization=None, kv_cache_dtype="auto", device="cpu", threads=1,
                block_size=16, num_layers=LAYERS, kv_bytes_per_token=KVB, max_model_len=4096,
                step=StepModel(knots=[1, 1001], knot_s=[0.01, 1.01], per_sampled_row_s=0.0,
                               per_prefill_pair_s=1e-6, per_decode_ctx_s=1e-5),
                links={"gloo": LinkModel(0.002, 1e6)}, router_per_request_s=R_REQ, router_per_token_s=R_TOK)
    base.update(kw)
    return Profile(**base)


def prefill_s(n: int, c: int = 0, streamed: int = 1) -> float:
    """A one-chunk prefill step that streams ``streamed`` first tokens (each costs the serving path R_TOK)."""
    return lin(n) + 1e-6 * n * (c + (n + 1) / 2) + R_TOK * streamed


def decode_s(ctx: int) -> float:
    return lin(1) + 1e-5 * ctx + R_TOK


def run(cfg: SimConfig, reqs: list[SimRequest], profile: Profile | None = None):
    sim = Simulation(profile or make_profile(), cfg)
    return sim, sim.run(reqs)


def test_one_request_on_one_colocated_worker_exact():
    sim, [rec] = run(SimConfig(mode="colocated", colocated=1), [SimRequest("a", 0.0, list(range(100)), 4)])
    t = R_REQ + prefill_s(100)
    assert rec.success and rec.output_tokens == 4
    assert ttft_s(rec) == pytest.approx(t, abs=1e-12)
    expect = [t]
    for ctx in (101, 102, 103):  # decode of output k attends over prompt + k tokens
        expect.append(expect[-1] + decode_s(ctx))
    assert rec.chunk_times_s == pytest.approx(expect, abs=1e-12)
    assert itls_s(rec) == pytest.approx([decode_s(c) for c in (101, 102, 103)], abs=1e-12)
    stats = sim.pool_stats()["colocated"]
    assert stats.steps == 4 and stats.busy_s == pytest.approx(expect[-1] - R_REQ, abs=1e-12)


def test_one_request_disaggregated_exact():
    sim, [rec] = run(SimConfig(mode="disaggregated"), [SimRequest("a", 0.0, list(range(100)), 3)])
    start = R_REQ
    end = start + prefill_s(100)
    assert ttft_s(rec) == pytest.approx(end, abs=1e-12)  # the first token does not wait for the KV
    nbytes = 100 * KVB
    link = lambda b: 0.002 + b / 1e6  # noqa: E731
    kv = max(end + link(nbytes / LAYERS), start + link(nbytes))  # layer by layer during the last step
    assert kv == pytest.approx(end + link(nbytes / LAYERS))  # here the last layer's share decides
    t2 = kv + decode_s(101)
    t3 = t2 + decode_s(102)
    assert rec.chunk_times_s == pytest.approx([end, t2, t3], abs=1e-12)
    pools = sim.pool_stats()
    assert pools["prefill"].steps == 1 and pools["decode"].steps == 2
    assert all(w.engine.num_free_blocks == w.engine.num_total_blocks for w in sim.workers.values())


def test_slow_link_bounds_the_transfer_by_its_total_bytes():
    prof = make_profile(links={"gloo": LinkModel(0.0, 1e4)})  # 100 KB at 10 KB/s: 10 s, far beyond the prefill
    sim, [rec] = run(SimConfig(), [SimRequest("a", 0.0, list(range(100)), 2)], prof)
    start, end = R_REQ, R_REQ + prefill_s(100)
    kv = start + 100 * KVB / 1e4
    assert rec.chunk_times_s[1] == pytest.approx(kv + decode_s(101), abs=1e-9)
    assert ttft_s(rec) == pytest.approx(end, abs=1e-12)


def test_two_requests_queue_behind_each_other():
    reqs = [SimRequest("a", 0.0, list(range(100)), 3), SimRequest("b", 0.0, list(range(500, 550)), 2)]
    _, (a, b) = run(SimConfig(mode="colocated", colocated=1, max_num_seqs=1), reqs)
    a_end = R_REQ + prefill_s(100) + decode_s(101) + decode_s(102)
    assert a.end_s == pytest.approx(a_end, abs=1e-12)
    # b was admitted at arrival but the engine runs one sequence at a time: it prefills after a's last step
    b_first = a_end + prefill_s(50)
    assert ttft_s(b) == pytest.approx(b_first, abs=1e-12)
    assert b.end_s == pytest.approx(b_first + decode_s(51), abs=1e-12)


def test_batched_prefill_shares_one_step():
    reqs = [SimRequest("a", 0.0, list(range(100)), 1), SimRequest("b", 0.0, list(range(500, 550)), 1)]
    _, (a, b) = run(SimConfig(mode="colocated", colocated=1), reqs)
    step = lin(150) + 1e-6 * (100 * 101 / 2 + 50 * 51 / 2) + 2 * R_TOK  # two first tokens streamed
    assert ttft_s(a) == pytest.approx(R_REQ + step, abs=1e-12)
    assert ttft_s(b) == pytest.approx(R_REQ + step, abs=1e-12)


def test_serving_path_costs_once_per_streaming_step_plus_per_token():
    """router_per_step_s is paid by every step that streams a token, once whatever the batch; a prefill chunk
    that samples nothing streams nothing and pays neither."""
    R_STEP = 0.002
    prof = make_profile(router_per_step_s=R_STEP)
    reqs = [SimRequest("a", 0.0, list(range(100)), 2), SimRequest("b", 0.0, list(range(500, 550)), 2)]
    _, (a, b) = run(SimConfig(mode="colocated", colocated=1), reqs, prof)
    first = lin(150) + 1e-6 * (100 * 101 / 2 + 50 * 51 / 2) + R_STEP + 2 * R_TOK
    second = lin(2) + 1e-5 * (101 + 51) + R_STEP + 2 * R_TOK  # both decode in one step: one R_STEP
    assert [ttft_s(a), ttft_s(b)] == pytest.approx([R_REQ + first] * 2, abs=1e-12)
    assert [a.end_s, b.end_s] == pytest.approx([R_REQ + first + second] * 2, abs=1e-12)
    # chunked: the first 64-token chunk samples nothing; only the last chunk streams the first token
    _, [c] = run(SimConfig(mode="colocated", colocated=1, max_num_batched_tokens=64),
                 [SimRequest("c", 0.0, list(range(100)), 1)], prof)
    chunk1 = lin(64) + 1e-6 * 64 * 65 / 2
    chunk2 = lin(36) + 1e-6 * 36 * (64 + 37 / 2) + R_STEP + R_TOK
    assert ttft_s(c) == pytest.approx(R_REQ + chunk1 + chunk2, abs=1e-12)


def test_the_routers_cpu_per_token_lengthens_steps_only_when_it_shares_the_workers_cores():
    """router_cpu_per_token_s (the router process's CPU per streamed token, measured by the profile) costs the
    workers nothing while the router runs apart; on their cores each decode step pays it once per token."""
    cpu = 0.0004
    prof = make_profile(router_cpu_per_token_s=cpu)
    req = [SimRequest("a", 0.0, list(range(100)), 4)]
    _, [apart] = run(SimConfig(mode="colocated", colocated=1), req, prof)
    _, [shared] = run(SimConfig(mode="colocated", colocated=1, router_on_worker_cores=True), req, prof)
    assert itls_s(apart) == pytest.approx([decode_s(c) for c in (101, 102, 103)], abs=1e-12)
    assert itls_s(shared) == pytest.approx([decode_s(c) + cpu for c in (101, 102, 103)], abs=1e-12)
    assert ttft_s(shared) == pytest.approx(R_REQ + prefill_s(100) + cpu, abs=1e-12)  # the first token's too
    back = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert back.router_cpu_per_token_s == cpu
    with pytest.raises(ValueError, match="router_on_worker_cores"):
        SimConfig(router_on_worker_cores="yes")


def test_preemption_when_blocks_run_out():
    # 3 blocks of 16: two 16-token prompts take one each; the first to need a second block takes the last one,
    # the other then preempts itself (the most recent) and recomputes after the first finishes
    reqs = [SimRequest("a", 0.0, list(range(16)), 20), SimRequest("b", 0.0, list(range(100, 116)), 20)]
    sim, (a, b) = run(SimConfig(mode="colocated", colocated=1, num_kv_blocks=3), reqs)
    eng = sim.workers["colocated-0"].engine
    assert eng.num_preemptions >= 1
    assert a.success and b.success and a.output_tokens == 20 and b.output_tokens == 20
    assert b.end_s > a.end_s
    assert eng.num_free_blocks == 3


def test_admission_queue_waits_for_decode_blocks():
    # the decode worker holds 8 blocks = 128 tokens: two 100-token prompts cannot be reserved together
    reqs = [SimRequest("a", 0.0, list(range(100)), 5), SimRequest("b", 0.001, list(range(200, 300)), 2)]
    _, (a, b) = run(SimConfig(num_kv_blocks=8), reqs)
    assert a.success and b.success
    assert ttft_s(b) + b.start_s > a.end_s  # b's prefill began only after a freed its blocks


def test_requests_waiting_for_decode_blocks_are_served_in_arrival_order():
    """The router's own AdmissionQueue (FIFO by arrival) orders the simulated waiters: b and c both wait for a's
    blocks (the decode worker holds 8 blocks, one 100-token prompt at a time); b, the earlier, goes first."""
    reqs = [SimRequest("a", 0.0, list(range(100)), 5), SimRequest("b", 0.001, list(range(200, 300)), 5),
            SimRequest("c", 0.002, list(range(400, 500)), 5)]
    sim, (a, b, c) = run(SimConfig(num_kv_blocks=8), reqs)
    assert a.success and b.success and c.success
    assert a.end_s < b.start_s + ttft_s(b) < c.start_s + ttft_s(c)
    assert sim.bound.held == 0 and not sim.admission.has_waiters()


def test_router_bound_refuses_at_once():
    reqs = [SimRequest("a", 0.0, list(range(10)), 5), SimRequest("b", 0.0, list(range(10)), 5)]
    _, (a, b) = run(SimConfig(mode="colocated", colocated=1, max_num_requests=1), reqs)
    assert a.success and not b.success and b.error.startswith("RESOURCE_EXHAUSTED")


def test_conditional_disaggregation_runs_short_prompts_on_decode():
    reqs = [SimRequest("short", 0.0, list(range(50)), 2), SimRequest("long", 0.5, list(range(300)), 2)]
    sim, (s, lng) = run(SimConfig(local_prefill_max_tokens=64), reqs)
    pools = sim.pool_stats()
    assert pools["prefill"].steps == 1  # only the long prompt was prefilled there
    assert ttft_s(s) == pytest.approx(R_REQ + prefill_s(50), abs=1e-12)


def test_it_drives_the_routers_and_engines_own_objects(monkeypatch):
    sim = Simulation(make_profile(), SimConfig(prefill=2, decode=2))
    assert type(sim.placer) is Placer and type(sim.selector) is WorkerSelector
    for w in sim.workers.values():
        assert type(w.engine) is LLMEngine and type(w.engine.scheduler) is Scheduler
    # the router's conditional-disaggregation rule decides: patch it and every request runs whole on decode
    monkeypatch.setattr("router.placement.prefill_locally", lambda *a: True)
    reqs = [SimRequest(f"r{i}", 0.1 * i, list(range(300)), 2) for i in range(3)]
    sim, recs = run(SimConfig(local_prefill_max_tokens=1), reqs)  # 300 > 1: the unpatched rule says prefill pool
    assert all(r.success for r in recs) and sim.pool_stats()["prefill"].steps == 0
    monkeypatch.undo()
    sim, recs = run(SimConfig(local_prefill_max_tokens=1), reqs)
    assert sim.pool_stats()["prefill"].steps > 0


def test_decode_ranking_spreads_load():
    reqs = [SimRequest(f"r{i}", 0.0, list(range(i * 1000, i * 1000 + 40)), 30) for i in range(4)]
    sim, recs = run(SimConfig(prefill=1, decode=2), reqs)
    assert all(r.success for r in recs)
    assert all(w.engine.num_steps > 0 for w in sim.workers.values() if w.role == "decode")


def test_the_same_seed_gives_the_same_simulation():
    """Ties between equally good decode workers are drawn at random (the router's no-herding draw); the simulation
    seeds that draw (``SimConfig.seed``), so one command line gives one result. An unseeded draw made the SLA
    planner's ramp test pick 5 or 6 decode workers from run to run."""
    reqs = [SimRequest(f"r{i}", 0.05 * i, list(range(i * 1000, i * 1000 + 40)), 20) for i in range(48)]

    def placement(seed: int) -> list[tuple[str, int]]:
        sim, recs = run(SimConfig(prefill=1, decode=4, seed=seed), [SimRequest(r.request_id, r.arrival_s,
                                                                                list(r.prompt_token_ids), r.max_tokens)
                                                                     for r in reqs])
        assert all(r.success for r in recs)
        return sorted((w.worker_id, w.requests_finished_total) for w in sim.worker_infos("decode"))

    first = placement(0)
    assert sum(n for _w, n in first) == 48 and len(first) == 4
    assert placement(0) == first and placement(0) == first
    assert any(placement(seed) != first for seed in (1, 2, 3))  # the draw does matter: another seed moves requests


# ---- the command line -----------------------------------------------------------------------------------

def _write_profile(tmp_path, **kw):
    p = tmp_path / "profile.json"
    p.write_text(json.dumps(make_profile(**kw).to_dict()))
    return p


def test_cli_writes_bench_keys(tmp_path, capsys):
    prof = _write_profile(tmp_path)
    out = tmp_path / "r.json"
    rc = cli.main(["--profile", str(prof), "--trace", "tests/data/azure_llm_2023_conv_first400.csv",
                   "--num-prompts", "40", "--length-scale", "0.1", "--request-rate", "4", "--goodput", "ttft:500",
                   "tpot:50", "--save-result", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    for key in ("completed", "request_goodput", "median_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "ttfts", "itls"):
        assert key in d, key
    assert d["completed"] == 40 and d["simulation"]["pools"]["decode"]["workers"] == 1
    assert "--prefill 1 --decode 1" in d["simulation"]["pdserve_up_flags"]


@pytest.mark.parametrize("args, needle", [
    (["--colocated", "0", "--prefill", "0"], "--prefill"),
    (["--model", "other"], "model"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--num-prompts", "0"], "num_prompts"),
    (["--workers-per-host", "0"], "--workers-per-host"),
])
def test_cli_bad_input(tmp_path, capsys, args, needle):
    prof = _write_profile(tmp_path)
    out = tmp_path / "r.json"
    rc = cli.main(["--profile", str(prof), "--dataset-name", "random", "--num-prompts", "5", *args,
                   "--save-result", str(out)])
    assert rc == 2 and needle in capsys.readouterr().err and not out.exists()


def test_cli_bad_trace_and_profile(tmp_path, capsys):
    prof = _write_profile(tmp_path)
    bad = tmp_path / "t.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,5\n2023-11-16 18:15:45.1,10,5\n")
    assert cli.main(["--profile", str(prof), "--trace", str(bad)]) == 2
    assert "t.csv row 1" in capsys.readouterr().err
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,ten,5\n")
    assert cli.main(["--profile", str(prof), "--trace", str(bad)]) == 2
    assert "row 0" in capsys.readouterr().err
    old = tmp_path / "old.json"
    d = make_profile().to_dict()
    d["meta"]["pdserve_version"] = "0.0.1"
    old.write_text(json.dumps(d))
    assert cli.main(["--profile", str(old), "--dataset-name", "random", "--num-prompts", "2"]) == 2
    assert "0.0.1" in capsys.readouterr().err
    assert cli.main(["--profile", str(tmp_path / "none.json"), "--num-prompts", "2"]) == 2


def test_mooncake_hash_ids_share_prefixes(tmp_path):
    prof = _write_profile(tmp_path)
    tr = tmp_path / "m.jsonl"
    rows = [{"timestamp": 1000 * i, "input_length": 1100, "output_length": 2, "hash_ids": [7, 8, 100 + i]}
            for i in range(3)]
    tr.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    args = cli.build_parser().parse_args(["--profile", str(prof), "--trace", str(tr), "--colocated", "1"])
    cli.check_workload_args(args)
    reqs, _, _ = cli.requests_from_args(args, make_profile())
    assert [r.arrival_s for r in reqs] == [0.0, 1.0, 2.0]
    assert reqs[0].prompt_token_ids[:1024] == reqs[2].prompt_token_ids[:1024]
    assert reqs[0].prompt_token_ids[1024:] != reqs[2].prompt_token_ids[1024:]
    sim, recs = run(cli.sim_config_from_args(args), reqs)
    eng = sim.workers["colocated-0"].engine
    assert eng.prefix_cache_hits >= 2 * 1024  # the later two found the shared 1024 tokens cached


# ---- the planner ------------------------------------------------------------------------------------------

def test_goodput_bisection_finds_the_threshold():
    from simulator.plan import Point, goodput_of

    def probe(rate: float) -> Point:
        return Point(rate, 1.0 if rate <= 3.7 else 0.5, 0.0, 0.0, {})

    g, at, probes = goodput_of(probe, 0.5, 1.0, 0.9)
    assert 3.7 * 0.96 <= g <= 3.7 and at.rate == g and len(probes) <= 14
    g, at, _ = goodput_of(lambda r: Point(r, 0.0, 0.0, 0.0, {}), 0.5, 1.0, 0.9)
    assert g == 0.0 and at is None


def test_goodput_bisection_looks_below_a_first_rate_that_misses():
    # a deployment that serves 0.1 req/s where the first guess was 1: gone looking below it, not called useless
    from simulator.plan import COLD_SHRINK, Point, goodput_of

    def probe(rate: float) -> Point:
        return Point(rate, 1.0 if rate <= 0.1 else 0.2, 0.0, 0.0, {})

    assert goodput_of(probe, 1.0, 4.0, 0.9)[0] == 0.0  # (without shrink: one probe, goodput 0)
    g, at, probes = goodput_of(probe, 1.0, 4.0, 0.9, shrink=COLD_SHRINK)
    assert 0.1 * 0.96 <= g <= 0.1 and at.rate == g and len(probes) <= 14
    assert [p.rate for p in probes[:3]] == [1.0, 0.25, 0.0625]
    assert all(0.0625 < p.rate < 0.25 for p in probes[3:])  # bisected between the last miss and the first pass
    # it stops at 1/4^shrink of the first rate
    g, _, probes = goodput_of(probe, 1000.0, 4000.0, 0.9, shrink=COLD_SHRINK)
    assert g == 0.0 and len(probes) == COLD_SHRINK + 1 and min(p.rate for p in probes) == 1000.0 / 4 ** COLD_SHRINK


def test_plan_cli(tmp_path, capsys):
    from simulator import plan

    prof = _write_profile(tmp_path)
    out = tmp_path / "plan.json"
    common = ["--profile", str(prof), "--dataset-name", "random", "--input-len", "200", "--output-len", "20",
              "--num-prompts", "60", "--chunk-sizes", "512", "--local-prefill", "0", "--jobs", "1"]
    assert plan.main([*common, "--workers", "2", "--ttft-slo-ms", "2000", "--tpot-slo-ms", "100",
                      "--save-result", str(out)]) == 0
    d = json.loads(out.read_text())
    assert set(d["best"]) == {"colocated", "disaggregated"}
    for mode, best in d["best"].items():  # the recommendation is the best of what it simulated
        assert best["goodput_rps"] == max(c["goodput_rps"] for c in d["candidates"] if c["mode"] == mode) > 0
    assert "pdserve up --colocated 2" in capsys.readouterr().out
    # SLOs nothing meets (a TTFT below one prefill step), a budget of 0: exit 2, the flags named
    assert plan.main([*common, "--workers", "2", "--ttft-slo-ms", "1", "--tpot-slo-ms", "100"]) == 2
    assert "--ttft-slo-ms 1" in capsys.readouterr().err
    assert plan.main([*common, "--workers", "0", "--ttft-slo-ms", "100", "--tpot-slo-ms", "100"]) == 2
    assert "--workers" in capsys.readouterr().err


def test_pair_requests_pay_the_pair_path_cost():
    prof = make_profile(router_per_request_pair_s=0.02)
    _, [rec] = run(SimConfig(), [SimRequest("a", 0.0, list(range(100)), 2)], prof)
    assert ttft_s(rec) == pytest.approx(0.02 + prefill_s(100), abs=1e-12)
    _, [rec] = run(SimConfig(mode="colocated", colocated=1), [SimRequest("a", 0.0, list(range(100)), 2)], prof)
    assert ttft_s(rec) == pytest.approx(R_REQ + prefill_s(100), abs=1e-12)


def test_up_flags_carry_what_pdserve_up_needs():
    prof = make_profile()  # 1000 B a token, 16-token blocks: 16,000 B a block
    assert SimConfig().up_flags(prof) == "--prefill 1 --decode 1 --max-num-batched-tokens 2048"
    cfg = SimConfig(mode="colocated", colocated=3, prefill=0, decode=0, max_num_batched_tokens=512,
                    kv_cache_memory_bytes=1_600_000, max_num_seqs=32, enable_prefix_caching=False)
    # pdserve up sizes KV by blocks: the budget becomes --num-kv-blocks (1,600,000 / 16,000 = 100)
    assert cfg.up_flags(prof) == ("--colocated 3 --max-num-batched-tokens 512 --num-kv-blocks 100 --max-num-seqs 32 "
                                  "--no-prefix-caching")
    assert SimConfig(local_prefill_max_tokens=64).up_flags(prof).endswith("--local-prefill-max-tokens 64 "
                                                                           "--max-num-batched-tokens 2048")


# -- co-run: workers sharing a host slow each other's steps --------------------------------------------------------

def test_corun_stretch_is_the_measured_extra_per_busy_sibling():
    m = CorunModel(const_s=0.004, ratio=0.1, min_step_s=0.01)
    assert m.stretch(0.02, 0) == 1.0
    assert m.stretch(0.02, 1) == pytest.approx(1 + (0.004 + 0.1 * 0.02) / 0.02)  # 1.3
    assert m.stretch(0.02, 2) == pytest.approx(1 + 2 * 0.3)
    # below the shortest measured step the extra shrinks in proportion: never a larger stretch than there
    assert m.stretch(0.005, 1) == pytest.approx(m.stretch(0.01, 1)) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="min_step_s"):
        CorunModel(const_s=0.0, ratio=0.0, min_step_s=0.0)


def test_corun_rescales_a_step_when_its_host_mate_starts_and_ends():
    """Two colocated workers on one host, a step twice as slow while the other steps (ratio 1, no constant).
    A's prefill (P solo seconds) starts at R_REQ; B's arrives when A is half done. From then both run at half
    speed: A ends after P more (its remaining P/2 at stretch 2), B has done P/2 by then and finishes its
    other P/2 alone. So both first tokens come 1.5 P after their placement."""
    P = prefill_s(100)
    prof = make_profile(corun=CorunModel(const_s=0.0, ratio=1.0, min_step_s=0.001))
    reqs = [SimRequest("a", 0.0, list(range(100)), 1), SimRequest("b", P / 2, list(range(100, 200)), 1)]
    sim, (a, b) = run(SimConfig(mode="colocated", colocated=2, workers_per_host=2), reqs, prof)
    assert ttft_s(a) == pytest.approx(R_REQ + 1.5 * P, abs=1e-12)
    assert ttft_s(b) == pytest.approx(R_REQ + 1.5 * P, abs=1e-12)
    assert sim.pool_stats()["colocated"].busy_s == pytest.approx(3 * P, abs=1e-12)  # wall time, stretched
    # one worker per host (the default), or a profile without a co-run model: no contention
    for cfg, p in ((SimConfig(mode="colocated", colocated=2), prof),
                   (SimConfig(mode="colocated", colocated=2, workers_per_host=2), make_profile())):
        _, (a, b) = run(cfg, reqs, p)
        assert [ttft_s(a), ttft_s(b)] == pytest.approx([R_REQ + P, R_REQ + P], abs=1e-12)
    # hosts fill in creation order: 1P+1D on one host, so the decode worker's steps slow the prefill's
    sim = Simulation(prof, SimConfig(mode="disaggregated", workers_per_host=2))
    assert [w.worker_id for w in sim.workers["prefill-0"].host] == ["prefill-0", "decode-0"]
    with pytest.raises(ValueError, match="--workers-per-host"):
        SimConfig(workers_per_host=0)


def test_profile_round_trips_its_corun_model():
    prof = make_profile(corun=CorunModel(const_s=0.003, ratio=0.08, min_step_s=0.008, siblings=1))
    back = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert back.corun == prof.corun
    assert Profile.from_dict(json.loads(json.dumps(make_profile().to_dict()))).corun is None
    bad = prof.to_dict()
    bad["corun"]["ratio"] = -1
    with pytest.raises(ValueError, match="corun: ratio"):
        Profile.from_dict(bad)


@pytest.mark.parametrize("delta", [True, False])
def test_a_second_turn_ships_only_what_its_decode_worker_lacks(delta):
    """Issue 47 in the simulator: turn 2 (turn 1's prompt and 40 new tokens, after turn 1 ended) goes back to turn
    1's decode worker (the router's mirror of its own reservations; the other decode worker is idle) and its transfer
    carries the 140 tokens less the 6 full blocks of 16 that worker holds from turn 1's prompt (its answer's tokens
    differ from turn 2's: the simulation samples a fixed token); without delta transfers, all 140."""
    turn1 = list(range(100))
    reqs = [SimRequest("t1", 0.0, turn1, 4), SimRequest("t2", 5.0, turn1 + list(range(5000, 5040)), 4)]
    sim, recs = run(SimConfig(prefill=1, decode=2, kv_delta_transfers=delta, decode_prefix_routing=delta), reqs)
    assert all(r.success for r in recs)
    stats = sim.pool_stats()["decode"]
    cached = 96 if delta else 0
    assert (stats.kv_cached_tokens, stats.kv_bytes_received) == (cached, (100 + 140 - cached) * KVB)
    if delta:
        busy = [w for w in sim.workers.values() if w.role == "decode" and w.engine.num_steps]
        assert len(busy) == 1  # both turns decoded on one worker


def _cached_hashes(w) -> set:
    """Block hashes a simulated engine's prefix cache holds now (the BlockManager's own map)."""
    return {key[2] for key in w.engine.block_manager._cached}


@pytest.mark.parametrize("kv_events", [True, False])
def test_the_router_routes_prompts_to_the_worker_holding_their_prefix_as_deployed(kv_events):
    """Issue 46: the simulated router scores prefixes as a deployed one does by default, on its KV-event index fed by
    the engines' own prefix-cache events (``kv_events=False``: on its mirror, ``--no-kv-events``). Two system prompts
    of 8 blocks, 6 requests each with a unique tail, 0.1 s apart through 2 prefill workers (each arrives while the
    previous one still prefills, so load alone would send it to the other worker): each system prompt is computed on
    one worker only and every later request finds it cached there; with events, the index holds exactly what every
    engine caches. Fails with the scoring's prefix term ignored (load order) or the engines' events not fed."""
    systems = [list(range(s * 1000, s * 1000 + 128)) for s in range(2)]
    reqs = [SimRequest(f"s{i % 2}-{i}", 0.1 * i, systems[i % 2] + list(range(50000 + 40 * i, 50000 + 40 * i + 40)), 2)
            for i in range(12)]
    sim, recs = run(SimConfig(prefill=2, decode=1, kv_events=kv_events, seed=3), reqs)
    assert all(r.success for r in recs)
    prefill = [w for w in sim.workers.values() if w.role == "prefill"]
    where = []
    for sysp in systems:
        first = tuple(sysp[:16])
        holders = [w.worker_id for w in prefill if any(k[1] == first for k in w.engine.block_manager._cached)]
        assert len(holders) == 1, holders  # computed once, on one worker
        where += holders
    assert sum(w.engine.prefix_cache_hits for w in prefill) == 10 * 128  # every later request hit its system prompt
    if kv_events:
        assert sim.kv_events is not None
        index = sim.kv_events.index
        for w in sim.workers.values():
            cached = _cached_hashes(w)
            assert index.num_blocks(w.worker_id) == len(cached), w.worker_id
            assert all(w.worker_id in index.holders(h) for h in cached), w.worker_id
    else:
        assert sim.kv_events is None


@pytest.mark.parametrize("fetch_min,link_bytes_per_s,fetched", [(16, 1e7, 96), (0, 1e7, 0), (16, 1e6, 0)])
def test_a_prefill_worker_that_lost_the_history_fetches_it_from_the_decode_worker(fetch_min, link_bytes_per_s,
                                                                                  fetched):
    """Issue 47's prefix fetch in the simulator: the prefill worker's cache is emptied between two turns; turn 2's
    decode worker holds 6 full blocks (96 tokens) of turn 1's prompt, so with the rule on (16) the prefill worker
    receives those 96 tokens over the link (bytes counted) and computes only turn 2's other 44: at 10 MB/s they
    arrive in 2 + 9.6 ms, against 96 ms to compute them (1 ms a token). At 1 MB/s (98 ms) computing is faster, so
    it computes all 140, as with the rule off (0), and nothing moves decode -> prefill."""
    turn1 = list(range(100))
    reqs = [SimRequest("t1", 0.0, turn1, 4), SimRequest("t2", 5.0, turn1 + list(range(5000, 5040)), 4)]
    prof = make_profile(links={"gloo": LinkModel(0.002, link_bytes_per_s)})
    sim = Simulation(prof, SimConfig(prefill=1, decode=1, kv_prefix_fetch_min_tokens=fetch_min))
    (p,) = [w for w in sim.workers.values() if w.role == "prefill"]
    sim.at(4.0, lambda: p.engine.block_manager.reset_prefix_cache() or pytest.fail("blocks still held at 4 s"))
    recs = sim.run(reqs)
    assert all(r.success for r in recs)
    stats = sim.pool_stats()
    assert stats["prefill"].kv_fetched_tokens == fetched
    assert stats["prefill"].tokens == 100 + 140 - fetched  # prompt tokens its engine computed
    assert stats["decode"].kv_cached_tokens == 96
    assert stats["decode"].kv_bytes_received == (100 + 140 - 96 + fetched) * KVB
    assert p.engine.num_free_blocks == p.engine.num_total_blocks  # the fetch's reservation was given back
