"""The SLA planner policy: its formulas against hand-computed sizes, hysteresis, the counter window, the flags,
and the real ``Planner`` driving a simulated cluster (pdserve's own scheduler and router) through a rate ramp.

The profile has round numbers (as in tests/simulator/test_simulate.py), so every size below is worked out by
hand from the formulas in cluster/sla_planner.py's docstring, not copied from the code's output.
"""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from cluster.planner import Planner, PlannerConfig
from cluster.sla_planner import (CounterWindow, Hysteresis, Load, SlaConfig, SlaPolicy, decode_step_seconds,
                                 plan, prefill_seconds)
from loadtest.stats import slo_attainment, tpot_s, ttft_s
from proto.worker_pb2 import WorkerInfo
from simulator.cluster_sim import SimConfig, SimRequest, Simulation
from simulator.costs import LinkModel, Profile, StepModel

R_REQ, R_TOK = 0.005, 0.001


def make_profile(**kw) -> Profile:
    """lin(T) = 0.01 + 0.001 (T - 1) s; 1e-6 s per prefill attention pair; 1e-5 s per decode context token;
    KV 1000 B/token over 4 layers on a 1 MB/s link with 2 ms latency; router 5 ms per request, 1 ms per token."""
    base = dict(model="tiny", dtype="float32", quantization=None, kv_cache_dtype="auto", device="cpu", threads=1,
                block_size=16, num_layers=4, kv_bytes_per_token=1000, max_model_len=4096,
                step=StepModel(knots=[1, 1001], knot_s=[0.01, 1.01], per_sampled_row_s=0.0,
                               per_prefill_pair_s=1e-6, per_decode_ctx_s=1e-5),
                links={"gloo": LinkModel(0.002, 1e6)}, router_per_request_s=R_REQ, router_per_token_s=R_TOK)
    base.update(kw)
    return Profile(**base)


def lin(t: float) -> float:
    return 0.01 + 0.001 * (t - 1)


def itl(b: int, ctx: float = 132) -> float:
    """A decode step of b sequences at context ctx; every sampled row also pays the router's per-token work."""
    return lin(b) + R_TOK * b + 1e-5 * b * ctx


S100 = lin(100) + 1e-6 * 100 * 50.5 + R_TOK  # a lone 100-token prompt: 0.11505 s
# the TTFT SLO that allows rho = 0.5 exactly with 100-token prompts, 64 tokens out and the TPOT SLO of 60 ms
# (whose largest decode batch is 14: the Reserve waits for one decode step, itl(14))
TTFT_AT_HALF = R_REQ + itl(14) + S100 + S100 * math.log(5) / 0.5


def sla(**kw) -> SlaConfig:
    base = dict(profile=make_profile(), ttft_slo_ms=1000 * TTFT_AT_HALF, tpot_slo_ms=60.0, headroom=1.0)
    base.update(kw)
    return SlaConfig(**base)


# ---- formulas -------------------------------------------------------------------------------------------------
def test_prefill_time_of_a_prompt_alone_and_in_chunks():
    prof = make_profile()
    assert prefill_seconds(prof, 100, 2048) == pytest.approx(S100)
    chunked = (lin(64) + 1e-6 * 64 * (0 + 65 / 2)) + (lin(36) + 1e-6 * 36 * (64 + 37 / 2) + R_TOK)
    assert prefill_seconds(prof, 100, 64) == pytest.approx(chunked)  # only the last chunk samples
    assert decode_step_seconds(prof, 21, 132) == pytest.approx(lin(21) + R_TOK * 21 + 1e-5 * 21 * 132)


