"""The OpenAI-compatible request shapes the HTTP front end accepts, and what they become.

Lifecycle: stateless. ``router.openai.http_api`` parses a request body into ``CompletionRequest`` or
``ChatCompletionRequest`` (pydantic, at the external boundary; unknown fields are ignored as OpenAI's own server
does) and turns it into the same ``pdserve.v1.GenerateRequest``s the gRPC front end receives
(``to_generate_requests``: one per prompt, its ``n`` choices sharing it), so both front ends share one validation
path; chat messages are rendered with the model's template (``render_chat``, tools and past calls included). Also
vLLM's /tokenize and /detokenize bodies (``tokenize_json``). Field names follow OpenAI's API, plus vLLM's extras
with vLLM's names. The answers are rendered by ``router.openai.responses``.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field

from engine import SamplingParams
from proto import pdserve_pb2
from router.openai.structured import ConstraintFields, ToolFields, template_tools
from router.validation import MAX_BEAM_WIDTH, ModelLimits, check_generates


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: with include_usage, every chunk carries its choice's usage so far (not only the last)."""


class _Sampling(ConstraintFields):
    """Fields both endpoints share (OpenAI's, then vLLM's extras); ``response_format`` and vLLM's
    ``structured_outputs`` come from ``ConstraintFields`` (``router.openai.structured``)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM's extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: Optional[int] = None
    skip_special_tokens: bool = True
    stop_token_ids: Optional[list[int]] = None
    use_beam_search: bool = False
    """vLLM's: beam search with ``n`` beams; the n best sequences come back as the choices, best first."""
    length_penalty: Optional[float] = None
    early_stopping: Optional[Union[bool, str]] = None
    prompt_logprobs: Optional[int] = None
    """vLLM's: each prompt token's logprob and the top-k (not with stream, as in vLLM; 0 there is ignored)."""
    allowed_token_ids: Optional[list[int]] = None
    """vLLM's: only these token ids can be generated."""
    bad_words: Optional[list[str]] = None
    """vLLM's: words never generated."""
    truncate_prompt_tokens: Optional[int] = None
    """vLLM's: keep only the prompt's last k tokens (a chat's: of the rendered conversation); -1: what fits."""
    cache_salt: Optional[str] = None
    """vLLM's: prefix-cache hits only among requests with the same salt."""
    return_tokens_as_token_ids: bool = False
    """vLLM's: logprobs name each token "token_id:<id>" instead of its text."""
    priority: int = 0
    """vLLM's: lower is served first (a cluster started with --scheduling-policy priority; 0 otherwise)."""
    request_id: Optional[str] = None
    """vLLM's: the request's id (else the ``X-Request-Id`` header's, else a new one): the answer's ``id`` is built
    from it, it comes back as the ``X-Request-Id`` header, and the workers' log lines of the request start with it."""
    # pdserve's extras
    pdserve_timings: bool = False
    """pdserve's: the usage block (the response's, or the streamed usage chunk's) gets ``pdserve_timings``, one
    object per prompt with where its time went (``timings_json``: TTFT's phases, the KV transfer, decode)."""


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    """An assistant turn's calls, as a response gave them (``function.arguments`` as JSON text)."""
    tool_call_id: Optional[str] = None
    """A ``tool`` turn: the call it answers."""
    reasoning: Optional[str] = None
    """An assistant turn's reasoning as a response gave it (vLLM's ``reasoning``)..."""
    reasoning_content: Optional[str] = None
    """... or by its older name: either reaches the template as ``reasoning_content`` (Qwen3's template puts it
    back, in a think block, for the turns of a tool loop)."""


