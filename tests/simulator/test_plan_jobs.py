"""`pdserve plan --jobs N`: candidates simulated in N spawned processes give the answer one process gives,
candidate for candidate, count every simulation, and leave no process behind (simulator/plan.py,
``Planner.evaluate_all``). Real processes (the ``spawn`` context `pdserve plan` uses), the hand-made profile of
test_simulate.py."""
from __future__ import annotations

import json

import pytest

from simulator import plan
from simulator.cluster_sim import SimConfig, SimRequest
from tests.simulator.test_simulate import make_profile
from tests.waiting import wait_until


def _plan(tmp_path, capsys, jobs: str, *extra: str) -> tuple[int, dict, str]:
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(make_profile().to_dict()))
    out = tmp_path / f"plan-{jobs}.json"
    rc = plan.main(["--profile", str(prof), "--dataset-name", "random", "--input-len", "200", "--output-len", "20",
                    "--num-prompts", "40", "--chunk-sizes", "256,512", "--local-prefill", "0,100", "--workers", "3",
                    "--ttft-slo-ms", "2000", "--tpot-slo-ms", "100", "--jobs", jobs, "--save-result", str(out),
                    *extra])
    captured = capsys.readouterr()
    return rc, (json.loads(out.read_text()) if out.exists() else {}), captured.out + captured.err


def test_plan_in_two_processes_answers_what_one_does(tmp_path, capsys):
    rc1, one, out1 = _plan(tmp_path, capsys, "1")
    rc2, two, out2 = _plan(tmp_path, capsys, "2")
    assert rc1 == rc2 == 0
    # 2 colocated and 2 x 2 x 2 split candidates (1P+2D, 2P+1D at two chunks and two local-prefill thresholds)
    assert len(one["candidates"]) == 10 and all(c["goodput_rps"] > 0 for c in one["candidates"])
    assert len({c["goodput_rps"] for c in one["candidates"]}) > 2  # candidates that differ, so order matters
    assert two == one  # every candidate's probes, in the same order, and the same recommendation
    sims = [line for line in out1.splitlines() if " simulations of " in line]
    assert sims and sims[0].split()[0] == str(sum(len(c["probes"]) for c in one["candidates"]))
    # the parent counts the workers' simulations
    assert [line.split()[0] for line in out2.splitlines() if " simulations of " in line] == [sims[0].split()[0]]
    assert "(2 processes)" in out2


def test_a_pruned_plan_in_two_processes_answers_what_one_does(tmp_path, capsys):
    """--prune: each candidate starts from the best found before it, so two processes evaluate candidates ahead of
    their turn and again when a new best moves their start; the JSON is still one process's."""
    rc1, one, out1 = _plan(tmp_path, capsys, "1", "--prune")
    rc2, two, out2 = _plan(tmp_path, capsys, "2", "--prune")
    assert rc1 == rc2 == 0
    assert len(one["candidates"]) == 10 and len({c["goodput_rps"] for c in one["candidates"]}) > 2
    assert two == one
    sims = [line.split()[0] for out in (out1, out2) for line in out.splitlines() if " simulations of " in line]
    assert sims[0] == sims[1] == str(sum(len(c["probes"]) for c in one["candidates"]))


def test_a_parallel_pruned_search_starts_again_what_a_new_best_moved():
    """``Planner._pruned_ahead``: the best split first (2P+1D: its kind's first best moves the start of every
    candidate under way), then the 1P+2D ones (pruned below it), then colocated (the first of its kind starts from
    the split's best, the second from its own): each candidate is evaluated from the start the sequential search
    gives it, so its probes are that search's."""
    reqs = [SimRequest(f"r{i}", 0.0, [1 + i] * 200, 20) for i in range(40)]
    cfgs = plan.candidates(3, [256, 512], [0, 100], SimConfig(), ["colocated", "disaggregated"])[::-1]
    slos = {"ttft": 2000.0, "tpot": 100.0}
    alone = plan.Planner(make_profile(), reqs, slos, 0.9, 1.0, 0, SimConfig(), prune=True)
    done1, best1 = alone.best_of(cfgs)
    with plan.Planner(make_profile(), reqs, slos, 0.9, 1.0, 0, SimConfig(), prune=True, jobs=2) as two:
        done2, best2 = two.best_of(cfgs)
    assert [(c.cfg, c.goodput, c.probes, c.pruned_below) for c in done2] == \
        [(c.cfg, c.goodput, c.probes, c.pruned_below) for c in done1]
    assert {m: c.cfg for m, c in best2.items()} == {m: c.cfg for m, c in best1.items()}
    assert two.simulations == alone.simulations and two.requests_simulated == alone.requests_simulated
    assert two.speculation_wasted > 0  # the path that starts a candidate again was taken
    pruned = [c for c in done1 if c.pruned_below is not None]
    assert pruned and len(pruned) < len(cfgs)  # a search that dropped some candidates and bisected others


