"""What ``benchmarks/cuda_engine.py`` runs on: the model shapes, the workload sizes (full and ``--quick``),
a random-weight Llama checkpoint in Hugging Face's layout, and seeded prompts.

Lifecycle: pure helpers; ``make_checkpoint`` writes a directory once per run (or reuses ``--ckpt``).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch


from engine.builtin import tokenizer_dir


VOCAB = 8192  # the built-in tokenizer's; prompts use ids 5..8191 (0-4 are its special tokens)

SHAPES = {
    # Llama-3.2-1B's decoder (vocab aside): 16 x (2048 hidden, 32 q / 8 kv heads of 64, SwiGLU 8192)
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, head_dim=64),
    # Llama-3.1-8B's decoder: 32 x (4096 hidden, 32 q / 8 kv heads of 128, SwiGLU 14336); issue 43's 8B goal
    # (<= 4.5 ms a decode step at batch 1-8): `--shape 8b --phases decode,graphs,prefill` (16 GB of bf16 weights)
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, head_dim=128),
    "small": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                  intermediate_size=4096, head_dim=64),
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, head_dim=64),
}


@dataclass(frozen=True)
class Workload:
    parity_lens: tuple = (8, 50, 300, 1000)
    parity_new: int = 48
    decode_batches: tuple = (1, 8, 32, 128)
    hf_decode_batches: tuple = (1, 8)
    decode_prompt: int = 128
    decode_new: int = 128
    prefill: tuple = ((1, 512), (1, 2048), (1, 8192), (8, 1024))
    repeats: int = 3
    max_pos: int = 16384
    mixed: tuple = ((32, 32), (32, 224), (8, 504))
    """(decodes, prompt tokens) of the graphs phase's mixed steps: each step decodes that many sequences and
    prefills one new prompt whole (32 + 224 = a 256-token step)."""
    mixed_steps: int = 24


FULL = Workload()
QUICK = Workload(parity_lens=(5, 19, 60), parity_new=32, decode_batches=(1, 4), hf_decode_batches=(1, 4),
                 decode_prompt=32, decode_new=16, prefill=((1, 64), (1, 256), (4, 64)), repeats=2, max_pos=2048,
                 mixed=((4, 20),), mixed_steps=3)


# -- the checkpoint ----------------------------------------------------------------------------------

def hf_config(shape: dict, max_pos: int, std: float) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": VOCAB, **shape, "max_position_embeddings": max_pos, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,  # the built-in tokenizer's
        "initializer_range": std, "torch_dtype": "bfloat16", "use_cache": True,
    }


def make_checkpoint(d: Path, shape: dict, max_pos: int = 16384, std: float = 0.02, seed: int = 0,
                    device: str = "cpu") -> Path:
    """A random Llama as a HF directory: config.json, bfloat16 model.safetensors, tokenizer files.

    Weights are drawn N(0, std) on ``device`` (fast on a GPU) and stored as bfloat16, so a float32 load
    of them is exact and both sides of every comparison hold the same numbers; norms are 1."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(shape, max_pos, std)
    h, inter, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    H, Hkv, D = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    shapes: dict[str, tuple] = {"model.embed_tokens.weight": (VOCAB, h)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (H * D, h), p + "self_attn.k_proj.weight": (Hkv * D, h),
                       p + "self_attn.v_proj.weight": (Hkv * D, h), p + "self_attn.o_proj.weight": (h, H * D),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
    shapes["lm_head.weight"] = (VOCAB, h)
    g = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, shp in shapes.items():
        state[name] = (torch.randn(shp, generator=g, device=device) * std).to(torch.bfloat16).cpu()
    for i in range(L):
        for n in ("input_layernorm", "post_attention_layernorm"):
            state[f"model.layers.{i}.{n}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    state["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in tokenizer_dir().iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    return d


def prompts_of(lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, VOCAB, (n,), generator=g).tolist() for n in lengths]
