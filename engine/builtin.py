"""Built-in models that need no download: ``tiny`` and ``tiny-draft`` (trained), ``bench`` (random).

Lifecycle: ``engine.loader`` asks ``builtin_spec(name)`` for a spec when
``EngineConfig.model`` is a built-in name. ``tiny`` (the default model of tests and
``pdserve up``) and ``tiny-draft`` (its speculative-decoding draft) are small Llamas
trained on the Python standard library's sources by ``engine/assets/train_models.py``;
their config and float16 weights are committed under ``engine/assets/models/<name>/``
and loaded like any HF checkpoint. ``bench`` (the benchmark shape) is built from its
config dict and filled with deterministic seeded weights (same numbers on every
machine and in every process, which is what lets a prefill worker and a decode
worker agree). All share the byte-level BPE tokenizer committed in
``engine/assets/tokenizer``. ``save_builtin`` writes a built-in model as a normal
HF directory (config.json + float32 model.safetensors + tokenizer files), so
``transformers`` can load exactly the same weights (the benchmark does).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(frozen=True)
class BuiltinSpec:
    """A named, seeded Llama config."""

    name: str
    """Model name as given in EngineConfig.model."""
    hf_config: dict
    """config.json contents (LlamaForCausalLM)."""
    seed: int
    """Weight RNG seed."""
    init_std: float
    """Std of the normal weight init (large enough that greedy text does not collapse)."""
    checkpoint: Optional[Path] = None
    """Directory with the trained weights (model.safetensors); None = seeded random weights."""


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, max_pos: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": 8192, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads, "max_position_embeddings": max_pos, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": "float32",
    }


_MODELS = Path(__file__).parent / "assets" / "models"


def _trained(name: str) -> BuiltinSpec:
    d = _MODELS / name
    return BuiltinSpec(name, json.loads((d / "config.json").read_text()), seed=0, init_std=0.0, checkpoint=d)


_SPECS = {
    # ~9.4M parameters (tied embeddings), trained: see engine/assets/train_models.py and docs/benchmarks.md
    "tiny": _trained("tiny"),
    # ~1.4M parameters, trained the same way: the speculative-decoding draft of tiny
    "tiny-draft": _trained("tiny-draft"),
    # ~81M parameters: the benchmark model of the engine issue
    "bench": BuiltinSpec("bench", _llama(hidden=768, layers=12, heads=12, kv_heads=4, inter=2048, max_pos=4096),
                         seed=4321, init_std=0.02),
}

BUILTIN_NAMES = tuple(_SPECS)


def builtin_spec(name: str) -> BuiltinSpec:
    """The spec of a built-in model; ValueError for unknown names."""
    if name not in _SPECS:
        raise ValueError(f"model {name!r} is not a built-in model ({', '.join(_SPECS)}) nor a directory")
    return _SPECS[name]


def tokenizer_dir() -> Path:
    """The committed tokenizer shared by the built-in models."""
    return Path(__file__).parent / "assets" / "tokenizer"


def builtin_state_dict(name: str) -> dict[str, "torch.Tensor"]:
    """The built-in model's weights under HF names (float32, CPU)."""
    import torch  # here: the router reads the specs and must not load torch

    from engine.config import ModelConfig
    from engine.model import CausalLM

    spec = builtin_spec(name)
    if spec.checkpoint is not None:
        from safetensors.torch import load_file

        # stored float16; the engine computes in float32 from exactly these upcast values
        return {k: v.float() for k, v in load_file(str(spec.checkpoint / "model.safetensors")).items()}
    mc = ModelConfig.from_hf_dict(spec.hf_config, torch.float32)
    with torch.device("meta"):
        model = CausalLM(mc)
    model = model.to_empty(device="cpu")
    model.init_random(spec.seed, spec.init_std)
    return to_hf_state_dict(model)


def to_hf_state_dict(model: "torch.nn.Module") -> dict[str, "torch.Tensor"]:
    """Our fused, transposed weights back under HF tensor names and [out, in] shapes."""
    mc = model.config
    H, Hkv, D, I = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, mc.intermediate_size
    out = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if not mc.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.weight_t.t()
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        w = layer.qkv_proj.weight_t.t()
        b = layer.qkv_proj.bias
        for name, (lo, hi) in (("q_proj", (0, H * D)), ("k_proj", (H * D, (H + Hkv) * D)),
                               ("v_proj", ((H + Hkv) * D, (H + 2 * Hkv) * D))):
            out[p + f"self_attn.{name}.weight"] = w[lo:hi]
            if b is not None:
                out[p + f"self_attn.{name}.bias"] = b[lo:hi]
        out[p + "self_attn.o_proj.weight"] = layer.o_proj.weight_t.t()
        gu = layer.gate_up_proj.weight_t.t()
        out[p + "mlp.gate_proj.weight"] = gu[:I]
        out[p + "mlp.up_proj.weight"] = gu[I:]
        out[p + "mlp.down_proj.weight"] = layer.down_proj.weight_t.t()
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def save_builtin(name: str, path: Union[str, Path]) -> Path:
    """Write the built-in model as a HF directory (config, safetensors, tokenizer) and return it."""
    from safetensors.torch import save_file

    spec = builtin_spec(name)
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(spec.hf_config)
    tok = tokenizer_dir()
    if (tok / "tokenizer_config.json").is_file():
        tc = json.loads((tok / "tokenizer_config.json").read_text())
        vocab = json.loads((tok / "tokenizer.json").read_text())
        ids = {t["content"]: t["id"] for t in vocab.get("added_tokens", [])}
        for key in ("bos_token", "eos_token"):
            v = tc.get(key)
            v = v.get("content") if isinstance(v, dict) else v
            if v in ids:
                cfg[key + "_id"] = ids[v]
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(builtin_state_dict(name), str(d / "model.safetensors"), metadata={"format": "pt"})
    for f in tok.iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    return d
