"""The quantized weight formats: int8 / int4 weight-only, and w8a8 / w4a8 (int8 activations), as rows or panels.

Lifecycle: ``quantized_format`` (called by ``CausalLM.finalize`` through ``Linear.quantize``) quantizes a layer's
float weight once, at load, into the format the machine runs best, and every forward is then ``fmt(x)``:

- int8 / int4 wherever the kernels are built (CPU): the weight-only panel formats (``Int8Panels`` /
  ``Int4Panels``, engine/quant.py ``to_panels_int8`` / ``to_panels_int4``), on the kernel at any number of rows
  (1.2-4.7x dequantize + GEMM at prefill sizes, benchmarks/quant_prefill_linears.py, docs/benchmarks/history.md run R);
  elsewhere rows (``Int8`` / ``Int4``), dequantize + GEMM.
- w8a8 / w4a8 on AVX2 / AVX-512 builds: the integer panel formats (``W8A8Panels`` / ``W4A8Panels``), on the
  kernel at any number of rows (2.3-17x dequantize + GEMM from 2048 down to 128 rows); other builds: rows, on the
  integer-dot row kernel for up to ``small_m`` rows where it takes K (and the int4 group) in whole steps (w8a8
  weights then stored in the kernel's step order, ``order``), dequantize + GEMM otherwise.

- fp8 (``Fp8``, the GPU counterpart of w8a8, as vLLM's "fp8"): float8 e4m3 weights with one scale per output
  channel and float8 activations with one scale per row, one ``torch._scaled_mm`` (Hopper's FP8 GEMM; torch's
  own on CPU, slow, there for tests).

w8a8 / w4a8 round the input to int8 per 32 values (engine/quant.py ``quantize_act``): the kernels do integer
dots; the GEMM fallback applies the same rounding to x first (``fake_quantize_act``), so both give the same
numbers. No float copy of a layer is kept.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from engine.quant import (ACT_BLOCK, QUANTIZATIONS, dequantize_int4, dequantize_int8, fake_quantize_act, pack_int4,
                          from_panels_int4, from_panels_int8, from_panels_w4a8, from_panels_w8a8, quantize_int4,
                          quantize_int8, step_order, to_panels_int4, to_panels_int8, to_panels_w4a8, to_panels_w8a8)
from engine.weight_formats import KernelFormat, LinearFormat, WeightFormat


class Int8(KernelFormat):
    """int8 [N, K] per output channel, scale [N]: ``linear_int8`` for small products, else dequantize + GEMM."""
    method = "int8"
    code = WeightFormat.INT8_ROWS

    @classmethod
    def pack(cls, w: Tensor, bias: Optional[Tensor], group: int, kern: Any, prefetch: Any = None) -> "Int8":
        q, s = quantize_int8(w)
        return cls(q, s, 0, w.shape[1], w.shape[0], bias, kern)

    def _kernel(self, x: Tensor) -> Tensor:
        return self.kern.linear_int8(x, self.w, self.scale, self.bias)

    def dense(self) -> Tensor:
        return dequantize_int8(self.w, self.scale)


class Int8Panels(Int8):
    """int8 in oneDNN's fp32 panel layout ([NP, K, 64], scale [NP * 64]): one contiguous stream per panel."""
    code = WeightFormat.INT8_PANELS
    panels = True

    @classmethod
    def pack(cls, w: Tensor, bias: Optional[Tensor], group: int, kern: Any, prefetch: Any = None) -> "Int8Panels":
        return cls(*to_panels_int8(*quantize_int8(w)), 0, w.shape[1], w.shape[0], bias, kern, prefetch)

    def _kernel(self, x: Tensor) -> Tensor:
        return self.kern.linear_int8_panels(x, self.w, self.scale, self.out_features, self.bias, self.prefetch)

    def dense(self) -> Tensor:
        return from_panels_int8(self.w, self.scale, self.out_features)


class Int4(KernelFormat):
    """int4 group-wise [N, K/2], scale [N, K/G]: ``linear_int4`` for small products, else dequantize + GEMM."""
    method = "int4"
    code = WeightFormat.INT4_ROWS

    @classmethod
    def pack(cls, w: Tensor, bias: Optional[Tensor], group: int, kern: Any, prefetch: Any = None) -> "Int4":
        q, s = quantize_int4(w, group)
        return cls(q, s, group, w.shape[1], w.shape[0], bias, kern)

    def _kernel(self, x: Tensor) -> Tensor:
        return self.kern.linear_int4(x, self.w, self.scale, self.group, self.bias)

    def dense(self) -> Tensor:
        return dequantize_int4(self.w, self.scale, self.group)


