"""Paged causal self-attention and rotary embeddings.

Lifecycle: once per engine step the model runner builds one ``AttentionMetadata``
(where each new token's K/V goes in the paged cache, the block tables and masks
of the decode batch, one ``PrefillSpan`` per prefill chunk); every layer then
calls ``paged_attention`` with it, which first writes the step's K/V into the
layer's cache and then reads K/V back through the block tables. The metadata is
dropped at the end of the step.

The flat batch holds the decode tokens first (one per sequence), then each
prefill chunk's tokens. On CPU, decode is one call of pdserve's paged kernel
(engine/csrc), which reads K/V in place through the block tables; on CUDA (float
cache, power-of-2 head_dim) it is one launch of pdserve's Triton kernel
(engine/triton_kernels.py), which also reads K/V in place through the block
tables and is CUDA-graph compatible; elsewhere (or without the kernels) it
attends over a padded [B, Hkv, L, D] gather of the cache with a length mask (one
SDPA call for the whole batch, the query heads of a KV group folded into the
query-length axis so GQA needs no K/V copies), which also stays the kernels'
fallback and their test reference. An int8
cache (``kv_cache_dtype="int8"``) is written quantized and read dequantized; an fp8 one
(``"fp8"``: float8 e4m3, scale 1) is written saturated and read widened, through the gather + SDPA paths. A
prefill chunk with no earlier context attends to its own fresh K/V: on CPU at
float32 through pdserve's flash-style prefill kernel (engine/csrc
``prefill_attention``, GQA without copies), elsewhere SDPA with ``is_causal``. A
later chunk (chunked prefill, a prefix-cache hit, re-prefill after preemption)
attends over its whole context: on CPU at float32 the same kernel reads the
cached K/V through the block table (``prefill_attention_paged``, any cache
dtype); on CUDA (float cache, power-of-2 head_dim) pdserve's Triton flash kernel
(``paged_prefill_attention``) reads it through the block table the same way, as it
does a first chunk whose sliding window is shorter than it; elsewhere it gathers
the cached K/V and uses SDPA with an explicit mask.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.kernels import cpu_kernels
from engine.quant import dequantize_kv, quantize_kv


@dataclass
class PrefillSpan:
    """One prefill chunk in the flat batch."""

    start: int
    """First row of the chunk in the flat token batch."""
    end: int
    """One past its last row."""
    num_computed: int
    """Tokens of this sequence already in the cache before the chunk (its first position)."""
    block_table: Tensor
    """Block ids (int64) covering num_computed + chunk length tokens."""
    masks: dict = field(default_factory=dict)
    """window -> bool mask [n, ctx] (True = attend), filled lazily and shared by all layers."""

    @property
    def ctx_len(self) -> int:
        return self.num_computed + self.end - self.start


@dataclass
class AttentionMetadata:
    """Per-step description of where K/V are written and read."""

    slot_mapping: Tensor
    """[T] int64 flat slot (block * block_size + offset) for each token's K/V."""
    num_decode: int
    """The first num_decode rows are single-token decodes."""
    decode_block_tables: Optional[Tensor] = None
    """[B, max_blocks] int64, padded with block 0 (masked out)."""
    decode_ctx_lens: Optional[Tensor] = None
    """[B] int64 context length including the new token."""
    prefills: list = field(default_factory=list)
    """PrefillSpan per prefill chunk, in batch order."""
    decode_masks: dict = field(default_factory=dict)
    """window -> bool mask [B, 1, 1, L], filled lazily and shared by all layers."""
    block_size: int = 16
    """Tokens per block (to size the padded decode gather)."""
    rows: Optional[Tensor] = None
    """For a ``keep`` view: [B] int64 rows of the flat batch whose queries it describes."""
    keep: Optional["AttentionMetadata"] = None
    """Rows that need hidden states after the last layer (the sampling rows), described as
    single-query decodes over their whole context; None when every row is needed."""
    lora: Optional[Any] = None
    """``engine.lora.StepLoRA``: these rows' LoRA adapters (a keep view: its rows'); None where every row is the
    base model's."""

    def decode_mask(self, window: Optional[int]) -> Tensor:
        m = self.decode_masks.get(window)
        if m is None:
            L = self.decode_block_tables.shape[1] * self.block_size
            idx = torch.arange(L, device=self.slot_mapping.device)
            ctx = self.decode_ctx_lens[:, None]
            m = idx[None, :] < ctx
            if window is not None:
                # the new token sits at ctx-1; HF keeps keys with q - k < window
                m &= idx[None, :] > ctx - 1 - window
            m = m[:, None, None, :]
            self.decode_masks[window] = m
        return m


