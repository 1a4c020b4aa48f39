"""Embedding requests through the router: what the OpenAI ``/v1/embeddings`` route shares with any other front end.

Lifecycle: a front end hands its body's fields to ``prepare_job`` (blocking: it tokenizes; cheap checks first: the
model or adapter, ``dimensions`` against the model's Matryoshka sizes, ``truncate_prompt_tokens``, a text that
cannot fit; then each input as token ids, its last ``truncate_prompt_tokens`` kept, checked against the context and
vocabulary), which gives an ``EmbedJob`` or raises ``EmbedInvalid`` (the status and the field it names), admits it
against its key's quota, and calls ``run_embed(core, job, deadline)`` on a thread of its own (it blocks). That
takes one of the router's ``max_num_requests`` slots for the whole request (RESOURCE_EXHAUSTED past it), then sends
every input at once as an ``Embed`` call to the least-loaded worker of the prefill pool (prompts are prefill work;
the colocated pool where there is no prefill pool, the decode pool's workers as a last resort), each worker
batching what it gets with its other prompts. An input whose worker is unavailable, full or stopping goes to the
next worker (at most ``ATTEMPTS`` tries); any other failure, or the deadline, cancels the rest (their workers free
them) and ends the request with that status. The answers come back raw; ``engine.finish_embedding`` cuts and
normalises each (cheap, no torch). A request served counts as vLLM counts a pooling request:
``request_success_total{finished_reason="stop"}``, its prompt tokens in ``prompt_tokens_total``, its latency in
``e2e_request_latency_seconds`` (errors: the front ends, as for the rest).
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import grpc

from engine import PoolingConfig, check_dimensions, finish_embedding, truncated_prompt
from proto import worker_pb2
from router.events import FlowError
from router.scope import scrub
from router.validation import ModelLimits
from router.wire import params_to_wire

log = logging.getLogger(__name__)

MAX_INPUTS = 2048
"""Inputs one request may hold (OpenAI's limit)."""
ATTEMPTS = 3
"""Workers an input is tried on before its request fails (UNAVAILABLE, RESOURCE_EXHAUSTED or CANCELLED answers)."""
_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED)
"""A worker that is gone or stopping (a draining worker cancels what it holds) or full: another may serve it."""


@dataclass
class EmbedJob:
    """One validated embedding request."""

    request_id: str
    inputs: list[list[int]]
    lora_name: Optional[str] = None
    lora_root: int = 0
    dimensions: Optional[int] = None
    normalize: bool = True


