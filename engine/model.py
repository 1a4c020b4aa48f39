"""Llama-family decoder (Llama, Mistral, Qwen2/3, Phi-3, Granite, Gemma 3; Qwen2/3-MoE, Mixtral MLPs) over a paged KV
cache.

Lifecycle: ``engine.loader`` builds a ``CausalLM`` from a ``ModelConfig`` on the
target device and dtype, fills it with ``load_weights`` (HF tensor names in,
q/k/v and gate/up fused on the way) or ``init_random``, and puts it in eval mode.
Every engine step then calls ``forward`` once on the flat token batch (all
sequences' new tokens back to back) with that step's ``AttentionMetadata`` and
the per-layer caches, and ``compute_logits`` on the rows that sample. ``finalize`` (at
load) chooses each linear layer's weight format once (engine/weight_formats.py), builds
the fused C++ decode layers where every linear runs on pdserve's kernels, gives the
norms and layers their ops (engine/layer_ops.py: pdserve's CPU kernels, or its Triton
kernels on CUDA) and tunes the model's own panel
prefetch distances (engine/prefetch_tuning.py). Qwen3's per-head query and key RMSNorms run before RoPE on every
path (the fused C++ decode layer applies them with the same row function as the kernels' RMSNorm). Gemma 3's layers
(``GemmaRMSNorm``s, four a layer, folded to (1 + w) * scale for the kernels in float32; GeGLU; local layers with a
RoPE table of their own) fuse too.

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
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine import attention
from engine.attention import FP8, AttentionMetadata, decode_attention, paged_attention, write_kv
from engine.config import ModelConfig, rope_attention_factor, rope_inv_freq
from engine.float_formats import Dense, fp32_rows_format, packed_format
from engine.kernels import cpu_kernels
from engine.layer_ops import TORCH_OPS, KernelOps, TorchOps, TritonOps
from engine.lora import LayerLoRA, StepLoRA
from engine.prefetch_tuning import tune_panel_prefetch
from engine.quant_formats import int4_format, quantized_format
from engine.weight_formats import LinearFormat

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """Pre-norm RMSNorm computed in float32 like HF, scaled in the model dtype (``ops``: engine/layer_ops.py)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops: TorchOps = TORCH_OPS  # KernelOps where CausalLM.finalize fused the layer (same numerics)

    def forward(self, x: Tensor) -> Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as HF stores it (zero-centred) and the row scaled by (1 + weight) in
    float32 before rounding to the model dtype, as HF's ``Gemma3RMSNorm`` (Llama rounds first, then scales).
    ``scale``: a constant folded into the (1 + weight) vector (the query norm carries Gemma's attention scale over
    the kernels' 1 / sqrt(head_dim)). In 16 bits always torch (no kernel rounds this way); in float32, where both
    orders round alike, a layer on pdserve's kernels scales by the folded vector (``fold``)."""

    def __init__(self, size: int, eps: float, scale: float = 1.0) -> None:
        super().__init__(size, eps)
        self.scale = scale
        self.folded: Optional[Tensor] = None
        """(1 + weight) * scale in float32, made once the weights are in (``fold``): what a float32 layer on pdserve's
        kernels scales by (the fused decode layer and the Python path alike; float32 rounds as HF's there)."""

    def fold(self) -> Tensor:
        w = 1.0 + self.weight.detach().float()
        self.folded = (w * self.scale if self.scale != 1.0 else w).contiguous()
        return self.folded

    def forward(self, x: Tensor) -> Tensor:
        if self.folded is not None and x.dtype == torch.float32:
            return self.ops.rms_norm(x, self.folded, self.eps)
        w = 1.0 + self.weight.float()
        if self.scale != 1.0:
            w = w * self.scale
        return F.rms_norm(x.float(), w.shape, w, self.eps).to(x.dtype)


class Linear(nn.Module):
    """y = x W^T + b. Holds the float weight, stored transposed ([in, out]), until ``CausalLM.finalize`` chooses
    the layer's format once at load (``pack``: oneDNN's prepacked layout, with pdserve's panel kernel for small
    products where oneDNN packs in panels; ``quantize``: pdserve's fp32 row kernel or a quantized format; or the
    dense weight through torch) and drops the float weight where the format keeps its own copy. Every forward is
    then one call of the format (engine/weight_formats.py). Weights cannot be read back after that; export
    happens before."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.fmt: Optional[LinearFormat] = None
        self.int4_scale: Optional[Tensor] = None
        """A prequantized checkpoint's group scales [out, in / group] (engine/prequantized.py), set as it loads;
        ``load_int4`` packs the weight with them."""

    def forward(self, x: Tensor) -> Tensor:
        return self.fmt(x)

    def _weight(self) -> Tensor:
        if self.weight_t is None:
            raise ValueError(f"Linear({self.in_features}, {self.out_features}): its format is already chosen")
        return self.weight_t.detach().t()

    def keep_dense(self) -> None:
        """The float weight as it is, through torch (other devices; ``cpu_gemm="torch"``)."""
        self.fmt = Dense(self.weight_t, self.bias)

    def pack(self, kern: Any = None, prefetch: Any = None) -> bool:
        """Prepack for oneDNN (CPU, float32 / bfloat16), with pdserve's panel kernel (``kern``: the kernel module,
        ``prefetch``: the model's ``PanelPrefetch``) where oneDNN's bytes are panels; False, dense, where oneDNN
        cannot pack."""
        fmt = packed_format(self._weight(), self.bias, kern, prefetch)
        if fmt is None:
            self.keep_dense()
            return False
        self.fmt = fmt
        self.register_parameter("weight_t", None)
        return True

    def load_int4(self, group: int, kern: Any = None, prefetch: Any = None) -> bool:
        """Pack the weight as int4 with the checkpoint's own scales (``int4_scale``): the stored integers come back
        exactly. False, and nothing changed, where they do not (the weight is not (q - 8) x scale with q in 0..15,
        e.g. a scale folded into it since): the caller quantizes it afresh."""
        w0 = self._weight()
        w = w0.float()
        N, K = w.shape
        s = self.int4_scale
        if s is None or tuple(s.shape) != (N, K // group) or K % group:
            return False
        # (a 16-bit model holds (q - 8) x scale rounded to its dtype: the integers still come back, and rounding
        # them times the scales to that dtype must give the weight it holds)
        q = torch.round(w.view(N, K // group, group) / s[..., None])
        if not bool(((q >= -8) & (q <= 7)).all()) or \
                not torch.equal((q * s[..., None]).view(N, K).to(w0.dtype), w0):
            return False
        if self.bias is not None:
            self.bias.data = self.bias.data.float()
        self.fmt = int4_format(q.view(N, K).to(torch.int16), s, group, self.bias,
                               kern if w.device.type == "cpu" else None, prefetch)
        self.register_parameter("weight_t", None)
        self.int4_scale = None
        return True

    def quantize(self, method: str, group: int = 128, kern: Any = None, prefetch: Any = None) -> None:
        """Replace the float weight by ``method``'s format (engine/quant_formats.py; 'fp32': the dense weight for
        pdserve's fp32 row kernel), once, at load. ``kern`` is the kernel module (None: plain torch)."""
        w = self._weight()
        if method == "fp32":
            self.fmt = fp32_rows_format(w, self.bias, kern if w.device.type == "cpu" else None)
        else:
            if self.bias is not None:
                self.bias.data = self.bias.data.float()
            self.fmt = quantized_format(method, w, self.bias, group, kern, prefetch)
        self.register_parameter("weight_t", None)


class MoE(nn.Module):
    """A sparse MoE MLP (Qwen2-MoE's, with its shared expert; Qwen3-MoE's; Mixtral's): a router picks each token's
    top-k experts from its softmax (the weights renormalised where the model does), each expert is a SwiGLU, and a token's output is its experts'
    outputs weighted. Computed as transformers computes it (per hit expert: its tokens' rows through ``F.linear``,
    weighted, added back in), so float32 results agree with it to rounding. The weights stay dense in the model's
    dtype (no quantized format yet); the loop over hit experts reads the routing on the host, so MoE steps run
    eagerly (no CUDA graphs)."""

    def __init__(self, mc: ModelConfig) -> None:
        super().__init__()
        E, H, I = mc.num_experts, mc.hidden_size, mc.moe_intermediate_size
        self.top_k, self.norm_topk_prob = mc.num_experts_per_tok, mc.norm_topk_prob
        self.cast_weights = mc.architecture != "MixtralForCausalLM"
        """Routing weights rounded to the model dtype before use (Qwen3-MoE; Mixtral keeps them float32)."""
        self.router = nn.Parameter(torch.empty(E, H))
        self.gate_up = nn.Parameter(torch.empty(E, 2 * I, H))
        """Each expert's gate then up projection, [2I, H] as HF's ``experts.gate_up_proj``."""
        self.down = nn.Parameter(torch.empty(E, H, I))
        S = mc.shared_expert_intermediate_size
        self.shared_gate_up = nn.Parameter(torch.empty(2 * S, H)) if S else None
        """Qwen2-MoE's shared expert (gate then up, [2S, H]), its down projection and its sigmoid gate [1, H]."""
        self.shared_down = nn.Parameter(torch.empty(H, S)) if S else None
        self.shared_gate = nn.Parameter(torch.empty(1, H)) if S else None

    def forward(self, x: Tensor) -> Tensor:
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.cast_weights:
            weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            rows, slot = torch.where(experts == e)
            gate, up = F.linear(x[rows], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        if self.shared_gate_up is not None:
            gate, up = F.linear(x, self.shared_gate_up).chunk(2, dim=-1)
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * F.linear(F.silu(gate) * up, self.shared_down)
        return out


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU (or Gemma's GeGLU) block with residuals; Gemma 3's also normalises the attention
    and MLP outputs before each residual add."""

    def __init__(self, mc: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
        self.window = mc.sliding_windows[layer_idx]
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(mc.hidden_size, qkv_out, bias=mc.attention_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, mc.hidden_size, bias=False)
        self.moe: Optional[MoE] = MoE(mc) if mc.moe_layers[layer_idx] else None
        """The layer's MoE MLP (then no dense gate_up_proj / down_proj)."""
        self.gate_up_proj = Linear(mc.hidden_size, 2 * mc.intermediate_size, bias=False) if self.moe is None else None
        self.down_proj = Linear(mc.intermediate_size, mc.hidden_size, bias=False) if self.moe is None else None
        norm = GemmaRMSNorm if mc.gemma_norms else RMSNorm
        self.input_layernorm = norm(mc.hidden_size, mc.rms_norm_eps)
        self.post_attention_layernorm = norm(mc.hidden_size, mc.rms_norm_eps)
        """The norm before the MLP (Gemma's checkpoints call it ``pre_feedforward_layernorm``)."""
        self.attn_out_norm = norm(mc.hidden_size, mc.rms_norm_eps) if mc.gemma_norms else None
        self.mlp_out_norm = norm(mc.hidden_size, mc.rms_norm_eps) if mc.gemma_norms else None
        """Gemma 3's norms of the attention output (its checkpoints' ``post_attention_layernorm``) and of the MLP
        output (``post_feedforward_layernorm``), each before its residual add; None elsewhere."""
        q_scale = (mc.attention_multiplier * self.head_dim ** 0.5
                   if mc.gemma_norms and mc.attention_multiplier is not None else 1.0)
        self.q_norm = (GemmaRMSNorm(self.head_dim, mc.rms_norm_eps, q_scale) if mc.gemma_norms
                       else RMSNorm(self.head_dim, mc.rms_norm_eps)) if mc.qk_norm else None
        self.k_norm = norm(self.head_dim, mc.rms_norm_eps) if mc.qk_norm else None
        """Qwen3's and Gemma 3's per-head query and key norms (before RoPE); None elsewhere."""
        self.gelu = mc.hidden_act == "gelu_pytorch_tanh"
        """GeGLU (tanh-approximated GELU of the gate, times up: Gemma) instead of SwiGLU."""
        self.local_rope = mc.rope_local_theta is not None and self.window is not None
        """This layer rotates with the model's local RoPE table (Gemma 3's sliding-window layers)."""
        self.intermediate_size = mc.intermediate_size
        self.fused = None  # the kernels' DecodeLayer, set by CausalLM.finalize where it can run
        self.fused_max_rows = 0
        self.ops: TorchOps = TORCH_OPS  # RoPE and silu * mul (KernelOps: the fused layer's numerics)
        self.sharded = False
        """One rank's shard of a tensor-parallel layer (engine/tensor_parallel.py): never fused."""
        self.tp_comm: Any = None
        """The group's collectives where sharded: o_proj's and down_proj's partial sums are all-reduced."""
        self.batch_invariant = False
        """Set by ``CausalLM.finalize(batch_invariant=True)`` on a Triton device: prefill chunks through one kernel."""
        self.lora: Optional[LayerLoRA] = None
        """This layer's LoRA adapters (engine/lora.py), attached by an engine that serves some."""

    def build_fused(self, kern: Any, prefetch: Any) -> bool:
        """Hand this layer's weights to the C++ decode layer (engine/csrc/decode_layer.cpp: the same kernels, one
        call per layer for a batch of single-token decodes) where every linear runs on pdserve's kernels; False,
        unchanged, elsewhere (oneDNN layouts other than panels, torch linears, no kernels, not float32 on CPU)."""
        if self.moe is not None:
            return False
        fmts = [m.fmt for m in (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)]
        if (kern is None or self.sharded or self.head_dim % 16 or self.input_layernorm.weight.device.type != "cpu"
                or self.input_layernorm.weight.dtype != torch.float32 or not all(f.on_kernels() for f in fmts)):
            return False
        def w(norm: Optional[RMSNorm]) -> Optional[Tensor]:  # (Gemma's: (1 + weight) * scale, folded once)
            if norm is None:
                return None
            return norm.fold() if isinstance(norm, GemmaRMSNorm) else norm.weight.detach()

        self.fused = kern.DecodeLayer(*[f.fused_spec() for f in fmts], w(self.input_layernorm),
                                      w(self.post_attention_layernorm), self.input_layernorm.eps,
                                      self.num_heads, self.num_kv_heads, self.head_dim, self.window or 0,
                                      self.head_dim ** -0.5, prefetch, w(self.q_norm), w(self.k_norm),
                                      w(self.attn_out_norm), w(self.mlp_out_norm), self.gelu)
        self.fused_max_rows = min(f.small_m for f in fmts)
        # the Python path of this layer (prefill, mixed and verify steps) then uses the same norm, RoPE and
        # silu * mul (gelu * mul) kernels as the fused one
        self.ops = KernelOps(kern)
        for norm in (self.input_layernorm, self.post_attention_layernorm, self.q_norm, self.k_norm,
                     self.attn_out_norm, self.mlp_out_norm):
            if norm is not None:
                norm.ops = self.ops
        return True

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata,
                kv_cache: tuple[Tensor, Tensor], keep: Optional[AttentionMetadata] = None) -> Tensor:
        """One block. With ``keep`` (last layer only) K/V are written for every row but the rest of the
        block runs only for the rows in keep.rows, each attending as a single query over its cache."""
        T = h.shape[0]
        if (self.fused is not None and keep is None and 0 < meta.num_decode == T <= self.fused_max_rows
                and kv_cache[0].dtype != FP8 and meta.lora is None):
            # a batch of single-token decodes: the whole block in one C++ call (same kernels, same numbers; it
            # writes and reads float and int8 caches; a row with a LoRA adapter runs the Python path)
            return self.fused.forward(h, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping,
                                      meta.decode_block_tables, meta.decode_ctx_lens)
        q, k, v = self.pre_attention(h, cos, sin, meta.lora)
        h, attn = self.attend(h, q, k, v, meta, kv_cache, keep)
        if attn is None:
            return h
        return self.post_attention(h, attn, (keep if keep is not None else meta).lora)

    def pre_attention(self, h: Tensor, cos: Tensor, sin: Tensor,
                      lora: Optional[StepLoRA] = None) -> tuple[Tensor, Tensor, Tensor]:
        """The block up to attention: q [T, H, D] and k [T, Hkv, D] rotated, v [T, Hkv, D] (views of one qkv
        projection). With ``attend`` and ``post_attention``, the three parts ``forward`` runs; piecewise graphs
        (engine/piecewise_graphs.py) capture this and ``post_attention`` and run ``attend`` eagerly. ``lora``: the
        rows' adapters (engine/lora.py)."""
        T = h.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        x = self.input_layernorm(h)
        qkv = self.qkv_proj(x)
        if lora is not None and self.lora is not None:
            qkv = self.lora.apply("qkv_proj", x, qkv, lora)
        qkv = qkv.view(T, H + 2 * Hkv, D)
        if self.q_norm is not None:  # Qwen3: each head normalised before RoPE (rows of D for the 2-D kernels)
            q = self.q_norm(qkv[:, :H].reshape(T * H, D)).view(T, H, D)
            k = self.k_norm(qkv[:, H:H + Hkv].reshape(T * Hkv, D)).view(T, Hkv, D)
            qk = self.ops.rope(torch.cat([q, k], dim=1), cos, sin, H + Hkv)
            return qk[:, :H], qk[:, H:H + Hkv], qkv[:, H + Hkv:]
        qk = self.ops.rope(qkv, cos, sin, H + Hkv)
        return qk[:, :H], qk[:, H:H + Hkv], qkv[:, H + Hkv:]

    def attend(self, h: Tensor, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata,
               kv_cache: tuple[Tensor, Tensor], keep: Optional[AttentionMetadata] = None,
               out: Optional[Tensor] = None, kv_written: bool = False) -> tuple[Tensor, Optional[Tensor]]:
        """Write the rows' K/V (unless ``kv_written``) and attend: (the residual rows that go on, their attention
        output [rows, H * D], in ``out`` [T, H, D] where given without ``keep``). With ``keep`` only its rows go on
        (None for the output where no row does: ``h[:0]`` is then the block's result)."""
        if keep is None:
            return h, paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.window, self.batch_invariant,
                                      out=out, kv_written=kv_written)
        if not kv_written:
            write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        if keep.num_decode == 0:
            return h[:0], None
        q = q.index_select(0, keep.rows)
        attn = decode_attention(q, kv_cache[0], kv_cache[1], keep, self.window)
        return h.index_select(0, keep.rows), attn.reshape(q.shape[0], self.num_heads * self.head_dim)

    def post_attention(self, h: Tensor, attn: Tensor, lora: Optional[StepLoRA] = None) -> Tensor:
        """The block after attention: o_proj and the residual, the MLP and its residual (``lora``: the rows'
        adapters)."""
        if self.moe is not None:  # (no LoRA on MoE models: refused at load)
            h = h + self._reduced(self.o_proj(attn))
            return h + self.moe(self.post_attention_layernorm(h))
        if self.attn_out_norm is not None:  # Gemma 3: each output normalised before its residual add
            o = self._reduced(self.o_proj(attn) if lora is None or self.lora is None
                              else self.lora.apply("o_proj", attn, self.o_proj(attn), lora))
            h = h + self.attn_out_norm(o)
            x = self.post_attention_layernorm(h)
            gate_up = self.gate_up_proj(x)
            if lora is not None and self.lora is not None:
                gate_up = self.lora.apply("gate_up_proj", x, gate_up, lora)
            act = self._act_mul(gate_up)
            down = self.down_proj(act)
            if lora is not None and self.lora is not None:
                down = self.lora.apply("down_proj", act, down, lora)
            return h + self.mlp_out_norm(self._reduced(down))
        if lora is None or self.lora is None:
            h = h + self._reduced(self.o_proj(attn))
            gate_up = self.gate_up_proj(self.post_attention_layernorm(h))
            return h + self._reduced(self.down_proj(self._act_mul(gate_up)))
        ll = self.lora  # (a row-parallel shard's delta is partial too: reduced with the base product's)
        h = h + self._reduced(ll.apply("o_proj", attn, self.o_proj(attn), lora))
        x = self.post_attention_layernorm(h)
        act = self._act_mul(ll.apply("gate_up_proj", x, self.gate_up_proj(x), lora))
        return h + self._reduced(ll.apply("down_proj", act, self.down_proj(act), lora))

    def _act_mul(self, gate_up: Tensor) -> Tensor:
        """act(gate) * up of the [rows, 2I] gate/up product through the layer's ops: SwiGLU, or GeGLU (HF's
        ``gelu_pytorch_tanh``)."""
        if not self.gelu:
            return self.ops.silu_mul(gate_up, self.intermediate_size)
        return self.ops.gelu_mul(gate_up, self.intermediate_size)

    def _reduced(self, partial: Tensor) -> Tensor:
        """A row-parallel linear's output: this rank's partial sum, summed over the ranks where sharded."""
        return partial if self.tp_comm is None else self.tp_comm.all_reduce(partial)


class CausalLM(nn.Module):
    """Embedding -> decoder layers -> final norm -> LM head (optionally tied)."""

    def __init__(self, mc: ModelConfig, max_positions: Optional[int] = None, tp: Any = None) -> None:
        """``mc`` gives the shapes; ``tp`` (an engine.tensor_parallel.TPLayout) makes this one rank's shard, and
        ``mc`` is then its ``local_config()``."""
        super().__init__()
        self.config = mc
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.tp_comm: Any = None
        self.embed_tokens = nn.Embedding(mc.vocab_size, mc.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(mc, i) for i in range(mc.num_hidden_layers))
        for layer in self.layers:
            layer.sharded = self.tp is not None
        self.norm = (GemmaRMSNorm if mc.gemma_norms else RMSNorm)(mc.hidden_size, mc.rms_norm_eps)
        # tied models still get their own [hidden, vocab] copy, filled from the embedding in finalize()
        self.lm_head = Linear(mc.hidden_size, mc.vocab_size, bias=False)
        self.has_lm_head = True
        """False for an untied checkpoint without ``lm_head.weight`` (an embedding model saved as its base model,
        Qwen3-Embedding-8B's way): the head is zero and the engine serves only embeddings (engine/pooling.py)."""
        self.max_positions = max_positions or mc.max_position_embeddings
        self.rope_cos: Optional[Tensor] = None
        self.rope_sin: Optional[Tensor] = None
        self.rope_local_cos: Optional[Tensor] = None
        self.rope_local_sin: Optional[Tensor] = None
        """The local layers' tables where they rotate with a base of their own (Gemma 3); None elsewhere."""
        # the panel kernels' prefetch distances, measured for this model at load (engine/prefetch_tuning.py)
        self.panel_prefetch = None

    def finalize(self, cpu_gemm: str = "onednn", quantization: Optional[str] = None,
                 group_size: int = 128, batch_invariant: bool = False,
                 prequantized_group: Optional[int] = None) -> "CausalLM":
        """Build the rope tables on the weights' device/dtype (after loading), choose every linear layer's weight
        format once (engine/weight_formats.py): quantized (``quantization``: 'int8' everywhere, or 'int4'
        group-wise in the decoder layers with the LM head at int8, the way llama.cpp's q4_0 keeps its output layer
        wider; 'w8a8' everywhere, or 'w4a8' with the LM head at w8a8), or else prepacked for oneDNN when on CPU and
        ``cpu_gemm == "onednn"`` (small products then run pdserve's panel kernel on the packed bytes where it can;
        ``"onednn_only"`` keeps every product on oneDNN), or dense for pdserve's row kernel with
        ``cpu_gemm == "pdserve"``, or dense through torch; build the fused decode layers where every linear runs
        on pdserve's kernels; measure the panel kernels' prefetch for this model; and switch to eval.
        ``batch_invariant`` on a Triton device (CUDA): every dense linear through ``triton_kernels.matmul`` and every
        prefill chunk through the Triton paged kernel, so a row's logits do not depend on its batch or chunking
        (on CPU pdserve's default kernels already give a row the same bits in any batch)."""
        w = self.embed_tokens.weight
        on_cpu = w.device.type == "cpu"
        if quantization is not None and self.config.num_experts:
            raise ValueError(f"quantization {quantization!r}: a mixture-of-experts model's experts have no "
                             "quantized format yet (serve it unquantized)")
        # (only where a kernel may run: a GPU model must not build the CPU extension)
        kern = cpu_kernels() if on_cpu and (quantization is not None or prequantized_group is not None
                                            or (w.dtype == torch.float32 and cpu_gemm != "torch")) else None
        self.panel_prefetch = kern.PanelPrefetch() if kern is not None else None
        if self.config.tie_word_embeddings:
            with torch.no_grad():
                self.lm_head.weight_t.copy_(w.t())
                if self.config.logits_scaling != 1.0:  # (Granite: folded, as load_weights does for an untied head)
                    self.lm_head.weight_t.div_(self.config.logits_scaling)
        if self.config.embedding_multiplier != 1.0:  # (Granite, Gemma; after the tied head took its copy)
            mult = self.config.embedding_multiplier
            if self.config.gemma_norms:  # (Gemma scales by sqrt(hidden) rounded to the model dtype first, as HF)
                mult = torch.tensor(mult, dtype=torch.float32).to(w.dtype).item()
            with torch.no_grad():
                w.mul_(mult)
        linears = [(name, m) for name, m in self.named_modules() if isinstance(m, Linear)]
        for name, m in linears:
            if prequantized_group is not None and m.int4_scale is not None:
                # a prequantized checkpoint's layer (engine/prequantized.py): its own integers and scales (group 0:
                # one per output channel, a group of all its inputs)
                g = prequantized_group or m.in_features
                if m.load_int4(g, kern, self.panel_prefetch):
                    continue
                log.warning("%s: the checkpoint's int4 levels do not come back from its weight (a scale was folded "
                            "in): quantized afresh, int4 group %d", name, g)
                m.int4_scale = None
                m.quantize("int4", g, kern, self.panel_prefetch)
            elif quantization is not None:
                head = "w8a8" if quantization in ("w8a8", "w4a8") else "fp8" if quantization == "fp8" else "int8"
                m.quantize(head if name == "lm_head" else quantization, group_size, kern, self.panel_prefetch)
            elif cpu_gemm == "pdserve" and on_cpu and w.dtype == torch.float32 and kern is not None:
                m.quantize("fp32", kern=kern)
            elif cpu_gemm in ("onednn", "onednn_only", "pdserve") and on_cpu:
                m.pack(kern if cpu_gemm != "onednn_only" else None, self.panel_prefetch)
            else:
                m.keep_dense()
        # where every linear runs on pdserve's kernels (the default oneDNN-packed fp32 path included, where
        # its layout is panels), decode runs a layer per call
        fused = [layer.build_fused(kern, self.panel_prefetch) for layer in self.layers]
        if fused and all(fused):
            self.norm.ops = KernelOps(kern)
            if isinstance(self.norm, GemmaRMSNorm):
                self.norm.fold()
        if w.device.type in attention.TRITON_DEVICE_TYPES:
            from engine import triton_kernels

            if triton_kernels.available(w.device):  # one launch per norm, RoPE and silu * mul (engine/layer_ops.py)
                ops = TritonOps()
                self.norm.ops = ops
                for layer in self.layers:
                    layer.ops = layer.input_layernorm.ops = layer.post_attention_layernorm.ops = ops
                    if layer.q_norm is not None:
                        layer.q_norm.ops = layer.k_norm.ops = ops
                if batch_invariant:
                    for _, m in linears:
                        if isinstance(m.fmt, Dense):
                            m.fmt.invariant = True
                    for layer in self.layers:
                        layer.batch_invariant = True
        products = [p for _, m in linears if (p := m.fmt.tune_product()) is not None]
        if products:
            tune_panel_prefetch(products, self.panel_prefetch)
        # one cos/sin table for all positions, indexed per step (no per-step trig); computed in
        # float32 and cast like HF does
        inv = rope_inv_freq(self.config).to(w.device)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device=w.device), inv)
        scale = rope_attention_factor(self.config)  # (YaRN's; 1 elsewhere, and then no multiply: same bits)
        self.rope_cos = (freqs.cos() * scale if scale != 1.0 else freqs.cos()).to(w.dtype)
        self.rope_sin = (freqs.sin() * scale if scale != 1.0 else freqs.sin()).to(w.dtype)
        if self.config.rope_local_theta is not None:
            d = self.config.head_dim
            inv = 1.0 / (self.config.rope_local_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
            freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device=w.device), inv.to(w.device))
            self.rope_local_cos, self.rope_local_sin = freqs.cos().to(w.dtype), freqs.sin().to(w.dtype)
        return self.eval().requires_grad_(False)

    def weight_bytes(self) -> int:
        """Bytes of every weight this model holds as it serves (after ``finalize``): the parameters left, the
        buffers and each linear's format's tensors (packed, quantized, scales), each storage counted once. What
        one rank's weights take of its memory (``pdserve profile`` records it)."""
        seen: dict[Any, int] = {}

        def add(t: Any) -> None:
            if isinstance(t, Tensor):
                key = (str(t.device), t.data_ptr()) if t.layout == torch.strided else id(t)
                seen[key] = max(seen.get(key, 0), t.numel() * t.element_size())

        for t in (*self.parameters(), *self.buffers()):
            add(t)
        for m in self.modules():
            fmt = getattr(m, "fmt", None)
            if fmt is not None:
                for t in fmt.tensors():
                    add(t)
        for name in ("rope_cos", "rope_sin", "rope_local_cos", "rope_local_sin"):
            add(getattr(self, name, None))
        return sum(seen.values())

    def attach_comm(self, comm: Any) -> None:
        """The tensor-parallel group's collectives (engine.tensor_parallel.TPComm), once the group is open."""
        self.tp_comm = comm
        for layer in self.layers:
            layer.tp_comm = comm

    def _embed(self, input_ids: Tensor) -> Tensor:
        if self.tp_comm is None:
            return self.embed_tokens(input_ids)
        # vocabulary-parallel: this rank's rows, zero for ids another rank holds, summed over the ranks
        local = input_ids - self.tp.vocab_lo
        outside = (local < 0) | (local >= self.tp.vocab_hi - self.tp.vocab_lo)
        h = self.embed_tokens(local.masked_fill(outside, 0))
        h.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp_comm.all_reduce(h)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[Tensor, Tensor]],
                layer_hook: Optional[Callable[[int], None]] = None) -> Tensor:
        """input_ids/positions [T] -> final-normed hidden states.

        Returns [T, hidden], or only the rows in meta.keep.rows when the runner set ``meta.keep``
        (the rows that sample): the last layer then skips attention output, o_proj and MLP for
        every other row, whose hidden state nothing reads (their K/V are still written).
        """
        h = self._embed(input_ids)
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        if self.rope_local_cos is not None:
            local = (self.rope_local_cos[positions].unsqueeze(1), self.rope_local_sin[positions].unsqueeze(1))
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            c, s = local if layer.local_rope else (cos, sin)
            h = layer(h, c, s, meta, kv_caches[i], meta.keep if i == last else None)
            if layer_hook is not None:
                layer_hook(i)
        return self.norm(h)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] -> float32 logits [N, vocab] (a tensor-parallel shard: gathered from every rank, which must
        all call this with the same rows)."""
        logits = self.lm_head(hidden).float()
        if self.tp_comm is not None:
            logits = self.tp_comm.gather_vocab(logits)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

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
                if name.endswith("norm.weight"):  # (every RMSNorm: the layers', q/k's and the final one)
                    p.fill_(0.0 if self.config.gemma_norms else 1.0)  # (Gemma's scale by 1 + weight)
                elif name.endswith(".bias"):
                    p.zero_()
                elif name.endswith(".weight_t"):
                    p.copy_((torch.randn(p.shape[::-1], generator=g, dtype=torch.float32) * std).t())
                else:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)

    _LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp|input_layernorm|post_attention_layernorm|"
                           r"pre_feedforward_layernorm|post_feedforward_layernorm)\.?(.*)$")
    _GEMMA_NORMS = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "attn_out_norm",
                    "pre_feedforward_layernorm": "post_attention_layernorm",
                    "post_feedforward_layernorm": "mlp_out_norm"}
    """Gemma 3's four norms of a layer, as its checkpoints name them -> this model's."""
    _MULTIMODAL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                            ("language_model.lm_head.", "lm_head."))
    """A multimodal checkpoint's language-model names (transformers 4.x's, then 5.x's) -> a causal LM's."""
    _VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector.")
    """What a multimodal checkpoint holds besides its language model (not loaded: the engine serves text)."""

    def _canonical(self, hf_name: str) -> Optional[str]:
        """``hf_name`` as a causal LM's checkpoint names it (a base model's, as embedding models are saved, has no
        ``model.`` prefix; Gemma 3's multimodal checkpoints hold the language model under one); None for a vision
        tower's or projector's tensor, which is not loaded."""
        if hf_name.startswith("layers.") or hf_name in ("embed_tokens.weight", "norm.weight"):
            return "model." + hf_name
        if not self.config.gemma_norms:
            return hf_name
        if hf_name.startswith(self._VISION_PREFIXES):
            return None
        for old, new in self._MULTIMODAL_PREFIXES:
            if hf_name.startswith(old):
                return new + hf_name[len(old):]
        return hf_name

    def load_weights(self, weights: Iterable[tuple[str, Tensor]],
                     int4_scales: Optional[dict[str, Tensor]] = None) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; raises ValueError on missing/unknown/mis-shaped.
        ``int4_scales``: a prequantized checkpoint's group scales by tensor name (engine/prequantized.py, filled
        as ``weights`` is read): each such weight's linear layer keeps its rows of them (``Linear.int4_scale``)."""
        mc = self.config
        H, Hkv, D, I = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, mc.intermediate_size
        qkv_cols = {"q_proj": (0, H * D), "k_proj": (H * D, (H + Hkv) * D), "v_proj": ((H + Hkv) * D, (H + 2 * Hkv) * D)}
        gu_cols = {"gate_proj": (0, I), "up_proj": (I, 2 * I)}
        params = dict(self.named_parameters())
        tied = mc.tie_word_embeddings
        # target name -> output features still to fill (weights are [in, out]: fused parts are column ranges)
        # (rows, over every leading dimension: an MoE tensor's experts are filled a part at a time)
        left = {n: (p.shape[-1] if n.endswith(".weight_t") else p.numel() // p.shape[-1] if p.dim() > 1 else p.shape[0])
                for n, p in params.items() if not (tied and n.startswith("lm_head"))}
        for hf_name, tensor in weights:
            scale = int4_scales.pop(hf_name, None) if int4_scales else None
            if "rotary_emb" in hf_name or (hf_name := self._canonical(hf_name)) is None:
                continue
            if tied and hf_name == "lm_head.weight":
                continue  # tied checkpoints sometimes still store it; the embedding wins
            moe = self._moe_target(hf_name, mc)
            if moe is not None:  # an expert's projection or a router: copied as HF stores it
                target, index = moe
                if target not in left:
                    raise ValueError(f"weights: unexpected tensor {hf_name!r} for {mc.architecture}")
                dst = params[target].data[index]
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(f"weights: {hf_name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(dst.shape)}")
                with torch.no_grad():
                    dst.copy_(tensor.to(dtype=dst.dtype, device=dst.device))
                left[target] -= dst.numel() // dst.shape[-1]
                continue
            if self.tp is not None:
                tensor = self.tp.shard(hf_name, tensor)  # this rank's heads, columns or vocabulary rows
                if scale is not None:
                    scale = self.tp.shard_scale(hf_name, scale)
            tensor = self._folded(hf_name, tensor, mc)
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
            if scale is not None and target.endswith(".weight_t"):
                lin = self.get_submodule(target.removesuffix(".weight_t"))
                if lin.int4_scale is None:
                    lin.int4_scale = torch.zeros(lin.out_features, scale.shape[1], dtype=torch.float32)
                lin.int4_scale[slice(*cols) if cols is not None else slice(None)] = scale
        missing = sorted(n for n, v in left.items() if v != 0)
        head = params["lm_head.weight_t"]
        if missing == ["lm_head.weight_t"] and left["lm_head.weight_t"] == head.shape[-1]:  # (none of it given)
            log.warning("the checkpoint has no lm_head.weight and does not tie it: an embedding model, served for "
                        "embeddings only")
            with torch.no_grad():
                head.data.zero_()
            self.has_lm_head = False
            missing = []
        if missing:
            raise ValueError(f"weights: missing tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    _MOE_RE = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(gate|shared_expert_gate|"
                         r"experts\.(\d+)\.(\w+)|shared_expert\.(\w+))\.weight$")
    _EXPERT_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
    """Qwen3-MoE's and Mixtral's names of an expert's gate, up and down projections."""

    def _moe_target(self, hf_name: str, mc: ModelConfig) -> Optional[tuple[str, Any]]:
        """(parameter, index into it) of an MoE tensor (a router, or one expert's projection); None for others."""
        m = self._MOE_RE.match(hf_name)
        if m is None or not mc.num_experts or not mc.moe_layers[int(m.group(1))]:
            return None
        i, what, e, part, shared = m.group(1), m.group(2), m.group(3), m.group(4), m.group(5)
        if what == "gate":
            return f"layers.{i}.moe.router", slice(None)
        if what == "shared_expert_gate":
            return f"layers.{i}.moe.shared_gate", slice(None)
        if shared is not None:
            kind, S = self._EXPERT_PART.get(shared), mc.shared_expert_intermediate_size
            if kind is None:
                return f"layers.{i}.moe.unknown", None
            if kind == 2:
                return f"layers.{i}.moe.shared_down", slice(None)
            return f"layers.{i}.moe.shared_gate_up", slice(kind * S, (kind + 1) * S)
        kind, I = self._EXPERT_PART.get(part), mc.moe_intermediate_size
        if kind is None or int(e) >= mc.num_experts:
            return f"layers.{i}.moe.unknown", None
        if kind == 2:
            return f"layers.{i}.moe.down", int(e)
        return f"layers.{i}.moe.gate_up", (int(e), slice(kind * I, (kind + 1) * I))

    @staticmethod
    def _folded(hf_name: str, tensor: Tensor, mc: ModelConfig) -> Tensor:
        """Granite's scalars folded into the weights as they load: the query projection carries the attention
        multiplier (over the kernels' 1 / sqrt(head_dim)), o_proj and down_proj the residual multiplier, an untied LM
        head 1 / logits_scaling (a tied one gets it in ``finalize``). Exact up to float rounding; nothing else changes
        (the fused layers, TP shards and every kernel see ordinary weights)."""
        scale = 1.0
        if mc.attention_multiplier is not None and not mc.qk_norm and hf_name.endswith(("self_attn.q_proj.weight",
                                                                                        "self_attn.q_proj.bias")):
            # (a model with query norms carries it in its query norm: Gemma 3's ``GemmaRMSNorm.scale``)
            scale = mc.attention_multiplier * mc.head_dim ** 0.5
        elif mc.residual_multiplier != 1.0 and hf_name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            scale = mc.residual_multiplier
        elif mc.logits_scaling != 1.0 and hf_name == "lm_head.weight":
            scale = 1.0 / mc.logits_scaling
        return tensor if scale == 1.0 else tensor * scale

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
        if block.endswith("layernorm"):
            if self.config.gemma_norms:
                return f"layers.{i}.{self._GEMMA_NORMS[block]}.{rest}", None
            if block in ("input_layernorm", "post_attention_layernorm"):
                return f"layers.{i}.{block}.{rest}", None
            return None, None
        proj, _, kind = rest.partition(".")
        if block == "self_attn" and proj in ("q_norm", "k_norm"):
            return f"layers.{i}.{proj}.{kind}", None
        kind = "weight_t" if kind == "weight" else kind
        if proj in ("qkv_proj", "gate_up_proj"):  # Phi-3 stores them fused, in our order (q, k, v; gate, up)
            return f"layers.{i}.{proj}.{kind}", None
        if proj in qkv_cols:
            return f"layers.{i}.qkv_proj.{kind}", qkv_cols[proj]
        if proj in gu_cols:
            return f"layers.{i}.gate_up_proj.{kind}", gu_cols[proj]
        if proj in ("o_proj", "down_proj"):
            return f"layers.{i}.{proj}.{kind}", None
        return None, None
