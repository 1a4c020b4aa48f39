"""How far ahead pdserve's panel kernels prefetch their weight stream, measured per loaded model.

Lifecycle: ``CausalLM.finalize`` makes one ``PanelPrefetch`` (the kernel module's object: two distances in
bytes, for products of one input row and of several) per model, hands it to every panel-format linear and
fused decode layer of that model, and calls ``tune_panel_prefetch`` once on the model's own panel linears.
The distances then live on that model: a draft model loaded after its target measures and keeps its own,
and neither changes the other's (nothing here is process-wide). A distance changes speed, never a result.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Optional, Sequence

import torch

log = logging.getLogger(__name__)

# prefetch distances (bytes of a panel tile's weight stream ahead of its loads) tune_panel_prefetch tries
PREFETCH_CANDIDATES = (0, 2048, 8192)
# a tuning pass runs the model's panel linears until this many weight bytes (beyond any last-level cache),
# so a large model costs about what a small one does
_TUNE_BYTES = 512 << 20


def _parse_prefetch(text: str) -> tuple[int, int]:
    parts = [p.strip() for p in text.split(",")]
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or not all(p.isdigit() for p in parts):  # isdigit: no sign, so no negatives
        raise ValueError(f"PDSERVE_PANEL_PREFETCH must be 'BYTES' or 'ONE_ROW,ROWS' (non-negative integers), "
                         f"got {text!r}")
    return int(parts[0]), int(parts[1])


def tune_panel_prefetch(products: Sequence[tuple[Callable[[torch.Tensor], object], int, int]],
                        prefetch: Optional[Any], rounds: int = 3) -> Optional[tuple[int, int]]:
    """Choose, on this machine and these weights, how far ahead the panel kernels prefetch their weight
    stream, for products of one input row and of several, and set it in ``prefetch`` (the model's
    ``PanelPrefetch``, which the ``products`` read).

    ``products``: (run, in_features, weight bytes) of the model's panel linears (run(x) computes one
    product with ``prefetch``). Whether software prefetch pays depends on the CPU: measured, it cost a third of
    the batch-1 rate on a Zen 4 and sped 8 to 32 rows up 1.3-1.4x (and int8 / int4 batch 1 1.6-1.8x) on an
    Emerald Rapids Xeon (docs/benchmarks/history.md, runs M and U), so it is measured here, once per load: each of
    ``PREFETCH_CANDIDATES`` runs the linears (up to ``_TUNE_BYTES`` of weights) at 1 and at 8 rows, interleaved
    over ``rounds`` rounds, best time of each; a distance replaces "none" only when it is at least 3% faster.
    Prefetches change no result, only speed. ``PDSERVE_PANEL_PREFETCH=BYTES`` or ``ONE_ROW,ROWS`` sets the
    distances instead (the value is checked). Returns the distances set, or None where ``prefetch`` is None
    (the kernels are not built)."""
    if prefetch is None:
        return None
    env = os.environ.get("PDSERVE_PANEL_PREFETCH")
    if env is not None:
        chosen = _parse_prefetch(env)
        prefetch.set(*chosen)
        return chosen
    picked, total = [], 0
    for run, k, nbytes in products:
        if total >= _TUNE_BYTES:
            break
        picked.append((run, k))
        total += nbytes
    if not picked:
        return tuple(prefetch.get())
    chosen = []
    gen = torch.Generator().manual_seed(0)  # its own: loading a model must not move the global RNG
    with torch.inference_mode():
        for m in (1, 8):
            xs = {k: torch.randn(m, k, generator=gen) for k in sorted({k for _, k in picked})}
            best = {pf: float("inf") for pf in PREFETCH_CANDIDATES}
            for r in range(rounds + 1):  # the first round warms up
                for pf in PREFETCH_CANDIDATES:
                    prefetch.set(pf, pf)
                    t = time.perf_counter()
                    for run, k in picked:
                        run(xs[k])
                    if r:
                        best[pf] = min(best[pf], time.perf_counter() - t)
            fastest = min(best, key=best.get)
            chosen.append(fastest if best[fastest] < 0.97 * best[0] else 0)
    prefetch.set(*chosen)
    log.info("panel kernels prefetch %d bytes ahead at one row, %d at several (measured at load)", *chosen)
    return chosen[0], chosen[1]
