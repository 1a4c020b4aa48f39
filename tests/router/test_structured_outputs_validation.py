"""The router's check of ``GenerateRequest.structured_outputs`` (router/validation.py + router/wire.py).

``validate_generate`` compiles the constraint against the model's real tokenizer (``engine.check_structured_outputs``,
llguidance) before the request is placed, so a bad one never reaches a worker: each case here is a ValueError
naming the field (the servicer's INVALID_ARGUMENT; tests/e2e/test_structured_outputs_cluster.py sees the status
through a cluster). A good constraint comes out in ``SamplingParams`` and survives the worker wire unchanged.
"""
from __future__ import annotations

import pytest

from engine import StructuredOutputsParams, Tokenizer
from proto import pdserve_pb2
from router.validation import ModelLimits, validate_generate
from router.wire import params_to_wire
from worker_common.wire import wire_to_params

SO = pdserve_pb2.StructuredOutputs
TOK = Tokenizer.builtin()
LIMITS = ModelLimits(model_name="tiny", max_context_length=512, vocab_size=8192, eos_token_id=1)


def _validate(so: SO, **kw):
    return validate_generate(pdserve_pb2.GenerateRequest(prompt="hi", structured_outputs=so, **kw), LIMITS,
                             TOK.encode, TOK)


@pytest.mark.parametrize("so, kw, match", [
    (SO(json='{"type": "objekt"}'), {}, r"structured_outputs\.json: .*objekt"),
    (SO(json='{"type": "object", "if": {}}'), {}, r"structured_outputs\.json: Unimplemented keys"),
    (SO(json='{"type": '), {}, r"structured_outputs\.json is not valid JSON"),
    (SO(regex="a(b"), {}, r"structured_outputs\.regex: .*unclosed group"),
    (SO(grammar="start: foo"), {}, r"structured_outputs\.grammar: .*unknown name"),
    (SO(choice=SO.Choices()), {}, r"structured_outputs\.choice must not be empty"),
    (SO(), {}, r"structured_outputs is set but empty"),
    (SO(json_object=False), {}, r"structured_outputs\.json_object must be true"),
    (SO(regex=r"[^\x00-\x{10FFFF}]"), {}, r"structured_outputs\.regex: no token"),
    (SO(regex="[a-z]+"), {"beam_width": 2}, r"structured_outputs cannot be used with beam_width"),
    (SO(regex="(a{1000}){1000}"), {}, r"structured_outputs\.regex: too complex for the parser's limits"),
])
def test_bad_constraints_name_the_field(so, kw, match):
    with pytest.raises(ValueError, match=match):
        _validate(so, **kw)


@pytest.mark.parametrize("so, want", [
    (SO(json='{"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}'),
     StructuredOutputsParams(json='{"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}')),
    (SO(json_object=True), StructuredOutputsParams(json_object=True)),
    (SO(regex=r"\d+"), StructuredOutputsParams(regex=r"\d+")),
    (SO(choice=SO.Choices(choice=["yes", "no"])), StructuredOutputsParams(choice=["yes", "no"])),
    (SO(grammar='start: "a"+'), StructuredOutputsParams(grammar='start: "a"+')),
])
def test_good_constraints_reach_the_params_and_cross_the_worker_wire(so, want):
    params = _validate(so, n=2, temperature=0.5).params
    assert params.structured_outputs.key() == want.key()
    back = wire_to_params(params_to_wire(params)).structured_outputs
    assert back.key() == want.key()  # property order of a schema is kept: it is the output's order
    assert list(back.key()[1]) == list(want.key()[1])
