"""Validation of a public ``GenerateRequest`` into engine-ready values.

Lifecycle: the router servicer calls ``validate_generate`` once per request,
before admission. It checks the request's shape (prompt xor token_ids), runs
the tokenizer, applies the model's limits and builds an ``engine.SamplingParams``
(whose own checks name the offending field). Any problem raises ``ValueError``
with a message that names the field; the servicer maps it to INVALID_ARGUMENT.
"""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from engine import BeamSearchParams, SamplingParams, bad_words_token_ids, check_structured_outputs, truncated_prompt
from proto import pdserve_pb2
from router.wire import structured_outputs_from_proto

MAX_REQUEST_ID_LEN = 256
DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 64
"""At most this many stop strings per request (stop matching runs on every token)."""
MAX_STOP_STRING_CHARS = 512
"""Each stop string at most this long."""
MAX_STOP_TOKEN_IDS = 1024
MAX_BEAM_WIDTH = min(BeamSearchParams.MAX_BEAM_WIDTH, SamplingParams.MAX_LOGPROBS // 2)
"""The cluster's beam search reads each beam's top 2 x beam_width log-probs from a worker."""
_NOT_WITH_BEAMS = ("n", "top_p", "top_k", "min_p", "typical_p", "repetition_penalty", "frequency_penalty",
                   "presence_penalty", "seed", "logprobs", "min_tokens", "prompt_logprobs")
"""Optional request fields that mean sampling (or per-token output) and so cannot go with beam_width."""


@dataclass(frozen=True)
class ModelLimits:
    """What the router enforces for one model."""

    model_name: str
    """Served model name (reported by GetModelInfo)."""
    max_context_length: int
    """Prompt tokens + max_tokens must fit in this."""
    vocab_size: int
    """token_ids and stop_token_ids must be in [0, vocab_size)."""
    eos_token_id: int = -1
    """Reported by GetModelInfo; -1 when the model has none."""
    max_new_tokens: Optional[int] = None
    """Largest max_tokens accepted; None means the context length."""
    max_prompt_bytes: Optional[int] = None
    """A prompt text longer than this (UTF-8 bytes) cannot fit the context whatever it says, so it is
    rejected before tokenizing; None: no such bound (no tokenizer)."""
    lora_adapters: tuple[str, ...] = ()
    """LoRA adapters every live worker serves (``WorkerInfo.lora_adapters``): names a request may give as its
    ``model`` besides ``model_name``."""
    lora_roots: tuple[tuple[str, int], ...] = ()
    """(name, prefix-cache root) of those adapters whose root every worker publishes alike (``LoRAStatus``)."""
    hidden_size: int = 0
    """The model's hidden size: an embedding's length (0: unknown)."""
    pooling: Any = None
    """How the model's embeddings are made (``engine.PoolingConfig``; None: as its defaults say)."""

    def __post_init__(self) -> None:
        if self.max_context_length < 2:
            raise ValueError(f"max_context_length must be >= 2, got {self.max_context_length}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")

    @property
    def max_tokens_limit(self) -> int:
        return self.max_new_tokens if self.max_new_tokens is not None else self.max_context_length - 1

    def lora_of(self, model: Optional[str]) -> Optional[str]:
        """The LoRA adapter a request's ``model`` names: None for none given or the served model name, the adapter
        for one of ``lora_adapters``; LookupError (NOT_FOUND, HTTP 404) naming what is served for anything else."""
        if not model or model == self.model_name:
            return None
        if model in self.lora_adapters:
            return model
        served = ", ".join(repr(m) for m in (self.model_name, *self.lora_adapters))
        raise LookupError(f"model {model!r} does not exist; this server serves {served}")


@dataclass
class ValidatedRequest:
    """A request that passed validation: what the router sends to the workers."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int = 1
    """Choices for this prompt: one prefill, one KV transfer, ``n`` decoded sequences."""
    beam: Optional[BeamSearchParams] = None
    """Set for a beam search request (``beam_width``): the router runs the search (``router.beam_search``)."""
    lora_root: int = 0
    """Its LoRA adapter's prefix-cache root as the workers publish it (0: the base model, or not known): its
    prompt's block hashes start there, and workers check it (``WireSamplingParams.lora_root``)."""

    def choice_params(self) -> list[SamplingParams]:
        """Each choice's params: choice i samples with ``seed + i`` when a seed is set (so choice 0 is the
        single-choice request), unseeded otherwise. Only choice 0 asks for ``prompt_logprobs`` (one prompt)."""
        if self.n == 1:
            return [self.params]
        seed = self.params.seed
        return [dataclasses.replace(self.params, seed=None if seed is None else (seed + i) % 2**63,
                                    prompt_logprobs=self.params.prompt_logprobs if i == 0 else None)
                for i in range(self.n)]


def _decimal(x: float) -> float:
    # proto floats are float32: 0.7 arrives as 0.699999988...; clients mean the decimal
    # they wrote, and the offline API (the reference) sees that decimal.
    return float(f"{x:.7g}")


def _check_ids(name: str, ids: list[int], vocab_size: int) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"{name}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")


