"""OpenAI's ``POST /v1/embeddings`` (with vLLM's extra fields) on the router's HTTP front end.

Lifecycle: the route (router/openai/http_api.py) parses the body into ``EmbeddingRequest`` and calls ``serve`` under
the request's id. ``serve`` checks what is cheap first (the model or adapter, ``dimensions`` against the model's
Matryoshka sizes, ``truncate_prompt_tokens``), tokenizes the text inputs off the event loop (token-id inputs are
taken as they are), keeps each input's last ``truncate_prompt_tokens`` where asked, checks every input against the
context and vocabulary (400 naming ``input[i]``), and runs the request through ``router.embeddings.run_embed`` on a
thread. The answer is OpenAI's list of ``embedding`` objects, each vector as floats or, with
``encoding_format: "base64"`` (what the ``openai`` SDK asks for by default), as the base64 of its little-endian
float32 bytes; errors are OpenAI's JSON with the status the failure maps to.
"""
from __future__ import annotations

import asyncio
import base64
import struct
import time
from typing import Any, Literal, Optional, Union

import grpc
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from engine import PoolingConfig, check_dimensions, truncated_prompt
from router.embeddings import EmbedJob, check_inputs, run_embed
from router.events import FlowError
from router.openai import responses as rs


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


def _error(status: int, message: str, param: Optional[str] = None) -> tuple[int, dict]:
    return status, rs.error_body(status, message, param)


def _inputs(body: EmbeddingRequest) -> tuple[list[str], list[list[int]], bool]:
    """(texts, token-id lists, whether the inputs are texts) of ``body.input``."""
    x = body.input
    if isinstance(x, str):
        return [x], [], True
    if x and all(isinstance(t, str) for t in x):
        return list(x), [], True  # type: ignore[arg-type]
    if x and all(isinstance(t, int) for t in x):
        return [], [list(x)], False  # type: ignore[arg-type]
    return [], [list(t) for t in x], False  # type: ignore[union-attr]


async def serve(core: Any, body: EmbeddingRequest, request_id: str) -> tuple[int, dict]:
    """(HTTP status, JSON body) of one embeddings request (see module docstring)."""
    lim = core.limits
    if lim is None or core.draining:
        return _error(503, "router is not serving")
    try:
        lora = lim.lora_of(body.model)
    except LookupError as e:
        core.count_error(grpc.StatusCode.NOT_FOUND)
        return _error(404, str(e), "model")
    pooling = lim.pooling if lim.pooling is not None else PoolingConfig()
    bad: Optional[tuple[int, dict]] = None
    if pooling.unsupported is not None:
        bad = _error(400, f"this model cannot serve embeddings: {pooling.unsupported}", "model")
    else:
        try:
            check_dimensions(pooling, body.dimensions, lim.hidden_size or 1 << 30)
        except ValueError as e:
            bad = _error(400, str(e), "dimensions")
    keep = body.truncate_prompt_tokens
    if bad is None and keep is not None and keep < 1 and keep != -1:
        bad = _error(400, f"truncate_prompt_tokens must be >= 1 or -1, got {keep}", "truncate_prompt_tokens")
    texts, token_lists, textual = _inputs(body)
    if bad is None and textual and core.tokenizer is None:
        bad = _error(400, "input: this model has no tokenizer; give token ids", "input")
    if bad is None and textual and keep is None and lim.max_prompt_bytes is not None:
        for i, t in enumerate(texts):
            if len(t.encode()) > lim.max_prompt_bytes:  # (cannot fit whatever it says: refused before tokenizing)
                bad = _error(400, f"input[{i}] is longer than the context ({lim.max_context_length} tokens) can "
                                  "hold (give truncate_prompt_tokens to keep only its last tokens)", "input")
                break
    if bad is not None:
        core.count_error(grpc.StatusCode.INVALID_ARGUMENT)
        return bad
    if textual:
        tok = core.tokenizer
        token_lists = await asyncio.to_thread(lambda: [tok.encode(t, body.add_special_tokens) for t in texts])
    try:
        token_lists = [truncated_prompt(ids, keep, 1, lim.max_context_length) for ids in token_lists]
        check_inputs(token_lists, lim)
    except ValueError as e:
        core.count_error(grpc.StatusCode.INVALID_ARGUMENT)
        return _error(400, str(e), "truncate_prompt_tokens" if str(e).startswith("truncate") else "input")
    job = EmbedJob(request_id, token_lists, lora, dict(lim.lora_roots).get(lora, 0) if lora else 0, body.dimensions,
                   pooling.normalize if body.normalize is None else body.normalize)
    try:
        got = await asyncio.to_thread(run_embed, core, job, time.monotonic() + core.cfg.request_timeout_s)
    except FlowError as e:
        core.count_error(e.code)
        return rs.flow_error(e)
    data = []
    for i, g in enumerate(got):
        vec: Any = g.embedding
        if body.encoding_format == "base64":
            vec = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": vec})
    n = sum(g.num_prompt_tokens for g in got)
    return 200, {"id": f"embd-{request_id}", "object": "list", "created": int(time.time()),
                 "model": body.model or lim.model_name, "data": data,
                 "usage": {"prompt_tokens": n, "total_tokens": n}}