class Int4Panels(Int4):
    """int4 in panels: two outputs per byte, the group scales beside them (engine/quant.py to_panels_int4)."""
    code = WeightFormat.INT4_PANELS
    panels = True

    @classmethod
    def pack(cls, w: Tensor, bias: Optional[Tensor], group: int, kern: Any, prefetch: Any = None) -> "Int4Panels":
        q, s = quantize_int4(w, group)
        return cls(*to_panels_int4(q, s, group), group, w.shape[1], w.shape[0], bias, kern, prefetch)

    def _kernel(self, x: Tensor) -> Tensor:
        return self.kern.linear_int4_panels(x, self.w, self.scale, self.out_features, self.group, self.bias,
                                            self.prefetch)

    def dense(self) -> Tensor:
        return from_panels_int4(self.w, self.scale, self.out_features, self.group)


class W8A8(KernelFormat):
    """int8 weights as rows and int8 activations: ``linear_w8a8`` on the weights in the kernel's step order
    (``order``: the natural column of each stored one; the GEMM gathers the input's columns the same way) where the
    row kernel takes this layer (``kern`` is None where it does not: dequantize + GEMM everywhere)."""
    method = "w8a8"
    code = WeightFormat.W8A8_ROWS

    def __init__(self, *args: Any, order: Optional[Tensor] = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.order = order

    @classmethod
    def pack(cls, w: Tensor, bias: Optional[Tensor], group: int, kern: Any, prefetch: Any = None) -> "W8A8":
        N, K = w.shape
        q, s = quantize_int8(w)
        step = kern.qstep() if kern is not None else 0
        if step and K % step == 0:  # stored in the kernel's step order
            order = step_order(K, step)
            return cls(q[:, order].contiguous(), s, 0, K, N, bias, kern, order=order)
        return cls(q, s, 0, K, N, bias, None)  # the row kernel cannot take this layer

    def _kernel(self, x: Tensor) -> Tensor:
        return self.kern.linear_w8a8(x, self.w, self.scale, self.bias)

    def dense(self) -> Tensor:
        return dequantize_int8(self.w, self.scale)

    def _act(self, x2: Tensor) -> Tensor:
        xf = fake_quantize_act(x2)
        return xf if self.order is None else xf[:, self.order]


class W8A8Panels(KernelFormat):
    """int8 weights in the integer panel format (bytes ``q ^ 0x80`` where ``unsigned``: the VNNI builds)."""
    method = "w8a8"
    code = WeightFormat.W8A8_PANELS
    panels = True

    def __init__(self, *args: Any, unsigned: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.unsigned = unsigned

    @classmethod
    def pack(cls, w: Tensor, bias: Optional[Tensor], group: int, kern: Any, prefetch: Any = None) -> "W8A8Panels":
        q, s = quantize_int8(w)
        unsigned = bool(kern.qpanel_unsigned())
        return cls(*to_panels_w8a8(q, s, kern.qpanel_width(), unsigned), 0, w.shape[1], w.shape[0], bias, kern,
                   prefetch, unsigned=unsigned)

    def _kernel(self, x: Tensor) -> Tensor:
        return self.kern.linear_w8a8_panels(x, self.w, self.scale, self.out_features, self.bias, self.prefetch)

    def dense(self) -> Tensor:
        return from_panels_w8a8(self.w, self.scale, self.out_features, self.unsigned)

    def _act(self, x2: Tensor) -> Tensor:
        return fake_quantize_act(x2)


class W4A8(KernelFormat):
    """int4 group-wise weights as rows and int8 activations: ``linear_w4a8`` where the row kernel takes this
    layer (``kern`` is None where it does not)."""
    method = "w4a8"
    code = WeightFormat.W4A8_ROWS

    @classmethod
    def pack(cls, w: Tensor, bias: Optional[Tensor], group: int, kern: Any, prefetch: Any = None) -> "W4A8":
        q, s = quantize_int4(w, group)
        step = kern.qstep() if kern is not None else 0
        on_kernel = bool(step) and w.shape[1] % step == 0 and group % step == 0
        return cls(q, s, group, w.shape[1], w.shape[0], bias, kern if on_kernel else None)

    def _kernel(self, x: Tensor) -> Tensor:
        return self.kern.linear_w4a8(x, self.w, self.scale, self.group, self.bias)

    def dense(self) -> Tensor:
        return dequantize_int4(self.w, self.scale, self.group)

    def _act(self, x2: Tensor) -> Tensor:
        return fake_quantize_act(x2)


class W4A8Panels(W4A8):
    """int4 weights in the integer panel format (engine/quant.py to_panels_w4a8)."""
    code = WeightFormat.W4A8_PANELS
    panels = True

    @classmethod
    def pack(cls, w: Tensor, bias: Optional[Tensor], group: int, kern: Any, prefetch: Any = None) -> "W4A8Panels":
        q, s = quantize_int4(w, group)
        return cls(*to_panels_w4a8(q, s, group, kern.qpanel_width()), group, w.shape[1], w.shape[0], bias, kern,
                   prefetch)

    def _kernel(self, x: Tensor) -> Tensor:
        return self.kern.linear_w4a8_panels(x, self.w, self.scale, self.out_features, self.group, self.bias,
                                            self.prefetch)

    def dense(self) -> Tensor:
        return from_panels_w4a8(self.w, self.scale, self.out_features, self.group)


FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(FP8).max)
_TINY = torch.finfo(torch.float32).tiny


def quantize_fp8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """[M, K] float -> (float8 e4m3 [M, K], float32 scale [M, 1]): each row scaled so its largest value is 448."""
    s = (x.abs().amax(dim=-1, keepdim=True).float() / _FP8_MAX).clamp_min(_TINY)
    return (x.float() / s).clamp(-_FP8_MAX, _FP8_MAX).to(FP8), s


class Fp8(LinearFormat):
    """float8 e4m3 weights [N, K] with a float32 scale per output channel, and each input row rounded to float8
    with a scale of its own on the fly (dynamic per-token, vLLM's "fp8" W8A8): y = (x8 sx) (w8 sw)^T + b in one
    ``torch._scaled_mm`` with row-wise scales, accumulated in float32. On CUDA that needs compute capability 8.9+
    (the engine refuses "fp8" below that at start), bfloat16 output (a float16 or float32 model gets bfloat16
    products, cast back) and rows in multiples of 16 (padded)."""
    method = "fp8"

    def __init__(self, w8: Tensor, scale: Tensor, in_features: int, out_features: int,
                 bias: Optional[Tensor]) -> None:
        super().__init__(in_features, out_features, bias, None)
        self.w8, self.scale = w8, scale  # [N, K] row-major: its transpose is the column-major B _scaled_mm takes

    @classmethod
    def pack(cls, w: Tensor, bias: Optional[Tensor]) -> "Fp8":
        if w.device.type == "cuda" and (w.shape[0] % 16 or w.shape[1] % 16):
            raise ValueError(f"quantization 'fp8': a linear layer of {w.shape[1]} inputs and {w.shape[0]} outputs; "
                             "the GPU's FP8 GEMM takes multiples of 16")
        w8, s = quantize_fp8_rows(w)
        # row-major whatever w's strides (a Linear hands its [in, out] weight transposed, and the rounding keeps
        # those strides): cuBLASLt's FP8 GEMM takes a row-major A and a column-major B only (an H200 refused it)
        return cls(w8.contiguous(), s.reshape(1, -1).contiguous(), w.shape[1], w.shape[0], bias)

    def __call__(self, x: Tensor) -> Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1])
        m = x2.shape[0]
        cuda = x.device.type == "cuda"
        if cuda and m % 16:  # the FP8 GEMM takes rows in multiples of 16
            x2 = torch.cat((x2, x2.new_zeros(16 - m % 16, x2.shape[1])))
        x8, sx = quantize_fp8_rows(x2.contiguous())
        out_dtype = torch.bfloat16 if cuda else dtype  # CUDA's row-wise FP8 GEMM writes bfloat16 only
        y = torch._scaled_mm(x8, self.w8.t(), scale_a=sx, scale_b=self.scale, out_dtype=out_dtype)[:m]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(dtype).reshape(*shape[:-1], self.out_features)

    def dense(self) -> Tensor:
        """The float32 [N, K] weight these bytes hold."""
        return self.w8.float() * self.scale.reshape(-1, 1)


