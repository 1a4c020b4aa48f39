"""``pdserve profile``'s co-run phase: how much slower a worker's steps run while its host mates run theirs.

Lifecycle: ``measure_corun(cfg, quick, reps, siblings)`` is called once by simulator/profile.py after the
engine's own grid (CPU only). It pins this process to its own cores (``cfg.num_threads`` of them) and builds
a fresh engine; times a few steps alone (decodes at small batches, which stream every weight once, and
prefills, which compute); then starts ``siblings`` processes, each pinned to other cores with the same
engine and model, stepping a mix of prefills and decodes in a loop as busy workers do, and times the same
steps again; then stops the siblings, restores this process's affinity and returns the samples. ``fit_corun``
fits ``costs.CorunModel``: per busy sibling a step of ``d`` solo seconds takes ``const_s + ratio * d``
longer (non-negative least squares on the two). Workers of one host share the memory bus and the last-level
cache even on their own cores, so a deployment of several workers per host (the 2-core validation host, a
CPU server with a worker per core) runs its decodes slower than a profile taken alone says.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import statistics
import time
from typing import Any, Optional, Sequence

from simulator.costs import CorunModel

DECODE_BATCHES = (1, 4, 16)
DECODE_BATCHES_QUICK = (1, 8)
PREFILL_TOKENS = (64, 256, 512)
PREFILL_TOKENS_QUICK = (64, 256)
DECODE_STEPS = 12
"""Decode steps timed per repetition (their median is the point's)."""


def cores_for(threads: int, siblings: int) -> Optional[list[list[int]]]:
    """Disjoint core sets of ``threads`` cores each, this process's first, from its affinity; None when too few."""
    avail = sorted(os.sched_getaffinity(0))
    need = threads * (1 + siblings)
    if len(avail) < need:
        return None
    return [avail[i * threads:(i + 1) * threads] for i in range(1 + siblings)]


class _Driver:
    """Times single steps of one engine (prompts of random ids, greedy, ``ignore_eos``)."""

    def __init__(self, cfg: Any, seed: int) -> None:
        from engine.llm_engine import LLMEngine
        from engine.sampling_params import SamplingParams

        self.engine = LLMEngine(cfg)
        self._params = SamplingParams
        self._rng = random.Random(seed)
        self._n = 0

    def _add(self, n: int, max_tokens: int) -> str:
        self._n += 1
        rid = f"c{self._n}"
        v = self.engine.model_config.vocab_size
        self.engine.add_request(rid, [self._rng.randrange(v) for _ in range(n)],
                                self._params(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
        return rid

    def _drain(self) -> None:
        sch = self.engine.scheduler
        for s in list(sch.running) + list(sch.waiting):
            self.engine.abort_request(s.request_id)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def prefill(self, n: int) -> float:
        """Seconds of one step that prefills one fresh prompt of ``n`` tokens."""
        self._add(n, 1)
        t0 = time.perf_counter()
        self.engine.step()
        dt = time.perf_counter() - t0
        self._drain()
        return dt

    def decode(self, batch: int, steps: int = DECODE_STEPS) -> float:
        """Median seconds of ``steps`` decode steps of ``batch`` sequences (16-token prompts)."""
        for _ in range(batch):
            self._add(16, steps + 2)
        sch = self.engine.scheduler
        while sch.waiting or any(s.num_tokens - s.num_computed > 1 for s in sch.running):
            self.engine.step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - t0)
        self._drain()
        return statistics.median(times)


def _sibling(cfg: Any, cores: list[int], ready: Any, go: Any, stop: Any) -> None:
    """A busy host mate: the same engine stepping like a busy colocated worker (8 sequences decoding, a fresh
    256-token prompt every 16 steps), one step at a time, while ``go`` is set; idle while it is clear."""
    os.sched_setaffinity(0, cores)
    import torch

    torch.set_num_threads(len(cores))
    d = _Driver(cfg, seed=len(cores) + cores[0])
    d.prefill(64)
    eng = d.engine
    ready.put(os.getpid())
    i = 0
    while not stop.is_set():
        if not go.is_set():
            go.wait(0.05)
            continue
        if len(eng.scheduler.running) + len(eng.scheduler.waiting) < 8:
            d._add(16, 64)
        if i % 16 == 0:
            d._add(min(256, cfg.max_num_batched_tokens), 1)
        eng.step()
        i += 1


def _points(d: _Driver, prefills: Sequence[int], batches: Sequence[int]) -> list[float]:
    return [d.prefill(n) for n in prefills] + [d.decode(b) for b in batches]


def measure_corun(cfg: Any, quick: bool, reps: int, siblings: int = 1, start_timeout_s: float = 300.0,
                  settle_s: float = 0.3) -> dict:
    """Solo and co-run seconds of the same steps (module docstring); ``{"skipped": why}`` when it cannot run.
    Solo and co-run rounds alternate (the siblings pause between), so a drift of the host over the phase lands
    on both alike, and each point keeps its mean over the rounds, not a median: on the 2-vCPU validation VM
    the slowdown of a decode step beside a busy sibling comes and goes (0 to +60% from one second to the next,
    whatever the sibling runs), so the mean over many rounds is what a long run sees."""
    rounds = max(reps, 2 if quick else 16)
    threads = cfg.num_threads or 1
    sets = cores_for(threads, siblings)
    if sets is None:
        return {"skipped": f"needs {threads * (1 + siblings)} cores for this process and {siblings} "
                           f"sibling(s) of {threads} thread(s), this process may use "
                           f"{len(os.sched_getaffinity(0))}"}
    budget = cfg.max_num_batched_tokens
    prefills = [n for n in (PREFILL_TOKENS_QUICK if quick else PREFILL_TOKENS) if n <= budget] or [budget]
    batches = [b for b in (DECODE_BATCHES_QUICK if quick else DECODE_BATCHES) if b <= cfg.max_num_seqs] or [1]
    before = os.sched_getaffinity(0)
    import queue

    import torch

    threads_before = torch.get_num_threads()
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    stop, go = ctx.Event(), ctx.Event()
    solo: list[list[float]] = []
    busy: list[list[float]] = []
    try:
        os.sched_setaffinity(0, sets[0])
        torch.set_num_threads(threads)
        d = _Driver(cfg, seed=0)
        ready = ctx.Queue()
        for cores in sets[1:]:
            p = ctx.Process(target=_sibling, args=(cfg, cores, ready, go, stop), daemon=True)
            p.start()
            procs.append(p)
        d.prefill(prefills[0])  # warm-up while the siblings load
        d.decode(batches[0])
        end = time.monotonic() + start_timeout_s
        up = 0
        while up < len(procs):  # each sibling says so once its engine steps; a dead one is an error at once
            try:
                ready.get(timeout=1.0)
                up += 1
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode is not None]
                if dead or time.monotonic() > end:
                    raise RuntimeError(f"co-run: a sibling engine did not start (exit codes {dead}, "
                                       f"{up} of {len(procs)} up)")
        for _ in range(rounds):
            go.clear()
            time.sleep(settle_s)  # the siblings finish the step they are in
            solo.append(_points(d, prefills, batches))
            go.set()
            time.sleep(settle_s)
            busy.append(_points(d, prefills, batches))
    finally:
        stop.set()
        go.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads_before)
    names = [("prefill", n) for n in prefills] + [("decode", b) for b in batches]
    samples = [{"kind": k, "size": n, "solo_s": statistics.fmean(r[i] for r in solo),
                "corun_s": statistics.fmean(r[i] for r in busy), "solo_reps_s": [r[i] for r in solo],
                "corun_reps_s": [r[i] for r in busy]} for i, (k, n) in enumerate(names)]
    return {"siblings": siblings, "cores": sets, "rounds": rounds, "samples": samples}


def fit_corun(samples: Sequence[dict], siblings: int) -> CorunModel:
    """``const_s`` and ``ratio`` >= 0 minimising the squared error of extra = const_s + ratio * solo, per sibling."""
    xs = [s["solo_s"] for s in samples]
    ys = [max(0.0, s["corun_s"] - s["solo_s"]) / siblings for s in samples]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    ratio = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    const = my - ratio * mx
    if const < 0:  # through the origin
        const, ratio = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    elif ratio < 0:
        const, ratio = my, 0.0
    return CorunModel(const_s=max(0.0, const), ratio=max(0.0, ratio), min_step_s=min(xs), siblings=siblings)