def test_sizes_against_hand_computed_ones():
    p = plan(sla(), Load(rate=10.0, prompt_tokens=100, output_tokens=64))
    # decode: ctx = 100 + 64 / 2 = 132, o_d = 63, kv = link(100 * 1000 / 4) = 0.027 s (the last layer's share
    # decides: link(100 kB) - s < 0); TPOT(B) = ITL(B) (1 + 1/63) + 0.027 / 63 <= 60 ms
    # with ITL(B) = 0.009 + (0.001 + 0.001 + 0.00132) B  ->  B <= 14.9: B* = 14
    assert p.detail["kv_s"] == pytest.approx(0.027)
    assert p.detail["decode_batch"] == 14
    assert itl(14) * 64 / 63 + 0.027 / 63 <= 0.060 < itl(15) * 64 / 63 + 0.027 / 63
    mu_d = 14 / itl(14)  # 252.3 tokens/s per decode worker
    assert p.per_replica["decode"] == pytest.approx(mu_d)
    assert p.sizes["decode"] == math.ceil(10 * 63 / mu_d) == 3  # 2.50 workers
    # prefill: TTFT90(rho) = r + ITL(B*) + s + s ln(10 rho) / (1 - rho) meets the SLO at rho = 0.5 exactly
    assert p.detail["rho_prefill"] == pytest.approx(0.5, abs=1e-6)
    mu_p = 0.5 / S100  # 4.346 req/s per prefill worker
    assert p.per_replica["prefill"] == pytest.approx(mu_p, rel=1e-5)
    assert p.sizes["prefill"] == math.ceil(10 / mu_p) == 3  # 2.30 workers
    assert p.notes == []


def test_headroom_batch_caps_and_zero_rate():
    load = Load(rate=10.0, prompt_tokens=100, output_tokens=64)
    assert plan(sla(headroom=1.5), load).sizes["prefill"] == math.ceil(15 * S100 / 0.5) == 4
    assert plan(sla(max_num_seqs=8), load).detail["decode_batch"] == 8
    assert plan(sla(kv_tokens=5 * 164 + 10), load).detail["decode_batch"] == 5  # 5 sequences of 100 + 64 tokens
    p8 = plan(sla(max_num_seqs=8), load)
    assert p8.sizes["decode"] == math.ceil(10 * 63 / (8 / itl(8)))
    assert plan(sla(), Load(0.0, 0.0, 0.0)).sizes == {"prefill": 0, "decode": 0}


def test_slos_no_size_meets_are_noted():
    p = plan(sla(ttft_slo_ms=100, tpot_slo_ms=5), Load(rate=2.0, prompt_tokens=100, output_tokens=64))
    assert len(p.notes) == 2 and "TPOT SLO 5 ms" in p.notes[0] and "TTFT SLO 100 ms" in p.notes[1]
    assert p.detail["rho_prefill"] == 0.5 and p.detail["decode_batch"] == 1


def test_colocated_capacity_meets_both_slos_and_grows_with_them():
    load = Load(rate=5.0, prompt_tokens=100, output_tokens=64)
    p = plan(sla(), load, mode="colocated")
    assert set(p.sizes) == {"colocated"}
    assert p.detail["ttft90_s"] <= TTFT_AT_HALF + 1e-9 and p.detail["tpot_s"] <= 0.060 + 1e-9
    assert p.sizes["colocated"] == math.ceil(5 / p.per_replica["colocated"])
    looser = plan(sla(tpot_slo_ms=120, ttft_slo_ms=2000), load, mode="colocated")
    assert looser.per_replica["colocated"] > p.per_replica["colocated"]


def test_bad_sla_config_names_the_field():
    with pytest.raises(ValueError, match="headroom"):
        sla(headroom=0.5)
    with pytest.raises(ValueError, match="tpot_slo_ms"):
        sla(tpot_slo_ms=0)
    with pytest.raises(ValueError, match="min_window_s"):
        sla(window_s=10, min_window_s=20)
    with pytest.raises(ValueError, match="sla must be an SlaConfig"):
        PlannerConfig(policy="sla")
    with pytest.raises(ValueError, match="policy must be one of"):
        PlannerConfig(policy="magic")


# ---- hysteresis -----------------------------------------------------------------------------------------------
def test_hysteresis_grows_at_once_and_shrinks_after_the_lower_size_was_enough_for_a_while():
    h = Hysteresis(down_after_s=30)
    assert h.apply("decode", 0, current=2, target=1) == 2  # watched 0 s: keep
    assert h.apply("decode", 10, current=2, target=5) == 5  # up by 3 at once
    assert h.apply("decode", 20, current=5, target=2) == 5  # watched 20 s only
    assert h.apply("decode", 35, current=5, target=3) == 5  # still within 30 s of the 5
    assert h.apply("decode", 41, current=5, target=2) == 3  # the largest of the last 30 s (20: 2, 35: 3, 41: 2)
    assert h.apply("decode", 60, current=3, target=2) == 3  # 35's 3 is still within the last 30 s
    assert h.apply("decode", 66, current=3, target=2) == 2  # now it is not
    assert h.apply("prefill", 66, current=3, target=1) == 3  # each role on its own: watched 0 s


