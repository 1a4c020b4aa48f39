"""Conversions between engine data objects and the protobuf messages.

Lifecycle: stateless helpers. The router turns a validated
``engine.SamplingParams`` into a ``WireSamplingParams`` once per request; each
worker turns it back before handing it to its engine, and the workers turn the
engine's ``TokenLogprob``s into ``pdserve.v1.TokenLogprob`` for the router,
which forwards them to the client unchanged.
"""
from __future__ import annotations

from typing import Optional

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2, worker_pb2


def params_to_wire(p: SamplingParams) -> worker_pb2.WireSamplingParams:
    """Every field set explicitly, so defaults on either side never matter."""
    w = worker_pb2.WireSamplingParams(
        max_tokens=p.max_tokens, min_tokens=p.min_tokens, temperature=p.temperature, top_p=p.top_p,
        top_k=p.top_k, min_p=p.min_p, typical_p=p.typical_p, repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
        stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens,
    )
    if p.seed is not None:
        w.seed = p.seed
    if p.logprobs is not None:
        w.logprobs = p.logprobs
    return w


def wire_to_params(w: worker_pb2.WireSamplingParams) -> SamplingParams:
    """Inverse of ``params_to_wire``; raises ValueError (naming the field) on bad values."""
    return SamplingParams(
        max_tokens=w.max_tokens, min_tokens=w.min_tokens, temperature=w.temperature, top_p=w.top_p,
        top_k=w.top_k, min_p=w.min_p, typical_p=w.typical_p, repetition_penalty=w.repetition_penalty,
        frequency_penalty=w.frequency_penalty, presence_penalty=w.presence_penalty,
        seed=w.seed if w.HasField("seed") else None, stop=list(w.stop),
        stop_token_ids=list(w.stop_token_ids), ignore_eos=w.ignore_eos,
        logprobs=w.logprobs if w.HasField("logprobs") else None,
        skip_special_tokens=w.skip_special_tokens,
    )


def logprob_to_proto(lp: TokenLogprob) -> pdserve_pb2.TokenLogprob:
    return pdserve_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[pdserve_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprob_from_proto(m: pdserve_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(token_id=m.token_id, logprob=m.logprob, top=[(t.token_id, t.logprob) for t in m.top])


def logprobs_to_proto(lps: Optional[list[TokenLogprob]]) -> list[pdserve_pb2.TokenLogprob]:
    return [logprob_to_proto(lp) for lp in lps or []]
