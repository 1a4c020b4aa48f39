"""Steps with a prefill chunk replayed piecewise from CUDA graphs: everything but attention (vLLM's piecewise mode).

Lifecycle: ``LLMEngine`` builds one ``PiecewiseGraphs`` beside its ``DecodeGraphs`` (the same conditions: CUDA, one
rank, ``enforce_eager`` off and the decode graphs' ``eager_reason`` None; or ``static_decode_buffers`` on any
device, without capture) when ``cuda_graph_token_sizes`` is not empty, after the KV cache exists and before the
first request. ``capture`` records, for every token-count bucket, one graph per decoder layer over static buffers
(token ids, positions, slot mapping, the rope rows, the residual stream, the q/k/v projection and the attention
output): piece 0 is the embedding, the rope rows and layer 0 up to attention; piece i is layer i - 1 after
attention (o_proj, the residuals, the MLP) and layer i up to attention; each piece ends by writing its layer's
K/V into the cache through the slot mapping. Every step the decode graphs do not take (a prefill chunk, a row
that does not sample, more rows than the largest decode bucket) that holds at most the
largest bucket's tokens is then ``run``: its ids, positions and slots are copied into the buffers, and per layer
the bucket's piece is replayed and attention runs eagerly on the step's real rows, with the metadata the runner
built for them (its kernels take the step's spans and lengths, which a graph would freeze: vLLM splits its graphs
at attention for the same reason), the Triton kernels writing into the buffer the next piece reads (one launch for
the decode rows and one a prefill chunk: nothing else of a layer runs eagerly). The last layer's
attention and what follows it (only for the rows that sample, as ``CausalLM.forward`` does) and the final norm run
eagerly too. Steps past the largest bucket run eagerly: there the GPU's work per launch hides the launches.

Padding rows (a step of 70 tokens runs the 96-token bucket) hold whatever ids and positions an earlier step left
in the buffers (valid values) and the slot of the scratch block (the decode graphs' block past the block
manager's pool, which no sequence owns): the pieces compute them and write their K/V there, attention never sees
them, and every op of a piece works row by row, so they change no real row and no request's KV. Nothing is
captured again: buffers and graphs live as long as the engine. Without capture (``static_decode_buffers``: the CPU tests) ``run``
calls each piece on the same buffers, the ops a captured graph replays.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from engine.attention import AttentionMetadata, write_kv
from engine.config import ModelConfig
from engine.cuda_graphs import GraphBuckets
from engine.model import CausalLM


def piecewise_memory_estimate(mc: ModelConfig, max_bucket: int, dtype: torch.dtype) -> int:
    """Bytes the piecewise graphs are expected to hold (taken out of ``kv_cache_memory_bytes`` with the decode
    graphs' before the cache is sized): the pool keeps one piece's peak temporaries at the largest bucket (the
    residual rows, the q/k/v projection, the MLP's gate/up and product rows), doubled for the caching allocator's
    rounding, plus the static buffers. The capture logs what it really took."""
    elem = torch.empty((), dtype=dtype).element_size()
    qkv = (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim
    per_row = (3 * mc.intermediate_size + 2 * qkv + 6 * mc.hidden_size) * elem
    buffers = max_bucket * ((mc.hidden_size + qkv + mc.num_attention_heads * mc.head_dim + mc.head_dim) * elem + 16)
    return 2 * max_bucket * per_row + buffers


class PiecewiseGraphs(GraphBuckets):
    """Static buffers for steps of up to ``sizes[-1]`` tokens, and (``capture``) per bucket one graph a layer."""

    def __init__(self, model: CausalLM, kv_caches: list[tuple[Tensor, Tensor]], sizes: Sequence[int],
                 block_size: int, scratch_block: int, capture: bool) -> None:
        w = model.embed_tokens.weight
        super().__init__(sizes, capture, w.device)
        self.model = model
        self.kv_caches = kv_caches
        self.scratch_slot = scratch_block * block_size
        dtype = w.dtype
        layer = model.layers[0]
        self.heads = (layer.num_heads, layer.num_kv_heads, layer.head_dim)
        H, Hkv, D = self.heads
        n, dev = self.sizes[-1], self.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev)
        self._live = 0
        """Rows of ``slot_mapping`` that may hold a real slot (from the last step); the rest hold the scratch slot."""
        rot = model.rope_cos.shape[-1]
        self.cos = torch.zeros(n, 1, rot, dtype=model.rope_cos.dtype, device=dev)
        self.sin = torch.zeros(n, 1, rot, dtype=model.rope_sin.dtype, device=dev)
        local = model.rope_local_cos is not None
        self.local_cos = torch.zeros_like(self.cos) if local else None
        self.local_sin = torch.zeros_like(self.sin) if local else None
        """The rows of the local layers' table (Gemma 3), where the model has one."""
        self.hidden = torch.zeros(n, model.config.hidden_size, dtype=dtype, device=dev)
        """The residual stream: each piece reads it and writes the next layer's."""
        self.qkv = torch.zeros(n, H + 2 * Hkv, D, dtype=dtype, device=dev)
        """The layer's q and k (rotated) and v, written by a piece, read by the eager attention."""
        self.attn = torch.zeros(n, H * D, dtype=dtype, device=dev)
        """The attention output of the step's real rows, written eagerly (in place by the Triton kernels), read by
        the next piece."""
        self.graphs: dict[int, list["torch.cuda.CUDAGraph"]] = {}

    def _piece(self, i: int, n: int) -> None:
        """Piece ``i`` over the first ``n`` rows of the buffers: layer i - 1 after attention (i = 0: the embedding
        and the rope rows), then layer i up to attention, its q/k/v left in ``qkv`` and its K/V written into the
        layer's cache (padding rows' into the scratch slot)."""
        m = self.model
        H, Hkv, _ = self.heads
        with torch.inference_mode():
            if i == 0:
                pos = self.positions[:n]
                self.cos[:n].copy_(m.rope_cos[pos].unsqueeze(1))
                self.sin[:n].copy_(m.rope_sin[pos].unsqueeze(1))
                if self.local_cos is not None:
                    self.local_cos[:n].copy_(m.rope_local_cos[pos].unsqueeze(1))
                    self.local_sin[:n].copy_(m.rope_local_sin[pos].unsqueeze(1))
                h = m.embed_tokens(self.input_ids[:n])
            else:
                h = m.layers[i - 1].post_attention(self.hidden[:n], self.attn[:n])
            self.hidden[:n].copy_(h)
            cos, sin = (self.local_cos, self.local_sin) if m.layers[i].local_rope else (self.cos, self.sin)
            q, k, v = m.layers[i].pre_attention(h, cos[:n], sin[:n])
            self.qkv[:n, :H].copy_(q)
            self.qkv[:n, H:H + Hkv].copy_(k)
            self.qkv[:n, H + Hkv:].copy_(v)
            write_kv(*self.kv_caches[i], k, v, self.slot_mapping[:n])

    def capture(self) -> None:
        """Record every bucket's pieces (``GraphBuckets._capture``) in one memory pool: a piece's outputs go to the
        static buffers and the cache, so the pool holds only temporaries, which every piece may reuse. Uncaptured,
        run each piece once."""
        self._capture(self._pieces, self._record)

    def _pieces(self, n: int) -> None:
        for i in range(len(self.model.layers)):
            self._piece(i, n)

    def _record(self, n: int, pool: Any) -> None:
        pieces = []
        for i in range(len(self.model.layers)):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._piece(i, n)
            pieces.append(g)
        self.graphs[n] = pieces

    def run(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata,
            layer_hook: Optional[Callable[[int], None]] = None) -> Tensor:
        """``CausalLM.forward`` of one step of at most ``max_size`` tokens: the final-normed hidden states of every
        row, or of ``meta.keep``'s rows where set. The pieces run padded to the step's bucket; attention and the
        last layer's rest run eagerly on the real rows. ``layer_hook(i)`` is called once layer i's K/V are written
        and its attention ran (as ``CausalLM.forward`` calls it after each layer): a worker's hook that times or
        ships a prompt's layers does not keep its step off the pieces."""
        T = input_ids.shape[0]
        n = self.bucket_for(T)
        if n is None or T == 0:
            raise ValueError(f"a piecewise step holds 1..{self.max_size} tokens, got {T}")
        self.input_ids[:T].copy_(input_ids)
        self.positions[:T].copy_(positions)
        self.slot_mapping[:T].copy_(meta.slot_mapping)
        if self._live > T:  # rows the last step wrote real slots into are padding now: back to the scratch slot
            self.slot_mapping[T:self._live].fill_(self.scratch_slot)
        self._live = T
        self.replays += 1
        H, Hkv, D = self.heads
        layers = self.model.layers
        last = len(layers) - 1
        q, k, v = self.qkv[:T, :H], self.qkv[:T, H:H + Hkv], self.qkv[:T, H + Hkv:]
        out = self.attn[:T].view(T, H, D)
        with torch.inference_mode():
            for i, layer in enumerate(layers):
                if self.capture_graphs:
                    self.graphs[n][i].replay()
                else:
                    self._piece(i, n)
                if i < last:
                    layer.attend(self.hidden[:T], q, k, v, meta, self.kv_caches[i], out=out, kv_written=True)
                    if layer_hook is not None:
                        layer_hook(i)
                    continue
                h, attn = layer.attend(self.hidden[:T], q, k, v, meta, self.kv_caches[i], meta.keep,
                                       kv_written=True)
                if attn is not None:
                    h = layer.post_attention(h, attn)
                if layer_hook is not None:
                    layer_hook(i)
                return self.model.norm(h)
        raise AssertionError("unreachable: a model has at least one layer")

    def describe(self) -> str:
        return (f"{len(self.sizes)} piecewise token buckets ({self.sizes[0]}..{self.max_size} tokens, "
                f"{len(self.model.layers)} pieces each) "
                f"{'captured' if self.capture_graphs else 'static, not captured'} in {self.capture_seconds:.2f} s"
                + (f", {self.memory_bytes / 2**20:.0f} MiB" if self.capture_graphs else ""))