def _info(role: str, wid: str, r: int, p: int, o: int, f: int, ready: bool = True) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role=role, ready=ready, requests_total=r, prompt_tokens_total=p,
                      output_tokens_total=o, requests_finished_total=f)


# ---- the counter window -----------------------------------------------------------------------------------------
def test_counter_window_rate_and_lengths():
    w = CounterWindow(window_s=20, min_window_s=5)
    w.observe(0, [_info("prefill", "p0", 100, 10_000, 100, 0), _info("decode", "d0", 3, 30, 900, 50)])
    assert w.load() is None  # one look: no rate yet
    w.observe(4, [_info("prefill", "p0", 120, 12_000, 120, 0), _info("decode", "d0", 3, 30, 1500, 60)])
    assert w.load() is None  # 4 s < min_window_s
    w.observe(10, [_info("prefill", "p0", 150, 15_000, 150, 0), _info("decode", "d0", 5, 130, 2900, 80)])
    load = w.load()  # over 0..10 s: 52 requests, 5100 prompt tokens, 2050 tokens out, 30 finished
    assert load == Load(rate=5.2, prompt_tokens=pytest.approx(5100 / 52), output_tokens=pytest.approx(2050 / 30))
    assert w.totals == {"requests_total": 52, "prompt_tokens_total": 5100, "output_tokens_total": 2050,
                        "requests_finished_total": 30}


def test_counter_window_slides():
    w = CounterWindow(window_s=10)
    for t in range(0, 31, 5):  # 2 requests/s until 15 s, then 6/s
        n = 2 * min(t, 15) + 6 * max(0, t - 15)
        w.observe(t, [_info("colocated", "c0", n, 10 * n, 5 * n, n)])
    assert w.load().rate == pytest.approx(6.0)  # 20..30 s only


def test_counter_window_restarts_new_and_departed_workers():
    w = CounterWindow(window_s=100)
    w.observe(0, [_info("prefill", "p0", 10, 1000, 10, 0), _info("decode", "d0", 0, 0, 500, 10)])
    # p0 restarted under its id (its counter went down): it counts from 0, so its 4 new requests add 4;
    # p1 is new since the last look: all of its 6 requests are new; d0 is gone (adds nothing more)
    w.observe(10, [_info("prefill", "p0", 4, 400, 4, 0), _info("prefill", "p1", 6, 600, 6, 0)])
    assert w.totals["requests_total"] == 10 and w.totals["prompt_tokens_total"] == 1000
    # d0 comes back (a new worker under an old id): counted from 0; an old worker without the fields reads 0
    w.observe(20, [_info("prefill", "p0", 5, 500, 5, 0), _info("prefill", "p1", 6, 600, 6, 0),
                   _info("decode", "d0", 0, 0, 30, 1), WorkerInfo(worker_id="old", role="decode", ready=True)])
    assert w.totals == {"requests_total": 11, "prompt_tokens_total": 1100, "output_tokens_total": 41,
                        "requests_finished_total": 1}
    load = w.load()
    assert load.rate == pytest.approx(11 / 20) and load.prompt_tokens == pytest.approx(100)
    assert load.output_tokens == pytest.approx(41)


def test_nothing_finished_yet_uses_what_was_sampled_so_far():
    w = CounterWindow(window_s=100)
    w.observe(0, [_info("decode", "d0", 0, 0, 0, 0)])
    w.observe(10, [_info("decode", "d0", 10, 1000, 80, 0)])
    assert w.load().output_tokens == pytest.approx(8.0)
    w.observe(20, [_info("decode", "d0", 10, 1000, 80, 0)])
    assert w.load().rate == pytest.approx(0.5)


