"""The OpenAI-compatible request and response shapes the HTTP front end speaks.

Lifecycle: stateless functions, and one renderer per response. ``router.http_api`` parses a
request body into ``CompletionRequest`` or ``ChatCompletionRequest`` (pydantic, at the external
boundary; unknown fields are ignored as OpenAI's own server does), turns it into the same
``pdserve.v1.GenerateRequest``s the gRPC front end receives (``to_generate_requests``: one per
prompt, its ``n`` choices sharing it), so both front ends share one validation path, and renders
the flow's ``FlowEvent``s back into OpenAI's JSON: a whole response (``ResponseBody``: ``add``
each event, then ``json()``) or server-sent events (``EventStream``: ``chunk`` per event, then
``end()``), with usage, logprobs and errors (``error_body``) in OpenAI's shapes; given a ``ToolCallParser``
both read tool calls out of each chat answer (``message.tool_calls``, streamed ``tool_calls`` deltas,
``finish_reason: "tool_calls"``), and ``echo`` puts each prompt before its completion (with ``logprobs``, the
prompt tokens' logprobs before the answer's, the first one null); vLLM's ``prompt_logprobs`` come back as
``choices[i].prompt_logprobs`` (completions) or a top-level ``prompt_logprobs`` (chat). Also vLLM's /tokenize and
/detokenize bodies (``tokenize_json``). Field names follow OpenAI's API, plus vLLM's extras with vLLM's names.
"""
from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Any, Callable, Optional, Union

import grpc
from pydantic import BaseModel, ConfigDict, Field

from engine import SamplingParams, TokenLogprob
from proto import pdserve_pb2
from router.events import FlowError, FlowEvent, Usage
from router.openai_structured import ConstraintFields, ToolFields, template_tools
from router.tool_parsers import ArgsDelta, CallStart, ContentDelta, ToolCallParser, ToolCallStream, new_tool_call_id
from router.validation import MAX_BEAM_WIDTH, ModelLimits

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
"""The HTTP status of each gRPC status a flow can end with (500 for the rest)."""

_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": _ERROR_TYPE.get(status, "server_error"), "param": param,
                      "code": status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(ConstraintFields):
    """Fields both endpoints share (OpenAI's, then vLLM's extras); ``response_format`` and vLLM's
    ``structured_outputs`` come from ``ConstraintFields`` (``router.openai_structured``)."""

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


class ChatCompletionRequest(_Sampling, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False


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
    return g


def to_generate_requests(body: _Sampling, chat: bool, model_name: str,
                         chat_ids: Callable[[ChatCompletionRequest], list[int]]) -> list[pdserve_pb2.GenerateRequest]:
    """One GenerateRequest per prompt, whose ``n`` choices share its prefill (choice i samples with seed + i).
    ``chat_ids`` renders a chat's messages to prompt ids. LookupError: another model; ValueError names the field."""
    if body.model is not None and body.model != model_name:
        raise LookupError(f"model {body.model!r} does not exist; this server serves {model_name!r}")
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
    try:
        return tokenizer.apply_chat_template(message_dicts(body), add_generation_prompt=add_gen, tools=tools,
                                             continue_final_message=body.continue_final_message)
    except ValueError as e:
        raise ValueError(f"messages: {e}") from None


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer: Any, limits: ModelLimits,
                    tools: Optional[list[dict]] = None) -> list[int]:
    """A chat's messages through the model's chat template, as prompt token ids (ValueError names the field)."""
    text = render_chat(body, tokenizer, tools)
    if limits.max_prompt_bytes is not None and len(text.encode("utf-8", "surrogatepass")) > limits.max_prompt_bytes:
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
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    tokens: list[int]


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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_json(usages: list[Usage], prompt_tokens: int, timings: Optional[list] = None) -> dict:
    """OpenAI's usage block; with ``timings`` (``pdserve_timings`` asked for), pdserve's phases of each prompt."""
    completion = sum(u.completion_tokens for u in usages)
    cached = max((u.cached_tokens for u in usages), default=0)
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
           "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}
    if timings is not None:
        out["pdserve_timings"] = [timings_json(t) for t in timings]
    return out


