"""Checkpoints quantized before they were published: GPTQ int4 (the ``-GPTQ-Int4`` repositories) and
compressed-tensors' ``pack-quantized`` W4A16 (llm-compressor's, the ``-quantized.w4a16`` repositories), which vLLM
serves as they are, loaded into pdserve's own int4 group-wise format without losing or changing a weight.

Lifecycle: ``read_prequantized`` reads config.json's ``quantization_config`` once (the engine at start) and says
whether the checkpoint is one the engine can take (``Int4Spec``) or refuses it by name (AWQ, other bit widths,
asymmetric or act-order weights, quantized activations, other methods). ``Int4Reader.iter`` then sits between the
safetensors stream and ``CausalLM.load_weights``: it buffers each layer's parts (GPTQ's ``qweight`` / ``qzeros`` /
``scales`` / ``g_idx``, compressed-tensors' ``weight_packed`` / ``weight_scale`` / ``weight_shape``) until all are
in, and yields the layer's weight dequantized to float32 (w = (q - zero) * scale, exactly: small integers times
16-bit scales) under its ``.weight`` name, keeping the scales [out, in / group] in ``scales``; every other
tensor (embeddings, norms, biases, a float LM head) passes through. ``load_weights`` gives each linear layer its
scales (fused q/k/v and gate/up rows included) and ``CausalLM.finalize(prequantized_group=G)`` packs those layers
with them (``Linear.load_int4``: the stored integers come back exactly, checked), leaving every layer the checkpoint
kept in float (the LM head, usually) in float, as vLLM does.

compressed-tensors' ``pack-quantized`` layout: ``weight_packed`` int32 [out, in / 8], eight values per word along the
input axis, lowest bits first, each stored as level + 8; ``weight_scale`` [out, in / group] (``strategy`` "group",
or "channel": one group of all inputs); ``weight_shape``; no zero point when ``symmetric``; w = level x scale.

The GPTQ layout (AutoGPTQ / GPTQModel, ``checkpoint_format`` "gptq"): ``qweight`` int32 [in / 8, out], eight 4-bit
values per word along the input axis, lowest bits first; ``qzeros`` int32 [groups, out / 8], packed along the output
axis, stored as zero - 1 ("gptq_v2": as zero); ``scales`` float16 [groups, out]; ``g_idx`` int32 [in] (each input's
group; k // group_size unless the checkpoint was quantized in activation order).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch
from torch import Tensor

_GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_CT_PARTS = ("weight_packed", "weight_scale", "weight_shape")


@dataclass(frozen=True)
class Int4Spec:
    """A symmetric int4 checkpoint the engine loads: GPTQ's layout, or compressed-tensors' (``method``)."""

    group_size: int
    v2: bool = False
    """``checkpoint_format: gptq_v2``: zeros stored as they are (v1 stores zero - 1)."""
    method: str = "gptq"
    """'gptq' or 'compressed-tensors'."""
    channel: bool = False
    """compressed-tensors' ``strategy: channel``: one scale per output (a group of all its inputs)."""

    def describe(self) -> str:
        return f"{self.method} int4 " + ("per channel" if self.channel else f"g{self.group_size}")