# ---- the policy inside the Planner ----------------------------------------------------------------------------------
class FakeCluster:
    """What the Planner uses of a Cluster: its mode, the registry's records, the pools, scale_pool."""

    def __init__(self, mode: str, sizes: dict[str, int]) -> None:
        self.config = SimpleNamespace(mode=mode)
        self.sizes = dict(sizes)
        self.records: dict[str, list[WorkerInfo]] = {r: [] for r in sizes}
        self.registry = SimpleNamespace(list=lambda role: self.records[role])
        self.scaled: list[tuple[str, int]] = []

    def worker_ids(self, role: str) -> list[str]:
        return [f"{role}-{i}" for i in range(self.sizes[role])]

    def scale_pool(self, role: str, n: int) -> None:
        self.scaled.append((role, n))
        self.sizes[role] = n


def test_planner_with_the_sla_policy_moves_pools_by_several_workers_within_bounds_and_cooldown():
    now = [0.0]
    c = FakeCluster("disaggregated", {"prefill": 1, "decode": 1})
    cfg = PlannerConfig(policy="sla", sla=sla(window_s=20, min_window_s=5, scale_down_after_s=30), cooldown_s=15,
                        min_prefill=1, max_prefill=4, min_decode=1, max_decode=4)
    planner = Planner(c, cfg, clock=lambda: now[0])
    assert planner.policy.name == "sla"

    def at(t: float, rate: float, total: list) -> None:
        now[0] = t
        total[0] += rate * 5  # 5 s since the last look; 100-token prompts, 64 tokens out each, all finished
        n = int(total[0])
        c.records["prefill"] = [_info("prefill", "p0", n, 100 * n, n, 0)]
        c.records["decode"] = [_info("decode", "d0", 0, 0, 63 * n, n)]
        planner.tick()

    total = [0.0]
    at(0, 0, total)
    at(5, 10, total)  # 10 req/s over 5 s: prefill 3, decode 3 (hand-computed above): both at once
    assert c.scaled == [("prefill", 3), ("decode", 3)]
    at(10, 40, total)  # the window's rate is now 25 req/s (> max): capped at 4... but prefill cools down
    assert c.scaled[2:] == []
    at(20, 40, total)  # cooled down (15 s); 450 requests in 20 s: prefill ceil(22.5 / 4.346) = 6, decode
    assert c.scaled[2:] == [("prefill", 4), ("decode", 4)]  # ceil(22.5 * 63 / 252.3) = 6: both capped at 4
    for t in range(25, 81, 5):  # nothing arrives from now on
        at(t, 0, total)
    # targets (window 20 s): 25 s: 20 req/s -> 4P 4D; 30 s: 10 req/s -> 3P 3D; 35 s: 8 req/s -> 2P 2D; from 40 s:
    # 0 -> 1P 1D. Down only to the largest target of the last 30 s: at 60 s that is 30 s's 3P 3D; the next
    # change waits out the cooldown (75 s), when everything since 45 s wanted 1
    assert c.scaled[4:] == [("prefill", 3), ("decode", 3), ("prefill", 1), ("decode", 1)]
    assert [d[1:] for d in planner.decisions] == [("prefill", 1, 3), ("decode", 1, 3), ("prefill", 3, 4),
                                                  ("decode", 3, 4), ("prefill", 4, 3), ("decode", 4, 3),
                                                  ("prefill", 3, 1), ("decode", 3, 1)]
    assert planner.policy.last_load == Load(0.0, 0.0, pytest.approx(64.0))


def test_threshold_stays_the_default_policy():
    c = FakeCluster("disaggregated", {"prefill": 1, "decode": 1})
    planner = Planner(c, PlannerConfig(min_prefill=1, max_prefill=3, prefill_tokens_high=1000, cooldown_s=0))
    assert planner.policy.name == "threshold"
    c.records["prefill"] = [WorkerInfo(worker_id="p", role="prefill", queued_prompt_tokens=5000, ready=True)]
    c.records["decode"] = [WorkerInfo(worker_id="d", role="decode", num_free_blocks=50, num_total_blocks=100,
                                      ready=True)]
    planner.tick()
    assert c.scaled == [("prefill", 2)]  # one step, as ever


# ---- flags -----------------------------------------------------------------------------------------------------
def _write_profile(tmp_path, **kw) -> str:
    import json

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(make_profile(**kw).to_dict()))
    return str(path)