def timings_json(t: Any) -> dict:
    """A flow's ``router.events.Timings`` as the ``pdserve_timings`` extension shows it: seconds, TTFT's parts
    (placement + worker_queue + prefill + delivery = ttft), then the KV transfer and the decode."""
    if t is None:
        return {}
    return {"ttft_s": t.ttft_s, "placement_s": t.placement_s, "worker_queue_s": t.worker_queue_s,
            "prefill_s": t.prefill_s, "delivery_s": t.delivery_s, "kv_transfer_s": t.kv_transfer_s,
            "decode_s": t.decode_s, "total_s": t.total_s}


def completion_logprobs(ev: FlowEvent, detok: Any, offset: int) -> Optional[dict]:
    """OpenAI completions' logprobs block for the tokens of one event."""
    if ev.logprobs is None:
        return None
    tokens = [detok(t) for t in ev.token_ids]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in ev.logprobs],
            "top_logprobs": [{detok(t): v for t, v in lp.top} for lp in ev.logprobs], "text_offset": offsets}


def prompt_logprobs_json(lps: Optional[list[Optional[TokenLogprob]]], detok: Any) -> Optional[list]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token {token id: {logprob, rank,
    decoded_token}} holding the actual token (rank: its vocabulary rank) and the top-k (rank 1..k)."""
    if lps is None:
        return None
    out: list = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": v, "rank": r, "decoded_token": detok(t)} for r, (t, v) in enumerate(lp.top, 1)}
        entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": detok(lp.token_id)}
        out.append(entry)
    return out


def echo_logprobs(first_token: int, lps: list[Optional[TokenLogprob]], detok: Any) -> dict:
    """The completions logprobs block of an echoed prompt: its tokens from offset 0, the first one's logprob
    (and top alternatives) null, as vLLM gives them."""
    tokens = [detok(first_token)] + [detok(lp.token_id) for lp in lps[1:]]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [None] + [lp.logprob for lp in lps[1:]],
            "top_logprobs": [None] + [{detok(t): v for t, v in lp.top} for lp in lps[1:]], "text_offset": offsets}


def chat_logprobs(ev: FlowEvent, detok: Any) -> Optional[dict]:
    """OpenAI chat's logprobs block for the tokens of one event."""
    if ev.logprobs is None:
        return None

    def entry(tok: int, lp: float) -> dict:
        s = detok(tok)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(a, b) for a, b in lp.top]}
                        for t, lp in zip(ev.token_ids, ev.logprobs)]}


def created() -> int:
    return int(time.time())



def detokenizer(tokenizer: Any) -> Callable[[int], str]:
    """One token id's text, as logprobs blocks show it (the id itself when the model has no tokenizer)."""
    return (lambda t: tokenizer.decode([t], skip_special_tokens=False)) if tokenizer is not None else str


def flow_error(e: FlowError) -> tuple[int, dict]:
    """The HTTP status and OpenAI error body of a flow's failure."""
    status = HTTP_STATUS.get(e.code, 500)
    return status, error_body(status, e.message)


def _finish_reason(reason: Optional[str], parser: Optional[ToolCallParser], called: bool) -> Optional[str]:
    """OpenAI's: an answer that ended by itself in tool calls finished with "tool_calls" (a named function's call
    is the answer itself: "stop", as OpenAI has it)."""
    if reason == "stop" and called and parser is not None and parser.kind != "named":
        return "tool_calls"
    return reason


def tool_calls_json(calls: list) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def _joined(first: dict, then: Optional[dict]) -> dict:
    """Two completions logprobs blocks, one after the other."""
    return first if then is None else {k: v + then[k] for k, v in first.items()}


def _cumulative_offsets(block: Optional[dict]) -> None:
    """An echoed block's text_offset as vLLM counts it: each token's string after all those before it."""
    if block is not None:
        pos, block["text_offset"] = 0, []
        for t in block["tokens"]:
            block["text_offset"].append(pos)
            pos += len(t)


