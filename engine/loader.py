"""Turn ``EngineConfig.model`` into a ready model, its config and its tokenizer.

Lifecycle: called once by ``LLMEngine.__init__``. A built-in name ('tiny',
'tiny-draft', 'bench') loads the committed trained weights or builds the seeded
model (``engine.builtin``); anything else must be a
local Hugging Face directory (never the network): ``config.json``, weights in
``model.safetensors`` or sharded with ``model.safetensors.index.json``, and
optionally ``tokenizer.json`` (+ ``tokenizer_config.json``). Weights are
streamed tensor by tensor from the safetensors files straight into the model,
which was allocated empty on the target device (no double copy, no random init
of tensors about to be overwritten). A directory without a tokenizer still
loads: the engine then takes token-id prompts only.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

from engine.builtin import BUILTIN_NAMES, builtin_spec, tokenizer_dir
from engine.config import EngineConfig, ModelConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from engine.model import CausalLM
    from engine.pooling import PoolingConfig

logger = logging.getLogger(__name__)


def load_model_config(cfg: EngineConfig) -> ModelConfig:
    """The ModelConfig of a built-in name or of a HF directory's config.json."""
    if cfg.model in BUILTIN_NAMES:
        return ModelConfig.from_hf_dict(builtin_spec(cfg.model).hf_config, cfg.dtype)
    d = _model_dir(cfg.model)
    try:
        raw = json.loads((d / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model: cannot read {d / 'config.json'}: {e}") from e
    try:
        return ModelConfig.from_hf_dict(raw, cfg.dtype)
    except KeyError as e:
        raise ValueError(f"model: config.json lacks required field {e.args[0]!r}") from e


def load_model(cfg: EngineConfig, mc: ModelConfig, max_positions: int) -> "CausalLM":
    """Allocate the model on cfg.device in cfg.dtype and fill its weights."""
    # imported here: reading a config or a tokenizer (the router's model view) must not load torch or the model stack
    import torch

    from engine.model import CausalLM

    device = torch.device(cfg.device)
    if mc.is_encoder:  # (engine/encoder.py; a HF directory's, never a built-in)
        from engine.encoder import EncoderModel

        with torch.device("meta"):
            enc = EncoderModel(mc)
        enc = enc.to_empty(device=device).to(cfg.torch_dtype)
        enc.load_weights(iter_checkpoint(cfg))
        return enc  # type: ignore[return-value]
    with torch.device("meta"):
        model = CausalLM(mc, max_positions=max_positions)
    model = model.to_empty(device=device).to(cfg.torch_dtype)
    if cfg.model not in BUILTIN_NAMES:
        group = fill_weights(model, cfg)
        if group is not None:
            return model.finalize(cfg.cpu_gemm, None, cfg.quantization_group_size, cfg.batch_invariant,
                                  prequantized_group=group)
    elif builtin_spec(cfg.model).checkpoint is not None:
        model.load_weights(iter_checkpoint(cfg))
    else:
        spec = builtin_spec(cfg.model)
        if device.type == "cpu" and cfg.torch_dtype == torch.float32:
            model.init_random(spec.seed, spec.init_std)
        else:
            # seeded on CPU in float32 then cast, so every device/dtype starts from the same numbers
            with torch.device("meta"):
                cpu = CausalLM(mc, max_positions=1)
            cpu = cpu.to_empty(device="cpu")
            cpu.init_random(spec.seed, spec.init_std)
            model.load_state_dict(cpu.state_dict())
    return model.finalize(cfg.cpu_gemm, cfg.quantization, cfg.quantization_group_size, cfg.batch_invariant)


def load_tokenizer(cfg: EngineConfig):
    """The model's Tokenizer, or None for a HF directory without tokenizer.json."""
    from engine.tokenizer import Tokenizer

    if cfg.model in BUILTIN_NAMES:
        return Tokenizer.from_dir(tokenizer_dir())
    d = _model_dir(cfg.model)
    if not (d / "tokenizer.json").is_file():
        logger.info("model %s has no tokenizer.json: token-id prompts only", d)
        return None
    return Tokenizer.from_dir(d)


def fill_weights(model: "CausalLM", cfg: EngineConfig) -> Optional[int]:
    """Stream a HF directory's checkpoint into ``model`` (a tensor-parallel rank's shard too); for a prequantized
    one (engine/prequantized.py) its layers' group scales come with them, and the group size to give
    ``CausalLM.finalize(prequantized_group=)`` is returned (0: per channel); None for a float checkpoint."""
    spec = load_prequantized(cfg)
    if spec is None:
        model.load_weights(iter_checkpoint(cfg))
        return None
    from engine.prequantized import Int4Reader

    reader = Int4Reader(spec)
    model.load_weights(reader.iter(iter_checkpoint(cfg)), int4_scales=reader.scales)
    return spec.group_size


def load_prequantized(cfg: EngineConfig):
    """The model's prequantized format (engine/prequantized.py ``Int4Spec``; None: float weights, or a built-in);
    ValueError for a quantized checkpoint the engine cannot load. Needs no torch beyond the import."""
    if cfg.model in BUILTIN_NAMES:
        return None
    from engine.prequantized import read_prequantized_dir

    return read_prequantized_dir(_model_dir(cfg.model))


def load_pooling_config(cfg: EngineConfig) -> "PoolingConfig":
    """How the model's embeddings are made (engine/pooling.py): from its sentence-transformers files and
    config.json; a built-in model's: last token, normalised. Needs no torch."""
    from engine.pooling import PoolingConfig, read_pooling_config

    if cfg.model in BUILTIN_NAMES:
        return PoolingConfig()
    return read_pooling_config(_model_dir(cfg.model))


def iter_checkpoint(cfg: EngineConfig) -> Iterator[tuple[str, "torch.Tensor"]]:
    """(HF name, tensor) of every weight of ``cfg.model``: a HF directory's or a trained built-in's safetensors,
    or a seeded built-in's weights drawn whole on CPU (what a tensor-parallel rank slices its shard from)."""
    if cfg.model in BUILTIN_NAMES:
        spec = builtin_spec(cfg.model)
        if spec.checkpoint is None:
            from engine.builtin import builtin_state_dict

            return iter(builtin_state_dict(cfg.model).items())
        return iter_safetensors(spec.checkpoint)
    return iter_safetensors(_model_dir(cfg.model))


def iter_safetensors(d: Path) -> Iterator[tuple[str, "torch.Tensor"]]:
    """(name, tensor) for every tensor of a HF dir's single or sharded safetensors checkpoint."""
    from safetensors import safe_open

    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"model: bad {index}: {e}") from e
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {d}")
    for name in files:
        path = d / name
        if not path.is_file():
            raise ValueError(f"model: shard {name} listed in the index is missing from {d}")
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _model_dir(model: str) -> Path:
    d = Path(model).expanduser()
    if not d.is_dir():
        raise ValueError(f"model {model!r} is not a built-in model ({', '.join(BUILTIN_NAMES)}) nor a directory")
    if not (d / "config.json").is_file():
        raise ValueError(f"model: directory {str(d)!r} has no config.json")
    return d


def default_eos(mc: ModelConfig, tokenizer: Optional[object]) -> Optional[int]:
    """EOS id: the tokenizer's, else the first of config.json's."""
    tid = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if tid is not None:
        return int(tid)
    return mc.eos_token_ids[0] if mc.eos_token_ids else None