class ChatCompletionRequest(_Sampling, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    """vLLM's: extra variables for the chat template (e.g. ``{"enable_thinking": false}`` for Qwen3), over the
    server's ``--default-chat-template-kwargs``."""
    include_reasoning: bool = True
    """vLLM's: with a reasoning parser, false leaves the reasoning out of the answer (it is still generated)."""
    thinking_token_budget: Optional[int] = None
    """vLLM's: at most this many reasoning tokens, then the end of the block is forced (needs a reasoning parser)."""


TEMPLATE_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                               "bos_token", "eos_token", "raise_exception", "strftime_now",
                               "range", "dict", "namespace", "cycler", "joiner", "lipsum"})
"""Template variables the server sets itself, and jinja's own functions: ``chat_template_kwargs`` cannot replace
them (a template calling a replaced ``namespace`` would fail as the server's error, not the request's)."""
MAX_TEMPLATE_KWARGS_BYTES = 16384


def check_template_kwargs(kwargs: Any, field: str = "chat_template_kwargs") -> dict:
    """``chat_template_kwargs`` checked (ValueError naming ``field``): an object of at most 16 KiB of JSON whose keys
    are identifiers the server does not set itself."""
    if not isinstance(kwargs, dict):
        raise ValueError(f"{field} must be an object, got {type(kwargs).__name__}")
    for k in kwargs:
        if not isinstance(k, str) or not k.isidentifier():
            raise ValueError(f"{field}: {k!r} is not a template variable name")
        if k in TEMPLATE_RESERVED:
            raise ValueError(f"{field}.{k} is set by the server and cannot be given")
    try:
        size = len(json.dumps(kwargs))
    except (TypeError, ValueError):
        raise ValueError(f"{field} must hold JSON values") from None
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise ValueError(f"{field} is {size} bytes of JSON; at most {MAX_TEMPLATE_KWARGS_BYTES}")
    return dict(kwargs)


def relabel_chat_error(message: str, where: Sequence[str], renames: Sequence[tuple[str, str]],
                       messages_field: str = "messages", parameters_field: str = "parameters") -> str:
    """A chat-path error message about a request translated from another API (Responses, Anthropic's Messages) ->
    naming that API's field: ``messages[k]`` -> ``where[k]`` (the field chat message k came from; past them,
    ``messages_field``), ``tools[i].function.parameters`` -> ``tools[i].<parameters_field>``, other
    ``tools[i].function.x`` -> ``tools[i].x``, then the first of ``renames`` (a chat field, that API's name) that
    leads the message as a whole name."""
    m = re.match(r"messages\[(\d+)\]", message)
    if m and int(m.group(1)) < len(where):
        return where[int(m.group(1))] + message[m.end():]
    if message.startswith("messages"):
        return messages_field + message[len("messages"):]
    message = re.sub(r"^tools\[(\d+)\]\.function\.parameters\b", rf"tools[\1].{parameters_field}", message)
    message = re.sub(r"^tools\[(\d+)\]\.function\.", r"tools[\1].", message)
    for chat_name, name in renames:
        if re.match(rf"{re.escape(chat_name)}\b", message):
            return name + message[len(chat_name):]
    return message


def message_dicts(req: ChatCompletionRequest) -> list[dict]:
    """Messages as the chat template takes them (text parts of a multi-part content joined)."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        d: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
        thought = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if thought is not None:
            d["reasoning_content"] = thought
        out.append(d)
    return out


def _template_call(call: dict, where: str) -> dict:
    """A past call as chat templates read it (transformers' convention, as vLLM passes it): ``function.arguments``
    a dict, not the JSON text the API carries."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}.function.name must be a string")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ValueError(f"{where}.function.arguments is not valid JSON") from None
    return {**call, "function": {**fn, "arguments": args}}


def _put(field: str, assign: Callable[[], Any]) -> None:
    """Run one assignment into a GenerateRequest; a value the wire type cannot hold (an integer past int32 or
    uint64, say) becomes a ValueError naming the request's field instead of protobuf's bare "Value out of range"."""
    try:
        assign()
    except (ValueError, TypeError, OverflowError) as e:
        raise ValueError(f"{field}: {e} (outside what the field can hold)") from None