class EmbedInvalid(Exception):
    """A request refused before any worker works: the status to answer and the field it names."""

    def __init__(self, code: grpc.StatusCode, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.code, self.message, self.field = code, message, field


def _limits_and_adapter(core: Any, model: Optional[str]) -> tuple[ModelLimits, Optional[str]]:
    """(the router's model limits, the LoRA adapter ``model`` names); ``EmbedInvalid`` while not serving
    (UNAVAILABLE) or for a model not served (NOT_FOUND)."""
    lim = core.limits
    if lim is None or core.draining:
        raise EmbedInvalid(grpc.StatusCode.UNAVAILABLE, "router is not serving")
    try:
        return lim, lim.lora_of(model)
    except LookupError as e:
        raise EmbedInvalid(grpc.StatusCode.NOT_FOUND, str(e), "model") from None


def _checked_keep(keep: Optional[int]) -> Optional[int]:
    if keep is not None and keep < 1 and keep != -1:
        raise EmbedInvalid(grpc.StatusCode.INVALID_ARGUMENT, f"truncate_prompt_tokens must be >= 1 or -1, got {keep}",
                           "truncate_prompt_tokens")
    return keep


def prepare_job(core: Any, request_id: str, model: Optional[str], texts: Optional[list[str]],
                token_lists: Optional[list[list[int]]], dimensions: Optional[int] = None,
                normalize: Optional[bool] = None, truncate_prompt_tokens: Optional[int] = None,
                add_special_tokens: bool = True, names: Optional[list[str]] = None,
                classify: bool = False) -> EmbedJob:
    """The ``EmbedJob`` of a request's fields (``texts`` or ``token_lists``); ``EmbedInvalid`` otherwise (see module
    docstring). Blocking: it tokenizes. ``names``: what each input is called in refusals (the score and rerank
    APIs' fields; default ``input[i]``). ``classify``: a classifier's inputs (``/classify``: its raw logits come
    back; ``engine.classify_probs`` makes the answer), refused unless the model is one."""
    lim, lora = _limits_and_adapter(core, model)
    bad = grpc.StatusCode.INVALID_ARGUMENT
    pooling = lim.pooling if lim.pooling is not None else PoolingConfig()
    if pooling.unsupported is not None:
        raise EmbedInvalid(grpc.StatusCode.FAILED_PRECONDITION,
                           f"this model cannot serve embeddings: {pooling.unsupported}", "model")
    if classify and not pooling.num_labels:
        raise EmbedInvalid(grpc.StatusCode.FAILED_PRECONDITION, "this model is not a classifier (a "
                                                                "...ForSequenceClassification encoder)", "model")
    if pooling.num_labels and not classify:
        raise EmbedInvalid(grpc.StatusCode.FAILED_PRECONDITION, "this model is a " + (
            "cross-encoder: it scores text pairs (/v1/score, /v1/rerank)" if pooling.num_labels == 1 else
            "classifier (/classify)") + ", it has no embeddings", "model")
    if classify:
        dimensions, normalize = None, False
    try:
        check_dimensions(pooling, dimensions, lim.hidden_size or 1 << 30)
    except ValueError as e:
        raise EmbedInvalid(bad, str(e), "dimensions") from None
    keep = _checked_keep(truncate_prompt_tokens)
    if texts is not None:
        if core.tokenizer is None:
            raise EmbedInvalid(bad, "input: this model has no tokenizer; give token ids", "input")
        if keep is None and lim.max_prompt_bytes is not None:
            for i, t in enumerate(texts):
                if len(t.encode()) > lim.max_prompt_bytes:  # (cannot fit whatever it says: before tokenizing)
                    name = names[i] if names is not None else f"input[{i}]"
                    raise EmbedInvalid(bad, f"{name} is longer than the context ({lim.max_context_length} "
                                            "tokens) can hold (give truncate_prompt_tokens to cut it)",
                                       name.split("[")[0])
    encoder_cut = pooling.encoder and keep is not None  # (an encoder keeps its first tokens, a decoder its last)
    try:
        if encoder_cut and texts is not None and add_special_tokens:  # (its tokenizer's cut: specials kept)
            ids = [core.tokenizer.encode_encoder(t, max_tokens=_encoder_keep(keep, lim)) for t in texts]
        else:
            if texts is not None:
                token_lists = [core.tokenizer.encode(t, add_special_tokens) for t in texts]
            ids = [list(t)[:_encoder_keep(keep, lim)] if encoder_cut
                   else truncated_prompt(list(t), keep, 0, lim.max_context_length) for t in token_lists or []]
    except ValueError as e:
        raise EmbedInvalid(bad, str(e), "truncate_prompt_tokens") from None
    check_inputs(ids, lim, names=names)
    return EmbedJob(request_id, ids, lora, dict(lim.lora_roots).get(lora, 0) if lora else 0, dimensions,
                    pooling.normalize if normalize is None else bool(normalize))


def _encoder_keep(keep: int, lim: ModelLimits) -> int:
    """An encoder's token limit for ``truncate_prompt_tokens`` (-1: as many as the context takes)."""
    return lim.max_context_length if keep == -1 else keep


def prepare_pair_job(core: Any, request_id: str, model: Optional[str], pairs: list[tuple[str, str]],
                     truncate_prompt_tokens: Optional[int], names: list[str]) -> EmbedJob:
    """A cross-encoder's ``EmbedJob``: each text pair as one input through the tokenizer's pair template (cut
    longest text first to ``truncate_prompt_tokens``, special tokens kept: ``Tokenizer.encode_encoder``); its
    answers are the classifier's raw logits (``engine.cross_encoder_score`` makes the score). ``names``: what each
    pair's second text is called in refusals. ``EmbedInvalid`` as ``prepare_job``'s. Blocking: it tokenizes."""
    lim, lora = _limits_and_adapter(core, model)
    bad = grpc.StatusCode.INVALID_ARGUMENT
    keep = _checked_keep(truncate_prompt_tokens)
    labels = lim.pooling.num_labels if lim.pooling is not None else 0
    if labels != 1:
        raise EmbedInvalid(grpc.StatusCode.FAILED_PRECONDITION, f"this model is a {labels}-label classifier: it "
                                                                "classifies texts (/classify); a pair's score needs a "
                                                                "one-label cross-encoder", "model")
    if core.tokenizer is None:
        raise EmbedInvalid(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer: a cross-encoder "
                                                                "scores texts", "model")
    if keep is None and lim.max_prompt_bytes is not None:
        for (a, b), name in zip(pairs, names):
            if len(a.encode()) + len(b.encode()) > lim.max_prompt_bytes:  # (cannot fit: before tokenizing)
                raise EmbedInvalid(bad, f"{name} and its pair are longer than the context "
                                        f"({lim.max_context_length} tokens) can hold (give truncate_prompt_tokens "
                                        "to cut them)", name.split("[")[0])
    try:
        ids = [core.tokenizer.encode_encoder(a, b, None if keep is None else _encoder_keep(keep, lim))
               for a, b in pairs]
    except ValueError as e:
        raise EmbedInvalid(bad, str(e), "truncate_prompt_tokens") from None
    check_inputs(ids, lim, names=names)
    return EmbedJob(request_id, ids, lora, dict(lim.lora_roots).get(lora, 0) if lora else 0, None, False)


@dataclass
class Embedded:
    """One input's answer: its vector (cut and normalised as asked) and its prompt's tokens."""

    embedding: list[float]
    num_prompt_tokens: int
    num_cached_tokens: int


def check_inputs(inputs: list[list[int]], limits: ModelLimits, field: str = "input",
                 names: Optional[list[str]] = None) -> None:
    """``EmbedInvalid`` (INVALID_ARGUMENT) naming ``field`` and the input's index (``names``: each input's name
    instead; the field named is its part before ``[``) unless every input is a non-empty list of token ids in the
    vocabulary that fits the context."""
    def refuse(message: str, name: str) -> EmbedInvalid:
        return EmbedInvalid(grpc.StatusCode.INVALID_ARGUMENT, message, name.split("[")[0])

    if not inputs:
        raise refuse(f"{field} must not be empty", field)
    if len(inputs) > MAX_INPUTS:
        raise refuse(f"{field} holds {len(inputs)} inputs; at most {MAX_INPUTS} in one request", field)
    for i, ids in enumerate(inputs):
        name = names[i] if names is not None else f"{field}[{i}]" if len(inputs) > 1 else field
        if not ids:
            raise refuse(f"{name} is empty", name)
        if len(ids) > limits.max_context_length:  # (an embedding's prompt may fill the context: nothing follows)
            raise refuse(f"{name} has {len(ids)} tokens; the context length is {limits.max_context_length} "
                         "(give truncate_prompt_tokens to cut it)", name)
        for t in ids:
            if not 0 <= t < limits.vocab_size:
                raise refuse(f"{name}: {t} is not a token id in [0, {limits.vocab_size})", name)


def _pool(core: Any) -> tuple[str, list[Any]]:
    """(role, ready workers) that embed: the prefill pool, else the colocated, else the decode pool."""
    for role in ("prefill", "colocated", "decode"):
        workers = [w for w in core.view.list(role) if w.ready]
        if workers:
            return role, workers
    raise FlowError(grpc.StatusCode.UNAVAILABLE, "no worker is serving embeddings (every pool is empty)")


class _Input:
    """One input's call: where it went, how many tries it has had, its future."""

    def __init__(self, index: int, ids: list[int]) -> None:
        self.index, self.ids = index, ids
        self.tries = 0
        self.tried: set[str] = set()
        self.worker: Any = None
        self.future: Any = None
        self.held = False
        """Its tokens count on ``worker``'s load in the router's selector (``acquire``d, not yet released)."""

    def release(self, core: Any) -> None:
        if self.held:
            core.selector.release(self.worker.worker_id, len(self.ids))
            self.held = False


def run_embed(core: Any, job: EmbedJob, deadline: float,
              cancelled: Optional[threading.Event] = None) -> list[Embedded]:
    """Every input's embedding, in order; FlowError with the status to answer otherwise (see module docstring).
    ``deadline``: monotonic seconds. ``cancelled``: set when the client went away (an HTTP disconnect): the
    inputs' calls still out are cancelled (their workers abort them) and this ends with CANCELLED within
    ``CANCEL_POLL_S``."""
    if core.limits is None or core.draining:
        raise FlowError(grpc.StatusCode.UNAVAILABLE, "router is not serving")
    if not core.bound.try_take():
        raise FlowError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"request {job.request_id}: router queue is full ({core.cfg.max_num_requests} requests "
                        "in flight)")
    from engine import SamplingParams

    t0 = time.monotonic()
    wire = params_to_wire(SamplingParams(max_tokens=1, lora_name=job.lora_name), job.lora_root)
    tag = secrets.token_hex(4)  # (clients may reuse a request id: each call's id on the workers is unique)
    calls = [_Input(i, ids) for i, ids in enumerate(job.inputs)]
    lock = threading.Lock()
    try:
        for c in calls:
            _send(core, job, c, wire, tag, deadline, lock)
        out: list[Optional[Embedded]] = [None] * len(calls)
        for c in calls:
            while out[c.index] is None:
                _wait(job, c, cancelled)
                out[c.index] = _result(core, job, c, wire, tag, deadline, lock)
        done = [o for o in out if o is not None]
        m = core.metrics
        if m is not None:  # (as vLLM counts a pooling request: a success, its prompt tokens, its latency)
            m.inc_success("stop")
            m.inc_prompt_tokens(sum(o.num_prompt_tokens for o in done))
            m.observe_e2e(time.monotonic() - t0)
        return done
    finally:
        for c in calls:
            if c.future is not None and not c.future.done():
                c.future.cancel()  # (its worker aborts the request when the call ends)
            c.release(core)
        core.bound.give_back()


