"""The float32 / bfloat16 weight formats: torch's dense product, oneDNN's prepacked one, pdserve's fp32 panel
and row kernels (engine/weight_formats.py tells how a format is chosen and used).

Lifecycle: ``float_format`` (called by ``CausalLM.finalize`` through ``Linear.pack`` / ``Linear.quantize("fp32")``)
builds one of these per linear layer at load from its float weight; each forward is ``fmt(x)``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from engine.onednn_layout import onednn_panels
from engine.weight_formats import KernelFormat, LinearFormat, WeightFormat, float_bias


class Dense(LinearFormat):
    """The float weight stored [in, out]: at batch-1 decode BLAS runs x @ W_t as a row-vector GEMM about 1.8x
    faster than nn.Linear's x @ W^T on the 2-core CPU box."""

    def __init__(self, weight_t: Tensor, bias: Optional[Tensor]) -> None:
        super().__init__(weight_t.shape[0], weight_t.shape[1], bias, None)
        self.weight_t = weight_t
        self.invariant = False
        """Batch-invariant products (``CausalLM.finalize(batch_invariant=True)`` on a Triton device): pdserve's
        fixed-tile Triton GEMM instead of cuBLAS, whose algorithm (split-K included) depends on the row count."""

    def __call__(self, x: Tensor) -> Tensor:
        if self.invariant:
            from engine import triton_kernels  # only where asked for: a CPU-only process never imports triton

            x2 = x.reshape(-1, self.in_features)
            return triton_kernels.matmul(x2, self.weight_t, self.bias).reshape(*x.shape[:-1], self.out_features)
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