def to_generate_request(req: _Sampling, *, prompt: Optional[str] = None, token_ids: Optional[list[int]] = None,
                        logprobs: Optional[int] = None, max_tokens: Optional[int] = None,
                        seed: Optional[int] = None) -> pdserve_pb2.GenerateRequest:
    """The gRPC-shaped request the router validates (one choice of one prompt)."""
    g = pdserve_pb2.GenerateRequest(ignore_eos=req.ignore_eos, skip_special_tokens_off=not req.skip_special_tokens)
    if prompt is not None:
        g.prompt = prompt
    if token_ids is not None:
        _put("prompt", lambda: g.token_ids.extend(token_ids))
    if max_tokens is not None:
        _put("max_tokens", lambda: setattr(g, "max_tokens", max_tokens))
    if isinstance(req.stop, str):
        g.stop.append(req.stop)
    elif req.stop:
        g.stop.extend(req.stop)
    if req.stop_token_ids:
        _put("stop_token_ids", lambda: g.stop_token_ids.extend(req.stop_token_ids))
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", "min_tokens"):
        v = getattr(req, name)
        if v is not None:
            _put(name, lambda: setattr(g, name, v))
    if seed is not None:
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        _put("seed", lambda: setattr(g, "seed", seed))
    if logprobs is not None:
        _put("logprobs", lambda: setattr(g, "logprobs", logprobs))
    if req.use_beam_search:
        if req.stream:
            raise ValueError("stream: beam search answers once the search ends; use stream: false")
        _put("n", lambda: setattr(g, "beam_width", req.n))
        if req.length_penalty is not None:
            _put("length_penalty", lambda: setattr(g, "length_penalty", req.length_penalty))
        if req.early_stopping is not None:
            g.early_stopping = str(req.early_stopping).lower()
    elif req.length_penalty is not None or req.early_stopping is not None:
        raise ValueError("length_penalty and early_stopping need use_beam_search: true")
    for t, b in (req.logit_bias or {}).items():
        try:
            g.logit_bias[int(t)] = b
        except (ValueError, OverflowError):
            raise ValueError(f"logit_bias keys must be token ids, got {t!r}") from None
    if req.allowed_token_ids is not None:
        if not req.allowed_token_ids:
            raise ValueError("allowed_token_ids is empty: no token could be generated")
        _put("allowed_token_ids", lambda: g.allowed_token_ids.extend(req.allowed_token_ids))
    if req.bad_words:
        g.bad_words.extend(req.bad_words)
    if req.priority:
        _put("priority", lambda: setattr(g, "priority", req.priority))
    if req.cache_salt is not None:
        if not req.cache_salt:
            raise ValueError("cache_salt must be a non-empty string")
        g.cache_salt = req.cache_salt
    if req.truncate_prompt_tokens is not None:
        _put("truncate_prompt_tokens", lambda: setattr(g, "truncate_prompt_tokens", req.truncate_prompt_tokens))
    return g


