"""Llama-family decoder (Llama, Mistral, Qwen2) running over a paged KV cache.

Lifecycle: ``engine.loader`` builds a ``CausalLM`` from a ``ModelConfig`` on the
target device and dtype, fills it with ``load_weights`` (HF tensor names in,
q/k/v and gate/up fused on the way) or ``init_random``, and puts it in eval mode.
Every engine step then calls ``forward`` once on the flat token batch (all
sequences' new tokens back to back) with that step's ``AttentionMetadata`` and
the per-layer caches, and ``compute_logits`` on the rows that sample.

Hot-path choices (measured on the 2-core CPU box, see docs/benchmarks.md):
fused projections (one [h, (H+2Hkv)D] and one [h, 2I] GEMM per layer instead of
five) halve the per-layer op count; weights are stored [in, out] so batch-1
decode runs row-vector GEMMs (~1.8x faster than nn.Linear's layout there); the
last layer computes attention output, o_proj and MLP only for the rows that
sample (a 2048-token prefill needs one row), after writing every row's K/V.
"""
from __future__ import annotations

import logging
import re
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.attention import AttentionMetadata, apply_rope, decode_attention, paged_attention, write_kv
from engine.config import ModelConfig, rope_inv_freq
from engine.kernels import cpu_kernels
from engine.onednn_layout import onednn_panels
from engine.prefetch_tuning import tune_panel_prefetch
from engine.quant import (ACT_BLOCK, QUANTIZATIONS, dequantize_int4, dequantize_int8, fake_quantize_act,
                          from_panels_int4, from_panels_int8, from_panels_w4a8, from_panels_w8a8, quantize_int4,
                          quantize_int8, step_order, to_panels_int4, to_panels_int8, to_panels_w4a8, to_panels_w8a8)

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """Pre-norm RMSNorm computed in float32 like HF, scaled in the model dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.shape = (size,)
        self.use_kernel = False  # set by CausalLM.finalize when the model's linears run on pdserve's kernels

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            if self.use_kernel and x.dim() == 2 and x.device.type == "cpu":
                # one call instead of torch's ~7 kernels (~16 us a norm at batch 1); the fused decode layer
                # uses the same kernel, so both paths round alike
                return cpu_kernels().rms_norm(x.contiguous(), self.weight, self.eps)
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)


class Linear(nn.Module):
    """y = x W^T + b with W stored transposed, [in, out] contiguous, until ``pack`` runs.

    Why the layout: at one token per step (batch-1 decode) BLAS runs x @ W_t as a plain
    row-vector GEMM about 1.8x faster than nn.Linear's x @ W^T on this CPU.

    ``pack`` (called by ``CausalLM.finalize`` on CPU) reorders the weight once into oneDNN's
    blocked layout and drops the dense copy; every later forward is one oneDNN inner-product on
    the prepacked weight, 1.2x to 3x faster than MKL sgemm on the dense one at the decode and
    prefill shapes of the bench model (docs/benchmarks.md). This is what vLLM's CPU backend does
    (prepacked oneDNN matmul). Weights cannot be read back after packing; export happens before.

    Where oneDNN's packed layout is panels of outputs (checked against the dense weight at pack time,
    engine/kernels.py ``onednn_panels``), products of up to ``PANEL_MAX_M`` rows (decode) run pdserve's
    ``linear_panel`` kernel on the same packed bytes instead: it streams them faster at batch 1 to 8 and
    matches oneDNN up to 64 rows (benchmarks/cpu_linear.py), gives a row the same bits whatever the batch,
    and lets a decoder layer run as one fused C++ call. Larger products (prefill) stay on oneDNN.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: Optional[Tensor] = None
        self.panel: Optional[Tensor] = None  # float32 [NP, K, B] view of `packed` for linear_panel (not owning it)
        self.qweight: Optional[Tensor] = None  # a panel format on CPU with kernels, else int8 [N, K] / int4 [N, K/2]
        self.qscale: Optional[Tensor] = None
        self.qmethod: Optional[str] = None
        self.qgroup = 0
        self.qkernel = True  # w8a8 / w4a8: whether the integer-dot kernel can run this layer (set at quantize)
        self.qorder: Optional[Tensor] = None  # w8a8 on the row kernel: the column order qweight is stored in
        self.qpanels = False  # stored in one of the kernels' panel formats (engine/quant.py to_panels_*)
        self.qunsigned = False  # (w8a8 panels: bytes stored as q ^ 0x80, the VNNI builds)
        self.prefetch = None  # the model's PanelPrefetch (engine/prefetch_tuning.py), for the panel kernels

    def quantize(self, method: str, group: int = 128) -> None:
        """Replace the float weight by its weight-only quantized form (engine/quant.py), once, at load.

        Forward then runs pdserve's CPU kernel: for any number of rows where the weights are stored in one of
        the kernels' panel formats (``qpanels``: int8 / int4 wherever the kernels are built, w8a8 / w4a8 on
        AVX2 / AVX-512), since there the kernel also beats dequantize + GEMM at prefill sizes (1.2-4.7x for
        int8 / int4, 2.3-17x for w8a8 / w4a8 from 2048 down to 128 rows; benchmarks/quant_prefill_linears.py,
        docs/benchmarks.md run R) and no float copy of the layer is made; otherwise for up to
        ``SMALL_M[method]`` rows (decode: reads 1/4 or 1/8 of the fp32 bytes) and dequantize + GEMM above
        that, or dequantize + GEMM everywhere when the kernels are not built (other devices, no compiler).
        'w8a8' / 'w4a8' store the int8 / int4 weights and also round the input to int8 per 32 values
        (engine/quant.py quantize_act): the kernel does integer dots; the GEMM path applies the same
        rounding to x first, so both give the same numbers."""
        w = self.weight_t.detach().t()
        if method == "fp32":  # not quantized: the dense [N, K] weight for pdserve's fp32 kernel
            self.qweight = w.float().contiguous()
        elif method in ("w8a8", "w4a8") and w.shape[1] % ACT_BLOCK:
            raise ValueError(f"quantization {method!r} rounds inputs in blocks of {ACT_BLOCK} values; this model has "
                             f"a linear layer with {w.shape[1]} inputs")
        elif method in ("int8", "w8a8"):
            self.qweight, self.qscale = quantize_int8(w)
            if method == "int8" and w.device.type == "cpu" and cpu_kernels() is not None:
                # the panel layout: one contiguous stream per output panel (engine/csrc, "fp32 on oneDNN's ...")
                self.qweight, self.qscale = to_panels_int8(self.qweight, self.qscale)
                self.qpanels = True
        elif method in ("int4", "w4a8"):
            self.qweight, self.qscale = quantize_int4(w, group)
            self.qgroup = group
            if method == "int4" and w.device.type == "cpu" and cpu_kernels() is not None:
                self.qweight, self.qscale = to_panels_int4(self.qweight, self.qscale, group)
                self.qpanels = True
        else:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {method!r}")
        if method in ("w8a8", "w4a8"):
            # AVX2 / AVX-512 builds: the integer panel kernels (any K and int4 group in whole 32-blocks). Else
            # the integer-dot row kernel runs this layer iff it takes K (and the int4 group) in whole steps;
            # w8a8 weights are then stored in the kernel's step order
            k = cpu_kernels() if w.device.type == "cpu" else None
            pw = k.qpanel_width() if k is not None else 0
            if pw:  # (an int4 group is always whole 32-blocks: quantize_int4 checks it)
                self.qpanels, self.qunsigned = True, method == "w8a8" and k.qpanel_unsigned()
                if method == "w8a8":
                    self.qweight, self.qscale = to_panels_w8a8(self.qweight, self.qscale, pw, self.qunsigned)
                else:
                    self.qweight, self.qscale = to_panels_w4a8(self.qweight, self.qscale, group, pw)
            step = k.qstep() if k is not None else 0
            self.qkernel = self.qpanels or (bool(step) and w.shape[1] % step == 0
                                            and (method == "w8a8" or group % step == 0))
            if self.qkernel and not self.qpanels and method == "w8a8":
                self.qorder = step_order(w.shape[1], step)
                self.qweight = self.qweight[:, self.qorder].contiguous()
        if method != "fp32" and self.bias is not None:
            self.bias.data = self.bias.data.float()
        self.qmethod = method
        self.register_parameter("weight_t", None)

    # Most rows that run through pdserve's kernel where the weights are not in panels (see quantize); more
    # go to one float GEMM (MKL). Quantized weights must be dequantized for that GEMM (a full write and read
    # of the layer in float32 per call), so they stay in the kernel longer (docs/benchmarks.md, runs G and
    # H; benchmarks/cpu_linear.py).
    SMALL_M = {"fp32": 32, "int8": 64, "int4": 64, "w8a8": 64, "w4a8": 64}

    def _quantized_forward(self, x: Tensor) -> Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1])
        k = cpu_kernels() if x.device.type == "cpu" else None
        bias = None if self.bias is None else self.bias.float()
        method = self.qmethod
        if method in ("w8a8", "w4a8") and not self.qkernel:
            k = None
        if k is not None and (self.qpanels or x2.shape[0] <= self.SMALL_M[method]):
            xf = x2.float().contiguous()
            w, sc, n, g = self.qweight, self.qscale, self.out_features, self.qgroup
            pf = () if self.prefetch is None else (self.prefetch,)
            if method == "fp32":
                y = k.linear_fp32(xf, w, bias)
            elif method == "int8":
                y = k.linear_int8_panels(xf, w, sc, n, bias, *pf) if self.qpanels else k.linear_int8(xf, w, sc, bias)
            elif method == "int4":
                y = k.linear_int4_panels(xf, w, sc, n, g, bias, *pf) if self.qpanels else k.linear_int4(xf, w, sc, g, bias)
            elif method == "w8a8":
                y = k.linear_w8a8_panels(xf, w, sc, n, bias, *pf) if self.qpanels else k.linear_w8a8(xf, w, sc, bias)
            else:
                y = k.linear_w4a8_panels(xf, w, sc, n, g, bias, *pf) if self.qpanels else k.linear_w4a8(xf, w, sc, g, bias)
        else:
            if method == "fp32":
                w = self.qweight
            elif self.qpanels and method == "w8a8":
                w = from_panels_w8a8(self.qweight, self.qscale, self.out_features, self.qunsigned)
            elif self.qpanels and method == "int8":
                w = from_panels_int8(self.qweight, self.qscale, self.out_features)
            elif self.qpanels and method == "int4":
                w = from_panels_int4(self.qweight, self.qscale, self.out_features, self.qgroup)
            elif self.qpanels:
                w = from_panels_w4a8(self.qweight, self.qscale, self.out_features, self.qgroup)
            elif method in ("int8", "w8a8"):
                w = dequantize_int8(self.qweight, self.qscale)
            else:
                w = dequantize_int4(self.qweight, self.qscale, self.qgroup)
            xf = fake_quantize_act(x2) if method in ("w8a8", "w4a8") else x2.float()
            if self.qorder is not None:
                xf = xf[:, self.qorder]
            y = F.linear(xf, w, bias)
        return y.to(dtype).reshape(*shape[:-1], y.shape[-1])

    def pack(self) -> bool:
        """Prepack for oneDNN (CPU, float32/bfloat16); False, unchanged, where oneDNN cannot."""
        w = self.weight_t
        if (w is None or w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16)
                or not torch.backends.mkldnn.is_available()):
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().t().contiguous(), None)
        except RuntimeError:  # e.g. bfloat16 on a CPU without the instructions oneDNN needs
            return False
        self.packed = packed
        if w.dtype == torch.float32 and cpu_kernels() is not None:
            self.panel = onednn_panels(packed, w.detach().t())
        self.register_parameter("weight_t", None)
        return True

    # Most rows a product on the packed weight runs through linear_panel; more go to oneDNN (prefill).
    PANEL_MAX_M = 64

    def on_kernels(self) -> bool:
        """Whether pdserve's CPU kernels run this layer's small products (what the fused layer needs)."""
        if self.panel is not None:
            return True
        return self.qweight is not None and self.qkernel and self.qweight.device.type == "cpu"

    def small_m(self) -> int:
        """Most rows of a product that runs on pdserve's kernel (see on_kernels)."""
        return self.PANEL_MAX_M if self.panel is not None else self.SMALL_M[self.qmethod]

    def forward(self, x: Tensor) -> Tensor:
        if self.qweight is not None:
            return self._quantized_forward(x)
        if self.packed is not None:
            if self.panel is not None and x.dtype == torch.float32 and x.numel() <= self.PANEL_MAX_M * self.in_features:
                x2 = x.reshape(-1, self.in_features).contiguous()
                pf = () if self.prefetch is None else (self.prefetch,)
                y = cpu_kernels().linear_panel(x2, self.panel, self.out_features, self.bias, *pf)
                return y.reshape(*x.shape[:-1], self.out_features)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU block with residuals."""

    def __init__(self, mc: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
        self.window = mc.sliding_windows[layer_idx]
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(mc.hidden_size, qkv_out, bias=mc.attention_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, mc.hidden_size, bias=False)
        self.gate_up_proj = Linear(mc.hidden_size, 2 * mc.intermediate_size, bias=False)
        self.down_proj = Linear(mc.intermediate_size, mc.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)
        self.intermediate_size = mc.intermediate_size
        self.fused = None  # pdserve_cpu_kernels.DecodeLayer, set by CausalLM.finalize where it can run
        self.fused_max_rows = 0
        self.kernel_small_ops = False  # silu * mul through pdserve's kernel (with the fused layer's numerics)

    _METHOD_CODES = {"fp32": 0, "int8": 1, "int4": 2, "w8a8": 3, "w4a8": 4}
    _PANEL_CODE = 5  # float32 on oneDNN's packed panels (Linear.panel)
    _QPANEL_CODES = {"w8a8": 6, "w4a8": 7, "int8": 8, "int4": 9}  # the panel formats (Linear.qpanels)

    def build_fused(self, prefetch: object) -> bool:
        """Hand this layer's weights to the C++ decode layer (engine/csrc: the same kernels, one call per
        layer for a batch of single-token decodes) where every linear runs on pdserve's kernels; False,
        unchanged, elsewhere (oneDNN layouts other than panels, torch linears, no kernels, not float32 on
        CPU)."""
        lins = (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)
        if (self.head_dim % 16 or self.input_layernorm.weight.device.type != "cpu"
                or self.input_layernorm.weight.dtype != torch.float32
                or not all(m.on_kernels() for m in lins)):
            return False  # (checked before cpu_kernels(), which would build the CPU extension for a GPU model)
        k = cpu_kernels()
        if k is None:
            return False
        def spec(m: Linear) -> tuple:
            bias = None if m.bias is None else m.bias.detach().float().contiguous()
            if m.panel is not None:
                return (k.WeightFormat(self._PANEL_CODE), m.panel, None, bias, 0, m.out_features)
            code = self._QPANEL_CODES[m.qmethod] if m.qpanels else self._METHOD_CODES[m.qmethod]
            return (k.WeightFormat(code), m.qweight, m.qscale, bias, m.qgroup, m.out_features)
        specs = [spec(m) for m in lins]
        self.fused = k.DecodeLayer(*specs, self.input_layernorm.weight.detach(), self.post_attention_layernorm.weight.detach(),
                                   self.input_layernorm.eps, self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.window or 0, self.head_dim ** -0.5, prefetch)
        self.fused_max_rows = min(m.small_m() for m in lins)
        # the Python path of this layer (prefill, mixed and verify steps) then uses the same norm and
        # silu * mul kernels as the fused one
        self.kernel_small_ops = True
        self.input_layernorm.use_kernel = self.post_attention_layernorm.use_kernel = True
        return True

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata,
                kv_cache: tuple[Tensor, Tensor], keep: Optional[AttentionMetadata] = None) -> Tensor:
        """One block. With ``keep`` (last layer only) K/V are written for every row but the rest of the
        block runs only for the rows in keep.rows, each attending as a single query over its cache."""
        T = h.shape[0]
        if self.fused is not None and keep is None and 0 < meta.num_decode == T <= self.fused_max_rows:
            # a batch of single-token decodes: the whole block in one C++ call (same kernels, same numbers)
            return self.fused.forward(h, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping,
                                      meta.decode_block_tables, meta.decode_ctx_lens)
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(self.input_layernorm(h)).view(T, H + 2 * Hkv, D)
        if self.kernel_small_ops and qkv.dtype == torch.float32 and qkv.is_contiguous():
            cpu_kernels().rope_(qkv, cos, sin, H + Hkv)  # in place, the fused decode layer's arithmetic
            qk = qkv
        else:
            qk = apply_rope(qkv[:, :H + Hkv], cos, sin)
        if keep is None:
            attn = paged_attention(qk[:, :H], qk[:, H:H + Hkv], qkv[:, H + Hkv:], kv_cache[0], kv_cache[1], meta,
                                   self.window)
        else:
            write_kv(kv_cache[0], kv_cache[1], qk[:, H:H + Hkv], qkv[:, H + Hkv:], meta.slot_mapping)
            if keep.num_decode == 0:
                return h[:0]
            h = h.index_select(0, keep.rows)
            q = qk.index_select(0, keep.rows)[:, :H]
            attn = decode_attention(q, kv_cache[0], kv_cache[1], keep, self.window).reshape(q.shape[0], H * D)
        h = h + self.o_proj(attn)
        gate_up = self.gate_up_proj(self.post_attention_layernorm(h))
        if self.kernel_small_ops and gate_up.dtype == torch.float32:
            return h + self.down_proj(cpu_kernels().silu_mul(gate_up.contiguous()))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)


class CausalLM(nn.Module):
    """Embedding -> decoder layers -> final norm -> LM head (optionally tied)."""

    def __init__(self, mc: ModelConfig, max_positions: Optional[int] = None) -> None:
        super().__init__()
        self.config = mc
        self.embed_tokens = nn.Embedding(mc.vocab_size, mc.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(mc, i) for i in range(mc.num_hidden_layers))
        self.norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)
        # tied models still get their own [hidden, vocab] copy, filled from the embedding in finalize()
        self.lm_head = Linear(mc.hidden_size, mc.vocab_size, bias=False)
        self.max_positions = max_positions or mc.max_position_embeddings
        self.rope_cos: Optional[Tensor] = None
        self.rope_sin: Optional[Tensor] = None
        # the panel kernels' prefetch distances, measured for this model at load (engine/prefetch_tuning.py)
        self.panel_prefetch = None

    def _tune_kernels(self) -> None:
        """Measure the panel kernels' prefetch distance on this machine and these weights (engine/kernels.py
        tune_panel_prefetch); nothing where no linear runs on a panel kernel."""
        products = []
        for m in self.modules():
            if isinstance(m, Linear) and m.panel is not None:
                products.append((m.forward, m.in_features, m.panel.numel() * 4))
            elif isinstance(m, Linear) and m.qpanels and m.qweight is not None and m.qweight.device.type == "cpu":
                products.append((m.forward, m.in_features, m.qweight.numel() * m.qweight.element_size()))
        if products:
            tune_panel_prefetch(products, self.panel_prefetch)

    def finalize(self, cpu_gemm: str = "onednn", quantization: Optional[str] = None,
                 group_size: int = 128) -> "CausalLM":
        """Build the rope tables on the weights' device/dtype (after loading), quantize the linear
        layers (``quantization``: 'int8' everywhere, or 'int4' group-wise in the decoder layers with the
        LM head at int8, the way llama.cpp's q4_0 keeps its output layer wider; 'w8a8' everywhere, or
        'w4a8' with the LM head at w8a8) or else prepack them
        for oneDNN when on CPU and ``cpu_gemm == "onednn"`` (small products then run pdserve's panel kernel
        on the packed bytes where it can; ``"onednn_only"`` keeps every product on oneDNN), or keep them
        dense for pdserve's row kernel with ``cpu_gemm == "pdserve"``, and switch to eval."""
        w = self.embed_tokens.weight
        kern = cpu_kernels() if w.device.type == "cpu" and (w.dtype == torch.float32 or quantization) else None
        self.panel_prefetch = kern.PanelPrefetch() if kern is not None else None
        if self.config.tie_word_embeddings:
            with torch.no_grad():
                self.lm_head.weight_t.copy_(w.t())
        if quantization is not None:
            for name, m in self.named_modules():
                if isinstance(m, Linear):
                    head = "w8a8" if quantization in ("w8a8", "w4a8") else "int8"
                    m.quantize(head if name == "lm_head" else quantization, group_size)
        elif cpu_gemm == "pdserve" and w.device.type == "cpu" and w.dtype == torch.float32 \
                and cpu_kernels() is not None:
            for m in self.modules():
                if isinstance(m, Linear):
                    m.quantize("fp32")
        elif cpu_gemm in ("onednn", "onednn_only", "pdserve") and w.device.type == "cpu":
            for m in self.modules():
                if isinstance(m, Linear):
                    m.pack()
                    if cpu_gemm == "onednn_only":
                        m.panel = None
        # where every linear runs on pdserve's kernels (the default oneDNN-packed fp32 path included, where
        # its layout is panels), decode runs a layer per call
        for m in self.modules():
            if isinstance(m, Linear):
                m.prefetch = self.panel_prefetch
        fused = [layer.build_fused(self.panel_prefetch) for layer in self.layers]
        self.norm.use_kernel = bool(fused) and all(fused)
        self._tune_kernels()
        # one cos/sin table for all positions, indexed per step (no per-step trig); computed in
        # float32 and cast like HF does
        inv = rope_inv_freq(self.config).to(w.device)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device=w.device), inv)
        self.rope_cos = freqs.cos().to(w.dtype)
        self.rope_sin = freqs.sin().to(w.dtype)
        return self.eval().requires_grad_(False)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[Tensor, Tensor]],
                layer_hook: Optional[Callable[[int], None]] = None) -> Tensor:
        """input_ids/positions [T] -> final-normed hidden states.

        Returns [T, hidden], or only the rows in meta.keep.rows when the runner set ``meta.keep``
        (the rows that sample): the last layer then skips attention output, o_proj and MLP for
        every other row, whose hidden state nothing reads (their K/V are still written).
        """
        h = self.embed_tokens(input_ids)
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, meta, kv_caches[i], meta.keep if i == last else None)
            if layer_hook is not None:
                layer_hook(i)
        return self.norm(h)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    # -- weights ------------------------------------------------------------------------------

    def init_random(self, seed: int, std: float) -> None:
        """Deterministic N(0, std) weights (norms at 1, biases at 0), same on every device.

        Matrices are drawn in HF's [out, in] shape, so the draw does not depend on our layout.
        """
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if name.startswith("lm_head") and self.config.tie_word_embeddings:
                    continue  # copied from the embedding in finalize()
                if name.endswith("layernorm.weight") or name == "norm.weight":
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                elif name.endswith(".weight_t"):
                    p.copy_((torch.randn(p.shape[::-1], generator=g, dtype=torch.float32) * std).t())
                else:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)

    _LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp|input_layernorm|post_attention_layernorm)\.?(.*)$")

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; raises ValueError on missing/unknown/mis-shaped."""
        mc = self.config
        H, Hkv, D, I = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, mc.intermediate_size
        qkv_cols = {"q_proj": (0, H * D), "k_proj": (H * D, (H + Hkv) * D), "v_proj": ((H + Hkv) * D, (H + 2 * Hkv) * D)}
        gu_cols = {"gate_proj": (0, I), "up_proj": (I, 2 * I)}
        params = dict(self.named_parameters())
        tied = mc.tie_word_embeddings
        # target name -> output features still to fill (weights are [in, out]: fused parts are column ranges)
        left = {n: (p.shape[-1] if n.endswith(".weight_t") else p.shape[0]) for n, p in params.items()
                if not (tied and n.startswith("lm_head"))}
        for hf_name, tensor in weights:
            if "rotary_emb" in hf_name:
                continue
            if tied and hf_name == "lm_head.weight":
                continue  # tied checkpoints sometimes still store it; the embedding wins
            target, cols = self._map_name(hf_name, qkv_cols, gu_cols)
            if target is None or target not in left:
                raise ValueError(f"weights: unexpected tensor {hf_name!r} for {mc.architecture}")
            p = params[target].data
            if target.endswith(".weight_t"):
                src = tensor.t()
                dst = p if cols is None else p[:, cols[0]:cols[1]]
            else:
                src = tensor
                dst = p if cols is None else p[cols[0]:cols[1]]
            if tuple(dst.shape) != tuple(src.shape):
                raise ValueError(f"weights: {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dst.t().shape if target.endswith('_t') else dst.shape)}")
            with torch.no_grad():
                dst.copy_(src.to(dtype=dst.dtype, device=dst.device))
            left[target] -= dst.shape[-1] if target.endswith(".weight_t") else dst.shape[0]
        missing = sorted(n for n, v in left.items() if v != 0)
        if missing:
            raise ValueError(f"weights: missing tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    def _map_name(self, hf_name: str, qkv_cols: dict, gu_cols: dict) -> tuple[Optional[str], Optional[tuple]]:
        if hf_name == "model.embed_tokens.weight":
            return "embed_tokens.weight", None
        if hf_name == "model.norm.weight":
            return "norm.weight", None
        if hf_name == "lm_head.weight":
            return "lm_head.weight_t", None
        m = self._LAYER_RE.match(hf_name)
        if not m:
            return None, None
        i, block, rest = m.group(1), m.group(2), m.group(3)
        if block in ("input_layernorm", "post_attention_layernorm"):
            return f"layers.{i}.{block}.{rest}", None
        proj, _, kind = rest.partition(".")
        kind = "weight_t" if kind == "weight" else kind
        if proj in qkv_cols:
            return f"layers.{i}.qkv_proj.{kind}", qkv_cols[proj]
        if proj in gu_cols:
            return f"layers.{i}.gate_up_proj.{kind}", gu_cols[proj]
        if proj in ("o_proj", "down_proj"):
            return f"layers.{i}.{proj}.{kind}", None
        return None, None
