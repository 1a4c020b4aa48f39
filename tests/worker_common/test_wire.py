"""worker_common.wire: wire sampling params -> engine params, engine logprobs <-> public messages."""
from __future__ import annotations

import pytest

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2, worker_pb2
from router.wire import params_to_wire  # the router's side of the wire
from worker_common.wire import logprob_from_proto, logprob_to_proto, logprobs_to_proto, wire_to_params

# every field away from its default, and no two numeric fields equal, so a swapped or dropped field shows
FULL = SamplingParams(max_tokens=33, min_tokens=2, temperature=0.7, top_p=0.8, top_k=13, min_p=0.05,
                      typical_p=0.9, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.4,
                      seed=1234, stop=["\n\n", "END"], stop_token_ids=[2, 9], ignore_eos=True, logprobs=3,
                      skip_special_tokens=False)


def test_wire_to_params_reads_every_field():
    w = worker_pb2.WireSamplingParams(
        max_tokens=33, min_tokens=2, temperature=0.7, top_p=0.8, top_k=13, min_p=0.05, typical_p=0.9,
        repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.4, seed=1234, stop=["\n\n", "END"],
        stop_token_ids=[2, 9], ignore_eos=True, logprobs=3, skip_special_tokens=False)
    assert wire_to_params(w) == FULL


def test_params_round_trip_through_the_wire():
    assert wire_to_params(params_to_wire(FULL)) == FULL
    plain = SamplingParams(max_tokens=5)
    back = wire_to_params(params_to_wire(plain))
    assert back == plain and back.seed is None and back.logprobs is None


def test_seed_and_logprobs_zero_are_kept_apart_from_unset():
    p = SamplingParams(max_tokens=5, seed=0, logprobs=0)
    back = wire_to_params(params_to_wire(p))
    assert back.seed == 0 and back.logprobs == 0


def test_bad_wire_values_raise_value_error_naming_the_field():
    w = params_to_wire(SamplingParams(max_tokens=5))
    w.top_k = -7
    with pytest.raises(ValueError, match="top_k"):
        wire_to_params(w)


def test_logprob_round_trip_keeps_the_top_list_in_order():
    lp = TokenLogprob(token_id=17, logprob=-0.25, top=[(17, -0.25), (4, -1.5), (99, -3.0)])
    m = logprob_to_proto(lp)
    assert isinstance(m, pdserve_pb2.TokenLogprob)
    assert (m.token_id, m.logprob) == (17, -0.25)
    assert [(t.token_id, t.logprob) for t in m.top] == [(17, -0.25), (4, -1.5), (99, -3.0)]
    assert logprob_from_proto(m) == lp
    # and through bytes, as it crosses the wire
    assert logprob_from_proto(pdserve_pb2.TokenLogprob.FromString(m.SerializeToString())) == lp


def test_logprobs_to_proto_of_none_is_empty_and_keeps_order():
    assert logprobs_to_proto(None) == [] and logprobs_to_proto([]) == []
    lps = [TokenLogprob(3, -0.5), TokenLogprob(8, -0.75, [(8, -0.75)])]
    assert [logprob_from_proto(m) for m in logprobs_to_proto(lps)] == lps


def test_reasoning_fields_round_trip_and_a_zero_budget_stays_apart_from_none():
    for budget in (None, 0, 7):
        p = SamplingParams(max_tokens=9, reasoning_end_token_ids=[5, 6, 7], reasoning_start_token_ids=[3, 4],
                           thinking_token_budget=budget)
        assert wire_to_params(params_to_wire(p)) == p
    plain = wire_to_params(params_to_wire(SamplingParams(max_tokens=9, reasoning_end_token_ids=[8])))
    assert plain.reasoning_end_token_ids == [8] and plain.reasoning_start_token_ids is None
    assert plain.thinking_token_budget is None
