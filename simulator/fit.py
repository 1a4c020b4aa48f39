"""Fitting a profile's measurements: the step model by non-negative least squares, the KV link by a line.

Lifecycle: ``pdserve profile`` (simulator/profile.py) hands its measured samples to ``fit_step_model``
and ``fit_link`` once, after measuring, and to ``fit_errors`` for the per-kind errors it records;
``--refit`` does the same on a stored profile's samples. Pure functions of numpy arrays.
"""
from __future__ import annotations

import bisect
import statistics
from typing import Any, Optional, Sequence

import numpy as np

from simulator.costs import LinkModel, StepFeatures, StepModel

# -- fitting ---------------------------------------------------------------------------------------

def nnls(A: Any, b: Any, max_iter: Optional[int] = None) -> np.ndarray:
    """min ||A x - b|| subject to x >= 0 (Lawson and Hanson's active set method), columns scaled to
    unit norm first so coefficients of very different sizes (seconds per step, per attention pair)
    are solved on one footing."""
    A = np.asarray(A, dtype=float)
    b = np.asarray(b, dtype=float)
    m, n = A.shape
    norms = np.linalg.norm(A, axis=0)
    norms[norms == 0] = 1.0
    As = A / norms
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(m, n) * max(1.0, float(np.abs(As).sum(axis=0).max()))
    max_iter = max_iter or 3 * n + 30
    it = 0
    w = As.T @ (b - As @ x)
    while not passive.all() and (w[~passive] > tol).any() and it < max_iter:
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        while it < max_iter:
            it += 1
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(As[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # step from x towards z as far as feasibility allows; the variables that hit 0 leave the set
            neg = passive & (z <= 0)
            den = x[neg] - z[neg]
            alpha = float(np.min(np.where(den > 0, x[neg] / np.where(den > 0, den, 1.0), 0.0)))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        w = As.T @ (b - As @ x)
    return np.maximum(x, 0.0) / norms


def choose_knots(token_counts: Sequence[float], ratio: float = 1.5) -> list[int]:
    """A geometric subset of the measured token counts: each kept count at least ``ratio`` times the
    one before, the smallest and the largest always kept (each knot then has samples on it)."""
    ts = sorted({int(t) for t in token_counts if t >= 1})
    if len(ts) < 2:
        raise ValueError(f"the step model needs steps of at least 2 distinct token counts, got {ts}")
    kept = [ts[0]]
    for t in ts[1:]:
        if t >= kept[-1] * ratio:
            kept.append(t)
    if kept[-1] != ts[-1]:
        if len(kept) > 1 and ts[-1] < kept[-1] * ratio:
            kept[-1] = ts[-1]
        else:
            kept.append(ts[-1])
    return kept


_TERMS = (("sampled", "per_sampled_row_s"), ("prefill_pairs", "per_prefill_pair_s"),
          ("decode_ctx", "per_decode_ctx_s"), ("prefill_ctx", "per_prefill_ctx_s"),
          ("prefill_chunks", "per_prefill_chunk_s"), ("prefill_cached_pairs", "per_prefill_cached_pair_s"))
"""(StepFeatures field, StepModel coefficient) of each linear term besides lin(T)."""


def _features(s: dict) -> StepFeatures:
    return StepFeatures(tokens=s["tokens"], sampled=s["sampled"], prefill_pairs=s["prefill_pairs"],
                        decode_ctx=s["decode_ctx"], prefill_ctx=s.get("prefill_ctx", 0),
                        prefill_chunks=s.get("prefill_chunks", 0),
                        prefill_cached_pairs=s.get("prefill_cached_pairs", 0.0))


def _row(f: StepFeatures, knots: Sequence[int]) -> list[float]:
    """The step model's seconds as a linear function of (knot_s..., then the ``_TERMS`` coefficients): lin(T)
    is a combination of hat functions over the knots, extended past the ends with the end segments' slopes,
    exactly as ``StepModel.lin`` reads it."""
    row = [0.0] * (len(knots) + len(_TERMS))
    i = min(max(bisect.bisect_right(knots, f.tokens), 1), len(knots) - 1)
    w = (f.tokens - knots[i - 1]) / (knots[i] - knots[i - 1])
    row[i - 1], row[i] = 1.0 - w, w
    row[len(knots):] = [float(getattr(f, feature)) for feature, _ in _TERMS]
    return row


def fit_step_model(samples: Sequence[tuple[StepFeatures, float]], knots: Optional[Sequence[int]] = None) -> StepModel:
    """Least-squares ``StepModel`` over (features, seconds) samples, every coefficient >= 0, residuals
    relative (each row divided by its measured seconds, so a 1 ms decode counts as much as a 1 s prefill)."""
    samples = [(f, s) for f, s in samples if f.tokens >= 1 and s > 0]
    knots = list(knots) if knots is not None else choose_knots([f.tokens for f, _ in samples])
    A = np.array([_row(f, knots) for f, _ in samples]) / np.array([[s] for _, s in samples])
    x = nnls(A, np.ones(len(samples)))
    return StepModel(knots=[int(k) for k in knots], knot_s=[float(v) for v in x[:len(knots)]],
                     **{coef: float(v) for (_, coef), v in zip(_TERMS, x[len(knots):])})


def fit_link(nbytes: Sequence[float], seconds: Sequence[float]) -> LinkModel:
    """seconds = latency_s + bytes / bytes_per_s by least squares on relative residuals, both terms >= 0."""
    A = np.array([[1.0, float(b)] for b in nbytes]) / np.array([[s] for s in seconds])
    lat, inv_bw = nnls(A, np.ones(len(seconds)))
    if not inv_bw > 0:
        raise RuntimeError(f"KV link: the transfer times do not grow with size ({list(zip(nbytes, seconds))})")
    return LinkModel(latency_s=float(lat), bytes_per_s=float(1.0 / inv_bw))


def fit_errors(model: StepModel, samples: Sequence[dict]) -> dict[str, dict[str, float]]:
    """Median and max |predicted / measured - 1| per sample kind, and over all fitted kinds ("all")."""
    by: dict[str, list[float]] = {}
    for s in samples:
        err = abs(model.seconds(_features(s)) / s["seconds"] - 1.0)
        by.setdefault(s["kind"], []).append(err)
        if s["kind"] != "fill":
            by.setdefault("all", []).append(err)
    return {k: {"n": len(v), "median_rel_err": statistics.median(v), "max_rel_err": max(v)} for k, v in by.items()}
