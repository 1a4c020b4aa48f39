"""vLLM's ``POST /v1/score`` (``/score``) and the Jina/Cohere-style ``POST /v1/rerank`` (``/rerank``, ``/v2/rerank``)
for cross-encoders and embedding models, on the router's HTTP front end.

As vLLM scores: with a cross-encoder (engine/encoder.py: bge-reranker, ms-marco cross-encoders) each pair is one
input through the tokenizer's pair template and its score the sigmoid of the classifier's logit
(``router.embeddings.prepare_pair_job``, ``engine.cross_encoder_score``); with an embedding model it is the cosine
similarity of its two texts' embeddings (engine/pooling.py's vectors, normalised).

Lifecycle: the route parses the body and calls ``score`` or ``rerank`` under the request's id; each validates and
computes its pairs as one embeddings request (a cross-encoder's pairs each one input; an embedding model's distinct
texts, a query shared by every pair embedded once: ``router.embeddings.prepare_job``), under the key's quota, then
``run_embed``, and answers vLLM's shapes: ``score`` objects in the pairs' order; rerank ``results`` best first,
``top_n`` of them (0: all), each with its document's index (and text, unless ``return_documents`` is false).
Refusals name the field (``text_1``, ``text_2``, ``query``, ``documents``, ``top_n``).
"""
from __future__ import annotations

import math
import time
from typing import Any, Awaitable, Callable, Optional, Union

import grpc
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr
from starlette.responses import JSONResponse

from engine import cross_encoder_score
from router.embeddings import EmbedInvalid, prepare_pair_job
from router.openai.embeddings_api import embed, error


class ScoreRequest(BaseModel):
    """vLLM's score request: ``text_1`` against each of ``text_2`` (one to many), or pairwise (equal lengths)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    text_1: Union[StrictStr, list[StrictStr]]
    text_2: Union[StrictStr, list[StrictStr]]
    truncate_prompt_tokens: Optional[StrictInt] = None
    request_id: Optional[str] = None


class RerankRequest(BaseModel):
    """The rerank request of Jina's and Cohere's APIs (vLLM's ``/rerank``)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    query: StrictStr
    documents: list[StrictStr]
    top_n: StrictInt = 0
    return_documents: bool = True
    truncate_prompt_tokens: Optional[StrictInt] = None
    request_id: Optional[str] = None


def score_pairs(text_1: Union[str, list[str]], text_2: Union[str, list[str]]) -> list[tuple[str, str]]:
    """vLLM's pairing: one ``text_1`` with every ``text_2``, else equal lists pairwise; ValueError naming the field."""
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    if not left:
        raise EmbedInvalid(grpc.StatusCode.INVALID_ARGUMENT, "text_1 must not be empty", "text_1")
    if not right:
        raise EmbedInvalid(grpc.StatusCode.INVALID_ARGUMENT, "text_2 must not be empty", "text_2")
    if len(left) == 1:
        return [(left[0], t) for t in right]
    if len(left) != len(right):
        raise EmbedInvalid(grpc.StatusCode.INVALID_ARGUMENT, f"text_1 has {len(left)} texts and text_2 {len(right)}: "
                                                             "give one text_1, or as many as text_2", "text_2")
    return list(zip(left, right))


def _cosine(a: list[float], b: list[float]) -> float:
    """Of two unit vectors (``run_embed`` normalised them)."""
    return math.fsum(x * y for x, y in zip(a, b))


async def _scores(core: Any, request_id: str, model: Optional[str], pairs: list[tuple[str, str]],
                  names: tuple[Callable[[int], str], Callable[[int], str]], truncate: Optional[int],
                  admit: Callable[[int], Any], blocking: Callable[..., Awaitable[Any]]
                  ) -> Union[JSONResponse, tuple[list[float], int]]:
    """(each pair's score, prompt tokens computed), or the error response; ``names``: what the left and right text
    of pair i are called in refusals."""
    pooling = core.limits.pooling if core.limits is not None else None
    if pooling is not None and pooling.num_labels:  # a cross-encoder: each pair one input
        got = await embed(core, admit, blocking, request_id, model, pairs, truncate,
                          [names[1](i) for i in range(len(pairs))], prepare=prepare_pair_job)
        if isinstance(got, JSONResponse):
            return got
        return [cross_encoder_score(g.embedding) for g in got], sum(g.num_prompt_tokens for g in got)
    label: dict[str, str] = {}
    for i, (a, b) in enumerate(pairs):  # (each distinct text embedded once, named where it first stands)
        label.setdefault(a, names[0](i))
        label.setdefault(b, names[1](i))
    texts = list(label)
    got = await embed(core, admit, blocking, request_id, model, texts, None, None, True, truncate, True,
                      [label[t] for t in texts])
    if isinstance(got, JSONResponse):
        return got
    vec = {t: g.embedding for t, g in zip(texts, got)}
    return [_cosine(vec[a], vec[b]) for a, b in pairs], sum(g.num_prompt_tokens for g in got)


async def score(core: Any, body: ScoreRequest, request_id: str, admit: Callable[[int], Any],
                blocking: Callable[..., Awaitable[Any]]) -> JSONResponse:
    """``POST /v1/score`` (see module docstring; ``admit`` and ``blocking`` as ``embeddings_api.serve``'s)."""
    try:
        pairs = score_pairs(body.text_1, body.text_2)
    except EmbedInvalid as e:
        core.count_error(e.code)
        return error(400, e.message, e.field)
    one = isinstance(body.text_1, str) or len(body.text_1) == 1
    names = ((lambda i: "text_1") if one else (lambda i: f"text_1[{i}]"),
             (lambda i: "text_2") if isinstance(body.text_2, str) else (lambda i: f"text_2[{i}]"))
    out = await _scores(core, request_id, body.model, pairs, names, body.truncate_prompt_tokens, admit, blocking)
    if isinstance(out, JSONResponse):
        return out
    values, n = out
    return JSONResponse({"id": f"score-{request_id}", "object": "list", "created": int(time.time()),
                         "model": body.model or core.limits.model_name,
                         "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(values)],
                         "usage": {"prompt_tokens": n, "total_tokens": n}})


async def rerank(core: Any, body: RerankRequest, request_id: str, admit: Callable[[int], Any],
                 blocking: Callable[..., Awaitable[Any]]) -> JSONResponse:
    """``POST /v1/rerank`` (see module docstring; ``admit`` and ``blocking`` as ``embeddings_api.serve``'s)."""
    if not body.documents:
        core.count_error(grpc.StatusCode.INVALID_ARGUMENT)
        return error(400, "documents must not be empty", "documents")
    if body.top_n < 0:
        core.count_error(grpc.StatusCode.INVALID_ARGUMENT)
        return error(400, f"top_n must be >= 0 (0: every document), got {body.top_n}", "top_n")
    out = await _scores(core, request_id, body.model, [(body.query, d) for d in body.documents],
                        (lambda i: "query", lambda i: f"documents[{i}]"), body.truncate_prompt_tokens, admit, blocking)
    if isinstance(out, JSONResponse):
        return out
    values, n = out
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    if body.top_n:
        order = order[:body.top_n]
    results = [{"index": i, "relevance_score": values[i],
                **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in order]
    return JSONResponse({"id": f"rerank-{request_id}", "model": body.model or core.limits.model_name,
                         "results": results, "usage": {"prompt_tokens": n, "total_tokens": n}})
