"""Weight-only and KV-cache quantization formats: round to nearest, scales kept in float32.

Lifecycle: pure functions. ``CausalLM.finalize`` calls ``quantize_int8`` / ``quantize_int4`` once per
linear layer at load (from the floating-point checkpoint) when ``EngineConfig.quantization`` asks for
it; the attention calls ``quantize_kv`` on every step's new K/V rows when ``kv_cache_dtype="int8"``
and ``dequantize_kv`` where it reads the cache without the C++ kernel. The formats are the ones
the kernels in engine/csrc read (linear_rows.cpp, panels.cpp, int_dots.cpp):

- **int8 weights, per output channel**: ``q [N, K] int8``, ``scale [N] float32``, ``W = q * scale``,
  ``scale = max|W[n]| / 127``, so ``|W - q * scale| <= scale / 2``.
- **int4 weights, group-wise** (llama.cpp's q4_0 rule per group of ``G`` inputs): ``d = m / -8`` where
  ``m`` is the group's value of largest magnitude, ``q = clamp(round(W / d), -8, 7)``; so ``m`` is
  exact and ``|W - q * d| <= |d| / 2`` except where the clamp at 7 bites (``<= |d|``). Packed two to
  a byte: in each run of 32 inputs, byte ``j`` holds ``q[j] + 8`` in its low nibble and
  ``q[j + 16] + 8`` in its high nibble. ``scale [N, K / G] float32``.
- **w8a8 / w4a8**: the int8 / int4 weights above, and every linear's input rounded to int8 on the fly
  in blocks of 32 values (llama.cpp's q8_0 rule, which its q8_0 and q4_0 dot products use):
  ``a = round_half_even(x * (127 / amax))``, ``s = amax / 127`` (0 for an all-zero block), so the inner
  products are exact integer dots (VNNI ``dpbusd``) and ``|x - a * s| <= s / 2``. ``quantize_act`` is
  the reference the kernels are tested against; ``fake_quantize_act`` is what the torch path applies
  to the input before a float GEMM, so prefill and decode round the same way. Where the kernel runs,
  w8a8 weights are stored with their columns in the kernel's ``step_order`` (the GEMM path gathers the
  input's columns the same way: a dot product does not depend on the order of its terms). On AVX2 and
  AVX-512 builds the model stores them in the integer panel kernels' formats instead (``to_panels_w8a8``
  / ``to_panels_w4a8``: panels of outputs, 4 inputs per int32 lane, like oneDNN's fp32 panels); int8
  weight-only weights likewise in ``to_panels_int8`` / ``to_panels_int4`` (oneDNN's fp32 panel layout with
  int8 values, or two int4 outputs per byte with the group scales beside them).
- **int8 KV rows**: each cached (token, KV head) row of ``D`` values becomes ``D + 4`` int8 bytes: the
  values ``round(x / s)`` with ``s = max|x| / 127``, then ``s`` itself as 4 bytes of float32. The
  scale travels inside the row, so every block copy (copy-on-write, KV transfer, the gather) moves
  values and scales together without knowing the format.
"""
from __future__ import annotations

import torch
from torch import Tensor

from engine.config import KV_CACHE_DTYPES, QUANTIZATIONS  # noqa: F401 - the names live with the config (no torch there)

