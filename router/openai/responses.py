"""The OpenAI-compatible response shapes the HTTP front end renders.

Lifecycle: stateless functions, and one renderer per response. ``router.openai.http_api`` renders a flow's
``FlowEvent``s into OpenAI's JSON: a whole response (``ResponseBody``: ``add`` each event, then ``json()``) or
server-sent events (``EventStream``: ``chunk`` per event, then ``end()``), with usage (and pdserve's
``pdserve_timings``), logprobs and errors (``error_body``, ``flow_error``: the HTTP status of each gRPC status) in
OpenAI's shapes; given a ``ToolCallParser`` both read tool calls out of each chat answer (``message.tool_calls``,
streamed ``tool_calls`` deltas, ``finish_reason: "tool_calls"``), and ``echo`` puts each prompt before its
completion (with ``logprobs``, the prompt tokens' logprobs before the answer's, the first one null); vLLM's
``prompt_logprobs`` come back as ``choices[i].prompt_logprobs`` (completions) or a top-level ``prompt_logprobs``
(chat).
"""
from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Any, Callable, Optional, Union

import grpc

from engine import TokenLogprob
from router.events import FlowError, FlowEvent, Usage
from router.openai.reasoning import ReasoningPlan, ReasoningStream
from router.openai.tool_parsers import ArgsDelta, CallStart, ContentDelta, ToolCallParser, ToolCallStream, new_tool_call_id

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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_json(usages: list[Usage], prompt_tokens: int, timings: Optional[list] = None,
               reasoning_tokens: Optional[int] = None) -> dict:
    """OpenAI's usage block; with ``timings`` (``pdserve_timings`` asked for), pdserve's phases of each prompt;
    with ``reasoning_tokens`` (a reasoning parser), ``completion_tokens_details``."""
    completion = sum(u.completion_tokens for u in usages)
    cached = max((u.cached_tokens for u in usages), default=0)
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
           "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
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


def token_id_strings(t: int) -> str:
    """vLLM's ``return_tokens_as_token_ids``: a logprobs block names a token "token_id:<id>" (its text may not be
    JSON-encodable, or may be one of several tokens spelling the same text), text offsets and bytes counted on
    that string as vLLM counts them."""
    return f"token_id:{t}"


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