def quantized_format(method: str, w: Tensor, bias: Optional[Tensor], group: int, kern: Any,
                     prefetch: Any = None) -> LinearFormat:
    """Quantize W [N, K] (float) by ``method`` (one of engine/quant.py ``QUANTIZATIONS``) into the format this
    machine runs best (see the module docstring). ``bias``: float32 or None; ``kern``: the kernel module or None;
    ``prefetch``: the model's ``PanelPrefetch`` for the panel formats (None: no prefetch)."""
    N, K = w.shape
    if method in ("w8a8", "w4a8") and K % ACT_BLOCK:
        raise ValueError(f"quantization {method!r} rounds inputs in blocks of {ACT_BLOCK} values; this model has "
                         f"a linear layer with {K} inputs")
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {method!r}")
    if method == "fp8":
        return Fp8.pack(w, bias)
    k = kern if w.device.type == "cpu" else None  # the kernels read CPU tensors only
    integer_panels = k is not None and k.qpanel_width() > 0  # (AVX2 / AVX-512 builds)
    cls = {"int8": Int8Panels if k is not None else Int8, "int4": Int4Panels if k is not None else Int4,
           "w8a8": W8A8Panels if integer_panels else W8A8, "w4a8": W4A8Panels if integer_panels else W4A8}[method]
    return cls.pack(w, bias, group, k, prefetch)


def int4_format(q: Tensor, scale: Tensor, group: int, bias: Optional[Tensor], kern: Any,
                prefetch: Any = None) -> LinearFormat:
    """The int4 format of integers already chosen (a prequantized checkpoint's, engine/prequantized.py): ``q``
    [N, K] in -8..7, ``scale`` [N, K / group] float32, w = q x scale; panels where the kernels are built."""
    N, K = q.shape
    packed = pack_int4(q)
    s = scale.float().contiguous()
    if kern is not None:
        return Int4Panels(*to_panels_int4(packed, s, group), group, K, N, bias, kern, prefetch)
    return Int4(packed, s, group, K, N, bias, kern)