def test_a_dropped_evaluation_stops_before_its_next_probe(monkeypatch):
    """The worker side of dropping (``_pruned_in_worker``, run here in this process): an evaluation whose slot no
    longer holds its token returns None before simulating anything more; one whose slot holds it runs to the end."""
    reqs = [SimRequest(f"r{i}", 0.0, [1 + i] * 50, 5) for i in range(12)]
    planner = plan.Planner(make_profile(), reqs, {"ttft": 2000.0, "tpot": 100.0}, 0.9, 1.0, 0, SimConfig())
    cfg = plan.candidates(2, [256], [0], SimConfig(), ["colocated"])[0]
    planner._flags = [0, 7]
    monkeypatch.setattr(plan, "_WORKER_PLANNER", planner)
    c, sims, _ = plan._pruned_in_worker(cfg, plan.COLD, 1, 7)
    assert c.goodput > 0 and sims == len(c.probes) > 1
    assert plan._pruned_in_worker(cfg, plan.COLD, 0, 7) is None and planner.simulations == sims  # nothing more ran
    probes = []
    real = plan.simulate_point

    def drop_after_two(*a, **kw):  # the parent drops it while its second probe runs
        probes.append(1)
        if len(probes) == 2:
            planner._flags[1] = 0
        return real(*a, **kw)

    monkeypatch.setattr(plan, "simulate_point", drop_after_two)
    assert plan._pruned_in_worker(cfg, plan.COLD, 1, 7) is None and len(probes) == 2
    assert planner._dropped is None  # (the hook does not outlive the evaluation)


def test_prune_order_puts_the_likeliest_winners_first():
    """Colocated first, then the splits at the highest local-prefill threshold, each from the given prefill share of
    ranks outwards (counted in ranks: a prefill worker at TP 2 is two), ties in their order."""
    cfgs = plan.candidates(8, [512], [0, 100], SimConfig(), ["disaggregated", "colocated"], tps=(1, 2))
    got = [(c.mode, c.local_prefill_max_tokens, c.prefill * c.pool_tp("prefill")) for c in plan.prune_order(cfgs)]
    assert got[:2] == [("colocated", 0, 0)] * 2
    split = got[2:]
    assert [loc for _, loc, _ in split] == sorted((loc for _, loc, _ in split), reverse=True)
    at100 = [ranks for _, loc, ranks in split if loc == 100]
    assert at100[:2] == [4, 4] and [abs(r - 4) for r in at100] == sorted(abs(r - 4) for r in at100)
    first = plan.prune_order(cfgs, 0.75)[2]
    assert first.local_prefill_max_tokens == 100 and first.prefill * first.pool_tp("prefill") == 6


def test_plan_probe_seconds_sizes_each_probe_by_its_rate(tmp_path, capsys):
    """--probe-seconds T: a probe at rate R simulates ceil(R x T) requests (the workload looped), counted in the
    printed total; here 40 requests last about 2.5 s at the split's goodput, too short for queues to form, and 10 s
    of arrivals serve less within the SLOs (what the flag is for). --probe-seconds 0, negative, inf or nan:
    exit 2 naming it."""
    import math

    rc1, once, out1 = _plan(tmp_path, capsys, "1")
    rc2, long, out2 = _plan(tmp_path, capsys, "1", "--probe-seconds", "10")
    assert rc1 == rc2 == 0
    want = sum(max(2, math.ceil(p["rate"] * 10)) for c in long["candidates"] for p in c["probes"])
    assert f" simulations of {want} requests in " in out2
    assert f"of {40 * sum(len(c['probes']) for c in once['candidates'])} requests" in out1  # (the workload once)
    pairs = [(a["goodput_rps"], b["goodput_rps"]) for a, b in zip(once["candidates"], long["candidates"])]
    assert all(g_long <= g_once for g_once, g_long in pairs)
    assert long["best"]["disaggregated"]["goodput_rps"] < 0.8 * once["best"]["disaggregated"]["goodput_rps"]
    (tmp_path / "plan-1.json").unlink()
    for bad in ("0", "-1", "inf", "nan"):
        rc, d, out = _plan(tmp_path, capsys, "1", "--probe-seconds", bad)
        assert rc == 2 and d == {} and "--probe-seconds" in out and "Traceback" not in out, bad