def _check_stops(req: pdserve_pb2.GenerateRequest) -> None:
    """Stop lists are matched on every generated token: bound them before any work."""
    if len(req.stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(req.stop)} strings; at most {MAX_STOP_STRINGS} are accepted")
    for i, st in enumerate(req.stop):
        if len(st) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop[{i}] is {len(st)} characters; at most {MAX_STOP_STRING_CHARS} are accepted")
    if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids has {len(req.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} "
                         f"are accepted")


def _tokenizer_of(tokenize: Callable[[str], list[int]]) -> Any:
    """The tokenizer behind ``tokenize`` (``RouterCore.tokenize`` is a bound method of the core that holds it)."""
    owner = getattr(tokenize, "__self__", None)
    return getattr(owner, "tokenizer", None) if owner is not None else None


def _opens_block(ids: list[int], start: list[int]) -> bool:
    """Whether the prompt's last tokens hold the reasoning block's start marker (DeepSeek-R1's template ends its
    generation prompt with ``<think>\n``): the answer then opens inside the block without writing the marker."""
    k = len(start)
    return any(ids[i:i + k] == start for i in range(max(0, len(ids) - k - 4), len(ids) - k + 1))


def check_generates(limits: ModelLimits, what: str) -> None:
    """ValueError naming ``model`` where the model is an encoder (engine/encoder.py), which serves ``what`` (a
    generation, a chat) never: said before any worker is asked, with what it does serve."""
    p = limits.pooling
    if p is None or not p.encoder:
        return
    serves = ("classifications (/classify)" if p.num_labels > 1 else "pair scores (/v1/score, /v1/rerank)"
              if p.num_labels else "embeddings (/v1/embeddings, /v1/score, /v1/rerank)")
    raise ValueError(f"model: {limits.model_name} is an encoder: it serves {serves}, not {what}")