def prefill_mask(span: PrefillSpan, window: Optional[int], device: torch.device) -> Tensor:
    """Bool [n, ctx] mask: query at position p sees keys k <= p (and p - k < window)."""
    m = span.masks.get(window)
    if m is None:
        ctx = span.ctx_len
        q_pos = torch.arange(span.num_computed, ctx, device=device)[:, None]
        k_pos = torch.arange(ctx, device=device)[None, :]
        m = k_pos <= q_pos
        if window is not None:
            m &= k_pos > q_pos - window
        span.masks[window] = m
    return m


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE (HF layout). x [T, heads, D]; cos/sin [T, 1, D/2] in x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Scatter this step's K/V [T, Hkv, D] into the layer's paged cache [N, bs, Hkv, D] (an int8 cache,
    [N, bs, Hkv, D + 4], gets the rows quantized with their scales: engine/quant.py)."""
    n, bs, hkv, d = k_cache.shape
    if k_cache.dtype == torch.int8:
        k, v = quantize_kv(k), quantize_kv(v)
    elif k_cache.dtype == FP8:  # saturated, then written as bytes (torch has no float8 index_copy_ on CPU)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        k, v = to_fp8(k).view(torch.uint8), to_fp8(v).view(torch.uint8)
    k_cache.view(n * bs, hkv, d).index_copy_(0, slot_mapping, k)
    v_cache.view(n * bs, hkv, d).index_copy_(0, slot_mapping, v)


FP8 = torch.float8_e4m3fn
"""The fp8 KV cache's element type (``kv_cache_dtype="fp8"``)."""
_FP8_MAX = float(torch.finfo(FP8).max)


def to_fp8(x: Tensor) -> Tensor:
    """K or V rows as float8 e4m3 with vLLM's default scale of 1, saturated at +-448 (torch's CPU cast saturates
    too; the clamp makes it so whatever a device's cast does with values past the range)."""
    return x.clamp(-_FP8_MAX, _FP8_MAX).to(FP8)


def paged_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                    meta: AttentionMetadata, window: Optional[int], invariant: bool = False,
                    out: Optional[Tensor] = None, kv_written: bool = False) -> Tensor:
    """Write k/v into the cache, then attend. q [T, H, D], k/v [T, Hkv, D] -> [T, H*D]. ``invariant``
    (``EngineConfig.batch_invariant``): every prefill chunk, a first one too, through the Triton paged kernel with
    its one tile shape, so a prompt's rows get the same bits however it was chunked and batched. ``out`` [T, H, D]
    (contiguous: the piecewise graphs' buffer): the result goes there, the Triton kernels writing it in place, and
    the return value is its [T, H*D] view. ``kv_written``: k/v are in the cache already (written by a piece)."""
    if not kv_written:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    T, H, D = q.shape
    hkv = k.shape[1]
    group = H // hkv
    B = meta.num_decode
    if B == T and out is None:
        return decode_attention(q, k_cache, v_cache, meta, window).reshape(T, H * D)
    o = q.new_empty(T, H, D) if out is None else out
    if B:
        ob = o[:B]
        r = decode_attention(q[:B], k_cache, v_cache, meta, window, out=ob)
        if r is not ob:
            ob.copy_(r)
    for span in meta.prefills:
        oc = o[span.start:span.end]
        r = _prefill(q, k, v, k_cache, v_cache, span, window, group, invariant, out=oc)
        if r is not oc:
            oc.copy_(r)
    return o.view(T, H * D)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                     window: Optional[int], out: Optional[Tensor] = None) -> Tensor:
    """One query per sequence over its cached context: q [B, H, D] -> [B, H, D].

    On CPU with pdserve's kernels built (engine/kernels.py) this is one C++ call that reads K/V in
    place through the block table; on CUDA with Triton one kernel launch that does the same (no host
    sync, so it can be captured in a CUDA graph); elsewhere it gathers the context and runs SDPA. ``out``: where the
    Triton kernel writes its result (then returned); the other paths return a new tensor, which the caller copies."""
    if q.device.type == "cpu" and q.shape[-1] % 16 == 0 and k_cache.dtype in _KERNEL_CACHE_DTYPES:
        k = cpu_kernels()
        if k is not None:
            out = k.paged_decode_attention(q.float().contiguous(), k_cache, v_cache, meta.decode_block_tables,
                                           meta.decode_ctx_lens, window or 0, q.shape[-1] ** -0.5)
            return out.to(q.dtype)
    D = q.shape[-1]
    if q.device.type in TRITON_DEVICE_TYPES and q.dtype in _TRITON_DTYPES and k_cache.dtype in (q.dtype, FP8) \
            and D & (D - 1) == 0 and 16 <= D <= 256:
        tk = _triton_kernels(q.device)
        if tk is not None:
            return tk.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_ctx_lens,
                                             window, D ** -0.5, out=out)
    return gather_decode_attention(q, k_cache, v_cache, meta, window)


def _triton_kernels(device: torch.device) -> Optional[ModuleType]:
    """engine/triton_kernels.py when it can run on ``device``, else None. Imported here, on CUDA only, so a
    CPU-only process never imports triton."""
    from engine import triton_kernels
    return triton_kernels if triton_kernels.available(device) else None