def read_prequantized(hf_config: dict) -> Optional[Int4Spec]:
    """The checkpoint's quantization as the engine loads it (None: a float checkpoint); ValueError naming what it
    cannot load."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method != "gptq":
        raise ValueError(f"quantization_config: quant_method {method!r} checkpoints are not loaded (pdserve loads "
                         "symmetric int4 GPTQ and compressed-tensors W4A16; serve the float checkpoint with "
                         "--quantization int4 or int8 instead)")
    bits, group = qc.get("bits"), qc.get("group_size")
    if bits != 4:
        raise ValueError(f"quantization_config: GPTQ with bits={bits} is not loaded (4 bits only)")
    if not qc.get("sym", True):
        raise ValueError("quantization_config: asymmetric GPTQ (sym: false) is not loaded (symmetric only: pdserve's "
                         "int4 format has no zero points)")
    if qc.get("desc_act"):
        raise ValueError("quantization_config: GPTQ in activation order (desc_act: true) is not loaded")
    _check_group(group)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config: checkpoint_format {fmt!r} is not loaded (gptq, gptq_v2)")
    return Int4Spec(group, v2=fmt == "gptq_v2")


def _check_group(group: object) -> None:
    if not isinstance(group, int) or group <= 0 or group % 32:
        raise ValueError(f"quantization_config: group_size {group} is not loaded (a positive multiple of 32; "
                         "pdserve's int4 kernels read groups of 32 values)")


def _compressed_tensors(qc: dict) -> Int4Spec:
    """compressed-tensors' W4A16 (``pack-quantized``, symmetric int4 weights by group or channel, float
    activations); ValueError naming anything else."""
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise ValueError(f"quantization_config: compressed-tensors format {fmt!r} is not loaded (pack-quantized "
                         "W4A16 only)")
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("quantization_config: compressed-tensors without config_groups")
    weights = [g.get("weights") or {} for g in groups]
    if any(w != weights[0] for w in weights):
        raise ValueError("quantization_config: compressed-tensors groups that quantize layers differently are not "
                         "loaded")
    w = weights[0]
    if any(g.get("input_activations") for g in groups):
        raise ValueError("quantization_config: compressed-tensors with quantized activations (W4A8, W8A8) is not "
                         "loaded (W4A16 only)")
    if w.get("num_bits") != 4 or w.get("type", "int") != "int":
        raise ValueError(f"quantization_config: compressed-tensors weights of {w.get('num_bits')} bits, type "
                         f"{w.get('type')!r} are not loaded (int4 only)")
    if not w.get("symmetric", True):
        raise ValueError("quantization_config: asymmetric compressed-tensors weights are not loaded (symmetric "
                         "only: pdserve's int4 format has no zero points)")
    if w.get("actorder"):
        raise ValueError(f"quantization_config: actorder {w.get('actorder')!r} is not loaded")
    strategy = w.get("strategy")
    if strategy == "channel":
        return Int4Spec(0, method="compressed-tensors", channel=True)
    if strategy != "group":
        raise ValueError(f"quantization_config: strategy {strategy!r} is not loaded (group, channel)")
    _check_group(w.get("group_size"))
    return Int4Spec(int(w["group_size"]), method="compressed-tensors")


def read_prequantized_dir(model_dir: Path) -> Optional[Int4Spec]:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return read_prequantized(cfg)


def _unpack(words: Tensor, axis: int) -> Tensor:
    """int32 words holding eight 4-bit values each (lowest bits first) -> the values (int16), ``axis`` 8x longer."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    if axis == 0:  # [R, C] -> [R * 8, C]
        return ((w[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, w.shape[1]).to(torch.int16)
    return ((w[:, :, None] >> shifts[None, None, :]) & 15).reshape(w.shape[0], -1).to(torch.int16)


@dataclass
class Int4Reader:
    """Turns a prequantized checkpoint's tensor stream into float weights plus their group scales (module
    docstring)."""

    spec: Int4Spec
    scales: dict[str, Tensor] = field(default_factory=dict)
    """``<layer>.weight`` -> its scales [out, in / group] float32, for each layer yielded dequantized."""

    def iter(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        ct = self.spec.method == "compressed-tensors"
        parts = _CT_PARTS if ct else _GPTQ_PARTS
        pending: dict[str, dict[str, Tensor]] = {}
        for name, tensor in weights:
            prefix, _, part = name.rpartition(".")
            if ct and part in ("weight_zero_point", "weight_g_idx"):
                raise ValueError(f"weights: layer {prefix!r} has {part} (asymmetric or act-order), which the config "
                                 "did not say and pdserve's int4 format cannot hold")
            if part not in parts:
                yield name, tensor
                continue
            got = pending.setdefault(prefix, {})
            got[part] = tensor
            if len(got) == len(parts):
                del pending[prefix]
                yield f"{prefix}.weight", self._compressed(prefix, got) if ct else self._gptq(prefix, got)
        for prefix, got in pending.items():  # (a GPTQ layer whose g_idx is absent: GPTQModel may leave it out)
            missing = [p for p in parts if p not in got and p != "g_idx"]
            if missing:
                raise ValueError(f"weights: quantized layer {prefix!r} lacks {missing}")
            yield f"{prefix}.weight", self._gptq(prefix, got)

    def _compressed(self, prefix: str, got: dict[str, Tensor]) -> Tensor:
        """A compressed-tensors layer: levels [N, K] (stored - 8) times its scales."""
        N, K = (int(x) for x in got["weight_shape"].tolist())
        q = _unpack(got["weight_packed"], 1)[:, :K]  # [N, K]
        scales = got["weight_scale"].float()
        g = K if self.spec.channel else self.spec.group_size
        if tuple(q.shape) != (N, K) or K % g or tuple(scales.shape) != (N, K // g):
            raise ValueError(f"weights: layer {prefix!r}: weight_packed {tuple(got['weight_packed'].shape)} / "
                             f"weight_scale {tuple(scales.shape)} do not fit {N} x {K} in groups of {g}")
        self.scales[f"{prefix}.weight"] = scales.contiguous()
        return (q.float() - 8.0) * scales.repeat_interleave(g, dim=1)

    def _gptq(self, prefix: str, got: dict[str, Tensor]) -> Tensor:
        """A GPTQ layer: (level - zero) times its scales, [N, K]."""
        q = _unpack(got["qweight"], 0)  # [K, N]
        K, N = q.shape
        g = self.spec.group_size
        if K % g:
            raise ValueError(f"weights: GPTQ layer {prefix!r} has {K} inputs, not a multiple of group_size {g}")
        zeros = _unpack(got["qzeros"], 1)[:, :N] + (0 if self.spec.v2 else 1)  # [K / g, N]
        scales = got["scales"].float()
        if tuple(scales.shape) != (K // g, N) or tuple(zeros.shape) != (K // g, N):
            raise ValueError(f"weights: GPTQ layer {prefix!r}: scales {tuple(scales.shape)} / qzeros "
                             f"{tuple(zeros.shape)} do not fit {K} inputs x {N} outputs in groups of {g}")
        if "g_idx" in got and not torch.equal(got["g_idx"].long(), torch.arange(K) // g):
            raise ValueError(f"weights: GPTQ layer {prefix!r}: g_idx is not in input order (act-order checkpoints "
                             "are not loaded)")
        if not bool((zeros == 8).all()):
            raise ValueError(f"weights: GPTQ layer {prefix!r} has zero points other than 8 (asymmetric), which "
                             "pdserve's int4 format cannot hold")
        w = (q.float() - 8.0) * scales.repeat_interleave(g, dim=0)  # [K, N]
        self.scales[f"{prefix}.weight"] = scales.t().contiguous()
        return w.t().contiguous()