def _reasoning_tokens(plan: Optional[ReasoningPlan], ids: dict[int, list[int]]) -> Optional[int]:
    """Every choice's reasoning tokens together (None without a reasoning plan: no details block)."""
    return None if plan is None else sum(plan.reasoning_tokens(t) for t in ids.values())


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
                 n_per_prompt: int = 1, echo_first: Optional[list[int]] = None,
                 reasoning: Optional[ReasoningPlan] = None) -> None:
        """``reasoning``: a chat's ``ReasoningPlan`` on a router with a reasoning parser
        (``router.openai.reasoning``)."""
        self.rid, self.chat, self.model, self.n_prompt, self._detok = rid, chat, model, n_prompt, detok
        self.tool_parser = tool_parser
        self._reasoning = reasoning
        self._ids: dict[int, list[int]] = {}
        """A chat choice's tokens (with a reasoning plan: ``reasoning_tokens`` counts each choice's block)."""
        self.texts: list[str] = list(echo) if echo is not None else [""] * n
        self.reasons: list[Optional[str]] = [None] * n
        self.stop_reasons: list[Optional[Union[str, int]]] = [None] * n
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
        if self._reasoning is not None:
            self._ids.setdefault(idx, []).extend(ev.token_ids)
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
            self.stop_reasons[idx] = ev.stop_reason
        if ev.usage is not None:  # the last event of a flow: its choices' tokens together
            self.usages.append(ev.usage)
            self.timings.append(ev.timings)

    def _message(self, i: int) -> tuple[dict, Optional[str]]:
        text, reason = self.texts[i], self.reasons[i]
        thought: Optional[str] = None
        if self._reasoning is not None:
            thought, text = self._reasoning.split(text)
        if self.tool_parser is None:
            msg: dict = {"role": "assistant",
                         "content": text if text or self._reasoning is None or not self._reasoning.open else None}
        else:
            found = self.tool_parser.extract(text)
            msg = {"role": "assistant", "content": found.content}
            if found.calls:
                msg["tool_calls"] = tool_calls_json(found.calls)
            reason = _finish_reason(reason, self.tool_parser, bool(found.calls))
        if thought is not None:  # vLLM's name, and its older one (clients read either)
            msg["reasoning"] = msg["reasoning_content"] = thought
        return msg, reason

    def json(self) -> dict:
        n = len(self.texts)
        if self.chat:
            choices = []
            for i in range(n):
                msg, reason = self._message(i)
                choices.append({"index": i, "message": msg, "logprobs": self.logprobs[i], "finish_reason": reason,
                                "stop_reason": self.stop_reasons[i]})
            obj = "chat.completion"
        else:
            if self._echo_first is not None:
                for block in self.logprobs:
                    _cumulative_offsets(block)
            choices = [{"index": i, "text": self.texts[i], "logprobs": self.logprobs[i],
                        "finish_reason": self.reasons[i], "stop_reason": self.stop_reasons[i]} for i in range(n)]
            for c, lps in zip(choices, self.prompt_logprobs):
                if lps is not None:  # (only when asked for: a plain answer keeps OpenAI's exact shape)
                    c["prompt_logprobs"] = prompt_logprobs_json(lps, self._detok)
            obj = "text_completion"
        body = {"id": self.rid, "object": obj, "created": created(), "model": self.model, "choices": choices,
                "usage": usage_json(self.usages, self.n_prompt, self.timings if self.with_timings else None,
                                    _reasoning_tokens(self._reasoning, self._ids))}
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
                 echo_first: Optional[list[int]] = None, reasoning: Optional[ReasoningPlan] = None) -> None:
        """``echo_first``, ``reasoning``: as ``ResponseBody``'s (each choice's first chunk then holds its prompt's
        logprobs; each chat choice's text goes through a ``ReasoningStream``: ``reasoning`` deltas, then content)."""
        self.rid, self.chat, self.model, self.n_prompt, self._detok = rid, chat, model, n_prompt, detok
        self._reasoning = reasoning
        self._thinking: dict[int, ReasoningStream] = {}
        self._ids: dict[int, list[int]] = {}
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
        self.prompt_lens: Optional[list[int]] = None
        """vLLM's ``continuous_usage_stats``: each choice's prompt tokens; set, every chunk carries that choice's
        usage so far (``_generated``: its tokens until then)."""
        self._generated: dict[int, int] = {}

    def _running_usage(self, idx: int, ev: FlowEvent) -> Optional[dict]:
        """A chunk's usage under ``continuous_usage_stats`` (vLLM's: the choice's prompt and its tokens so far)."""
        if self.prompt_lens is None:
            return None
        done = self._generated[idx] = self._generated.get(idx, 0) + len(ev.token_ids)
        n = self.prompt_lens[idx] if idx < len(self.prompt_lens) else 0
        return {"prompt_tokens": n, "completion_tokens": done, "total_tokens": n + done}

    def _data(self, choices: list, usage: Optional[dict] = None) -> str:
        body: dict = {"id": self.rid, "object": self.obj, "created": created(), "model": self.model,
                      "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def _reasoning_delta(self, idx: int, ev: FlowEvent, delta: dict) -> str:
        """The event's text through the choice's ``ReasoningStream``: its reasoning into ``delta``; the content
        returned."""
        stream = self._thinking.get(idx)
        if stream is None:
            stream = self._thinking[idx] = self._reasoning.stream()
        if self.include_usage:  # (only the usage chunk counts reasoning tokens)
            self._ids.setdefault(idx, []).extend(ev.token_ids)
        thought, text = stream.step(ev.text, bool(ev.finish_reason))
        if thought and self._reasoning.include:
            delta["reasoning"] = delta["reasoning_content"] = thought
        return text

    def _tool_delta(self, idx: int, text: str, final: bool, delta: dict) -> None:
        stream = self._streams.get(idx)
        if stream is None:
            stream = self._streams[idx] = self.tool_parser.stream()
        parts = stream.feed(text) + (stream.finish() if final else [])
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
        usage = self._running_usage(idx, ev)  # (counted even for a chunk the tool parser holds back)
        if self.chat:
            first = idx not in self._started
            delta: dict = {"role": "assistant"} if first else {}
            self._started.add(idx)
            text = self._reasoning_delta(idx, ev, delta) if self._reasoning is not None else ev.text
            if self.tool_parser is not None:
                self._tool_delta(idx, text, bool(ev.finish_reason), delta)
                reason = _finish_reason(ev.finish_reason, self.tool_parser, idx in self._called)
            else:
                if text:
                    delta["content"] = text
                reason = ev.finish_reason
            lp = chat_logprobs(ev, self._detok)
            if ev.usage is not None:
                self.usages.append(ev.usage)
                self.timings.append(ev.timings)
            if not first and len(delta) == 0 and reason is None and lp is None:
                return ""  # held back by a parser (the start of a tag or a marker, a call's name)
            choice = {"index": idx, "delta": delta, "logprobs": lp, "finish_reason": reason}
            if reason is not None:
                choice["stop_reason"] = ev.stop_reason
            return self._data([choice], usage)
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
            if ev.finish_reason is not None:
                choice["stop_reason"] = ev.stop_reason
            if ev.usage is not None:
                self.usages.append(ev.usage)
                self.timings.append(ev.timings)
        return self._data([choice], usage)

    @staticmethod
    def error(e: FlowError) -> str:
        return f"data: {json.dumps(flow_error(e)[1])}\n\n"

    def end(self) -> list[str]:
        """The closing events: the usage chunk (when asked for) and ``[DONE]``."""
        usage = usage_json(self.usages, self.n_prompt, self.timings if self.with_timings else None,
                           _reasoning_tokens(self._reasoning, self._ids))
        tail = [self._data([], usage)] if self.include_usage else []
        return tail + [self.DONE]