SLA = ["--autoscale", "--planner", "sla"]


@pytest.mark.parametrize("extra, message", [
    (["--planner", "sla", "--ttft-slo-ms", "500", "--tpot-slo-ms", "50"], "--planner sla needs --autoscale"),
    ([*SLA, "--tpot-slo-ms", "50", "--profile", "P"], "--planner sla needs --ttft-slo-ms"),
    ([*SLA, "--ttft-slo-ms", "500", "--profile", "P"], "--planner sla needs --tpot-slo-ms"),
    ([*SLA, "--ttft-slo-ms", "500", "--tpot-slo-ms", "50"], "--planner sla needs --profile"),
    ([*SLA, "--ttft-slo-ms", "0", "--tpot-slo-ms", "50", "--profile", "P"], "--ttft-slo-ms must be"),
    ([*SLA, "--ttft-slo-ms", "500", "--tpot-slo-ms", "50", "--profile", "/nonexistent"], "--profile: no such file"),
    ([*SLA, "--ttft-slo-ms", "500", "--tpot-slo-ms", "50", "--profile", "P", "--model", "bench"],
     "--profile P: measured model='tiny', but the run asks for 'bench'"),
    ([*SLA, "--ttft-slo-ms", "500", "--tpot-slo-ms", "50", "--profile", "P", "--kv-cache-dtype", "int8"],
     "--profile P: measured kv_cache_dtype='auto', but the run asks for 'int8'"),
    (["--autoscale", "--ttft-slo-ms", "500"], "--ttft-slo-ms is only used by --planner sla"),
])
def test_bad_sla_flags_exit_2_naming_the_flag(tmp_path, capsys, extra, message):
    from cluster.cli import main

    path = _write_profile(tmp_path)
    argv = [path if a == "P" else a for a in extra]
    for cmd in (["up", "--port", "0", "--http-port", "0"], ["controller", "--address", "auto", "--namespace", "x"]):
        assert main([*cmd, *argv]) == 2
        err = capsys.readouterr().err
        assert message.replace(" P:", f" {path}:") in err, err


def test_good_sla_flags_build_the_planner_config(tmp_path):
    from cluster.cli import build_parser
    from cluster.up_checks import check_pool_args
    from cluster.up_flags import sla_config

    path = _write_profile(tmp_path)
    args = build_parser().parse_args(["up", "--autoscale", "--planner", "sla", "--ttft-slo-ms", "500",
                                      "--tpot-slo-ms", "50", "--profile", path, "--num-kv-blocks", "100",
                                      "--max-num-seqs", "32"])
    check_pool_args(args)
    cfg = sla_config(args)
    assert (cfg.ttft_slo_ms, cfg.tpot_slo_ms, cfg.max_num_seqs, cfg.kv_tokens, cfg.kv_link) == (500, 50, 32, 1600,
                                                                                                "gloo")
    assert cfg.profile.model == "tiny"
    plain = build_parser().parse_args(["up", "--autoscale"])
    check_pool_args(plain)
    assert plain.planner == "threshold" and plain.sla_profile is None


# ---- the counters on real workers -------------------------------------------------------------------------------
def test_real_workers_count_arrivals_once_and_every_sampled_token():
    """Real prefill and decode workers (in process, tiny model, gloo KV) behind the real router. A pair request is
    counted by the prefill worker that prefills it; a short prompt the decode worker prefills itself (conditional
    disaggregation) by the decode worker; a request with n = 2 once, with both choices' tokens."""
    import torch

    from tests.roles.harness import collect, start_roles
    from tests.waiting import wait_until

    torch.set_num_threads(1)
    roles = start_roles(tag="sla-", router={"local_prefill_max_tokens": 8})
    try:
        common = dict(ignore_eos=True, temperature=0.0)
        collect(roles.stub, token_ids=list(range(10, 40)), max_tokens=5, **common)  # pair
        collect(roles.stub, token_ids=list(range(10, 15)), max_tokens=4, **common)  # 5 tokens: on the decode worker
        collect(roles.stub, token_ids=list(range(50, 80)), max_tokens=3, n=2, **common)  # pair, two choices
        wait_until(lambda: roles.decodes[0].info().requests_finished_total >= 3, timeout=30,
                   message="the decode worker never finished 3 requests")
        p, d = roles.prefills[0].info(), roles.decodes[0].info()
    finally:
        roles.close()
    assert (p.requests_total, p.prompt_tokens_total, p.output_tokens_total, p.requests_finished_total) == (2, 60, 2, 0)
    # decode: 4 + 4 (local) + 2 (choice 0 after its first token) + 3 (choice 1, prefilled from the cached prompt)
    assert (d.requests_total, d.prompt_tokens_total, d.output_tokens_total, d.requests_finished_total) == (1, 5, 13, 3)


