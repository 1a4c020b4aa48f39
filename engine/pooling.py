"""Embeddings: how a model's pooled hidden state becomes the vector a client gets (vLLM's ``--runner pooling``).

Lifecycle: ``read_pooling_config`` reads a model directory once (the engine at start, the router for its checks):
the sentence-transformers files beside the checkpoint (``modules.json``, the Pooling module's ``config.json``,
a ``Normalize`` module) and config.json's Matryoshka fields. An embedding request goes through the engine like any
prompt (``LLMEngine.add_request(pooling=True)``: scheduled, chunked, prefix-cached, batched with generation); the
step that computes its last prompt token keeps that row's final (normed) hidden state, and the request ends there
with it (``CoreOutput.embedding``). ``finish_embedding`` then cuts it to the requested Matryoshka ``dimensions`` and
normalises it, where the answer is made (``LLM.embed``, the router).

Last-token pooling is what the decoder embedding models (Qwen3-Embedding, e5-mistral, gte-Qwen2, ...) use, and the
only pooling computed: a model whose sentence-transformers config asks for another (mean, CLS, ...) is refused by
name (``PoolingConfig.unsupported``), never served with the wrong pooling.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

POOLING_MODES = ("lasttoken",)
"""sentence-transformers' pooling modes the engine computes (``pooling_mode_lasttoken``)."""


@dataclass(frozen=True)
class PoolingConfig:
    """How a model's embeddings are made."""

    normalize: bool = True
    """L2-normalise by default (vLLM's default for embedding models; a sentence-transformers model without a
    Normalize module says False). A request may say otherwise."""
    matryoshka: bool = False
    """The model is trained so a prefix of its vector is an embedding too (config.json ``is_matryoshka`` or
    ``matryoshka_dimensions``): requests may ask for ``dimensions``."""
    matryoshka_dimensions: Optional[tuple[int, ...]] = None
    """The prefixes it was trained for, where config.json names them (then only those); None: any."""
    unsupported: Optional[str] = None
    """Why this model cannot serve embeddings (its pooling is one the engine does not compute); None: it can."""


def read_pooling_config(model_dir: Optional[Path], hf_config: Optional[dict] = None) -> PoolingConfig:
    """The pooling of the model in ``model_dir`` (None: a built-in model: last token, normalised). ``hf_config``:
    its config.json, where the caller has it read."""
    cfg = hf_config or {}
    if model_dir is not None and not cfg:
        try:
            cfg = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError):
            cfg = {}
    dims = cfg.get("matryoshka_dimensions")
    kw: dict[str, Any] = dict(matryoshka=bool(cfg.get("is_matryoshka") or dims),
                              matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None)
    modules = _read_json(model_dir, "modules.json") if model_dir is not None else None
    if not isinstance(modules, list):
        return PoolingConfig(**kw)
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pool = types.get("Pooling")
    if pool is not None:
        pc = _read_json(model_dir, f"{pool.get('path', '')}/config.json") or {}
        modes = sorted(k.removeprefix("pooling_mode_") for k, v in pc.items()
                       if k.startswith("pooling_mode_") and v is True)
        if modes and modes != ["lasttoken"]:
            kw["unsupported"] = (f"its sentence-transformers pooling is {' + '.join(modes)}; the engine computes "
                                 "last-token pooling only")
    return PoolingConfig(normalize="Normalize" in types, **kw)


def _read_json(model_dir: Path, name: str) -> Any:
    try:
        return json.loads((Path(model_dir) / name).read_text())
    except (OSError, ValueError):
        return None


def check_dimensions(pc: PoolingConfig, dimensions: Optional[int], hidden_size: int) -> None:
    """ValueError naming ``dimensions`` unless the model can give a vector that long (None: its whole vector)."""
    if dimensions is None:
        return
    if not isinstance(dimensions, int) or isinstance(dimensions, bool):
        raise ValueError(f"dimensions must be an integer, got {dimensions!r}")
    if not pc.matryoshka:
        raise ValueError("dimensions: this model is not a Matryoshka embedding model (config.json has neither "
                         "is_matryoshka nor matryoshka_dimensions), so its vectors cannot be shortened")
    if pc.matryoshka_dimensions is not None and dimensions not in pc.matryoshka_dimensions:
        raise ValueError(f"dimensions must be one of {list(pc.matryoshka_dimensions)}, got {dimensions}")
    if not 1 <= dimensions <= hidden_size:
        raise ValueError(f"dimensions must be in [1, {hidden_size}], got {dimensions}")


def finish_embedding(vec: Sequence[float], normalize: bool = True, dimensions: Optional[int] = None) -> list[float]:
    """The client's vector: the pooled state cut to ``dimensions`` (Matryoshka) and then L2-normalised (as vLLM and
    sentence-transformers: cut first, so the short vector has unit length)."""
    out = [float(x) for x in (vec.tolist() if hasattr(vec, "tolist") else vec)]
    if dimensions is not None:
        out = out[:dimensions]
    if normalize:
        norm = math.sqrt(math.fsum(x * x for x in out))
        out = [x / max(norm, 1e-12) for x in out]  # (torch's F.normalize eps)
    return out