ACT_BLOCK = 32


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """W [N, K] float -> (q [N, K] int8, scale [N] float32), per output channel."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    return q.float() * scale[:, None]


def quantize_int4(w: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """W [N, K] float -> (packed [N, K/2] uint8, scale [N, K/group] float32); group % 32 == 0."""
    N, K = w.shape
    if group % 32 or K % group:
        raise ValueError(f"quantization_group_size must be a multiple of 32 that divides {K}, got {group}")
    g = w.float().reshape(N, K // group, group)
    idx = g.abs().argmax(dim=2, keepdim=True)
    d = (g.gather(2, idx) / -8.0).squeeze(2)
    d = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(g / d[..., None]).clamp_(-8, 7).to(torch.int16)
    return pack_int4(q.reshape(N, K)), d.contiguous()


def pack_int4(q: Tensor) -> Tensor:
    """Levels [N, K] in -8..7 -> the int4 format's bytes [N, K/2]: stored as level + 8, in each run of 32 inputs
    the first 16 in the low nibbles and the next 16 in the high ones."""
    N, K = q.shape
    runs = (q.to(torch.int16) + 8).reshape(N, K // 32, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).to(torch.uint8).reshape(N, K // 2).contiguous()


def dequantize_int4(packed: Tensor, scale: Tensor, group: int) -> Tensor:
    N, half = packed.shape
    K = 2 * half
    b = packed.reshape(N, K // 32, 16).to(torch.int16)
    q = torch.stack((b & 15, b >> 4), dim=2).reshape(N, K // group, group) - 8
    return (q.float() * scale[..., None]).reshape(N, K)


def quantize_act(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., K] float (K % 32 == 0) -> (a [..., K] int8, s [..., K/32] float32): int8 per block of 32."""
    *lead, K = x.shape
    if K % ACT_BLOCK:
        raise ValueError(f"activation quantization needs the input width to be a multiple of {ACT_BLOCK}, got {K}")
    b = x.float().reshape(*lead, K // ACT_BLOCK, ACT_BLOCK)
    amax = b.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    a = torch.round(b * inv).clamp_(-127, 127).to(torch.int8)
    return a.reshape(*lead, K), (amax / 127.0).squeeze(-1)


def fake_quantize_act(x: Tensor) -> Tensor:
    """x rounded through ``quantize_act`` and back, in float32."""
    a, s = quantize_act(x)
    return (a.float().reshape(*s.shape, ACT_BLOCK) * s[..., None]).reshape(a.shape)


def step_order(K: int, step: int) -> Tensor:
    """The order in which the integer-dot kernels read K values (engine/csrc/int_dots.cpp):
    a step of ``step`` values is two halves of ``step / 2`` bytes; byte j of the first half is value
    32 * (j // 16) + j % 16 of the step, byte j of the second half the value 16 after it (the low and high
    nibbles of the int4 format). ``order[p]`` is the natural index of position p; identity for step 32."""
    if step % 32 or K % step:
        raise ValueError(f"step must be a multiple of 32 dividing K={K}, got {step}")
    half = step // 2
    p = torch.arange(step)
    j = p % half
    within = 32 * (j // 16) + 16 * (p // half) + j % 16
    return (torch.arange(0, K, step)[:, None] + within[None, :]).reshape(K)


def int4_levels(packed: Tensor) -> Tensor:
    """The stored nibbles ``q + 8`` (0..15) of the int4 format as uint8 [N, K], in natural order."""
    N = packed.shape[0]
    runs = packed.view(N, -1, 16)
    return torch.cat([runs & 15, runs >> 4], dim=2).reshape(N, -1)


def _pad_rows(t: Tensor, rows: int, value: int | float = 0) -> Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), value)])


