"""Bidirectional encoders: BERT, RoBERTa and XLM-RoBERTa as embedding models and cross-encoder rerankers.

What RAG stacks serve beside their LLM: bge-*-en-v1.5, e5, all-MiniLM, gte, nomic-style BERTs and bge-m3 (XLM-R) for
embeddings; bge-reranker and the ms-marco cross-encoders (``...ForSequenceClassification``) to rerank. vLLM serves
them with ``--runner pooling``; here the same engine does, as pooling requests (engine/pooling.py).

Lifecycle: ``engine.loader.load_model`` builds an ``EncoderModel`` where config.json names an encoder
(``engine.config.ENCODER_ARCHITECTURES``) and fills it from the checkpoint by transformers' names (a
``bert.`` / ``roberta.`` prefix, as ``...ForSequenceClassification`` saves them, is dropped; an MLM head, a saved
``position_ids`` buffer and, for an embedding model, the pooler are skipped). ``LLMEngine`` then runs it for
pooling requests only: every prompt in one step, whole (the scheduler's ``whole_prompts``: attention is
bidirectional, so a prompt cannot be chunked and its states cannot be reused by another prompt: no prefix cache),
and the model's forward answers, for each prompt of the step, its pooled vector (``pooling_mode``: the CLS
token's state, the mean of every token's, or the last token's) or, for a cross-encoder, its classifier's logits,
in the row where a decoder answers its last token's hidden state. The engine's KV cache is allocated but never
written (an encoder keeps no K/V); its blocks only meter the tokens in flight.

Numerics follow transformers: post-LayerNorm blocks, exact (erf) GELU, softmax(QK^T / sqrt(d)) over the whole
prompt; positions from 0 (BERT) or from ``pad_token_id + 1`` (RoBERTa's rule, pad tokens inside a prompt
included); token types: BERT's pair encoding ``[CLS] a [SEP] b [SEP]`` gives type 1 to what follows the first
``[SEP]``, so the model derives them from ``sep_token_id`` (set by the engine from the tokenizer), which is what
the tokenizer would have given for a pair it built.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.attention import AttentionMetadata
from engine.config import ModelConfig

log = logging.getLogger(__name__)

class _SelfAttention(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)


class _DenseNorm(nn.Module):
    def __init__(self, n_in: int, n_out: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(n_in, n_out)
        self.LayerNorm = nn.LayerNorm(n_out, eps=eps)


class _Attention(nn.Module):
    def __init__(self, h: int, eps: float) -> None:
        super().__init__()
        self.self = _SelfAttention(h)
        self.output = _DenseNorm(h, h, eps)


class _Dense(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.dense = nn.Linear(n_in, n_out)


class EncoderLayer(nn.Module):
    """One post-LayerNorm transformer block, transformers' ``BertLayer`` names."""

    def __init__(self, mc: ModelConfig) -> None:
        super().__init__()
        h, eps = mc.hidden_size, mc.layer_norm_eps
        self.attention = _Attention(h, eps)
        self.intermediate = _Dense(h, mc.intermediate_size)
        self.output = _DenseNorm(mc.intermediate_size, h, eps)
        self.num_heads, self.head_dim = mc.num_attention_heads, mc.head_dim

    def forward(self, h: Tensor, spans: list[tuple[int, int]]) -> Tensor:
        T = h.shape[0]
        sa = self.attention.self
        q = sa.query(h).view(T, self.num_heads, self.head_dim).transpose(0, 1)
        k = sa.key(h).view(T, self.num_heads, self.head_dim).transpose(0, 1)
        v = sa.value(h).view(T, self.num_heads, self.head_dim).transpose(0, 1)
        ctx = torch.cat([F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b]) for a, b in spans], dim=1)
        ctx = ctx.transpose(0, 1).reshape(T, -1)
        out = self.attention.output
        h = out.LayerNorm(out.dense(ctx) + h)
        x = F.gelu(self.intermediate.dense(h))
        return self.output.LayerNorm(self.output.dense(x) + h)


class _Embeddings(nn.Module):
    def __init__(self, mc: ModelConfig) -> None:
        super().__init__()
        h = mc.hidden_size
        self.word_embeddings = nn.Embedding(mc.vocab_size, h)
        self.position_embeddings = nn.Embedding(mc.max_position_embeddings + mc.position_offset, h)
        self.token_type_embeddings = nn.Embedding(mc.type_vocab_size, h) if mc.type_vocab_size else None
        self.LayerNorm = nn.LayerNorm(h, eps=mc.layer_norm_eps)


class _Encoder(nn.Module):
    def __init__(self, mc: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(mc) for _ in range(mc.num_hidden_layers))


class _RobertaHead(nn.Module):
    """RoBERTa's classification head: dense -> tanh -> out_proj on the first token's state."""

    def __init__(self, h: int, n: int) -> None:
        super().__init__()
        self.dense = nn.Linear(h, h)
        self.out_proj = nn.Linear(h, n)