_KERNEL_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
TRITON_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
"""Device types whose steps run pdserve's Triton kernels (the decode and prefill attention here, and
layer_ops.TritonOps's norm, RoPE and silu * mul, which ``CausalLM.finalize`` installs there). Serving: CUDA only.
tests/engine/test_triton_kernels.py adds "cpu" (with Triton's interpreter on and the CPU kernels off) to run the GPU
path's composition, static decode buffers included, on CPU."""
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def gather_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                            window: Optional[int]) -> Tensor:
    """``decode_attention`` by gather + SDPA: the reference the kernel is tested against."""
    B, H, D = q.shape
    hkv = k_cache.shape[2]
    group = H // hkv
    bt = meta.decode_block_tables
    # [B, nb, bs, Hkv, D] -> [B, Hkv, L, D]; the gather is one copy of the live context
    # (index_select on the flattened table is ~5x faster than advanced indexing here)
    flat = bt.view(-1)
    kd = _rows(k_cache.index_select(0, flat), q.dtype).view(B, -1, hkv, D).transpose(1, 2)
    vd = _rows(v_cache.index_select(0, flat), q.dtype).view(B, -1, hkv, D).transpose(1, 2)
    # fold the query heads sharing a KV head into the query axis: [B, Hkv, G, D]
    qd = q.reshape(B, hkv, group, D)
    o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask(window))
    return o.reshape(B, H, D)


def _rows(gathered: Tensor, dtype: torch.dtype) -> Tensor:
    """Gathered cache rows as values: int8 rows are dequantized, fp8 ones widened, float rows pass through."""
    if gathered.dtype == torch.int8:
        return dequantize_kv(gathered, dtype)
    return gathered.to(dtype) if gathered.dtype == FP8 else gathered


def _prefill(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, span: PrefillSpan,
             window: Optional[int], group: int, invariant: bool = False, out: Optional[Tensor] = None) -> Tensor:
    s, e = span.start, span.end
    n = e - s
    D = q.shape[-1]
    if (q.device.type == "cpu" and q.dtype == torch.float32 and D % 16 == 0 and D <= 256
            and (span.num_computed == 0 or k_cache.dtype != FP8)):  # (the kernel reads float and int8 caches)
        kern = cpu_kernels()
        if kern is not None:  # pdserve's flash-style kernel (engine/csrc), GQA in place, q read as a strided view
            if span.num_computed == 0:  # a prompt over itself: k / v as views of the qkv projection (no copies)
                return kern.prefill_attention(q[s:e], k[s:e], v[s:e], window or 0, D ** -0.5)
            # a later chunk or a prefix-cache hit: the context's K/V (this chunk's written above) read through
            # the block table, dequantized per row, instead of gathered whole and handed to SDPA with a mask
            return kern.prefill_attention_paged(q[s:e], k_cache, v_cache, span.block_table, span.ctx_len,
                                                window or 0, D ** -0.5)
    if q.device.type in TRITON_DEVICE_TYPES and (invariant or not (span.num_computed == 0
                                                                  and (window is None or window >= n))) \
            and q.dtype in _TRITON_DTYPES and k_cache.dtype == q.dtype and D & (D - 1) == 0 and 16 <= D <= 256:
        # where SDPA below would need the explicit [n, ctx] mask (a later chunk, or a window shorter than the
        # chunk), and every chunk where batch-invariant: pdserve's Triton flash kernel reads the context through
        # the block table, GQA in place
        tk = _triton_kernels(q.device)
        if tk is not None:
            return tk.paged_prefill_attention(q[s:e], k_cache, v_cache, span.block_table, span.num_computed, window,
                                              D ** -0.5, invariant=invariant, out=out)
    qs = q[s:e].transpose(0, 1)  # [H, n, D]
    hkv, D = k.shape[1], k.shape[2]
    if span.num_computed == 0:
        ks, vs = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
    else:
        ctx = span.ctx_len
        ks = _rows(k_cache.index_select(0, span.block_table), q.dtype).view(-1, hkv, D)[:ctx].transpose(0, 1)
        vs = _rows(v_cache.index_select(0, span.block_table), q.dtype).view(-1, hkv, D)[:ctx].transpose(0, 1)
    if group > 1:
        ks = ks.repeat_interleave(group, dim=0)
        vs = vs.repeat_interleave(group, dim=0)
    # 4-D [1, H, n, D]: torch's CPU flash kernel only takes batched inputs (3-D falls back to the
    # math kernel, which materialises the n x n scores: ~2x slower on a 2048-token prompt)
    qs, ks, vs = qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0)
    if span.num_computed == 0 and (window is None or window >= n):
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    else:
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=prefill_mask(span, window, q.device))
    return o[0].transpose(0, 1)