class ResponseBody:
    """A whole (non-streamed) response: ``add`` each choice's events, then ``json()``. ``tool_parser`` reads
    each chat answer's tool calls; ``echo`` is each choice's prompt text, put before its answer, and
    ``echo_first`` (echo with logprobs) each choice's first prompt token: the prompt's logprobs block goes before
    the answer's. Choices come ``n_per_prompt`` to a prompt, whose first carries its ``prompt_logprobs``."""

    def __init__(self, rid: str, chat: bool, model: str, n: int, n_prompt: int, detok: Callable[[int], str],
                 tool_parser: Optional[ToolCallParser] = None, echo: Optional[list[str]] = None,
                 n_per_prompt: int = 1, echo_first: Optional[list[int]] = None) -> None:
        self.rid, self.chat, self.model, self.n_prompt, self._detok = rid, chat, model, n_prompt, detok
        self.tool_parser = tool_parser
        self.texts: list[str] = list(echo) if echo is not None else [""] * n
        self.reasons: list[Optional[str]] = [None] * n
        self.logprobs: list[Optional[dict]] = [None] * n
        self.prompt_logprobs: list[Optional[list]] = [None] * n
        self.usages: list[Usage] = []
        self.timings: list = []
        self.with_timings = False
        """``pdserve_timings`` asked for: the usage block carries each prompt's timings."""
        self._n_per, self._echo_first = n_per_prompt, echo_first

    def add(self, idx: int, ev: FlowEvent) -> None:
        if ev.prompt_logprobs is not None:  # the prompt's: every choice of it shows them
            g0 = idx - idx % self._n_per
            for j in range(g0, g0 + self._n_per):
                self.prompt_logprobs[j] = ev.prompt_logprobs
                if self._echo_first is not None:
                    self.logprobs[j] = _joined(echo_logprobs(self._echo_first[j], ev.prompt_logprobs, self._detok),
                                               self.logprobs[j])
        self.texts[idx] += ev.text
        if ev.logprobs is not None:
            block = (chat_logprobs(ev, self._detok) if self.chat
                     else completion_logprobs(ev, self._detok, len(self.texts[idx])))
            if self.logprobs[idx] is None:
                self.logprobs[idx] = block
            else:
                for k, v in block.items():
                    self.logprobs[idx][k] = self.logprobs[idx][k] + v
        if ev.finish_reason:
            self.reasons[idx] = ev.finish_reason
        if ev.usage is not None:  # the last event of a flow: its choices' tokens together
            self.usages.append(ev.usage)
            self.timings.append(ev.timings)

    def _message(self, i: int) -> tuple[dict, Optional[str]]:
        text, reason = self.texts[i], self.reasons[i]
        if self.tool_parser is None:
            return {"role": "assistant", "content": text}, reason
        found = self.tool_parser.extract(text)
        msg: dict = {"role": "assistant", "content": found.content}
        if found.calls:
            msg["tool_calls"] = tool_calls_json(found.calls)
        return msg, _finish_reason(reason, self.tool_parser, bool(found.calls))

    def json(self) -> dict:
        n = len(self.texts)
        if self.chat:
            choices = []
            for i in range(n):
                msg, reason = self._message(i)
                choices.append({"index": i, "message": msg, "logprobs": self.logprobs[i], "finish_reason": reason})
            obj = "chat.completion"
        else:
            if self._echo_first is not None:
                for block in self.logprobs:
                    _cumulative_offsets(block)
            choices = [{"index": i, "text": self.texts[i], "logprobs": self.logprobs[i],
                        "finish_reason": self.reasons[i]} for i in range(n)]
            for c, lps in zip(choices, self.prompt_logprobs):
                if lps is not None:  # (only when asked for: a plain answer keeps OpenAI's exact shape)
                    c["prompt_logprobs"] = prompt_logprobs_json(lps, self._detok)
            obj = "text_completion"
        body = {"id": self.rid, "object": obj, "created": created(), "model": self.model, "choices": choices,
                "usage": usage_json(self.usages, self.n_prompt, self.timings if self.with_timings else None)}
        if self.chat and self.prompt_logprobs[0] is not None:  # vLLM's: the one prompt's, top level
            body["prompt_logprobs"] = prompt_logprobs_json(self.prompt_logprobs[0], self._detok)
        return body


