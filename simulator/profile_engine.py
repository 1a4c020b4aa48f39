"""``pdserve profile``'s first part: the engine's steps, measured (``measure_engine``) through a ``StepProbe``.

Lifecycle: ``simulator.profile`` builds one ``StepProbe`` around a fresh ``LLMEngine`` and calls ``measure_engine``
once; it runs the grid of decode, prefill, cached-prefix, k-prompt and mixed steps (see ``simulator.profile``'s
docstring, part 1), each warmed up once and then timed ``reps`` times, and returns the samples (their
``step_features`` and median seconds) and the router part's reference steps. Nothing here writes a file.
"""
from __future__ import annotations

import random
import statistics
import time
from typing import Any, Callable, Optional

from simulator.costs import StepFeatures, step_features

ROUTER_PROMPT_TOKENS = 16
ROUTER_BATCH = 8
"""Concurrent streams of the router part's second point."""


class StepProbe:
    """Drives one engine: adds requests, times steps, reads each step's features as it is scheduled."""

    def __init__(self, engine: Any, cuda: bool, seed: int) -> None:
        import torch

        from engine.sampling_params import SamplingParams

        self.engine = engine
        self._params = SamplingParams
        self._sync = torch.cuda.synchronize if cuda else (lambda: None)
        self._rng = random.Random(seed)
        self._ids = iter(range(1 << 62))
        self._features: Optional[StepFeatures] = None
        self._ctx = 0
        self.fill: list[dict] = []
        real = engine.scheduler.schedule

        def schedule():  # read BEFORE the step advances the sequences (costs.step_features' contract)
            out = real()
            self._features = None if out.is_empty else step_features(out)
            self._ctx = max((s.num_computed for s, _ in out.prefills), default=0)
            return out

        engine.scheduler.schedule = schedule

    def tokens(self, n: int) -> list[int]:
        v = self.engine.model_config.vocab_size
        return [self._rng.randrange(v) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        rid = f"p{next(self._ids)}"
        self.engine.add_request(rid, prompt, self._params(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
        return rid

    def step(self) -> tuple[Optional[StepFeatures], float, int]:
        """One timed ``engine.step()``: (its features, seconds, the context of its prompt chunk)."""
        self._features = None
        self._sync()
        t0 = time.perf_counter()
        self.engine.step()
        self._sync()
        return self._features, time.perf_counter() - t0, self._ctx

    def running(self) -> list:
        return list(self.engine.scheduler.running)

    def all_decoding(self) -> bool:
        sch = self.engine.scheduler
        return not sch.waiting and all(s.num_tokens - s.num_computed == 1 for s in sch.running)

    def fill_until_decoding(self) -> None:
        """Step until every running sequence decodes; those steps are kept as ``fill`` samples."""
        while not self.all_decoding():
            f, dt, ctx = self.step()
            if f is not None:
                self.fill.append(_sample("fill", [(f, dt)], ctx=ctx))

    def drain(self) -> None:
        for s in self.running() + list(self.engine.scheduler.waiting):
            self.engine.abort_request(s.request_id)
        while self.engine.has_unfinished_requests():
            self.engine.step()


def _sample(kind: str, reps: list[tuple[StepFeatures, float]], **extra: Any) -> dict:
    """One grid point: the median seconds of its repetitions and their mean features."""
    fs = [f for f, _ in reps]
    return {"kind": kind, "tokens": fs[0].tokens, "sampled": fs[0].sampled,
            "prefill_pairs": statistics.fmean(f.prefill_pairs for f in fs),
            "decode_ctx": round(statistics.fmean(f.decode_ctx for f in fs)),
            "prefill_ctx": round(statistics.fmean(f.prefill_ctx for f in fs)),
            "prefill_chunks": round(statistics.fmean(f.prefill_chunks for f in fs)),
            "prefill_cached_pairs": statistics.fmean(f.prefill_cached_pairs for f in fs),
            "seconds": statistics.median(dt for _, dt in reps), "reps_s": [dt for _, dt in reps], **extra}


def _pow2_grid(lo: int, hi: int, factor: int) -> list[int]:
    out, n = [], lo
    while n < hi:
        out.append(n)
        n *= factor
    return out + [hi] if hi >= lo else out


def measure_engine(probe: StepProbe, cfg: Any, quick: bool, reps: int, router_stream: int) -> tuple[list[dict], dict]:
    """The grid (module docstring, part 1). Returns (samples, reference timings for the router part)."""
    eng = probe.engine
    L, M, bs = eng.max_model_len, cfg.max_num_batched_tokens, eng.block_size
    kv_tokens = eng.num_total_blocks * bs
    samples: list[dict] = []

    def point(kind: str, once: Callable[[], tuple[Optional[StepFeatures], float, int]], **extra: Any) -> None:
        got = []
        for i in range(reps + 1):  # the first run warms this shape up and is dropped
            f, dt, ctx = once()
            if f is not None and i:
                got.append((f, dt))
        if got:
            samples.append(_sample(kind, got, ctx=ctx, **extra))

    def prefill_once(prefix: list[int], n: int) -> Callable[[], tuple[Optional[StepFeatures], float, int]]:
        def once():
            if prefix:  # (re)names the prefix in the cache; a cheap one-chunk step when it still is
                probe.add(prefix + probe.tokens(1), 1)
                while eng.has_unfinished_requests():
                    eng.step()
            probe.add(prefix + probe.tokens(n), 1)
            out = probe.step()
            while eng.has_unfinished_requests():
                eng.step()
            return out
        return once

    def batch_once(k: int, n: int) -> Callable[[], tuple[Optional[StepFeatures], float, int]]:
        def once():
            for _ in range(k):
                probe.add(probe.tokens(n), 1)
            out = probe.step()
            while eng.has_unfinished_requests():
                eng.step()
            return out
        return once

    # warm-up: the allocator, oneDNN's primitives and the kernels see a prompt and a small batch once
    for _ in range(2):
        probe.add(probe.tokens(min(M, L - 1, 256)), 8)
        probe.add(probe.tokens(16), 8)
        while eng.has_unfinished_requests():
            eng.step()

    # pure prefill, fresh and after a cached prefix
    top = min(M, L - 2)
    ns = _pow2_grid(4 if quick else 2, top, 4 if quick else 2)
    for n in ns:
        point("prefill", prefill_once([], n), n=n)
    # several prompts in one step: lin(T) at large T without the attention of one long prompt (which the
    # pair term alone would otherwise have to tell apart from it)
    for T in ns:
        k = min(cfg.max_num_seqs, T // 16)
        if k >= 2:
            point("prefill_batch", batch_once(k, T // k), n=T // k, prompts=k)
    hit_ctx = sorted({c for c in ((L // 4,) if quick else (L // 4, L // 2)) if c >= bs})
    for c in hit_ctx:
        c -= c % bs
        prefix = probe.tokens(c)
        for n in ns:
            if c + n <= L - 2:
                point("prefill_hit", prefill_once(prefix, n), n=n)

    # pure decode (and mixed steps on the medium context), batch sizes largest first
    margin = 64 + 8 * (reps + 1) * 4  # tokens a sequence may still grow by while its level is measured
    levels = [min(64, L // 8), min(256 if quick else L // 4, L - 2 * margin)]
    if not quick:
        levels.append(min(3 * L // 4, L - 2 * margin))
    levels = sorted({c for c in levels if c >= 2})
    mixed_ns = [n for n in ((64,) if quick else (16, 128, 512)) if n < M]
    for li, c in enumerate(levels):
        per_seq = -(-(c + margin) // bs) * bs
        cap = min(cfg.max_num_seqs, kv_tokens // per_seq, 16 if quick else 64)
        Bs = [b for b in ((1, 4, 16) if quick else (1, 2, 4, 8, 16, 32, 64)) if b <= cap]
        if cap not in Bs and cap >= 1 and cap == cfg.max_num_seqs:
            Bs.append(cap)
        if not Bs:
            continue
        for _ in range(Bs[-1]):
            probe.add(probe.tokens(c - 1), max(2, L - c - 1))
        probe.fill_until_decoding()
        for B in reversed(Bs):
            for s in probe.running()[B:]:
                eng.abort_request(s.request_id)
            point("decode", probe.step, batch=B)
            if li == 1 and B in ((4,) if quick else (4, 32)):
                for n in mixed_ns:
                    if n + B > M:
                        continue

                    def mixed(n=n):
                        rid = probe.add(probe.tokens(n), 2)
                        out = probe.step()
                        eng.abort_request(rid)
                        return out
                    point("mixed", mixed, batch=B, n=n)
        probe.drain()

    ref: dict = {}
    if router_stream:  # the engine's own time for what the router part sends: a short prompt, one stream
        p = ROUTER_PROMPT_TOKENS
        firsts = []
        for _ in range(reps + 3):
            probe.add(probe.tokens(p), 1)
            firsts.append(probe.step()[1])
            probe.drain()
        probe.add(probe.tokens(p), router_stream)
        probe.step()
        gaps = []
        while eng.has_unfinished_requests():
            gaps.append(probe.step()[1])
        ref = {"prompt_tokens": p, "vocab_size": eng.model_config.vocab_size,
               "engine_prefill_s": statistics.median(firsts[1:]),
               "stream_tokens": router_stream, "engine_decode_s": statistics.fmean(gaps[1:] or gaps)}
        # and ROUTER_BATCH streams at once: the router part's second point separates its per-step cost from
        # its per-token one
        for _ in range(ROUTER_BATCH):
            probe.add(probe.tokens(p), router_stream)
        while not probe.all_decoding():
            probe.step()
        gaps = []
        while eng.has_unfinished_requests():
            gaps.append(probe.step()[1])
        ref.update(batch=ROUTER_BATCH, engine_decode_batch_s=statistics.fmean(gaps[1:-1] or gaps))
    return samples, ref


# -- where it ran ----------------------------------------------------------------------------------