def test_plan_probe_seconds_loops_a_hash_id_trace_with_its_own_prompts(tmp_path, capsys, monkeypatch):
    """A trace whose hash_ids name its prompts' blocks is looped with the very prompts (its prefix sharing is what the
    trace says); random prompts are made new on every pass (a looped copy would be a prefix-cache hit)."""
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(make_profile().to_dict()))
    tr = tmp_path / "m.jsonl"
    tr.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 300, "output_length": 4,
                                      "hash_ids": [7, 100 + i]}) + "\n" for i in range(6)))
    seen: list[dict] = []
    real = plan.Planner

    def spy(*a, **kw):
        seen.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(plan, "Planner", spy)
    common = ["--profile", str(prof), "--workers", "2", "--modes", "colocated", "--chunk-sizes", "512",
              "--ttft-slo-ms", "2000", "--tpot-slo-ms", "100", "--jobs", "1", "--probe-seconds", "2"]
    assert plan.main(common + ["--dataset-name", "trace", "--trace", str(tr)]) == 0
    assert plan.main(common + ["--dataset-name", "random", "--input-len", "300", "--output-len", "4",
                               "--num-prompts", "6"]) == 0
    capsys.readouterr()
    assert [(kw["duration_s"], kw["new_prompts"]) for kw in seen] == [(2.0, False), (2.0, True)]


def test_plan_jobs_is_checked(tmp_path, capsys):
    rc, d, out = _plan(tmp_path, capsys, "0")
    assert rc == 2 and d == {} and "--jobs" in out
    with pytest.raises(ValueError, match="jobs"):
        plan.Planner(make_profile(), [SimRequest("a", 0.0, [1, 2], 2)], {"ttft": 1.0}, 0.9, 1.0, 0, SimConfig(),
                     jobs=0)


def test_planner_ends_its_worker_processes(tmp_path):
    reqs = [SimRequest(f"r{i}", 0.0, [1 + i] * 50, 5) for i in range(12)]
    cfgs = plan.candidates(2, [256, 512], [0], SimConfig(), ["colocated", "disaggregated"])
    planner = plan.Planner(make_profile(), reqs, {"ttft": 2.0, "tpot": 0.1}, 0.9, 1.0, 0, SimConfig(), jobs=2)
    with planner:
        got = planner.evaluate_all(cfgs)
        pool = planner._pool  # (held here: a pool dropped unreferenced would end its workers anyway)
        procs = list(pool._processes.values())
        assert len(procs) == 2 and all(p.is_alive() for p in procs)
    assert planner._pool is None and pool is not None
    wait_until(lambda: not any(p.is_alive() for p in procs), timeout=60, message="the planner's workers to exit")
    # and what they found is what this process finds
    alone = plan.Planner(make_profile(), reqs, {"ttft": 2.0, "tpot": 0.1}, 0.9, 1.0, 0, SimConfig())
    assert [(c.goodput, c.probes) for c in got] == [(c.goodput, c.probes) for c in alone.evaluate_all(cfgs)]
    assert planner.simulations == alone.simulations > len(cfgs)


