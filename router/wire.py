"""Conversions between the router's values and the worker wire protocol (``proto/worker.proto``).

Lifecycle: stateless helpers. The router turns a validated ``SamplingParams`` into
``WireSamplingParams`` once per request (``RequestScope``), reads the workers'
``pdserve.v1.TokenLogprob``s into the engine's ``TokenLogprob`` for its front-end-neutral
events, and the gRPC front end renders those back into the public message. The worker side
has its own mirror (``worker_common.wire``): ``proto/`` imports nothing of the project.
"""
from __future__ import annotations

from typing import Optional, Sequence

from engine import SamplingParams, StructuredOutputsParams, TokenLogprob
from proto import pdserve_pb2, worker_pb2


def params_to_wire(p: SamplingParams, lora_root: int = 0) -> worker_pb2.WireSamplingParams:
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
    if p.prompt_logprobs is not None:
        w.prompt_logprobs = p.prompt_logprobs
    if p.logit_bias:
        w.logit_bias.update(p.logit_bias)
    w.priority = p.priority
    if p.cache_salt:
        w.cache_salt = p.cache_salt
    if p.allowed_token_ids is not None:
        w.allowed_token_ids.extend(p.allowed_token_ids)
    for seq in p.bad_words_token_ids or ():
        w.bad_words_token_ids.add(ids=seq)
    if p.reasoning_end_token_ids is not None:
        w.reasoning_end_token_ids.extend(p.reasoning_end_token_ids)
        w.reasoning_start_token_ids.extend(p.reasoning_start_token_ids or ())
        if p.thinking_token_budget is not None:
            w.thinking_token_budget = p.thinking_token_budget
    if p.structured_outputs is not None:
        w.structured_outputs.CopyFrom(structured_outputs_to_proto(p.structured_outputs))
    if p.lora_name is not None:
        w.lora_name = p.lora_name
        w.lora_root = lora_root  # (the adapter's weights as admitted: workers check it)
    return w


def structured_outputs_to_proto(so: StructuredOutputsParams) -> pdserve_pb2.StructuredOutputs:
    """The constraint as the public/worker message (a schema travels as canonical JSON text)."""
    k = so.kind
    if k == "json":
        return pdserve_pb2.StructuredOutputs(json=so.schema_text())
    if k == "json_object":
        return pdserve_pb2.StructuredOutputs(json_object=True)
    if k == "choice":
        return pdserve_pb2.StructuredOutputs(choice=pdserve_pb2.StructuredOutputs.Choices(choice=so.choice))
    return pdserve_pb2.StructuredOutputs(**{k: getattr(so, k)})


def structured_outputs_from_proto(m: pdserve_pb2.StructuredOutputs) -> StructuredOutputsParams:
    """The public message's constraint; ValueError naming ``structured_outputs.<field>`` (none set, an empty
    choice list, a false json_object, a schema that is not JSON...)."""
    k = m.WhichOneof("constraint")
    value = None if k is None else m.choice.choice if k == "choice" else getattr(m, k)
    return StructuredOutputsParams.of_field(k, value)


def logprobs_from_wire(msgs: Sequence[pdserve_pb2.TokenLogprob]) -> list[TokenLogprob]:
    return [TokenLogprob(token_id=m.token_id, logprob=m.logprob, top=[(t.token_id, t.logprob) for t in m.top],
                         rank=m.rank if m.HasField("rank") else None)
            for m in msgs]


def logprobs_to_public(lps: Optional[Sequence[TokenLogprob]]) -> list[pdserve_pb2.TokenLogprob]:
    return [pdserve_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                     top=[pdserve_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
                                     rank=lp.rank)
            for lp in lps or []]
