"""`pdserve plan`: the deployment that serves a workload within its SLOs, found in the simulator.

Lifecycle: ``main(argv)`` reads a profile, a workload (``pdserve bench``'s flags: a trace's lengths or
random lengths), the SLOs (``--ttft-slo-ms``, ``--tpot-slo-ms``) and either a worker budget
(``--workers N``: the best configurations of N workers) or a target rate (``--target-rate R``: the
fewest workers that serve R). For each candidate configuration it finds the goodput, DistServe's
measure: the highest request rate at which at least ``--goal`` (90%) of the requests meet both SLOs (a
trace's own arrival pattern rescaled to each rate; with ``--request-rate``, or random lengths, Poisson or
``--burstiness`` gamma arrivals), by bisection on the rate with one simulation per probe (``goodput_of``).
Candidates: colocated N workers at each chunk size (``--chunk-sizes``); disaggregated P:D for every
split (a coarse-to-fine search when N is large) at each chunk size, with conditional disaggregation off
and at each ``--local-prefill`` threshold. It prints the best disaggregated and best colocated side by
side (goodput, per worker, each pool's utilisation, p90 TTFT and mean TPOT at that rate) and the
``pdserve up`` flags of each, and with ``--save-result`` writes every candidate's numbers as JSON.

With tensor parallelism (``--profile`` given once per TP size the pools may run, from ``pdserve profile
--tensor-parallel-size N``), the budget counts engine ranks (a worker at TP k takes k) and the candidates also
range over each pool's TP (``--tp-sizes``, default every size profiled): colocated at each TP dividing the
budget, disaggregated at every (prefill TP, decode TP) pair and every split of the ranks into whole workers
(DistServe's placement search, per pool). ``--rank-memory-bytes`` prices a rank's memory: a TP whose weights
leave no room for one KV block is left out (with a note), and the others' KV caches get what their weights
leave. Goodput per rank is what the recommendation compares.

The same arrival seed is used for every candidate and rate, so candidates are compared on the same
request sequence (only its time axis is rescaled). ``--jobs N`` (default: every core this process may use)
evaluates candidates in N spawned processes; each holds a copy of the planner made at its first parallel search,
and the answer is the one a single process gives, candidate for candidate (``Planner.close`` ends the
processes). A full search's candidates are independent of one another; a pruned one's (``--prune``) each start
from the best found before them, so they are evaluated ahead of their turn from the search as it stands, and
one whose start a newly found best changes is evaluated again (``Planner._pruned_ahead``).
``Planner.progress`` hears of each candidate as it finishes (a progress bar on a terminal's stderr).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import psutil
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from loadtest.arrivals import gamma_arrivals
from loadtest.cli import add_workload_args, check_workload_args
from loadtest.stats import percentile, slo_attainment, tpot_s, ttft_s
from simulator.cli import (SIM_VOCAB, add_deployment_args, check_profile_args, hashed_trace_rows,
                           requests_from_args, run_simulation)
from simulator.cluster_sim import SimConfig, SimRequest
from simulator.costs import Profile, ProfileSet


@dataclass
class Point:
    """One simulated (configuration, rate)."""

    rate: float
    attainment: float
    p90_ttft_ms: float
    mean_tpot_ms: float
    utilisation: dict[str, float]


@dataclass
class Candidate:
    cfg: SimConfig
    goodput: float = 0.0
    """Highest rate (req/s) with attainment >= goal; 0 if even the lowest probe misses."""
    at_goodput: Optional[Point] = None
    probes: list[Point] = field(default_factory=list)
    pruned_below: Optional[float] = None
    """Set when a pruned search gave up on it: it misses the goal at this rate (req/s), below the best's."""

    @property
    def per_worker(self) -> float:
        """Goodput per engine rank (per worker where every worker is one rank): what a budget of ranks buys."""
        return self.goodput / self.cfg.num_ranks

    def as_dict(self, profile: "Profile | ProfileSet") -> dict[str, Any]:
        p = self.at_goodput
        return {"deployment": self.cfg.label(), "pdserve_up_flags": self.cfg.up_flags(profile), "mode": self.cfg.mode,
                "config": asdict(self.cfg),
                "workers": self.cfg.num_workers, "ranks": self.cfg.num_ranks,
                "tensor_parallel": {r: self.cfg.pool_tp(r) for r in self.cfg.roles},
                "goodput_rps": self.goodput, "goodput_per_worker": self.per_worker,
                "at_goodput": None if p is None else p.__dict__, "pruned_below_rps": self.pruned_below,
                "probes": [q.__dict__ for q in self.probes]}


def loop_requests(reqs: list[SimRequest], n: int, new_prompts: bool = True, vocab: int = SIM_VOCAB
                  ) -> list[SimRequest]:
    """The first ``n`` requests of ``reqs`` replayed end to end as often as it takes (a trace looped).

    Pass k (k >= 1) repeats request i as ``{id}~k`` with the same prompt length and ``max_tokens``, in the
    same order, arriving ``k * period`` later, where period = the trace's span + its mean gap (so pass k
    starts one mean gap after pass k - 1's last arrival and arrivals never decrease). ``new_prompts``
    (for traces without ``hash_ids``, whose prompts are each their own): pass k's prompts differ from every
    other pass's in their first token (shifted by k modulo ``vocab``), so a looped request is no prefix-cache
    hit on its earlier copy, while prompts that share a prefix within the trace still share it within each
    pass (the block hashes chain from the first block). ``new_prompts=False`` (traces with ``hash_ids``):
    a looped request keeps its very prompt, i.e. its prefix hashes, as the trace says it would.
    ValueError naming the argument for an empty ``reqs`` or a negative ``n``."""
    if n < 0:
        raise ValueError(f"loop_requests: n must be >= 0, got {n}")
    if n and not reqs:
        raise ValueError("loop_requests: reqs is empty (nothing to loop)")
    m = len(reqs)
    if n <= m:
        return reqs[:n]
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    period = span + (span / (m - 1) if m > 1 else 0.0)
    out = list(reqs)
    for i in range(m, n):
        k, r = divmod(i, m)
        src = reqs[r]
        prompt = src.prompt_token_ids
        if new_prompts and prompt:
            prompt = [(prompt[0] + k) % vocab] + prompt[1:]
        out.append(SimRequest(f"{src.request_id}~{k}", src.arrival_s + k * period, prompt, src.max_tokens))
    return out


