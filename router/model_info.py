"""The router's view of the model: its tokenizer and its limits, without loading weights.

Lifecycle: ``load_model_view(cfg)`` runs once in ``RouterServer.start()``; the
tokenizer and ``ModelLimits`` it returns are read-only for the router's life
(the tokenizer is thread-safe for encode/decode); ``within_workers_context`` derives the limits
``RouterCore.limits`` checks requests against once its workers publish a shorter context. It reads
``config.json`` and the tokenizer through the engine's public names, which load lazily: the model stack
(``engine.model``, attention, kernels, the engine loop) is never imported into a router
process (tests/router/test_model_info.py checks it in a fresh interpreter).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from router.config import RouterConfig
from router.validation import ModelLimits


def load_model_view(cfg: RouterConfig) -> tuple[Any, ModelLimits]:
    """(tokenizer or None, limits) of ``cfg.model``; ValueError naming ``model`` when it cannot be read."""
    from engine import EngineConfig, default_eos, load_model_config, load_pooling_config, load_tokenizer

    ecfg = EngineConfig(model=cfg.model)
    mc = load_model_config(ecfg)
    tok = load_tokenizer(ecfg)
    ctx = mc.max_position_embeddings
    if cfg.max_context_length is not None:
        ctx = min(ctx, cfg.max_context_length)
    eos = default_eos(mc, tok)
    max_bytes = None if tok is None else (ctx - 1) * tok.max_input_bytes_per_token()
    limits = ModelLimits(model_name=cfg.served_model_name, max_context_length=ctx, vocab_size=mc.vocab_size,
                         eos_token_id=-1 if eos is None else eos, max_new_tokens=cfg.max_new_tokens,
                         max_prompt_bytes=max_bytes, hidden_size=mc.hidden_size, pooling=load_pooling_config(ecfg))
    return tok, limits


def within_workers_context(limits: ModelLimits, workers_len: int) -> ModelLimits:
    """``limits`` with the context length ``workers_len`` (the shortest a live worker serves) where that is
    shorter; ``limits`` itself when it is not, or when it is unknown (0)."""
    if not 2 <= workers_len < limits.max_context_length:
        return limits
    max_bytes = limits.max_prompt_bytes
    if max_bytes is not None:  # (context - 1) prompt tokens, each at most the same bytes
        max_bytes = max_bytes // (limits.max_context_length - 1) * (workers_len - 1)
    return dataclasses.replace(limits, max_context_length=workers_len, max_prompt_bytes=max_bytes)