def to_generate_requests(body: _Sampling, chat: bool, limits: ModelLimits,
                         chat_ids: Callable[[ChatCompletionRequest], list[int]]) -> list[pdserve_pb2.GenerateRequest]:
    """One GenerateRequest per prompt, whose ``n`` choices share its prefill (choice i samples with seed + i).
    ``chat_ids`` renders a chat's messages to prompt ids. LookupError: a model not served (neither the model nor
    one of its LoRA adapters); ValueError names the field."""
    lora = limits.lora_of(body.model)
    if not 1 <= body.n <= SamplingParams.MAX_N:
        raise ValueError(f"n must be in [1, {SamplingParams.MAX_N}], got {body.n}")
    prompt_lp = body.prompt_logprobs
    if prompt_lp is not None and body.stream:
        if prompt_lp != 0:
            raise ValueError("prompt_logprobs is not available when stream is true (as in vLLM)")
        prompt_lp = None
    if chat:
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        lp = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        prompts: list = [chat_ids(body)]
    else:
        if body.suffix or (body.best_of not in (None, 1, body.n)):
            raise ValueError("suffix and best_of are not supported")
        if body.echo and body.logprobs is not None and not body.use_beam_search:
            # the prompt's own logprobs go before the answer's: ask for them with as many alternatives
            prompt_lp = body.logprobs if prompt_lp is None else max(prompt_lp, body.logprobs)
        max_tokens, lp = body.max_tokens, body.logprobs
        p = body.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts:
            raise ValueError("prompt is empty")
    out = []
    for prompt in prompts:
        kw = dict(prompt=prompt) if isinstance(prompt, str) else dict(token_ids=list(prompt))
        g = to_generate_request(body, logprobs=lp, max_tokens=max_tokens, seed=body.seed, **kw)
        if lora is not None:
            g.model = lora
        if prompt_lp is not None:
            _put("prompt_logprobs", lambda: setattr(g, "prompt_logprobs", prompt_lp))
        if body.use_beam_search:
            if body.n > MAX_BEAM_WIDTH:
                raise ValueError(f"n (the beam width, with use_beam_search) must be in [1, {MAX_BEAM_WIDTH}], "
                                 f"got {body.n}")
        else:
            g.n = body.n
        out.append(g)
    return out


def render_chat(body: Any, tokenizer: Any, tools: Optional[list[dict]] = None) -> str:
    """A chat's messages (and tools) through the model's chat template (ValueError names the field)."""
    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError("messages: this model has no chat template; use /v1/completions")
    add_gen = body.add_generation_prompt and not body.continue_final_message
    extra = getattr(body, "chat_template_kwargs", None)
    extra = check_template_kwargs(extra) if extra else {}
    try:
        return tokenizer.apply_chat_template(message_dicts(body), add_generation_prompt=add_gen, tools=tools,
                                             continue_final_message=body.continue_final_message, **extra)
    except ValueError as e:
        raise ValueError(f"messages: {e}") from None


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer: Any, limits: ModelLimits,
                    tools: Optional[list[dict]] = None) -> list[int]:
    """A chat's messages through the model's chat template, as prompt token ids (ValueError names the field)."""
    check_generates(limits, "chat")  # (said before the template is looked for)
    text = render_chat(body, tokenizer, tools)
    if (limits.max_prompt_bytes is not None and getattr(body, "truncate_prompt_tokens", None) is None
            and len(text.encode("utf-8", "surrogatepass")) > limits.max_prompt_bytes):
        raise ValueError(f"messages: the conversation is longer than the context length "
                         f"({limits.max_context_length} tokens) can hold")
    return tokenizer.encode(text, add_special_tokens=False)  # the template already has the special tokens


class TokenizeCompletionRequest(BaseModel):
    """vLLM's ``POST /tokenize`` with a prompt."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ToolFields):
    """vLLM's ``POST /tokenize`` with chat messages (rendered by the chat template, tools included)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` (router/lora_admin.py)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/unload_lora_adapter`` (``lora_int_id``, vLLM's engine-internal id, is accepted and
    ignored)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: Optional[int] = None


def tokenize_json(body: Union[TokenizeCompletionRequest, TokenizeChatRequest], tokenizer: Any,
                  limits: ModelLimits) -> dict:
    """vLLM's /tokenize answer: ``count``, ``max_model_len``, ``tokens`` (and ``token_strs`` when asked). A text
    longer than any prompt the context could hold is refused before it is tokenized (ValueError)."""
    if isinstance(body, TokenizeChatRequest):
        text, where = render_chat(body, tokenizer, template_tools(body)), "messages"
    else:
        text, where = body.prompt, "prompt"
    if limits.max_prompt_bytes is not None and len(text.encode("utf-8", "surrogatepass")) > limits.max_prompt_bytes:
        raise ValueError(f"{where}: the text is longer than the context length ({limits.max_context_length} "
                         f"tokens) can hold")
    ids = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    return {"count": len(ids), "max_model_len": limits.max_context_length, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None}