def at_rate(reqs: list[SimRequest], rate: float, burstiness: Optional[float], seed: int) -> list[SimRequest]:
    """The same requests, arriving at mean ``rate`` req/s: gamma gaps of shape ``burstiness`` (1 = Poisson), or,
    with ``burstiness`` None, their own arrival times rescaled (a trace's burst pattern kept, as
    benchmarks/disagg_vs_colocated.py replays it)."""
    if burstiness is None:
        span = reqs[-1].arrival_s - reqs[0].arrival_s
        f = (len(reqs) - 1) / (rate * span) if span > 0 else 0.0
        return [replace(r, arrival_s=(r.arrival_s - reqs[0].arrival_s) * f) for r in reqs]
    arr = gamma_arrivals(len(reqs), rate, burstiness, seed)
    return [replace(r, arrival_s=t) for r, t in zip(reqs, arr)]


def simulate_point(profile: "Profile | ProfileSet", cfg: SimConfig, reqs: list[SimRequest], rate: float, slos: dict[str, float],
                   burstiness: Optional[float], seed: int) -> Point:
    records, duration, pools = run_simulation(profile, cfg, at_rate(reqs, rate, burstiness, seed))
    ok = [r for r in records if r.success]
    ttfts = [ttft_s(r) for r in ok if ttft_s(r) is not None]
    tpots = [t for t in (tpot_s(r) for r in ok) if t is not None]
    return Point(rate, slo_attainment(records, slos),
                 1000 * percentile(ttfts, 90) if ttfts else math.inf,
                 1000 * sum(tpots) / len(tpots) if tpots else 0.0,
                 {role: s.utilisation(duration) for role, s in pools.items()})


COLD_SHRINK = 3
"""A cold bisection (no bracket from another candidate) that misses at its first rate, a twentieth of the
optimistic guess, tries a quarter of it up to this many times (down to 1/64): a 70B's ranks or a bursty trace's
arrivals can serve far less than the guess, and "no configuration meets the SLOs at any rate" must mean it."""


def goodput_of(probe: Callable[[float], Point], lo: float, hi: float, goal: float, rel_tol: float = 0.04,
               max_probes: int = 14, grow: float = 2.0, shrink: int = 0) -> tuple[float, Optional[Point], list[Point]]:
    """Bisection for the highest passing rate in [lo, hi] (hi grows ``grow``-fold while it still passes). Where lo
    misses, up to ``shrink`` more probes at a quarter of the rate each before giving up (goodput 0): a first guess
    can be far above what a slow deployment (a 70B, a bursty trace) serves."""
    if not grow > 1:
        raise ValueError(f"grow must be > 1, got {grow}")
    probes: list[Point] = []
    first = probe(lo)
    probes.append(first)
    missed_at = None
    while first.attainment < goal and len(probes) <= shrink:
        missed_at, lo = lo, lo / 4
        first = probe(lo)
        probes.append(first)
    if first.attainment < goal:
        return 0.0, None, probes
    best = first
    if missed_at is not None:
        hi = missed_at  # known to miss: bisect below it
    else:
        top = probe(hi)
        probes.append(top)
        while top.attainment >= goal and len(probes) < max_probes:
            best, lo, hi = top, hi, hi * grow
            top = probe(hi)
            probes.append(top)
    while hi - lo > rel_tol * lo and len(probes) < max_probes:
        mid = math.sqrt(lo * hi)
        p = probe(mid)
        probes.append(p)
        if p.attainment >= goal:
            best, lo = p, mid
        else:
            hi = mid
    return best.rate, best, probes


