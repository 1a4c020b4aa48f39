"""Shared helpers for the engine-core tests: small HF checkpoints and greedy runs.

Checkpoints are random-initialised ``transformers`` models (initializer_range 0.1
so greedy continuations do not collapse onto one token) saved with
``save_pretrained`` to tmp dirs; transformers itself is the reference.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

VOCAB = 512


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny matmuls: a second OpenMP thread only adds barrier waits on a shared 2-core box
    torch.set_num_threads(1)
    yield


def hf_config(arch: str, **over):
    """A small transformers config of the given architecture (GQA 4 heads / 2 KV heads)."""
    import transformers

    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                initializer_range=0.1, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    base.update(over)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "phi3": transformers.Phi3Config, "qwen3_moe": transformers.Qwen3MoeConfig,
           "mixtral": transformers.MixtralConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "granite": transformers.GraniteConfig, "gemma3": transformers.Gemma3TextConfig}[arch]
    if arch == "gemma3":
        base["pad_token_id"] = 0
    if arch == "phi3":
        base["pad_token_id"] = 0  # (Phi-3's default pad id is past this vocabulary)
    return cls(**base)


def make_checkpoint(tmp: Path, arch: str, seed: int = 0, max_shard_size: Optional[str] = None, **over):
    """Random HF model saved to tmp (safetensors); returns (dir, the float32 transformers model)."""
    import transformers

    cfg = hf_config(arch, **over)
    cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
           "phi3": transformers.Phi3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
           "mixtral": transformers.MixtralForCausalLM, "qwen2_moe": transformers.Qwen2MoeForCausalLM,
           "granite": transformers.GraniteForCausalLM, "gemma3": transformers.Gemma3ForCausalLM}[arch]
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    if arch in ("qwen3", "qwen3_moe"):  # HF initialises the q/k norms at 1; other weights make their loading observable
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.normal_(1.0, 0.3)
    if arch == "gemma3":  # HF initialises Gemma's (1 + weight) norms at 0: random ones make each norm observable,
        # and scales near 2 keep a tied model's greedy continuations from repeating its input token
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(1.0, 0.3)
    if arch in ("qwen3_moe", "mixtral", "qwen2_moe"):  # a router at zero ties every expert: spread it
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("gate.weight"):
                    p.normal_(0.0, 1.0)
    if getattr(cfg, "attention_bias", False) or arch in ("qwen2", "qwen2_moe"):
        # HF zero-initialises biases; random ones make the bias path observable
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_proj.bias"):
                    p.normal_(0, 0.1)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(tmp, **kw)
    return tmp, model


def make_engine(path, **over) -> LLMEngine:
    kw = dict(model=str(path), dtype="float32", num_kv_blocks=256, block_size=4)
    kw.update(over)
    return LLMEngine(EngineConfig(**kw))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_engine(eng: LLMEngine, prompts: dict, params: SamplingParams, max_steps: int = 10_000) -> dict:
    """Add all prompts, step to completion; returns id -> generated token ids."""
    for rid, p in prompts.items():
        eng.add_request(rid, p, params)
    out = {rid: [] for rid in prompts}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
    else:
        raise AssertionError("engine did not finish")
    return out


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation (KV cache on, no EOS stop)."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def prompts_of(lengths, seed: int = 1, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def outputs_of(llm, prompts, params) -> list:
    """Per prompt: tokens, finish reason and (token, logprob) pairs; compare results with ``same_outputs``."""
    return [(o.token_ids, o.finish_reason, [(lp.token_id, lp.logprob) for lp in (o.logprobs or [])])
            for o in llm.generate(prompts, params)]


def same_outputs(a, b) -> bool:
    """Identical tokens and finish reasons; logprobs within 1e-4 (a verification computes them in a
    differently shaped batch than plain decoding, so the last float bits may differ)."""
    return len(a) == len(b) and all(
        x[:2] == y[:2] and [t for t, _ in x[2]] == [t for t, _ in y[2]]
        and all(abs(p - q) < 1e-4 for (_, p), (_, q) in zip(x[2], y[2])) for x, y in zip(a, b))
