"""Embeddings: how a model's pooled hidden state becomes the vector a client gets (vLLM's ``--runner pooling``).

Lifecycle: ``read_pooling_config`` reads a model directory once (the engine at start, the router for its checks):
the sentence-transformers files beside the checkpoint (``modules.json``, the Pooling module's ``config.json``,
a ``Normalize`` module) and config.json's Matryoshka fields and architecture. An embedding request goes through the
engine like any prompt (``LLMEngine.add_request(pooling=True)``: scheduled, chunked, prefix-cached, batched with
generation); the step that computes its last prompt token keeps that row's pooled state, and the request ends there
with it (``CoreOutput.embedding``). ``finish_embedding`` then cuts it to the requested Matryoshka ``dimensions`` and
normalises it, where the answer is made (``LLM.embed``, the router).

Pooling: a decoder (Qwen3-Embedding, e5-mistral, gte-Qwen2, ...) pools its last token, the only pooling computed
for one (its prompt may be chunked and prefix-cached; a decoder model whose sentence-transformers config asks for
mean or CLS pooling is refused by name, ``PoolingConfig.unsupported``). An encoder (engine/encoder.py: BERT,
RoBERTa, XLM-R) computes each prompt whole, so it pools as its config says: CLS, mean or last token (CLS where it
has no sentence-transformers files, as vLLM does for BERT). A sequence classifier (``...ForSequenceClassification``,
``num_labels``) answers its classifier's logits instead of an embedding: a one-label one is a cross-encoder, whose
score and rerank APIs read text pairs (``cross_encoder_score``); any classifier answers ``/classify``
(``classify_probs``); the embeddings API refuses them. A sentence-transformers pipeline with a module after pooling
that the engine does not compute (``Dense``: a projection) is refused, never served without it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

_ST_MODES = {"lasttoken": "lasttoken", "cls_token": "cls", "mean_tokens": "mean"}
"""sentence-transformers' pooling modes (``pooling_mode_<key>``) the engine computes, by the name it gives them."""


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
    mode: str = "lasttoken"
    """How a prompt's states become its vector: 'lasttoken', 'cls' or 'mean' (the last two: encoders only)."""
    num_labels: int = 0
    """A sequence classifier's outputs (1: a cross-encoder, which scores text pairs); it serves no embeddings. 0: an
    embedding model."""
    labels: tuple[str, ...] = ()
    """A classifier's label names, by output (config.json ``id2label``; ``LABEL_i`` where it has none)."""
    multi_label: bool = False
    """Its labels are independent (``problem_type: multi_label_classification``): a sigmoid each, not a softmax."""
    encoder: bool = False
    """The model is an encoder (engine/encoder.py): a text is cut by its tokenizer, keeping its first tokens and
    its special tokens, where a decoder's prompt keeps its last tokens."""


def read_pooling_config(model_dir: Optional[Path], hf_config: Optional[dict] = None) -> PoolingConfig:
    """The pooling of the model in ``model_dir`` (None: a built-in model: last token, normalised). ``hf_config``:
    its config.json, where the caller has it read."""
    from engine.config import ENCODER_ARCHITECTURES, classifier_labels

    cfg = hf_config or {}
    if model_dir is not None and not cfg:
        try:
            cfg = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError):
            cfg = {}
    archs = cfg.get("architectures") or [""]
    encoder = archs[0] in ENCODER_ARCHITECTURES
    dims = cfg.get("matryoshka_dimensions")
    kw: dict[str, Any] = dict(matryoshka=bool(cfg.get("is_matryoshka") or dims),
                              matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
                              mode="cls" if encoder else "lasttoken", encoder=encoder)
    if encoder and archs[0].endswith("ForSequenceClassification"):
        kw["labels"] = classifier_labels(cfg)
        kw["num_labels"] = len(kw["labels"])
        kw["multi_label"] = cfg.get("problem_type") == "multi_label_classification"
    modules = _read_json(model_dir, "modules.json") if model_dir is not None else None
    if not isinstance(modules, list):
        return PoolingConfig(**kw)
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pool = types.get("Pooling")
    if pool is not None:
        pc = _read_json(model_dir, f"{pool.get('path', '')}/config.json") or {}
        modes = sorted(k.removeprefix("pooling_mode_") for k, v in pc.items()
                       if k.startswith("pooling_mode_") and v is True)
        ours = [_ST_MODES.get(m) for m in modes]
        if len(modes) == 1 and ours[0] is not None and (encoder or ours[0] == "lasttoken"):
            kw["mode"] = ours[0]
        elif modes:
            kw["unsupported"] = (f"its sentence-transformers pooling is {' + '.join(modes)}; the engine computes "
                                 + ("CLS, mean or last-token pooling" if encoder else
                                    "last-token pooling only for a decoder"))
        if pc.get("include_prompt") is False:
            kw["unsupported"] = "its sentence-transformers pooling leaves the prompt out (include_prompt: false)"
    extra = sorted(set(types) - {"Transformer", "Pooling", "Normalize"})
    if extra and kw.get("unsupported") is None:
        kw["unsupported"] = (f"its sentence-transformers pipeline has {', '.join(extra)} module(s) the engine does "
                             "not compute")
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


def cross_encoder_score(logits: Sequence[float]) -> float:
    """A cross-encoder's score of a pair from its classifier's logits: the sigmoid of its one logit (what
    sentence-transformers' CrossEncoder and vLLM answer for a one-label model)."""
    x = float(logits[0])
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def classify_probs(logits: Sequence[float], multi_label: bool = False) -> list[float]:
    """A classifier's probabilities from its logits: a softmax over the labels, or (one label, or
    ``multi_label``) a sigmoid each (what vLLM's ``/classify`` and transformers' pipelines answer)."""
    xs = [float(x) for x in logits]
    if multi_label or len(xs) == 1:
        return [cross_encoder_score([x]) for x in xs]
    top = max(xs)
    exps = [math.exp(x - top) for x in xs]
    total = math.fsum(exps)
    return [e / total for e in exps]
