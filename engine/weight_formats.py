"""How a linear layer's weights are stored and multiplied: one small class per format, chosen once at load.

Lifecycle: ``CausalLM.finalize`` chooses one format per ``Linear``, once, at load (from its float weight, the
engine's ``quantization`` / ``cpu_gemm`` choice and whether pdserve's CPU kernels are built: ``Linear.pack`` ->
engine/float_formats.py ``packed_format``, ``Linear.quantize`` -> ``fp32_rows_format`` or engine/quant_formats.py
``quantized_format``); the format's ``pack`` makes its bytes from the float weight, and every forward afterwards
is one call, ``fmt(x)``. Each format knows its plain-torch fallback (what runs where the kernels are not built,
``PDSERVE_CPU_KERNELS=0``, or above the rows its kernel takes), and the spec the fused C++ decode layer needs
(``fused_spec``). The shape follows vLLM's ``quant_method`` layers and gpt-fast's module swap.

The formats the kernels read are one enum, defined in C++ (engine/csrc/decode_layer.h ``WeightFormat``) and
exported by the kernel module; ``WeightFormat`` here mirrors it for builds without the kernels, and
tests/engine/test_weight_formats.py checks the two are equal wherever the kernels are built. The classes:

- ``Dense``: the float weight [in, out] through torch (other devices; ``cpu_gemm="torch"``).
- ``OneDNN`` / ``Fp32Panels``: prepacked by oneDNN; ``Fp32Panels`` where the packed bytes are panels of
  outputs (engine/onednn_layout.py), whose small products run pdserve's ``linear_panel`` on the same bytes.
- ``Fp32Rows``: the dense [N, K] weight for pdserve's row kernel (``cpu_gemm="pdserve"``).
- ``Int8`` / ``Int4`` (weight-only) and ``W8A8`` / ``W4A8`` (int8 activations): rows, or panels (the
  ``*Panels`` classes) wherever the kernels are built (the integer panel kernels need AVX2 / AVX-512).
"""
from __future__ import annotations

import enum
from typing import Any, Optional

import torch.nn.functional as F
from torch import Tensor



class WeightFormat(enum.IntEnum):
    """Mirror of the kernels' ``WeightFormat`` (engine/csrc/decode_layer.h) for builds without them."""
    FP32_ROWS = 0
    INT8_ROWS = 1
    INT4_ROWS = 2
    W8A8_ROWS = 3
    W4A8_ROWS = 4
    FP32_PANELS = 5
    W8A8_PANELS = 6
    W4A8_PANELS = 7
    INT8_PANELS = 8
    INT4_PANELS = 9


def float_bias(bias: Optional[Tensor]) -> Optional[Tensor]:
    """A bias as the fused layer takes it: float32, contiguous, detached."""
    return None if bias is None else bias.detach().float().contiguous()


class LinearFormat:
    """A linear layer's weights in one format: ``fmt(x)`` is ``x W^T + b`` for x [..., in_features].

    ``kern`` is the kernel module where a pdserve kernel reads these weights (None: plain torch only);
    ``code`` the kernels' ``WeightFormat`` of the weights as stored (None: no pdserve kernel reads them);
    ``small_m`` the most rows of a decode batch the fused layer runs with this format."""
    method = "dense"
    code: Optional[WeightFormat] = None
    small_m = 0

    def __init__(self, in_features: int, out_features: int, bias: Optional[Tensor], kern: Any) -> None:
        self.in_features, self.out_features, self.bias, self.kern = in_features, out_features, bias, kern

    def __call__(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def on_kernels(self) -> bool:
        """Whether pdserve's kernels run this layer's small products (what the fused decode layer needs)."""
        return self.kern is not None and self.code is not None

    def fused_spec(self) -> tuple:
        """(WeightFormat, w, scale or None, bias or None, group, N): a linear of the fused decode layer."""
        raise ValueError(f"weight format {type(self).__name__} has no kernel for the fused decode layer")

    def tune_product(self) -> Optional[tuple]:
        """(run, in_features, weight bytes) where this layer runs a panel kernel (prefetch tuning), else None."""
        return None

    def tensors(self) -> list[Tensor]:
        """The tensors that hold this format's bytes (weights, scales, bias), views of one another not listed
        twice: what the layer takes of memory (``CausalLM.weight_bytes``)."""
        return [v for v in vars(self).values() if isinstance(v, Tensor)]


class KernelFormat(LinearFormat):
    """Weights stored for one of pdserve's kernels (``w``, ``scale``, ``group``): a product on CPU runs the kernel
    (``_kernel``) for any number of rows where the weights are in panels (``panels``: there the kernel also beats
    dequantize + GEMM at prefill sizes, docs/benchmarks/history.md run R) and for up to ``small_m`` rows otherwise;
    everything else runs the fallback: one GEMM of the input as the kernel sees it (``_act``) with the float
    weight (``dense``). Each subclass's ``pack(w, bias, group, kern, prefetch)`` makes its bytes from the float
    weight W [N, K]. Quantized weights must be dequantized for that GEMM (a full write and read of the layer in
    float32 per call), so they stay in the kernel longer than fp32 (docs/benchmarks/history.md, runs G and H)."""
    small_m = 64
    panels = False

    def __init__(self, w: Tensor, scale: Optional[Tensor], group: int, in_features: int, out_features: int,
                 bias: Optional[Tensor], kern: Any, prefetch: Any = None) -> None:
        super().__init__(in_features, out_features, bias, kern)
        self.w, self.scale, self.group = w, scale, group
        # the panel kernels' prefetch distances: the model's (engine/prefetch_tuning.py), else none
        self.prefetch = prefetch if prefetch is not None or kern is None or not self.panels else kern.PanelPrefetch()

    def __call__(self, x: Tensor) -> Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1])
        if self.kern is not None and x.device.type == "cpu" and (self.panels or x2.shape[0] <= self.small_m):
            y = self._kernel(x2.float().contiguous())
        else:
            w = self.dense()
            y = F.linear(self._act(x2), w, self.bias)
        return y.to(dtype).reshape(*shape[:-1], y.shape[-1])

    def _kernel(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def dense(self) -> Tensor:
        """The float32 [N, K] weight these bytes hold (the fallback's GEMM)."""
        raise NotImplementedError

    def _act(self, x2: Tensor) -> Tensor:
        return x2.float()

    def fused_spec(self) -> tuple:
        if not self.on_kernels():
            return super().fused_spec()
        return (self.kern.WeightFormat(int(self.code)), self.w, self.scale, float_bias(self.bias), self.group,
                self.out_features)

    def tune_product(self) -> Optional[tuple]:
        if not (self.panels and self.kern is not None and self.w.device.type == "cpu"):
            return None
        return (self, self.in_features, self.w.numel() * self.w.element_size())