CANCEL_POLL_S = 0.1
"""How often a request whose client may go away looks whether it did, while it waits on its workers."""


def _wait(job: EmbedJob, c: _Input, cancelled: Optional[threading.Event]) -> None:
    """Until ``c``'s call is done; FlowError(CANCELLED) once ``cancelled`` is set (``run_embed``'s ``finally``
    cancels what is still out)."""
    if cancelled is None:
        return
    done = threading.Event()
    c.future.add_done_callback(lambda _f: done.set())
    while not done.wait(CANCEL_POLL_S):
        if cancelled.is_set():
            raise FlowError(grpc.StatusCode.CANCELLED, f"request {job.request_id}: the client went away")


def _send(core: Any, job: EmbedJob, c: _Input, wire: Any, tag: str, deadline: float, lock: threading.Lock) -> None:
    """Start ``c``'s call on the least-loaded worker it has not tried."""
    role, workers = _pool(core)
    with lock:
        ranked = [w for w in core.selector.ranked_prefill(workers) if w.worker_id not in c.tried] or \
            core.selector.ranked_prefill(workers)
        w = ranked[0]
        core.selector.acquire(w.worker_id, len(c.ids))
    c.worker, c.tries, c.held = w, c.tries + 1, True
    c.tried.add(w.worker_id)
    stub = core.clients.prefill(w.grpc_address) if role == "prefill" else core.clients.colocated(w.grpc_address)
    req = worker_pb2.EmbedRequest(request_id=f"{job.request_id}-{c.index}-{tag}-{c.tries}",
                                  prompt_token_ids=c.ids, params=wire)
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        c.release(core)
        raise FlowError(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {job.request_id}: deadline exceeded")
    c.future = stub.Embed.future(req, timeout=remaining)


def _result(core: Any, job: EmbedJob, c: _Input, wire: Any, tag: str, deadline: float,
            lock: threading.Lock) -> Optional[Embedded]:
    """``c``'s answer; None after sending it again (its worker could not take it); FlowError for the rest."""
    try:
        resp = c.future.result()
    except grpc.RpcError as e:
        c.release(core)
        code = e.code()
        log.warning("request %s: input %d on worker %s: %s %s", job.request_id, c.index, c.worker.worker_id,
                    code.name, scrub(e.details() or ""))
        if code in _RETRIED and c.tries < ATTEMPTS and time.monotonic() < deadline:
            if code is grpc.StatusCode.UNAVAILABLE:
                core.view.suspect(c.worker.worker_id)
            _send(core, job, c, wire, tag, deadline, lock)
            return None
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            raise FlowError(code, f"request {job.request_id}: deadline exceeded") from None
        details = scrub(e.details() or code.name)
        if code in _RETRIED:  # (tries used up: the cluster cannot serve it now; a worker's cancel is not the client's)
            raise FlowError(code if code is grpc.StatusCode.RESOURCE_EXHAUSTED else grpc.StatusCode.UNAVAILABLE,
                            f"request {job.request_id}: input {c.index}: {details}") from None
        if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):  # (a worker's bug: not the client's)
            raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {job.request_id}: input {c.index}: the worker "
                                                         f"failed ({details})") from None
        # (the worker's message names the field: INVALID_ARGUMENT, NOT_FOUND, ...)
        raise FlowError(code, details) from None
    c.release(core)
    vec = finish_embedding(resp.embedding, job.normalize, job.dimensions)
    return Embedded(vec, resp.num_prompt_tokens, resp.num_cached_tokens)
