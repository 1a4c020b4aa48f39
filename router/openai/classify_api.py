"""vLLM's ``POST /classify`` (``/v1/classify``) for sequence classifiers, on the router's HTTP front end.

A classifier is an encoder with a classification head (engine/encoder.py: BERT / RoBERTa / XLM-R
``...ForSequenceClassification``: sentiment, toxicity, intent models). Lifecycle: the route parses the body into
``ClassifyRequest`` and calls ``serve`` under the request's id; ``serve`` validates and runs its inputs as one
embeddings request (``router.embeddings.prepare_job(classify=True)``: the model must be a classifier; texts or
token ids, cut to ``truncate_prompt_tokens`` at their end with the special tokens kept; the key's quota; then
``run_embed`` on the prefill or colocated pool, each input's answer its raw logits), and answers vLLM's shape: per
input its ``probs`` (``engine.classify_probs``: softmax over the labels, or a sigmoid each for a one-label or
multi-label model), ``num_classes`` and its best ``label`` (config.json ``id2label``). Refusals name the field.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Awaitable, Callable, Optional, Union

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr
from starlette.responses import JSONResponse

from engine import classify_probs
from router.embeddings import prepare_job
from router.openai.embeddings_api import embed, split_inputs


class ClassifyRequest(BaseModel):
    """vLLM's classification request."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    input: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    truncate_prompt_tokens: Optional[StrictInt] = None
    add_special_tokens: bool = True
    request_id: Optional[str] = None


async def serve(core: Any, body: ClassifyRequest, request_id: str, admit: Callable[[int], Any],
                blocking: Callable[..., Awaitable[Any]]) -> JSONResponse:
    """One classification request (see module docstring; ``admit`` and ``blocking`` as ``embeddings_api.serve``'s)."""
    texts, token_lists = split_inputs(body.input)
    got = await embed(core, admit, blocking, request_id, body.model, texts, token_lists,
                      prepare=functools.partial(prepare_job, classify=True,
                                                truncate_prompt_tokens=body.truncate_prompt_tokens,
                                                add_special_tokens=body.add_special_tokens))
    if isinstance(got, JSONResponse):
        return got
    pooling = core.limits.pooling
    data = []
    for i, g in enumerate(got):
        probs = classify_probs(g.embedding, pooling.multi_label)
        data.append({"index": i, "label": pooling.labels[probs.index(max(probs))], "probs": probs,
                     "num_classes": len(probs)})
    n = sum(g.num_prompt_tokens for g in got)
    return JSONResponse({"id": f"classify-{request_id}", "object": "list", "created": int(time.time()),
                         "model": body.model or core.limits.model_name, "data": data,
                         "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}})
