"""Conversions between the engine's data objects and the worker wire messages, on the worker side.

Lifecycle: stateless helpers. The router turns a validated ``engine.SamplingParams`` into a
``WireSamplingParams`` once per request (its own ``params_to_wire``); each worker turns it back
with ``wire_to_params`` before handing it to its engine. Workers turn the engine's
``TokenLogprob``s into ``pdserve.v1.TokenLogprob`` for the router, which forwards them to the
client unchanged; a decode worker turns the prefill worker's first-token logprob back with
``logprob_from_proto``. ``proto/`` imports nothing of the project, so these live here.
"""
from __future__ import annotations

from typing import Optional

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.structured_outputs import StructuredOutputsParams
from proto import pdserve_pb2, worker_pb2


def wire_to_params(w: worker_pb2.WireSamplingParams) -> SamplingParams:
    """The engine's SamplingParams of a wire message; raises ValueError (naming the field) on bad values.

    Every field is read explicitly (the router sets them all), so a default on either side never
    decides a request's sampling; ``seed`` and ``logprobs`` stay None unless present."""
    return SamplingParams(
        max_tokens=w.max_tokens, min_tokens=w.min_tokens, temperature=w.temperature, top_p=w.top_p,
        top_k=w.top_k, min_p=w.min_p, typical_p=w.typical_p, repetition_penalty=w.repetition_penalty,
        frequency_penalty=w.frequency_penalty, presence_penalty=w.presence_penalty,
        seed=w.seed if w.HasField("seed") else None, stop=list(w.stop),
        stop_token_ids=list(w.stop_token_ids), ignore_eos=w.ignore_eos,
        logprobs=w.logprobs if w.HasField("logprobs") else None,
        prompt_logprobs=w.prompt_logprobs if w.HasField("prompt_logprobs") else None,
        skip_special_tokens=w.skip_special_tokens,
        logit_bias=dict(w.logit_bias) or None,
        allowed_token_ids=list(w.allowed_token_ids) or None,
        priority=w.priority,
        cache_salt=w.cache_salt or None,
        bad_words_token_ids=[list(s.ids) for s in w.bad_words_token_ids] or None,
        structured_outputs=(structured_outputs_from_proto(w.structured_outputs)
                            if w.HasField("structured_outputs") else None),
        lora_name=w.lora_name or None,
        reasoning_end_token_ids=list(w.reasoning_end_token_ids) or None,
        reasoning_start_token_ids=list(w.reasoning_start_token_ids) or None,
        thinking_token_budget=w.thinking_token_budget if w.HasField("thinking_token_budget") else None,
    )


def structured_outputs_from_proto(m: pdserve_pb2.StructuredOutputs) -> StructuredOutputsParams:
    """The constraint of a (router-checked) message; ValueError naming ``structured_outputs.<field>``."""
    k = m.WhichOneof("constraint")
    value = None if k is None else m.choice.choice if k == "choice" else getattr(m, k)
    return StructuredOutputsParams.of_field(k, value)


def logprob_to_proto(lp: TokenLogprob) -> pdserve_pb2.TokenLogprob:
    """One chosen token's logprob (and its top alternatives, most likely first) as the public message."""
    return pdserve_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[pdserve_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top], rank=lp.rank)


def logprobs_to_proto(lps: Optional[list[TokenLogprob]]) -> list[pdserve_pb2.TokenLogprob]:
    """``logprob_to_proto`` of each; None (logprobs not asked for) gives an empty list."""
    return [logprob_to_proto(lp) for lp in lps or []]


def prompt_logprobs_to_proto(lps: Optional[list[Optional[TokenLogprob]]]) -> list[pdserve_pb2.TokenLogprob]:
    """An engine output's prompt logprobs (None first) as the wire's list, which leaves that None out."""
    return [logprob_to_proto(lp) for lp in (lps or [])[1:]]


def logprob_from_proto(m: pdserve_pb2.TokenLogprob) -> TokenLogprob:
    """Inverse of ``logprob_to_proto``."""
    return TokenLogprob(token_id=m.token_id, logprob=m.logprob, top=[(t.token_id, t.logprob) for t in m.top],
                        rank=m.rank if m.HasField("rank") else None)