def to_panels_int8(q: Tensor, scale: Tensor, width: int = 64) -> tuple[Tensor, Tensor]:
    """int8 [N, K] + scale [N] -> the weight-only panel format of ``linear_int8_panels`` (the layout of
    oneDNN's fp32 panels): int8 [NP, K, width] with p[n // width][k][n % width] = q[n, k], scale [NP * width];
    zero rows pad N."""
    N, K = q.shape
    NP = -(-N // width)
    p = _pad_rows(q, NP * width).view(NP, width, K).transpose(1, 2).contiguous()
    return p, _pad_rows(scale.float(), NP * width).contiguous()


def from_panels_int8(p: Tensor, scale: Tensor, N: int) -> Tensor:
    """The float32 [N, K] weight of ``to_panels_int8``'s format."""
    NP, K, width = p.shape
    return p.transpose(1, 2).reshape(NP * width, K)[:N].float() * scale[:N, None]


def to_panels_int4(packed: Tensor, scale: Tensor, group: int, width: int = 64) -> tuple[Tensor, Tensor]:
    """The int4 format + group scales [N, K/G] -> the weight-only panel format of ``linear_int4_panels``:
    uint8 [NP, K, width/2], byte j of row k holding output j's stored nibble low and output j + width/2's
    high; scales [NP, K/G, width] float32. Padding outputs hold level 0 (nibble 8) with scale 0."""
    N = packed.shape[0]
    NP = -(-N // width)
    lv = _pad_rows(int4_levels(packed), NP * width, 8)
    K = lv.shape[1]
    t = lv.view(NP, width, K).transpose(1, 2)  # [NP, K, width]
    half = width // 2
    p = (t[:, :, :half] | (t[:, :, half:] << 4)).contiguous()
    s = _pad_rows(scale.float(), NP * width).view(NP, width, -1).transpose(1, 2).contiguous()
    return p, s


def from_panels_int4(p: Tensor, scale: Tensor, N: int, group: int) -> Tensor:
    """The float32 [N, K] weight of ``to_panels_int4``'s format."""
    NP, K, half = p.shape
    lv = torch.cat([p & 15, p >> 4], dim=2).transpose(1, 2).reshape(NP * 2 * half, K)[:N]
    s = scale.transpose(1, 2).reshape(NP * 2 * half, -1)[:N]
    return (lv.float() - 8) * s.repeat_interleave(group, dim=1)


def to_panels_w8a8(q: Tensor, scale: Tensor, pw: int, unsigned: bool) -> tuple[Tensor, Tensor]:
    """int8 [N, K] + scale [N] -> the integer panel kernels' w8a8 format (engine/csrc/int_dots.cpp,
    "W8A8 / W4A8 on panels"): uint8 [NP, K/4, pw, 4] with byte (o, t) of quad j = q[p * pw + o, 4j + t]
    (``^ 0x80`` where ``unsigned``: the VNNI builds), and scale padded to [NP * pw]. Zero rows pad N."""
    N, K = q.shape
    NP = -(-N // pw)
    u = _pad_rows(q, NP * pw).view(torch.uint8)
    if unsigned:
        u = u ^ 0x80
    return u.view(NP, pw, K // 4, 4).permute(0, 2, 1, 3).contiguous(), _pad_rows(scale.float(), NP * pw).contiguous()


def from_panels_w8a8(p: Tensor, scale: Tensor, N: int, unsigned: bool) -> Tensor:
    """The float32 [N, K] weight of ``to_panels_w8a8``'s format."""
    NP, Kq, pw, _ = p.shape
    u = p.permute(0, 2, 1, 3).reshape(NP * pw, Kq * 4)[:N]
    if unsigned:
        u = u ^ 0x80
    return u.view(torch.int8).float() * scale[:N, None]


def to_panels_w4a8(packed: Tensor, scale: Tensor, group: int, pw: int) -> tuple[Tensor, Tensor]:
    """The int4 format + group scales [N, K/G] -> the w4a8 panel format: uint8 [NP, K/8, pw, 4] with byte
    (o, t) of octet j holding the stored nibble of input 8j + t low and of 8j + 4 + t high; scales
    [NP, K/G, pw] float32. Padding rows hold level 0 (nibble 8) with scale 0."""
    N = packed.shape[0]
    lv = _pad_rows(int4_levels(packed), -(-N // pw) * pw, 8)
    NP, K = lv.shape[0] // pw, lv.shape[1]
    o = lv.view(NP, pw, K // 8, 2, 4)
    p = (o[:, :, :, 0] | (o[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    s = _pad_rows(scale.float(), NP * pw).view(NP, pw, K // group).permute(0, 2, 1).contiguous()
    return p, s


def from_panels_w4a8(p: Tensor, scale: Tensor, N: int, group: int) -> Tensor:
    """The float32 [N, K] weight of ``to_panels_w4a8``'s format."""
    NP, Ko, pw, _ = p.shape
    b = p.permute(0, 2, 1, 3)  # [NP, pw, K/8, 4]
    lv = torch.stack([b & 15, b >> 4], dim=3).reshape(NP * pw, Ko * 8)[:N]
    s = scale.permute(0, 2, 1).reshape(NP * pw, -1)[:N]
    return (lv.float() - 8) * s.repeat_interleave(group, dim=1)


def quantize_kv(x: Tensor) -> Tensor:
    """K or V rows [..., D] float -> int8 [..., D + 4] (values, then the row's float32 scale)."""
    x = x.float()
    s = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(x / s).clamp_(-127, 127).to(torch.int8)
    return torch.cat((q, s.view(torch.int8)), dim=-1)


def dequantize_kv(q: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """int8 rows [..., D + 4] -> [..., D] in dtype."""
    D = q.shape[-1] - 4
    s = q[..., D:].contiguous().view(torch.float32)
    return (q[..., :D].float() * s).to(dtype)