def validate_generate(req: pdserve_pb2.GenerateRequest, limits: ModelLimits,
                      tokenize: Callable[[str], list[int]], tokenizer: Any = None, *,
                      allow_priority: bool = False, reasoning: Any = None) -> ValidatedRequest:
    """Check ``req`` against ``limits``; raise ValueError naming the field (LookupError: a ``model`` not served).
    ``allow_priority``: the router's scheduling policy is "priority" (otherwise a non-zero ``priority`` is refused).
    ``reasoning``: the router's reasoning markers (``router.openai.reasoning.ReasoningMarkers``: token ids of the
    block's start and end), needed by a request that sets ``reasoning``; None: no reasoning parser.

    ``structured_outputs`` is compiled against the model's vocabulary here (``engine.check_structured_outputs``,
    bounded by llguidance's limits) so a bad constraint never reaches a worker; ``tokenizer`` is the model's
    (default: the one behind ``tokenize``, as the router core passes it)."""
    request_id = req.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_LEN or not request_id.isprintable():
        raise ValueError(f"request_id must be printable and at most {MAX_REQUEST_ID_LEN} characters")
    lora = limits.lora_of(req.model)  # LookupError: NOT_FOUND
    check_generates(limits, "generation")
    has_prompt, has_ids = req.prompt != "", len(req.token_ids) > 0
    if has_prompt and has_ids:
        raise ValueError("prompt and token_ids are both set: give one, not both")
    if not has_prompt and not has_ids:
        raise ValueError("prompt is empty and token_ids is empty: give one of them")
    _check_stops(req)
    if req.priority and not allow_priority:
        raise ValueError(f"priority ({req.priority}) needs a cluster started with --scheduling-policy priority; this "
                         f"one serves requests first-come-first-served (leave priority unset or 0)")
    truncate = req.truncate_prompt_tokens if req.HasField("truncate_prompt_tokens") else None
    if truncate is not None and truncate < 1 and truncate != -1:
        raise ValueError(f"truncate_prompt_tokens must be >= 1, or -1 (as much as fits), got {truncate}")
    if has_ids:
        if len(req.token_ids) >= limits.max_context_length and truncate is None:
            raise ValueError(f"token_ids has {len(req.token_ids)} tokens; the context length is "
                             f"{limits.max_context_length}")
        ids = list(req.token_ids)
        _check_ids("token_ids", ids, limits.vocab_size)
    else:
        # (a prompt to truncate may be longer than the context: the request body's own bound limits its work)
        if (limits.max_prompt_bytes is not None and truncate is None
                and len(req.prompt) > limits.max_prompt_bytes // 4):
            n_bytes = len(req.prompt.encode("utf-8", "surrogatepass"))
            if n_bytes > limits.max_prompt_bytes:
                raise ValueError(f"prompt is {n_bytes} bytes: more than the context length "
                                 f"({limits.max_context_length} tokens) can hold for this tokenizer "
                                 f"(at most {limits.max_prompt_bytes} bytes)")
        ids = list(tokenize(req.prompt))
        if not ids:
            raise ValueError("prompt tokenizes to zero tokens")

    max_tokens = req.max_tokens if req.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if max_tokens > limits.max_tokens_limit:
        raise ValueError(f"max_tokens must be <= {limits.max_tokens_limit}, got {max_tokens}")
    if truncate is not None:
        kept = truncated_prompt(ids, truncate, max_tokens, limits.max_context_length)
        if len(kept) < len(ids):
            ids, has_prompt = kept, False  # (the response's prompt, echo's included, is the kept tokens' text)
    if len(ids) >= limits.max_context_length:
        raise ValueError(f"prompt is {len(ids)} tokens; the context length is {limits.max_context_length}")
    if len(ids) + max_tokens > limits.max_context_length:
        raise ValueError(f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                         f"the context length {limits.max_context_length}")
    _check_ids("stop_token_ids", list(req.stop_token_ids), limits.vocab_size)
    if len(req.logit_bias) > SamplingParams.MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(req.logit_bias)} entries; at most {SamplingParams.MAX_LOGIT_BIAS}")
    for t in req.logit_bias:
        if not 0 <= t < limits.vocab_size:
            raise ValueError(f"logit_bias key {t} is outside the vocabulary [0, {limits.vocab_size})")

    kw: dict = dict(max_tokens=max_tokens, stop=list(req.stop), stop_token_ids=list(req.stop_token_ids),
                    ignore_eos=req.ignore_eos, skip_special_tokens=not req.skip_special_tokens_off, lora_name=lora,
                    priority=req.priority, cache_salt=req.cache_salt or None)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", "typical_p"):
        if req.HasField(name):
            kw[name] = _decimal(getattr(req, name))
    for name in ("top_k", "seed", "logprobs", "min_tokens", "prompt_logprobs"):
        if req.HasField(name):
            kw[name] = getattr(req, name)
    if req.logit_bias:
        kw["logit_bias"] = {int(t): _decimal(b) for t, b in req.logit_bias.items()}
    if req.reasoning:
        if reasoning is None:
            raise ValueError("reasoning needs a router started with --reasoning-parser; this one has none")
        kw["reasoning_end_token_ids"] = list(reasoning.end)
        if not _opens_block(ids, list(reasoning.start)):  # (else the model writes its own start marker first)
            kw["reasoning_start_token_ids"] = list(reasoning.start)
    if req.HasField("thinking_token_budget"):
        if not req.reasoning:
            raise ValueError("thinking_token_budget needs reasoning (an answer that opens with the model's "
                             "reasoning, on a router started with --reasoning-parser)")
        if req.thinking_token_budget < 0:
            raise ValueError(f"thinking_token_budget must be >= 0, got {req.thinking_token_budget}")
        kw["thinking_token_budget"] = req.thinking_token_budget
    if req.allowed_token_ids:
        if len(req.allowed_token_ids) > SamplingParams.MAX_ALLOWED_TOKEN_IDS:
            raise ValueError(f"allowed_token_ids has {len(req.allowed_token_ids)} ids; at most "
                             f"{SamplingParams.MAX_ALLOWED_TOKEN_IDS}")
        kw["allowed_token_ids"] = list(req.allowed_token_ids)
        _check_ids("allowed_token_ids", kw["allowed_token_ids"], limits.vocab_size)
    if req.bad_words:
        kw["bad_words"] = list(req.bad_words)
        SamplingParams(bad_words=kw["bad_words"])  # its checks (count, length, blank words) before tokenizing
        tok = tokenizer if tokenizer is not None else _tokenizer_of(tokenize)
        if tok is None:
            raise ValueError("bad_words needs the model's tokenizer, and this model has none")
        kw["bad_words_token_ids"] = bad_words_token_ids(kw["bad_words"], tok, limits.vocab_size)
    if req.HasField("structured_outputs"):
        if req.HasField("beam_width"):
            raise ValueError("structured_outputs cannot be used with beam_width: beam search keeps no grammar "
                             "state per beam (use n with temperature instead)")
        so = structured_outputs_from_proto(req.structured_outputs)
        check_structured_outputs(so, tokenizer if tokenizer is not None else _tokenizer_of(tokenize),
                                 limits.vocab_size)
        kw["structured_outputs"] = so
    lora_root = dict(limits.lora_roots).get(lora, 0) if lora is not None else 0
    if req.HasField("beam_width"):
        return _beam_request(req, request_id, ids, has_prompt, kw, lora_root)
    for name, given in (("length_penalty", req.HasField("length_penalty")), ("early_stopping", req.early_stopping)):
        if given:
            raise ValueError(f"{name} is a beam search parameter: set beam_width too")
    # SamplingParams' own checks name the field (temperature, top_p, seed, logprobs...).
    params = SamplingParams(**kw)
    n = req.n if req.HasField("n") else 1
    if not 1 <= n <= SamplingParams.MAX_N:
        raise ValueError(f"n must be in [1, {SamplingParams.MAX_N}], got {n}")
    return ValidatedRequest(request_id=request_id, prompt=req.prompt if has_prompt else None,
                            prompt_token_ids=ids, params=params, n=n, lora_root=lora_root)