# ---- the simulator's scaling hooks --------------------------------------------------------------------------------
def _requests(rate_at, duration_s: float, seed: int = 1) -> list[SimRequest]:
    """Poisson arrivals of rate ``rate_at(t)`` (thinning under its maximum); prompts of 60..140 tokens, outputs of
    32..96 (means 100 and 64)."""
    rng = random.Random(seed)
    top = max(rate_at(t / 10) for t in range(int(duration_s * 10) + 1))
    out, t = [], 0.0
    while True:
        t += rng.expovariate(top)
        if t >= duration_s:
            return out
        if rng.random() * top <= rate_at(t):
            n = rng.randint(60, 140)
            out.append(SimRequest(f"r{len(out)}", t, [rng.randrange(32000) for _ in range(n)], rng.randint(32, 96)))


def test_simulation_adds_and_removes_workers_and_counts_worker_seconds():
    sim = Simulation(make_profile(), SimConfig(prefill=1, decode=1))
    reqs = _requests(lambda t: 4.0, 20.0)
    events = []

    def hook() -> None:
        events.append((sim.now, len(sim.live_worker_ids("decode"))))
        if sim.now == 5.0:
            assert sim.add_worker("decode", ready_after_s=1.0) == "decode-1"
        if sim.now == 10.0:
            before = {i.worker_id: i for i in sim.worker_infos("decode")}
            assert before["decode-1"].ready and before["decode-1"].output_tokens_total > 0  # it served
            assert sim.remove_worker("decode") == "decode-1"
            after = {i.worker_id: i.ready for i in sim.worker_infos("decode")}
            assert after.get("decode-1", False) is False and after["decode-0"]  # out of routing at once

    sim.every(5.0, hook)
    recs = sim.run(reqs)
    assert all(r.success for r in recs)
    assert events[:3] == [(5.0, 1), (10.0, 2), (15.0, 1)]
    assert sim.live_worker_ids("decode") == ["decode-0"] and "decode-1" not in sim.workers  # dropped once idle
    ws = sim.worker_seconds()
    assert ws["prefill"] == pytest.approx(sim.now)
    assert 5.0 <= ws["decode"] - sim.now <= 5.5  # decode-1: added at 5, dropped shortly after its drain at 10
    infos = sim.worker_infos()
    total = sum(i.requests_total for i in infos)
    assert total == len(reqs) and sum(i.prompt_tokens_total for i in infos) == sum(len(r.prompt_token_ids)
                                                                                     for r in reqs)
    # decode-1 left with its counters: what is left up counts every token but decode-1's
    done = sum(i.requests_finished_total for i in infos)
    assert done <= len(reqs) and sum(i.output_tokens_total for i in infos) <= sum(r.max_tokens for r in reqs)


class SimCluster:
    """A ``Cluster`` as the Planner sees it, over a Simulation: new workers load for ``load_s`` virtual seconds."""

    def __init__(self, sim: Simulation, load_s: float) -> None:
        self.sim, self.load_s = sim, load_s
        self.config = SimpleNamespace(mode=sim.cfg.mode)
        self.registry = SimpleNamespace(list=sim.worker_infos)
        self.sizes: list[tuple[float, str, int]] = []

    def worker_ids(self, role: str) -> list[str]:
        return self.sim.live_worker_ids(role)

    def scale_pool(self, role: str, n: int) -> None:
        while len(self.worker_ids(role)) < n:
            self.sim.add_worker(role, ready_after_s=self.load_s)
        while len(self.worker_ids(role)) > n:
            self.sim.remove_worker(role)
        self.sizes.append((self.sim.now, role, n))