def candidates(n: int, chunks: list[int], locals_: list[int], base: SimConfig, modes: list[str],
               tps: Sequence[int] = (1,)) -> list[SimConfig]:
    """Every deployment of ``n`` engine ranks to simulate: colocated at each TP in ``tps`` that divides ``n``,
    and disaggregated at each (prefill TP, decode TP) pair for every split of the ranks into whole workers (a
    coarse grid of prefill shares when ``n`` > 16), each at every chunk size (and local-prefill threshold)."""
    out = []
    if "colocated" in modes:
        out += [replace(base, mode="colocated", colocated=n // t, prefill=0, decode=0, max_num_batched_tokens=c,
                        local_prefill_max_tokens=0, tensor_parallel_size=t, prefill_tp=None, decode_tp=None)
                for t in tps if n % t == 0 for c in chunks]
    if "disaggregated" in modes and n >= 2:
        for pt in tps:
            for dt in tps:
                if n <= 16:
                    ps: Any = range(1, n // pt + 1)
                else:  # every 1/16th of the budget; the best region is refined by ``Planner.best_of``
                    ps = sorted({max(1, round(n * k / 16 / pt)) for k in range(1, 16)})
                for p in ps:
                    rest = n - p * pt
                    if rest < dt or rest % dt:
                        continue
                    d = rest // dt
                    for c in chunks:
                        for loc in locals_:
                            out.append(replace(base, mode="disaggregated", prefill=p, decode=d, colocated=0,
                                               max_num_batched_tokens=c, local_prefill_max_tokens=loc,
                                               tensor_parallel_size=1, prefill_tp=pt, decode_tp=dt))
    return out


def prune_order(cfgs: list[SimConfig], share: float = 0.5) -> list[SimConfig]:
    """``cfgs`` in the order a pruned search goes through them fastest (the higher its first bar, the more it drops
    after one probe): colocated first, then the splits with the highest local-prefill threshold first, each from
    the prefill share of ranks ``share`` (a smaller budget's winner; default half) outwards; ties keep their order."""
    def key(c: SimConfig) -> tuple[bool, int, float]:
        if c.mode == "colocated":
            return False, 0, 0.0
        return True, -c.local_prefill_max_tokens, abs(c.prefill * c.pool_tp("prefill") - share * c.num_ranks)
    return sorted(cfgs, key=key)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, action="append", metavar="FILE",
                   help="profile.json from `pdserve profile`; repeat it with one profile per tensor-parallel size to "
                        "search TP per pool")
    p.add_argument("--model", default=None, help="the model the profile must have measured (checked)")
    p.add_argument("--ttft-slo-ms", type=float, required=True, help="time-to-first-token SLO (ms)")
    p.add_argument("--tpot-slo-ms", type=float, required=True, help="time-per-output-token SLO (ms)")
    p.add_argument("--goal", type=float, default=0.9, help="fraction of requests that must meet both SLOs (0.9)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--workers", type=int,
                      help="budget in engine ranks (cores or GPUs; a worker at TP k counts k): the best "
                           "configurations of this many")
    what.add_argument("--target-rate", type=float, help="req/s to serve: the fewest ranks that serve it")
    p.add_argument("--tp-sizes", default="auto",
                   help="tensor-parallel sizes to try for each pool (comma-separated; default: every size a "
                        "--profile was taken at)")
    p.add_argument("--chunk-sizes", default="256,512,1024,2048",
                   help="--max-num-batched-tokens values to try (comma-separated)")
    p.add_argument("--local-prefill", default="0,auto",
                   help="--local-prefill-max-tokens values to try for disaggregated configurations ('auto': the "
                        "workload's 25th and 50th percentile prompt lengths)")
    p.add_argument("--modes", default="colocated,disaggregated", help="which kinds of deployment to consider")
    p.add_argument("--max-workers", type=int, default=1024,
                   help="--target-rate: the largest deployment to try (in ranks)")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="processes that simulate candidates side by side (default: every core this process may "
                        "use, at most one per GiB of available memory; the answer is the same at any N)")
    p.add_argument("--prune", action="store_true",
                   help="a faster search: each candidate's bisection starts near the best of its kind so far, and "
                        "one that misses the SLOs at 0.75x that is dropped after one probe (it cannot win); the "
                        "goodputs found differ from a full search's within its bisection tolerance")
    p.add_argument("--probe-seconds", type=float, default=None, metavar="T",
                   help="each probe at rate R simulates ceil(R x T) requests, the workload looped as often as it "
                        "takes (each pass's prompts new, unless a trace's hash_ids name them), so a probe lasts T "
                        "seconds at any rate and queues have time to form (default: the workload once, however "
                        "short it is at a high rate)")
    add_workload_args(p)
    add_deployment_args(p, pools=False)
    return p


def _int_list(text: str, flag: str) -> list[int]:
    try:
        vals = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not vals or vals[0] < 1:
        raise ValueError(f"{flag}: need integers >= 1, got {text!r}")
    return vals


def check_args(args: argparse.Namespace) -> None:
    check_workload_args(args)
    if not (args.ttft_slo_ms > 0 and args.tpot_slo_ms > 0):
        raise ValueError("--ttft-slo-ms and --tpot-slo-ms must be > 0")
    if not 0 < args.goal <= 1:
        raise ValueError(f"--goal must be within (0, 1], got {args.goal}")
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1 (a budget of {args.workers} workers serves nothing)")
    if args.target_rate is not None and not args.target_rate > 0:
        raise ValueError(f"--target-rate must be > 0, got {args.target_rate}")
    if args.probe_seconds is not None and not 0 < args.probe_seconds < math.inf:
        raise ValueError(f"--probe-seconds must be a finite number > 0, got {args.probe_seconds}")
    if args.jobs is None:
        args.jobs = default_jobs()
    elif args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    args.chunk_list = _int_list(args.chunk_sizes, "--chunk-sizes")
    args.mode_list = [m for m in args.modes.split(",") if m]
    if not args.mode_list or any(m not in ("colocated", "disaggregated") for m in args.mode_list):
        raise ValueError(f"--modes: expected colocated and/or disaggregated, got {args.modes!r}")
    if args.workers == 1 and args.mode_list == ["disaggregated"]:
        raise ValueError("--workers 1 cannot be disaggregated (it needs a prefill and a decode worker)")


JOB_MEMORY_BYTES = 1 << 30
"""What the default ``--jobs`` allows a worker process: pdserve's imports and a 1,000-request simulation of a
70B plan took ~0.55 GB resident (30 Nov), so a many-core host with little memory gets fewer processes."""


