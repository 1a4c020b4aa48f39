"""The small per-layer ops of the decoder (RMSNorm, RoPE, silu * mul, Gemma's gelu * mul): plain torch, or pdserve's
CPU kernels.

Lifecycle: every ``RMSNorm`` and ``DecoderLayer`` starts with ``TORCH_OPS``; ``CausalLM.finalize`` gives a layer
(and its norms) ``KernelOps`` where it built the layer's fused C++ decode layer, so the layer's Python path
(prefill, mixed and verify steps) rounds exactly like the fused one (same kernels), and gives the final norm
``KernelOps`` where every layer is fused. On CUDA, ``TritonOps`` runs the same ops as one Triton kernel each
(engine/triton_kernels.py) instead of torch's chain of small launches. An ops object holds no state beyond the
kernel module.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from engine import attention
from engine.attention import apply_rope


class TorchOps:
    """The ops as torch computes them (HF's numerics: RMSNorm in float32, scaled in the model dtype)."""

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)

    def rope(self, qkv: Tensor, cos: Tensor, sin: Tensor, heads: int) -> Tensor:
        """RoPE on the first ``heads`` heads of qkv [T, heads + ..., D]: those heads, rotated."""
        return apply_rope(qkv[:, :heads], cos, sin)

    def silu_mul(self, gate_up: Tensor, intermediate: int) -> Tensor:
        gate, up = gate_up.split(intermediate, dim=-1)
        return F.silu(gate) * up

    def gelu_mul(self, gate_up: Tensor, intermediate: int) -> Tensor:
        """Gemma's GeGLU: HF's gelu_pytorch_tanh of the gate, times up."""
        gate, up = gate_up.split(intermediate, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class KernelOps(TorchOps):
    """The same ops on pdserve's kernels where the input is float32 on CPU (one call each instead of torch's
    ~7 kernels: ~16 us a norm at batch 1), torch elsewhere."""

    def __init__(self, kern: Any) -> None:
        self.kern = kern

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu":
            return self.kern.rms_norm(x.contiguous(), weight, eps)
        return super().rms_norm(x, weight, eps)

    def rope(self, qkv: Tensor, cos: Tensor, sin: Tensor, heads: int) -> Tensor:
        """In place where it can (the fused decode layer's arithmetic): then qkv itself, its first heads rotated."""
        if qkv.dtype == torch.float32 and qkv.is_contiguous():
            self.kern.rope_(qkv, cos, sin, heads)
            return qkv
        return super().rope(qkv, cos, sin, heads)

    def silu_mul(self, gate_up: Tensor, intermediate: int) -> Tensor:
        if gate_up.dtype == torch.float32:
            return self.kern.silu_mul(gate_up.contiguous())
        return super().silu_mul(gate_up, intermediate)

    def gelu_mul(self, gate_up: Tensor, intermediate: int) -> Tensor:
        if gate_up.dtype == torch.float32 and gate_up.device.type == "cpu":
            return self.kern.gelu_tanh_mul(gate_up.contiguous())
        return super().gelu_mul(gate_up, intermediate)


class TritonOps(TorchOps):
    """The same ops as pdserve's Triton kernels on CUDA tensors (one launch each where torch takes ~3-7, which is
    what a launch-bound decode step, or a CUDA graph replaying it, pays for), torch elsewhere. Numerics follow
    TorchOps: float32 math with every intermediate torch rounds rounded to the model dtype, so a 16-bit model
    matches TorchOps to the last bit or one rounding, and float32 to reduction order."""

    def __init__(self) -> None:
        from engine import triton_kernels  # only where asked for: a CPU-only process never imports triton
        self.tk = triton_kernels

    def _runs_on(self, t: Tensor) -> bool:
        return t.device.type in attention.TRITON_DEVICE_TYPES

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if self._runs_on(x) and x.dim() == 2 and weight.dtype == x.dtype:
            return self.tk.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def rope(self, qkv: Tensor, cos: Tensor, sin: Tensor, heads: int) -> Tensor:
        """In place (like KernelOps.rope): qkv itself, its first heads rotated."""
        if self._runs_on(qkv) and qkv.stride(-1) == 1 and cos.dtype == sin.dtype == qkv.dtype:
            return self.tk.rope_(qkv, cos, sin, heads)
        return super().rope(qkv, cos, sin, heads)

    def silu_mul(self, gate_up: Tensor, intermediate: int) -> Tensor:
        if self._runs_on(gate_up) and gate_up.dim() == 2 and gate_up.shape[1] == 2 * intermediate:
            return self.tk.silu_mul(gate_up)
        return super().silu_mul(gate_up, intermediate)


TORCH_OPS = TorchOps()