def _sigint_default() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _busy_plan(tmp_path, cpu_s: float, *extra: str):
    """`python -m simulator.plan --jobs 2` on a search of many minutes (4000 requests a probe, 10 candidates), in a
    session of its own, once both workers have used ``cpu_s`` of CPU (0: once both exist, still starting; 4: past
    their start, simulating: importing pdserve takes ~2.3 s of CPU here; 6 until 1 Dec, which cost the suite ~2 s of
    two workers' CPU a test): (the process, its psutil handle, its
    workers)."""
    import subprocess
    import sys

    import psutil

    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(make_profile().to_dict()))
    proc = subprocess.Popen([sys.executable, "-m", "simulator.plan", "--profile", str(prof), "--dataset-name", "random",
                             "--input-len", "200", "--output-len", "200", "--num-prompts", "4000", "--chunk-sizes",
                             "256,512", "--local-prefill", "0,100", "--workers", "3", "--ttft-slo-ms", "2000",
                             "--tpot-slo-ms", "100", "--jobs", "2", *extra],
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            # as from a terminal: a suite started in the background (`cmd &`: SIGINT ignored, and so
                            # inherited, and Python keeps an ignored SIGINT ignored) would make Ctrl-C a no-op
                            preexec_fn=_sigint_default)
    parent = psutil.Process(proc.pid)
    def busy():
        found = [c for c in parent.children() if "spawn_main" in " ".join(c.cmdline())  # (not the resource tracker)
                 and c.cpu_times().user >= cpu_s]
        return found if len(found) == 2 else None

    workers = wait_until(busy, timeout=240, message="two busy plan workers")
    return proc, parent, workers


@pytest.mark.parametrize("how", ["ctrl-c", "ctrl-c at start", "worker killed", "worker killed, pruned"])
def test_a_parallel_plan_interrupted_or_losing_a_worker_ends_with_its_workers(tmp_path, how):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) mid-search: `pdserve plan` exits promptly
    (130, a line saying so, no traceback), and its worker processes (which ignore SIGINT, so the parent ends them)
    are gone: none keeps simulating; at their start too (where SIGINT reaches a worker still importing, which
    prints its own traceback). A worker SIGKILLed (the OOM killer): exit 1 naming --jobs, the other ended; in a
    pruned search too (``Planner._pruned_ahead``, where evaluations run ahead of their turn)."""
    import os
    import signal

    import psutil

    proc, parent, workers = _busy_plan(tmp_path, 0 if how == "ctrl-c at start" else 4,
                                       *(["--prune"] if how.endswith("pruned") else []))
    try:
        kids = parent.children(recursive=True)
        if how.startswith("ctrl-c"):
            os.killpg(proc.pid, signal.SIGINT)
        else:
            workers[0].kill()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if how.startswith("ctrl-c"):
        assert proc.returncode == 130, out[-2000:]  # interrupted (a shell's status for SIGINT), not finished
        assert b"interrupted after" in out
    else:
        assert proc.returncode == 1, out[-2000:]
        assert b"worker process of the search (--jobs 2) died" in out
    if how != "ctrl-c at start":
        assert b"Traceback" not in out
    _, alive = psutil.wait_procs(kids, timeout=30)
    assert not alive, [p.pid for p in alive]


@pytest.mark.parametrize("jobs", [1, 2])
def test_planner_reports_each_candidate_as_it_finishes(jobs):
    """``Planner.progress`` (`pdserve plan`'s progress bar): called once per candidate with (evaluated, planned),
    the count rising by one to the number of candidates, in one process or several."""
    reqs = [SimRequest(f"r{i}", 0.0, [1 + i] * 50, 5) for i in range(8)]
    cfgs = plan.candidates(2, [256, 512], [0], SimConfig(), ["colocated", "disaggregated"])
    calls: list[tuple[int, int]] = []
    with plan.Planner(make_profile(), reqs, {"ttft": 2.0, "tpot": 0.1}, 0.9, 1.0, 0, SimConfig(), jobs=jobs) as p:
        p.progress = lambda evaluated, planned: calls.append((evaluated, planned))
        done, _ = p.best_of(cfgs)
    assert len(done) == len(cfgs) == 4
    assert calls == [(i, len(cfgs)) for i in range(1, len(cfgs) + 1)]


def test_default_jobs_follows_the_cores_this_process_may_use():
    """`--jobs`'s default counts the affinity mask (a container's cpuset), not the host's cores."""
    import os

    mask = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(mask)})
        assert plan.default_jobs() == 1
    finally:
        os.sched_setaffinity(0, mask)
    assert 1 <= plan.default_jobs() <= len(mask)