def default_jobs() -> int:
    """``--jobs``'s default: the cores this process may run on (its affinity mask, which a container's cpuset
    narrows), at most one per ``JOB_MEMORY_BYTES`` of the memory available now."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        cores = os.cpu_count() or 1
    return max(1, min(cores, psutil.virtual_memory().available // JOB_MEMORY_BYTES))


def _locals(text: str, reqs: list[SimRequest]) -> list[int]:
    out: set[int] = set()
    lens = sorted(len(r.prompt_token_ids) for r in reqs)
    for x in text.split(","):
        x = x.strip()
        if x == "auto":
            out.update({lens[len(lens) // 4], lens[len(lens) // 2]})
        elif x[:1] == "p" and x[1:].isdigit() and 0 < int(x[1:]) < 100:  # a percentile of the prompt lengths
            out.add(lens[len(lens) * int(x[1:]) // 100])
        elif x:
            try:
                v = int(x)
            except ValueError:
                raise ValueError(f"--local-prefill: expected integers, 'auto' or pNN, got {x!r}") from None
            if v < 0:
                raise ValueError(f"--local-prefill: values must be >= 0, got {v}")
            out.add(v)
    return sorted(out) or [0]


PRUNE_BELOW = 0.75
"""A pruned search's first probe of a candidate: this fraction of the best goodput of its mode so far."""
PRUNE_HI = 1.15
"""... and its second: this fraction (doubling on from there while it passes)."""
COLD: tuple[Optional[float], Optional[float], bool] = (None, None, False)
"""The ``Planner._prune_key`` of a cold evaluation: no bracket (``Planner.pruned`` is then ``evaluate``)."""