class EventStream:
    """A streamed response as server-sent events: ``chunk`` per event (an empty string when it says nothing
    new), ``error`` for a failure, ``end()`` last. With a ``tool_parser`` each chat choice's text goes through
    its own ``ToolCallStream``: content deltas and OpenAI's ``tool_calls`` deltas (a call's first delta has its
    index, id, type and name, later ones more of its arguments), as the OpenAI SDK assembles them."""

    DONE = "data: [DONE]\n\n"

    def __init__(self, rid: str, chat: bool, model: str, n_prompt: int, detok: Callable[[int], str],
                 include_usage: bool = False, tool_parser: Optional[ToolCallParser] = None,
                 echo: Optional[list[str]] = None, n_per_prompt: int = 1,
                 echo_first: Optional[list[int]] = None) -> None:
        """``echo_first``: as ``ResponseBody``'s (each choice's first chunk then holds its prompt's logprobs)."""
        self.rid, self.chat, self.model, self.n_prompt, self._detok = rid, chat, model, n_prompt, detok
        self.include_usage = include_usage
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.tool_parser = tool_parser
        self._echo = dict(enumerate(echo)) if echo is not None else {}
        self._streams: dict[int, ToolCallStream] = {}
        self._called: set[int] = set()
        self._started: set[int] = set()
        self._offsets: dict[int, int] = {}
        self.usages: list[Usage] = []
        self.timings: list = []
        self.with_timings = False
        """``pdserve_timings`` asked for: the usage chunk carries each prompt's timings."""
        self._n_per, self._echo_first = n_per_prompt, echo_first
        self._prompt_lps: dict[int, list] = {}
        """First choice of a prompt -> its prompt logprobs (they come on that choice's first event)."""

    def _data(self, choices: list, usage: Optional[dict] = None) -> str:
        body: dict = {"id": self.rid, "object": self.obj, "created": created(), "model": self.model,
                      "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def _tool_delta(self, idx: int, ev: FlowEvent, delta: dict) -> None:
        stream = self._streams.get(idx)
        if stream is None:
            stream = self._streams[idx] = self.tool_parser.stream()
        parts = stream.feed(ev.text) + (stream.finish() if ev.finish_reason else [])
        content = "".join(p.text for p in parts if isinstance(p, ContentDelta))
        if content:
            delta["content"] = content
        calls: dict[int, dict] = {}
        for p in parts:
            if isinstance(p, CallStart):
                self._called.add(idx)
                calls[p.index] = {"index": p.index, "id": new_tool_call_id(), "type": "function",
                                  "function": {"name": p.name, "arguments": ""}}
            elif isinstance(p, ArgsDelta):
                entry = calls.setdefault(p.index, {"index": p.index, "function": {"arguments": ""}})
                entry["function"]["arguments"] += p.text
        if calls:
            delta["tool_calls"] = list(calls.values())

    def chunk(self, idx: int, ev: FlowEvent) -> str:
        if self.chat:
            first = idx not in self._started
            delta: dict = {"role": "assistant"} if first else {}
            self._started.add(idx)
            if self.tool_parser is not None:
                self._tool_delta(idx, ev, delta)
                reason = _finish_reason(ev.finish_reason, self.tool_parser, idx in self._called)
            else:
                if ev.text:
                    delta["content"] = ev.text
                reason = ev.finish_reason
            lp = chat_logprobs(ev, self._detok)
            if ev.usage is not None:
                self.usages.append(ev.usage)
                self.timings.append(ev.timings)
            if not first and len(delta) == 0 and reason is None and lp is None:
                return ""  # held back by the tool parser (the start of a tag, a call's name)
            choice = {"index": idx, "delta": delta, "logprobs": lp, "finish_reason": reason}
        else:
            offset = self._offsets.get(idx, 0)
            g0 = idx - idx % self._n_per
            if ev.prompt_logprobs is not None:
                self._prompt_lps[g0] = ev.prompt_logprobs
            first = idx in self._echo
            echo = self._echo.pop(idx, "")
            text = echo + ev.text
            lp = completion_logprobs(ev, self._detok, offset + len(echo))
            if self._echo_first is not None:  # offsets count token strings from the prompt's first, as vLLM's
                if first and g0 in self._prompt_lps:
                    lp = _joined(echo_logprobs(self._echo_first[idx], self._prompt_lps[g0], self._detok), lp)
                if lp is not None:
                    ends = list(itertools.accumulate((len(t) for t in lp["tokens"]), initial=offset))
                    lp["text_offset"], self._offsets[idx] = ends[:-1], ends[-1]
            else:
                self._offsets[idx] = offset + len(text)
            choice = {"index": idx, "text": text, "finish_reason": ev.finish_reason, "logprobs": lp}
            if ev.usage is not None:
                self.usages.append(ev.usage)
                self.timings.append(ev.timings)
        return self._data([choice])

    @staticmethod
    def error(e: FlowError) -> str:
        return f"data: {json.dumps(flow_error(e)[1])}\n\n"

    def end(self) -> list[str]:
        """The closing events: the usage chunk (when asked for) and ``[DONE]``."""
        usage = usage_json(self.usages, self.n_prompt, self.timings if self.with_timings else None)
        tail = [self._data([], usage)] if self.include_usage else []
        return tail + [self.DONE]