class EncoderModel(nn.Module):
    """An encoder with the interface ``ModelRunner`` drives (``forward`` over a step's flat batch,
    ``compute_logits``, ``embed_tokens``, ``layers``); see the module docstring."""

    def __init__(self, mc: ModelConfig) -> None:
        super().__init__()
        self.config = mc
        self.embeddings = _Embeddings(mc)
        self.encoder = _Encoder(mc)
        self.roberta = mc.architecture.startswith(("Roberta", "XLMRoberta"))
        self.pooler: Optional[_Dense] = None
        self.classifier: Optional[nn.Module] = None
        if mc.num_labels:
            if self.roberta:
                self.classifier = _RobertaHead(mc.hidden_size, mc.num_labels)
            else:
                self.pooler = _Dense(mc.hidden_size, mc.hidden_size)
                self.classifier = nn.Linear(mc.hidden_size, mc.num_labels)
        self.has_lm_head = False
        self.pooling_mode = "cls"
        """How a prompt's states become its embedding ('cls', 'mean' or 'lasttoken': ``PoolingConfig.mode``, which
        the engine sets it from); a classifier's head reads the first token's state whatever it is."""
        self.sep_token_id: Optional[int] = None
        """BERT's ``[SEP]`` (set by the engine from the tokenizer): tokens after the first one are token type 1."""

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    @property
    def layers(self) -> nn.ModuleList:
        return self.encoder.layer

    def finalize(self, *args: object, **kwargs: object) -> "EncoderModel":
        """(``CausalLM.finalize``'s place in ``load_model``: nothing to pack; quantization is refused earlier.)"""
        return self

    # -- the step ------------------------------------------------------------------------------

    def _positions_and_types(self, input_ids: Tensor, spans: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
        mc = self.config
        pos, types = [], []
        for a, b in spans:
            ids = input_ids[a:b]
            if self.roberta:  # transformers' create_position_ids_from_input_ids
                mask = (ids != mc.pad_token_id).long()
                pos.append(torch.cumsum(mask, 0) * mask + mc.pad_token_id)
            else:
                pos.append(torch.arange(b - a, device=ids.device))
            t = torch.zeros(b - a, dtype=torch.long, device=ids.device)
            if mc.type_vocab_size > 1 and self.sep_token_id is not None:
                seps = (ids == self.sep_token_id).nonzero()
                if len(seps):
                    t[int(seps[0]) + 1:] = 1
            types.append(t)
        return torch.cat(pos), torch.cat(types)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[Tensor, Tensor]],
                layer_hook: Optional[Callable[[int], None]] = None) -> Tensor:
        """A step of whole prompts -> [prompts, hidden or num_labels]: each prompt's answer in its sampling row's order
        (``meta.keep.rows``: each prompt's last row). ``positions`` and ``kv_caches`` are not read."""
        if meta.num_decode or any(p.num_computed for p in meta.prefills):
            raise RuntimeError("an encoder computes whole prompts only (a decode row or a partial prompt reached it)")
        spans = [(p.start, p.end) for p in meta.prefills]
        emb = self.embeddings
        pos, types = self._positions_and_types(input_ids, spans)
        h = emb.word_embeddings(input_ids) + emb.position_embeddings(pos)
        if emb.token_type_embeddings is not None:
            h = h + emb.token_type_embeddings(types)
        h = emb.LayerNorm(h)
        for i, layer in enumerate(self.encoder.layer):
            h = layer(h, spans)
            if layer_hook is not None:
                layer_hook(i)
        pooled = {b - 1: self._pool(h, a, b) for a, b in spans}
        rows = meta.keep.rows.tolist() if meta.keep is not None else [b - 1 for _a, b in spans]
        return torch.stack([pooled[r] for r in rows])

    def _pool(self, h: Tensor, a: int, b: int) -> Tensor:
        if self.classifier is not None:
            first = h[a]
            if self.roberta:
                return self.classifier.out_proj(torch.tanh(self.classifier.dense(first)))
            return self.classifier(torch.tanh(self.pooler.dense(first)))
        if self.pooling_mode == "mean":
            return h[a:b].float().mean(0)
        return h[a] if self.pooling_mode == "cls" else h[b - 1]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Zeros [N, vocab]: the one token the engine's step draws for a pooling request is thrown away."""
        return torch.zeros(hidden.shape[0], self.config.vocab_size, dtype=torch.float32, device=hidden.device)

    # -- weights -------------------------------------------------------------------------------

    _SKIPPED = ("cls.", "lm_head.", "embeddings.position_ids", "embeddings.token_type_ids")
    """An MLM head (BERT's ``cls.predictions``, RoBERTa's ``lm_head``) and buffers older transformers saved."""

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy transformers-named tensors in; ValueError naming a missing, unexpected or mis-shaped one."""
        params = dict(self.named_parameters())
        left = set(params)
        skipped = 0
        for name, tensor in weights:
            for prefix in ("bert.", "roberta.", "model."):
                if name.startswith(prefix):
                    name = name[len(prefix):]
                    break
            if name.startswith(self._SKIPPED) or (name.startswith("pooler.") and self.pooler is None):
                skipped += 1
                continue
            if name.endswith((".gamma", ".beta")):  # (the oldest BERT checkpoints' LayerNorm names)
                name = name.rpartition(".")[0] + (".weight" if name.endswith(".gamma") else ".bias")
            p = params.get(name)
            if p is None:
                raise ValueError(f"weights: unexpected tensor {name!r} for {self.config.architecture}")
            if tuple(p.shape) != tuple(tensor.shape):
                raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(tensor.to(dtype=p.dtype, device=p.device))
            left.discard(name)
        if left:
            missing = sorted(left)
            raise ValueError(f"weights: missing tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if skipped:
            log.info("encoder checkpoint: %d tensors not used (an MLM head, saved buffers or the pooler)", skipped)
