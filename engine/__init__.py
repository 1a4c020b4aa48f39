"""pdserve's model runtime: models, paged KV cache, scheduler, sampler, tokenizer, offline API.

Lifecycle: importing ``engine`` is cheap (no torch, no model); the public names
below are loaded on first use. ``from engine import LLM, SamplingParams`` is the
offline API (``BeamSearchParams`` for ``LLM.beam_search``); the worker roles
build an ``LLMEngine`` from an ``EngineConfig``.
"""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# torch's CPU allocator advises transparent huge pages (madvise) for tensors of 2 MB and more when this variable is
# set at the process's first tensor allocation; importing ``engine`` sets it unless the user already did (``0``
# turns it off). Without it each large activation is fresh 4 KB pages: a 2048-token prompt on ``bench`` took ~90K
# page faults and ~10% more CPU time (docs/benchmarks/history.md, run V). Set after the first allocation it has no effect.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

_EXPORTS = {
    "LLM": "engine.llm",
    "SamplingParams": "engine.sampling_params",
    "bad_words_token_ids": "engine.sampling_params",
    "truncated_prompt": "engine.sampling_params",
    "StructuredOutputsParams": "engine.structured_outputs",
    "check_structured_outputs": "engine.structured_outputs",
    "BeamSearchParams": "engine.beam_search",
    "BeamSearchOutput": "engine.beam_search",
    "BeamSearchSequence": "engine.beam_search",
    "PromptBeamSearch": "engine.beam_search",
    "RequestOutput": "engine.outputs",
    "CoreOutput": "engine.outputs",
    "TokenLogprob": "engine.outputs",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.config",
    "Tokenizer": "engine.tokenizer",
    "OutputProcessor": "engine.detokenizer",
    "prefix_block_hashes": "engine.block_manager",
    "salted_root": "engine.block_manager",
    "lora_key_root": "engine.lora",
    "check_lora_name": "engine.lora",
    "KVEventBatch": "engine.kv_events",
    "BlockStored": "engine.kv_events",
    "BlockRemoved": "engine.kv_events",
    "AllBlocksCleared": "engine.kv_events",
    "KVSnapshot": "engine.kv_events",
    "decode_kv_batch": "engine.kv_events",
    "decode_kv_snapshot": "engine.kv_events",
    "kv_stream_key": "engine.kv_events",
    "kv_snapshot_key": "engine.kv_events",
    "KV_ENTRY_SEQ": "engine.kv_events",
    "KV_ENTRY_GEN": "engine.kv_events",
    "KV_ENTRY_BATCH": "engine.kv_events",
    "KV_ENTRY_LOAD": "engine.kv_events",
    "load_model_config": "engine.loader",
    "load_tokenizer": "engine.loader",
    "load_pooling_config": "engine.loader",
    "PoolingConfig": "engine.pooling",
    "check_dimensions": "engine.pooling",
    "finish_embedding": "engine.pooling",
    "EmbeddingRequestOutput": "engine.outputs",
    "ScoringRequestOutput": "engine.outputs",
    "cross_encoder_score": "engine.pooling",
    "classify_probs": "engine.pooling",
    "ClassificationRequestOutput": "engine.outputs",
    "default_eos": "engine.loader",
    "default_served_model_name": "engine.names",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, PromptBeamSearch
    from engine.block_manager import prefix_block_hashes, salted_root
    from engine.lora import check_lora_name, lora_key_root
    from engine.kv_events import (KV_ENTRY_BATCH, KV_ENTRY_GEN, KV_ENTRY_LOAD, KV_ENTRY_SEQ, AllBlocksCleared,
                                  BlockRemoved, BlockStored, KVEventBatch, KVSnapshot, decode_kv_batch,
                                  decode_kv_snapshot, kv_snapshot_key, kv_stream_key)
    from engine.config import EngineConfig
    from engine.names import default_served_model_name
    from engine.detokenizer import OutputProcessor
    from engine.loader import default_eos, load_model_config, load_tokenizer
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import CoreOutput, RequestOutput, TokenLogprob
    from engine.sampling_params import SamplingParams, bad_words_token_ids, truncated_prompt
    from engine.structured_outputs import StructuredOutputsParams, check_structured_outputs
    from engine.tokenizer import Tokenizer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