TTFT_MS, TPOT_MS = 600.0, 60.0
LOW, HIGH, RAMP_S, HOLD_S = 1.0, 16.0, 240.0, 60.0


def _ramp(t: float) -> float:
    return LOW + (HIGH - LOW) * min(1.0, t / RAMP_S) if t < RAMP_S + HOLD_S else LOW


def _attainment(recs) -> dict[str, float]:
    slos = {"ttft": TTFT_MS, "tpot": TPOT_MS}
    return {"both": slo_attainment(recs, slos), "ttft": slo_attainment(recs, {"ttft": TTFT_MS}),
            "tpot": slo_attainment(recs, {"tpot": TPOT_MS})}


def test_sla_policy_follows_a_rate_ramp_within_the_slos_on_fewer_worker_seconds_than_the_peak_size():
    """1 -> 16 req/s over 240 virtual seconds, 60 s at the peak, then 60 s back at 1 req/s. The real Planner (sla
    policy, 5 s ticks, 10 s cooldown) sizes the pools from the simulated workers' counters; a new worker takes
    5 s to load. Compared with the static configuration the same policy picks for the peak rate."""
    profile = make_profile()
    reqs = _requests(_ramp, RAMP_S + HOLD_S + 60.0)
    cfg = SlaConfig(profile=profile, ttft_slo_ms=TTFT_MS, tpot_slo_ms=TPOT_MS, headroom=1.2, window_s=30,
                    min_window_s=10, scale_down_after_s=30, max_num_batched_tokens=2048, max_num_seqs=64)
    bounds = dict(min_prefill=1, max_prefill=8, min_decode=1, max_decode=8)
    sim = Simulation(profile, SimConfig(prefill=1, decode=1))
    cluster = SimCluster(sim, load_s=5.0)
    planner = Planner(cluster, PlannerConfig(policy="sla", sla=cfg, interval_s=5, cooldown_s=10, **bounds),
                      clock=lambda: sim.now)
    sim.every(5.0, planner.tick)
    recs = sim.run(reqs)
    horizon = sim.now
    got = _attainment(recs)
    ws = sim.worker_seconds(horizon)

    mean_p = sum(len(r.prompt_token_ids) for r in reqs) / len(reqs)
    mean_o = sum(r.max_tokens for r in reqs) / len(reqs)
    peak = plan(cfg, Load(HIGH, mean_p, mean_o)).sizes
    fixed = Simulation(profile, SimConfig(prefill=peak["prefill"], decode=peak["decode"]))
    fixed_recs = fixed.run(reqs)
    fixed_ws = (peak["prefill"] + peak["decode"]) * horizon
    most = {r: max([n for _, role, n in cluster.sizes if role == r] + [1]) for r in ("prefill", "decode")}
    print(f"\nramp {LOW:g} -> {HIGH:g} req/s, {len(reqs)} requests, {horizon:.0f} virtual s: sla attainment "
          f"{got['both']:.3f} (ttft {got['ttft']:.3f}, tpot {got['tpot']:.3f}), worker-seconds "
          f"{sum(ws.values()):.0f} ({', '.join(f'{k} {v:.0f}' for k, v in ws.items())}), largest pools {most}; "
          f"fixed peak {peak['prefill']}P+{peak['decode']}D: attainment {_attainment(fixed_recs)['both']:.3f}, "
          f"worker-seconds {fixed_ws:.0f}; decisions {[(round(t), r, n) for t, r, n in cluster.sizes]}")
    assert all(r.success for r in recs)
    assert got["ttft"] >= 0.9 and got["tpot"] >= 0.9 and got["both"] >= 0.9
    assert sum(ws.values()) < fixed_ws
    assert most == peak  # at the peak it runs the size it would have picked for it
    assert len(sim.live_worker_ids("prefill")) + len(sim.live_worker_ids("decode")) < sum(peak.values())  # shrank
    late = [r for r in recs if r.start_s > RAMP_S + HOLD_S + 20]
    assert late and all(ttft_s(r) * 1000 <= TTFT_MS and (tpot_s(r) or 0) * 1000 <= TPOT_MS for r in late)