def _beam_request(req: pdserve_pb2.GenerateRequest, request_id: str, ids: list[int], has_prompt: bool,
                  kw: dict, lora_root: int = 0) -> ValidatedRequest:
    """A beam search request: deterministic, no sampling knobs, width bounded by what a worker reports."""
    width = req.beam_width
    if not 1 <= width <= MAX_BEAM_WIDTH:
        raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {width}")
    for name in _NOT_WITH_BEAMS:
        if req.HasField(name):
            raise ValueError(f"{name} cannot be used with beam_width: beam search is deterministic and "
                             f"returns its beam_width best sequences")
    if req.HasField("thinking_token_budget"):
        raise ValueError("thinking_token_budget cannot be used with beam_width: beam search forces no tokens")
    for name in ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words"):
        if len(getattr(req, name)):
            raise ValueError(f"{name} cannot be used with beam_width: beam search stops on EOS or max_tokens")
    if req.HasField("temperature") and req.temperature != 0.0:
        raise ValueError(f"temperature must be 0 (or unset) with beam_width, got {_decimal(req.temperature)}")
    early = {"": False, "false": False, "true": True, "never": "never"}.get(req.early_stopping.lower())
    if early is None:
        raise ValueError(f"early_stopping must be 'true', 'false' or 'never', got {req.early_stopping!r}")
    length_penalty = _decimal(req.length_penalty) if req.HasField("length_penalty") else 1.0
    beam = BeamSearchParams(beam_width=width, max_tokens=kw["max_tokens"], ignore_eos=req.ignore_eos,
                            length_penalty=length_penalty, early_stopping=early)
    params = SamplingParams(max_tokens=kw["max_tokens"], temperature=0.0, ignore_eos=req.ignore_eos,
                            skip_special_tokens=kw["skip_special_tokens"], lora_name=kw["lora_name"],
                            priority=kw["priority"], cache_salt=kw["cache_salt"])
    return ValidatedRequest(request_id=request_id, prompt=req.prompt if has_prompt else None,
                            prompt_token_ids=ids, params=params, n=width, beam=beam, lora_root=lora_root)
