"""OpenAI's ``POST /v1/embeddings`` (with vLLM's extra fields) on the router's HTTP front end.

Lifecycle: the route (router/openai/http_api.py) parses the body into ``EmbeddingRequest`` and calls ``serve`` under
the request's id. ``serve`` validates it off the event loop (``router.embeddings.prepare_job``: cheap checks first,
then the text inputs tokenized; a refusal is the status it maps to, naming the field), takes the API key's quota
for its prompt tokens (429 past it), and runs it through ``router.embeddings.run_embed`` on a thread of the
router's flow pool. The answer is OpenAI's list of ``embedding`` objects, each vector as floats or, with
``encoding_format: "base64"`` (what the ``openai`` SDK asks for by default), as the base64 of its little-endian
float32 bytes; errors are OpenAI's JSON with the status the failure maps to.
"""
from __future__ import annotations

import asyncio
import base64
import struct
import time
from typing import Any, Awaitable, Callable, Literal, Optional, Union

import grpc
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr
from starlette.responses import JSONResponse

from router.embeddings import EmbedInvalid, Embedded, prepare_job, run_embed
from router.events import FlowError
from router.openai import responses as rs
from router.quotas import QuotaExceeded


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request, with vLLM's ``normalize``, ``truncate_prompt_tokens``, ``add_special_tokens`` and
    ``request_id``."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    input: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[StrictInt] = None
    user: Optional[str] = None
    normalize: Optional[bool] = None
    """L2-normalise (None: the model's default, engine/pooling.py)."""
    truncate_prompt_tokens: Optional[StrictInt] = None
    """Keep each input's last this many tokens (-1: as many as the context holds)."""
    add_special_tokens: bool = True
    request_id: Optional[str] = None


def split_inputs(x: Any) -> tuple[Optional[list[str]], Optional[list[list[int]]]]:
    """(texts, token-id lists), one of them None, of a request's ``input`` (a text, texts, token ids, lists of
    them)."""
    if isinstance(x, str):
        return [x], None
    if x and all(isinstance(t, str) for t in x):
        return list(x), None
    if x and all(isinstance(t, int) for t in x):
        return None, [list(x)]
    return None, [list(t) for t in x]


def error(status: int, message: str, param: Optional[str] = None,
          headers: Optional[dict] = None) -> JSONResponse:
    """OpenAI's error response (``param``: the field it names)."""
    return JSONResponse(rs.error_body(status, message, param), status_code=status, headers=headers)


async def embed(core: Any, admit: Callable[[int], Any], blocking: Callable[..., Awaitable[Any]],
                *fields: Any, prepare: Callable[..., Any] = prepare_job) -> Union[JSONResponse, list[Embedded]]:
    """A request's embeddings (``fields``: ``prepare``'s after the core and the request id: by default
    ``router.embeddings.prepare_job``, a cross-encoder's ``prepare_pair_job``), or the error response: validated
    off the event loop, admitted against the key's quota, run on ``blocking`` (``serve``'s arguments). What the
    embeddings, score and rerank routes share."""
    try:
        job = await asyncio.to_thread(prepare, core, *fields)
    except EmbedInvalid as e:
        core.count_error(e.code)
        return error(rs.HTTP_STATUS.get(e.code, 400), e.message, e.field)
    try:
        lease = admit(sum(len(ids) for ids in job.inputs))
    except QuotaExceeded as e:
        core.count_error(grpc.StatusCode.RESOURCE_EXHAUSTED)
        return error(429, e.message, headers={"Retry-After": e.retry_after_header}
                      if e.retry_after_header is not None else None)
    try:
        return await blocking(run_embed, core, job, time.monotonic() + core.cfg.request_timeout_s)
    except FlowError as e:
        core.count_error(e.code)
        status, err = rs.flow_error(e)
        return JSONResponse(err, status_code=status)
    finally:
        lease.release(0)


async def serve(core: Any, body: EmbeddingRequest, request_id: str, admit: Callable[[int], Any],
                blocking: Callable[..., Awaitable[Any]]) -> JSONResponse:
    """One embeddings request (see module docstring); ``admit(prompt_tokens)``: the key's quota lease
    (``router.quotas``), or QuotaExceeded; ``blocking(fn, *args)``: ``fn`` run where the router's flows run their
    blocking steps (its flow pool: a request waiting on its workers must not hold one of the HTTP loop's few
    default threads, which every completion's preparation shares)."""
    texts, token_lists = split_inputs(body.input)
    got = await embed(core, admit, blocking, request_id, body.model, texts, token_lists, body.dimensions,
                      body.normalize, body.truncate_prompt_tokens, body.add_special_tokens)
    if isinstance(got, JSONResponse):
        return got
    data = []
    for i, g in enumerate(got):
        vec: Any = g.embedding
        if body.encoding_format == "base64":
            vec = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": vec})
    n = sum(g.num_prompt_tokens for g in got)
    return JSONResponse({"id": f"embd-{request_id}", "object": "list", "created": int(time.time()),
                         "model": body.model or core.limits.model_name, "data": data,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})