class OneDNN(LinearFormat):
    """Prepacked once into oneDNN's blocked layout (the dense copy dropped); every forward is one oneDNN
    inner product, 1.2x to 3x faster than MKL sgemm on the dense weight at the bench model's shapes
    (docs/benchmarks.md). This is what vLLM's CPU backend does. A product of more than 64 rows runs at its row
    count rounded up to a bucket (``onednn_rows``), so a prefill worker's oneDNN primitives stay few."""
    method = "onednn"

    def __init__(self, packed: Tensor, in_features: int, out_features: int, bias: Optional[Tensor]) -> None:
        super().__init__(in_features, out_features, bias, None)
        self.packed = packed

    @staticmethod
    def pack(w: Tensor) -> Optional[Tensor]:
        """The oneDNN-packed form of W [N, K] (CPU, float32 / bfloat16), or None where oneDNN cannot."""
        if (w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16)
                or not torch.backends.mkldnn.is_available()):
            return None
        try:
            return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)
        except RuntimeError:  # e.g. bfloat16 on a CPU without the instructions oneDNN needs
            return None

    def __call__(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        rows = onednn_rows(m)
        if rows != m:  # zero rows up to the bucket: the real rows get the same bits (test_weight_formats.py)
            xp = x2.new_empty(rows, self.in_features)
            xp[:m] = x2
            xp[m:] = 0
            x2 = xp
        y = _linear_pointwise(x2, self.packed, self.bias)
        return y[:m].reshape(*x.shape[:-1], self.out_features)


ONEDNN_EXACT_ROWS = 64
"""Products of up to this many rows run oneDNN at their own row count (decode batches: few distinct counts)."""
ONEDNN_BUCKETS_PER_OCTAVE = 8
"""Row buckets per power of two above ``ONEDNN_EXACT_ROWS``: at most 1/8 (12.5%) padding rows."""


def onednn_rows(m: int) -> int:
    """The rows a product of ``m`` rows runs oneDNN with: ``m`` up to ``ONEDNN_EXACT_ROWS``, else ``m`` rounded up
    to the next of ``ONEDNN_BUCKETS_PER_OCTAVE`` steps per power of two (65 -> 72, 200 -> 208, 300 -> 320,
    1500 -> 1536).

    Why: torch's oneDNN linear keeps the primitive it creates for each (row count, weight shape) in two LRU
    caches, oneDNN's (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's (``LRU_CACHE_CAPACITY``), 1024 entries
    each by default, about 0.6 MiB a primitive even at a small layer (256 x 96); RSS stays flat
    only with both off. A prefill product has as many rows as the step's prompt tokens, so every new prompt
    length cost a prefill worker about 2.4 MiB (four linear shapes) until the caches filled: ``tiny``, lengths
    50-400, 640 -> 1378 MiB over 2000 prompts. With the buckets a worker runs at most 40 row counts from 65 to
    2048 (36 distinct counts for lengths 50-400): 637 -> 700 MiB, flat after the first 100 prompts, outputs
    bit-identical (docs/reliability.md)."""
    if m <= ONEDNN_EXACT_ROWS:
        return m
    step = max(1, (1 << (m.bit_length() - 1)) // ONEDNN_BUCKETS_PER_OCTAVE)
    return -(-m // step) * step


def _linear_pointwise(x: Tensor, packed: Tensor, bias: Optional[Tensor]) -> Tensor:
    """oneDNN's inner product of x [M, K] with the packed weight (one place, so a test can see the row counts)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Fp32Panels(OneDNN):
    """oneDNN's packed bytes where they are panels of outputs (checked against the dense weight at pack time):
    products of up to ``max_kernel_rows`` rows (decode) run pdserve's ``linear_panel`` on the same bytes, which
    streams them faster at batch 1 to 8, matches oneDNN up to 64 rows (benchmarks/cpu_linear.py), gives a row
    the same bits whatever the batch, and lets a decoder layer run as one fused C++ call. Larger products
    (prefill) stay on oneDNN."""
    method = "onednn"
    code = WeightFormat.FP32_PANELS
    small_m = 64  # most rows of a product on linear_panel; more go to oneDNN (prefill)

    def __init__(self, packed: Tensor, panel: Tensor, in_features: int, out_features: int, bias: Optional[Tensor],
                 kern: Any, prefetch: Any) -> None:
        super().__init__(packed, in_features, out_features, bias)
        self.panel, self.kern = panel, kern  # panel: a view of packed, not owning it (keep both)
        self.prefetch = prefetch if prefetch is not None or kern is None else kern.PanelPrefetch()

    def __call__(self, x: Tensor) -> Tensor:
        if (self.kern is not None and x.dtype == torch.float32
                and x.numel() <= self.small_m * self.in_features):
            x2 = x.reshape(-1, self.in_features).contiguous()
            y = self.kern.linear_panel(x2, self.panel, self.out_features, self.bias, self.prefetch)
            return y.reshape(*x.shape[:-1], self.out_features)
        return super().__call__(x)

    def fused_spec(self) -> tuple:
        return (self.kern.WeightFormat(int(self.code)), self.panel, None, float_bias(self.bias), 0, self.out_features)

    def tensors(self) -> list[Tensor]:
        return [t for t in super().tensors() if t is not self.panel]  # the panel is a view of the packed bytes

    def tune_product(self) -> Optional[tuple]:
        return (self, self.in_features, self.panel.numel() * 4)


class Fp32Rows(KernelFormat):
    """The dense float32 [N, K] weight for pdserve's row kernel (``cpu_gemm="pdserve"``): up to ``small_m`` rows
    on ``linear_fp32``, more through one float GEMM (MKL)."""
    method = "fp32"
    code = WeightFormat.FP32_ROWS
    small_m = 32

    @classmethod
    def pack(cls, w: Tensor, bias: Optional[Tensor], group: int = 0, kern: Any = None,
             prefetch: Any = None) -> "Fp32Rows":
        return cls(w.float().contiguous(), None, 0, w.shape[1], w.shape[0], bias, kern)

    def _kernel(self, x: Tensor) -> Tensor:
        return self.kern.linear_fp32(x, self.w, self.bias)

    def dense(self) -> Tensor:
        return self.w


def packed_format(w: Tensor, bias: Optional[Tensor], kern: Any, prefetch: Any) -> Optional[LinearFormat]:
    """W [N, K] prepacked for oneDNN (CPU, float32 / bfloat16): ``Fp32Panels`` where ``kern`` is given, W is
    float32 and oneDNN's bytes are panels of outputs, else ``OneDNN``; None where oneDNN cannot pack it."""
    packed = OneDNN.pack(w)
    if packed is None:
        return None
    N, K = w.shape
    panel = onednn_panels(packed, w) if w.dtype == torch.float32 and kern is not None else None
    if panel is not None:
        return Fp32Panels(packed, panel, K, N, bias, kern, prefetch)
    return OneDNN(packed, K, N, bias)


def fp32_rows_format(w: Tensor, bias: Optional[Tensor], kern: Any) -> Fp32Rows:
    """W [N, K] kept dense for pdserve's fp32 row kernel (``kern``: the kernel module, or None for the GEMM)."""
    return Fp32Rows.pack(w, bias, kern=kern)