class Planner:
    """Goodput of deployments for one workload, profile and SLOs."""

    def __init__(self, profile: "Profile | ProfileSet", reqs: list[SimRequest], slos: dict[str, float], goal: float,
                 burstiness: Optional[float], seed: int, base: SimConfig, duration_s: Optional[float] = None,
                 new_prompts: bool = True, rel_tol: float = 0.04, prune: bool = False,
                 tps: Sequence[int] = (1,), jobs: int = 1) -> None:
        """``duration_s``: each probe replays ``ceil(rate * duration_s)`` requests (``reqs`` looped by
        ``loop_requests`` when it runs out, ``new_prompts`` passed on) instead of all of ``reqs``, so a probe
        lasts about as long at 1,000 req/s as at 1 req/s and queues have time to form. ``rel_tol``: the
        bisection stops when its bracket is that narrow (relative). ``prune``: ``best_of`` starts each
        candidate's bisection at ``PRUNE_BELOW`` x the best goodput per worker of its mode found so far and
        gives up on a candidate that misses there (goodput 0, ``pruned_below`` set): it cannot be the best, and
        a search over many candidates then costs about one probe for each loser. ``jobs``: processes that
        evaluate a search's candidates side by side (the answer does not depend on how many)."""
        if not 0 < rel_tol < 1:
            raise ValueError(f"rel_tol must be within (0, 1), got {rel_tol}")
        if duration_s is not None and not 0 < duration_s < math.inf:
            raise ValueError(f"duration_s (--probe-seconds) must be a finite number > 0, got {duration_s}")
        if not reqs:
            raise ValueError("reqs: the workload has no requests")
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise ValueError(f"jobs (--jobs) must be an integer >= 1, got {jobs!r}")
        self.jobs = jobs
        self._pool: Optional[ProcessPoolExecutor] = None
        self._pool_size = 0
        self._handoff: Any = None
        """The queue that hands the planner to the pool's workers as they start."""
        self.progress: Optional[Callable[[int, int], None]] = None
        """Called with (candidates evaluated, candidates planned so far) as each one finishes (`pdserve plan`'s
        progress bar); a later budget or the refinement of a split adds to the second."""
        self._evaluated = self._planned = 0
        self.profiles = ProfileSet.of(profile)
        self.profile = self.profiles.base
        self.tps = list(tps)
        """Tensor-parallel sizes the candidates' pools may take (each needs a profile in ``profiles``)."""
        self.reqs, self.slos, self.goal = reqs, slos, goal
        self.burstiness, self.seed, self.base = burstiness, seed, base
        self.duration_s, self.new_prompts, self.rel_tol, self.prune = duration_s, new_prompts, rel_tol, prune
        self.refine = True
        """``best_of`` refines a large budget's best P:D split (off when the caller chose the splits itself)."""
        self.hints: dict[str, float] = {}
        """mode -> a goodput per worker to start the first candidate of that mode from (with ``prune``)."""
        self._looped: list[SimRequest] = reqs
        self.simulations = 0
        self.requests_simulated = 0
        self.speculation_wasted = 0
        """Evaluations a parallel pruned search started ahead of their turn and dropped (``_pruned_ahead``)."""
        self._dropped: Optional[Callable[[], bool]] = None
        """In a worker process, during an evaluation the parent may drop: true once it did (checked before each
        probe, which then raises ``_Dropped``)."""
        self._flags: Any = None
        """The shared array through which the parent drops evaluations under way (one slot each)."""
        # a first rate guess: what one worker could do if every step were a lone request's (an upper bound)
        mean_p = sum(len(r.prompt_token_ids) for r in reqs) / len(reqs)
        mean_o = sum(r.max_tokens for r in reqs) / len(reqs)
        step = self.profile.step
        one = step.lin(mean_p) + step.lin(1) * mean_o / 32  # a prefill + a share of batched decode steps
        self.rate_per_worker_guess = 1.0 / max(one, 1e-6)

    def fits(self, cfg: SimConfig) -> bool:
        """Whether every pool of ``cfg`` has a profile at its TP and room for KV beside its weights."""
        return all(cfg.pool_tp(r) in self.profiles.by_tp and cfg.fits(self.profiles.at(cfg.pool_tp(r)))
                   for r in cfg.roles)

    def requests_at(self, rate: float) -> list[SimRequest]:
        """The requests a probe at ``rate`` replays: all of them, or ``duration_s`` worth (at least 2)."""
        if self.duration_s is None:
            return self.reqs
        n = max(2, math.ceil(rate * self.duration_s))
        if len(self._looped) < n:  # grow the looped pool geometrically: a bisection asks for many sizes
            self._looped = loop_requests(self.reqs, max(n, 2 * len(self._looped)), self.new_prompts)
        return self._looped[:n]

    def evaluate(self, cfg: SimConfig, lo: Optional[float] = None, hi: Optional[float] = None) -> Candidate:
        """``cfg``'s goodput by bisection from ``lo`` (default: a twentieth of the rate guess) and ``hi`` (4 lo)."""
        def probe(rate: float) -> Point:
            if self._dropped is not None and self._dropped():
                raise _Dropped
            reqs = self.requests_at(rate)
            self.simulations += 1
            self.requests_simulated += len(reqs)
            return simulate_point(self.profiles, cfg, reqs, rate, self.slos, self.burstiness, self.seed)

        if lo is None:
            lo = 0.05 * self.rate_per_worker_guess * cfg.num_ranks
            g, at, probes = goodput_of(probe, lo, 4 * lo, self.goal, self.rel_tol, shrink=COLD_SHRINK)
        else:  # a warm bracket: grow gently past it, a probe at twice the rate costs twice the requests
            g, at, probes = goodput_of(probe, lo, 2 * lo if hi is None else hi, self.goal, self.rel_tol, grow=1.3)
        return Candidate(cfg, g, at, probes)

    def _bracket(self, cfg: SimConfig, best: dict[str, Candidate]) -> tuple[Optional[float], Optional[float]]:
        """With ``prune``: where to start a candidate's bisection, from the best per-worker goodput found so far
        (its own mode's, else the other mode's, wider); (None, None): the cold start from the rate guess."""
        if not self.prune:
            return None, None
        n = cfg.num_ranks
        own = best.get(cfg.mode)
        if own is not None:
            return PRUNE_BELOW * own.per_worker * n, PRUNE_HI * own.per_worker * n
        if cfg.mode in self.hints:  # another budget's best per worker of this mode
            return 0.6 * self.hints[cfg.mode] * n, 1.2 * self.hints[cfg.mode] * n
        other = next(iter(best.values()), None)
        if other is not None:
            return 0.2 * other.per_worker * n, other.per_worker * n
        return None, None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pool": None, "_handoff": None, "_flags": None, "_dropped": None,
                "progress": None}  # the planner, not its pool

    def evaluate_all(self, cfgs: list[SimConfig]) -> list[Candidate]:
        """Every ``cfg``'s goodput from a cold start, in ``cfgs``' order: in up to ``jobs`` processes at once
        (the same answers as one after another: each evaluation is a function of the planner and its ``cfg``)."""
        self._planned += len(cfgs)
        if self.jobs == 1 or len(cfgs) < 2:
            out = []
            for cfg in cfgs:
                out.append(self.evaluate(cfg))
                self._tick()
            return out
        pool = self._ensure_pool(min(self.jobs, len(cfgs)))
        try:
            futures = [pool.submit(_pruned_in_worker, cfg, COLD) for cfg in cfgs]
            for f in as_completed(futures):
                f.result()  # (a worker's error, raised here)
                self._tick()
            out = []
            for f in futures:  # in cfgs' order, whichever finished first
                c, sims, reqs = f.result()
                self.simulations += sims
                self.requests_simulated += reqs
                out.append(c)
            return out
        except BaseException:  # (KeyboardInterrupt included) the workers' candidates are not wanted any more
            self.close(kill=True)
            raise

    def _ensure_pool(self, want: int) -> ProcessPoolExecutor:
        """The worker processes, at least ``want`` of them (started on first use, restarted larger)."""
        if self._pool is not None and self._pool_size < want:  # (a --target-rate search's budgets grow)
            self.close()
        if self._pool is None:
            # the planner (megabytes: every request) goes through a queue its feeder thread writes in the
            # background, not in the workers' start arguments: those are written to each child's pipe while it
            # imports pdserve (seconds), which would hold this thread inside submit, half-way through a spawn
            ctx = multiprocessing.get_context("spawn")
            self._handoff = ctx.Queue()
            for _ in range(want):
                self._handoff.put(self)
            self._flags = ctx.Array("q", 4 * want + 8, lock=False)  # (more slots than evaluations under way)
            self._pool = ProcessPoolExecutor(want, mp_context=ctx, initializer=_serve,
                                             initargs=(self._handoff, self._flags))
            self._pool_size = want
        return self._pool

    def close(self, kill: bool = False) -> None:
        """End the worker processes (``kill``: now, mid-simulation); a later parallel search starts new ones."""
        pool, self._pool = self._pool, None
        handoff, self._handoff = self._handoff, None
        if pool is None:
            return
        if handoff is not None:  # (copies no worker took, had one died first, are dropped, not waited on)
            handoff.cancel_join_thread()
            handoff.close()
        if not kill:
            pool.shutdown(wait=True, cancel_futures=True)
            return
        # ended here, not through the executor's own shutdown, which joins its manager thread: the workers are
        # what must not outlive us, and Python before 3.14 has no public way to end them
        procs = list((getattr(pool, "_processes", None) or {}).values())
        for proc in procs:
            proc.terminate()
        if procs:  # (an empty wait would sleep its whole timeout)
            multiprocessing.connection.wait([proc.sentinel for proc in procs], timeout=10)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "Planner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(kill=exc[0] is not None)

    def _search(self, cfgs: list[SimConfig], best: dict[str, Candidate]) -> list[Candidate]:
        """``cfgs`` evaluated, each kept in ``best`` (per mode) if it beats it; pruned (one after another, each
        from the best so far) or cold (side by side with ``jobs``)."""
        if not self.prune:
            done = self.evaluate_all(cfgs)
            for c in done:
                _keep(best, c)
            return done
        self._planned += len(cfgs)
        if self.jobs > 1 and len(cfgs) > 1:
            return self._pruned_ahead(cfgs, best)
        done = []
        for cfg in cfgs:
            c = self.pruned(cfg, *self._prune_key(cfg, best))
            done.append(c)
            _keep(best, c)
            self._tick()
        return done

    def _prune_key(self, cfg: SimConfig, best: dict[str, Candidate]) -> tuple[Optional[float], Optional[float], bool]:
        """Everything a pruned evaluation of ``cfg`` reads of the search so far: its bracket (``_bracket``) and
        whether its mode has a best yet."""
        return (*self._bracket(cfg, best), cfg.mode in best)

    def pruned(self, cfg: SimConfig, lo: Optional[float], hi: Optional[float], known: bool) -> Candidate:
        """One candidate of a pruned search, from its ``_prune_key``: bisected from the warm bracket; a miss there
        drops it (``pruned_below``) when its mode has a best (``known``), else it is bisected again cold."""
        c = self.evaluate(cfg, lo, hi)
        if c.goodput == 0 and lo is not None and known:
            c.pruned_below = lo
        elif c.goodput == 0 and lo is not None:  # the first of its mode missed a warm bracket: start cold
            c = self.evaluate(cfg)
        return c

    def _pruned_ahead(self, cfgs: list[SimConfig], best: dict[str, Candidate]) -> list[Candidate]:
        """A pruned search on the worker processes, speculatively: candidates are evaluated ahead of their turn
        (up to twice as many as there are workers) with the ``_prune_key`` of the search as it stands, and taken
        in order; when taking one changes the key of a candidate already under way (a new best of its mode), that
        evaluation is dropped (a worker running it stops before its next probe) and started again from the new
        key. So every candidate is evaluated from exactly the key a search one after another gives it, and the
        answer, probes and simulation counts are that search's (the dropped evaluations are not counted:
        ``speculation_wasted`` says how many there were)."""
        pool = self._ensure_pool(min(self.jobs, len(cfgs)))
        flags = self._flags
        window = 2 * self._pool_size
        free = list(range(len(flags)))
        dropped: list[tuple[int, Any]] = []  # (slot, future) of dropped evaluations that may still be running
        tokens = itertools.count(1)
        ahead: dict[int, tuple[tuple, int, Any]] = {}

        def launch(j: int) -> tuple[tuple, int, Any]:
            for sl, f in [d for d in dropped if d[1].done()]:  # their slots are free again
                dropped.remove((sl, f))
                free.append(sl)
            key, slot, token = self._prune_key(cfgs[j], best), free.pop(), next(tokens)
            flags[slot] = token
            return key, slot, pool.submit(_pruned_in_worker, cfgs[j], key, slot, token)

        done: list[Candidate] = []
        nxt = 0
        try:
            for k, cfg in enumerate(cfgs):
                while nxt < len(cfgs) and nxt < k + window:
                    ahead[nxt] = launch(nxt)
                    nxt += 1
                key, slot, fut = ahead.pop(k)
                assert key == self._prune_key(cfg, best), "a candidate was taken from a stale key"
                c, sims, reqs = fut.result()
                free.append(slot)
                self.simulations += sims
                self.requests_simulated += reqs
                done.append(c)
                _keep(best, c)
                self._tick()
                for j in sorted(ahead):  # (in order: the executor starts what was submitted first)
                    old, slot, f = ahead[j]
                    if self._prune_key(cfgs[j], best) != old:
                        flags[slot] = 0  # a worker running it stops at its next probe
                        if f.cancel():  # (not handed to a worker yet: never runs)
                            free.append(slot)
                        else:
                            dropped.append((slot, f))
                        self.speculation_wasted += 1
                        ahead[j] = launch(j)
            return done
        except BaseException:  # (KeyboardInterrupt included) as in evaluate_all
            self.close(kill=True)
            raise

    def _tick(self) -> None:
        self._evaluated += 1
        if self.progress is not None:
            self.progress(self._evaluated, self._planned)

    def best_of(self, cfgs: list[SimConfig]) -> tuple[list[Candidate], dict[str, Candidate]]:
        best: dict[str, Candidate] = {}
        done = self._search(cfgs, best)
        # refine a large budget's P:D split around the best coarse one
        b = best.get("disaggregated")
        if self.refine and b is not None and b.cfg.num_ranks > 16:  # the coarse grid went in steps of n / 16
            n, fine = b.cfg.num_ranks, max(1, b.cfg.num_ranks // 64)
            pt, dt = b.cfg.pool_tp("prefill"), b.cfg.pool_tp("decode")
            ps = {max(1, b.cfg.prefill + k * max(1, fine // pt)) for k in (-3, -2, -1, 1, 2, 3)} - {b.cfg.prefill}
            extra = [replace(b.cfg, prefill=p, decode=(n - p * pt) // dt) for p in sorted(ps)
                     if n - p * pt >= dt and (n - p * pt) % dt == 0]
            done += self._search(extra, best)
        return done, best


def _keep(best: dict[str, Candidate], c: Candidate) -> None:
    """``c`` becomes its mode's best if it serves more (the first of equals stays)."""
    if c.goodput > 0 and (c.cfg.mode not in best or c.goodput > best[c.cfg.mode].goodput):
        best[c.cfg.mode] = c


_WORKER_PLANNER: Optional[Planner] = None
"""In a Planner's worker process only (``Planner._ensure_pool``): the planner it evaluates candidates for."""


class _Dropped(Exception):
    """Raised in a worker's probe once the parent dropped the evaluation under way (``Planner._pruned_ahead``)."""


def _serve(handoff: Any, flags: Any) -> None:
    global _WORKER_PLANNER
    # a terminal's Ctrl-C is the parent's to handle (it ends us); one during a worker's start (its imports, before
    # this runs) ends that worker with a traceback of its own, and the parent then ends the rest
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER_PLANNER = handoff.get()
    _WORKER_PLANNER._flags = flags


def _pruned_in_worker(cfg: SimConfig, key: tuple[Optional[float], Optional[float], bool], slot: Optional[int] = None,
                      token: int = 0) -> Optional[tuple[Candidate, int, int]]:
    """``Planner.pruned`` in a worker (``COLD``: a plain cold evaluation): (the candidate, the simulations and
    requests it took); None when the parent dropped it (``slot`` of the shared flags no longer holds ``token``)."""
    p = _WORKER_PLANNER
    assert p is not None, "_pruned_in_worker runs only in a Planner's worker process"
    sims, reqs = p.simulations, p.requests_simulated
    flags = p._flags
    if slot is not None:
        p._dropped = lambda: flags[slot] != token
    try:
        c = p.pruned(cfg, *key)
    except _Dropped:
        return None
    finally:
        p._dropped = None
    return c, p.simulations - sims, p.requests_simulated - reqs


def _table(best: dict[str, Candidate], title: str) -> Table:
    t = Table(title=title)
    t.add_column("")
    cols = [m for m in ("disaggregated", "colocated") if m in best]
    for m in cols:
        t.add_column(f"best {m}", justify="right")
    rows = [("deployment", lambda c: c.cfg.label()),
            ("workers (ranks)", lambda c: f"{c.cfg.num_workers} ({c.cfg.num_ranks})"),
            ("goodput (req/s)", lambda c: f"{c.goodput:.3g}"), ("per rank (req/s)", lambda c: f"{c.per_worker:.3g}"),
            ("p90 TTFT at goodput (ms)", lambda c: f"{c.at_goodput.p90_ttft_ms:.0f}"),
            ("mean TPOT at goodput (ms)", lambda c: f"{c.at_goodput.mean_tpot_ms:.1f}"),
            ("utilisation", lambda c: ", ".join(f"{k} {v:.0%}" for k, v in c.at_goodput.utilisation.items()))]
    for name, fn in rows:
        t.add_row(name, *[fn(best[m]) for m in cols])
    return t


def plan_budget(planner: Planner, n: int, chunks: list[int], locals_: list[int], modes: list[str]
                ) -> tuple[list[Candidate], dict[str, Candidate]]:
    """The best of every deployment of ``n`` ranks whose pools' TP sizes fit (``Planner.fits``); a pruned search
    takes them in ``prune_order``."""
    cfgs = [c for c in candidates(n, chunks, locals_, planner.base, modes, planner.tps) if planner.fits(c)]
    return planner.best_of(prune_order(cfgs) if planner.prune else cfgs)


def _tp_sizes(text: str, profiles: ProfileSet, base: SimConfig) -> tuple[list[int], list[str]]:
    """(the TP sizes to search, a note per size left out because its weights leave a rank no KV room)."""
    sizes = profiles.sizes if text == "auto" else _int_list(text, "--tp-sizes")
    errors = {t: _fit_error(base, profiles.at(t, "--tp-sizes")) for t in sizes}
    notes = [f"TP {t} left out: {e}" for t, e in errors.items() if e]
    fit = [t for t, e in errors.items() if not e]
    if not fit:
        raise ValueError("no tensor-parallel size fits: " + "; ".join(notes))
    return fit, notes


def _fit_error(cfg: SimConfig, profile: Profile) -> str:
    try:
        cfg.kv_blocks(profile)
    except ValueError as e:
        return str(e)
    return ""


def _search_budgets(planner: Planner, args: argparse.Namespace, tps: list[int], locals_: list[int]
            ) -> tuple[int, list[Candidate], dict[str, Candidate]]:
    """(the budget searched last, every candidate evaluated, the best per mode): ``--workers``'s budget, or
    budgets growing until one serves ``--target-rate``."""
    if args.workers is not None:
        done, best = plan_budget(planner, args.workers, args.chunk_list, locals_, args.mode_list)
        return args.workers, done, best
    n, done = min(tps) if "colocated" in args.mode_list else 2 * min(tps), []
    while True:
        d, b = plan_budget(planner, n, args.chunk_list, locals_, args.mode_list)
        done += d
        if any(c.goodput >= args.target_rate for c in b.values()) or n >= args.max_workers:
            return n, done, b
        top = max([c.goodput for c in b.values()] + [0.0])
        # next budget: proportional to the shortfall (goodput grows about linearly with workers), at least +1
        n = min(args.max_workers, max(n + 1, math.ceil(n * args.target_rate / top)) if top > 0 else 2 * n)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of `pdserve plan`; 0 with a recommendation, 2 on bad input or SLOs nothing meets, 1 when a
    worker process died, 130 on Ctrl-C."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        check_args(args)
        profiles = check_profile_args(args)
        profile = profiles.base
        reqs, _, _ = requests_from_args(args, profile)
        locals_ = _locals(args.local_prefill, reqs)
        base = SimConfig(num_kv_blocks=args.num_kv_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                         max_num_seqs=args.max_num_seqs, enable_prefix_caching=not args.no_prefix_caching,
                         max_num_requests=args.max_num_requests, kv_link=args.kv_link,
                         workers_per_host=args.workers_per_host, seed=args.seed,
                         rank_memory_bytes=args.rank_memory_bytes)
        tps, tp_notes = _tp_sizes(args.tp_sizes, profiles, base)
        if args.workers is not None and not candidates(args.workers, args.chunk_list, [0], base, args.mode_list, tps):
            raise ValueError(f"--workers {args.workers}: no {' or '.join(args.mode_list)} deployment of "
                             f"{args.workers} ranks at tensor-parallel sizes {', '.join(map(str, tps))}")
        if "disaggregated" in args.mode_list:
            profile.link(args.kv_link)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    slos = {"ttft": args.ttft_slo_ms, "tpot": args.tpot_slo_ms}
    # a trace replayed without --request-rate keeps its own burst pattern at every probed rate
    own_gaps = args.dataset_name == "trace" and args.request_rate is None
    planner = Planner(profiles, reqs, slos, args.goal, None if own_gaps else args.burstiness, args.seed, base,
                      tps=tps, jobs=args.jobs, prune=args.prune, duration_s=args.probe_seconds,
                      new_prompts=hashed_trace_rows(args) is None)
    for note in tp_notes:
        print(f"note: {note}")
    t0 = time.perf_counter()
    err = Console(stderr=True)  # a progress bar where stderr is a terminal (a long search is minutes)
    bar = Progress(TextColumn("simulating candidates"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=err, transient=True, disable=not err.is_terminal)
    task = bar.add_task("plan", total=None)
    planner.progress = lambda evaluated, planned: bar.update(task, completed=evaluated, total=planned)
    try:
        with bar, planner:
            n, done, best = _search_budgets(planner, args, tps, locals_)
    except KeyboardInterrupt:  # Ctrl-C: the workers are ended (``Planner.__exit__``), a shell's status for it
        print(f"interrupted after {planner.simulations} simulations: no plan", file=sys.stderr)
        return 130
    except BrokenProcessPool:  # a worker killed (the OOM killer, a signal): the search cannot be trusted to finish
        print(f"error: a worker process of the search (--jobs {args.jobs}) died, killed or out of memory: no plan; "
              f"run with fewer --jobs", file=sys.stderr)
        return 1
    wall = time.perf_counter() - t0
    if not best:
        lowest = [min(c.probes, key=lambda p: p.rate) for c in done if c.probes]
        lone = min(lowest, key=lambda p: p.p90_ttft_ms, default=None)
        hint = "" if lone is None else (f" (the lowest tried: {min(p.rate for p in lowest):.3g} req/s); there the best "
                                        f"p90 TTFT was {lone.p90_ttft_ms:.0f} ms and mean TPOT "
                                        f"{lone.mean_tpot_ms:.1f} ms")
        print(f"error: no configuration of {n} ranks meets --ttft-slo-ms {args.ttft_slo_ms:g} and --tpot-slo-ms "
              f"{args.tpot_slo_ms:g} for {args.goal:.0%} of requests at any rate{hint}", file=sys.stderr)
        return 2
    title = (f"{len(reqs)} requests, SLOs TTFT {args.ttft_slo_ms:g} ms / TPOT {args.tpot_slo_ms:g} ms at "
             f"{args.goal:.0%}, profile {profile.model} on {profile.device} ({profile.meta.get('device_name', '?')})")
    Console().print(_table(best, title))
    if args.target_rate is not None and not any(c.goodput >= args.target_rate for c in best.values()):
        print(f"note: even {n} ranks (--max-workers) do not reach {args.target_rate:g} req/s")
    for m, c in best.items():
        print(f"{m}: pdserve up {c.cfg.up_flags(profiles)}")
    if "disaggregated" in best and "colocated" in best:
        r = best["disaggregated"].per_worker / best["colocated"].per_worker
        print(f"disaggregated / colocated goodput per rank: {r:.2f}x")
    print(f"{planner.simulations} simulations of {planner.requests_simulated} requests in {wall:.1f} s "
          f"({args.jobs} process{'es' if args.jobs > 1 else ''})")
    if args.save_result:
        path = Path(args.save_result if isinstance(args.save_result, str) else "plan.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"slos_ms": slos, "goal": args.goal, "num_requests": len(reqs),
                                    "tp_sizes": tps, "notes": tp_notes,
                                    "best": {m: c.as_dict(profiles) for m, c in best.items()},
                                    "candidates": [c.as_dict(profiles) for c in done]}, indent=1))
        print(f"plan saved to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
