"""The router's front-end-neutral core over real workers: a second front end iterates ``RouterCore.generate``
and gets plain events whose tokens, text, usage and timings need no gRPC message to read.

Real router core, prefill and decode workers, gloo KV. The reference is the offline engine.
"""
from __future__ import annotations

import time

import grpc
import pytest
import torch

from engine import SamplingParams
from router.events import FlowError, FlowEvent
from router.validation import ValidatedRequest
from tests.roles.harness import offline, start_roles

PROMPT = "def events(stream):"


def _run(core, vreq: ValidatedRequest) -> list[FlowEvent]:
    cancels = []
    evs = list(core.generate(vreq, time.monotonic(), None, cancels.append))
    assert len(cancels) == 1  # the front end was handed the flow's cancel
    return evs


@pytest.mark.parametrize("local", [False, True], ids=["pair", "local-prefill"])
def test_core_events_equal_offline_for_pair_and_local_paths(local):
    torch.set_num_threads(1)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    want_ids, want_text, want_reason, want_lps = offline([PROMPT], [params])[0]
    roles = start_roles(tag="core-", router=dict(local_prefill_max_tokens=1000 if local else 0))
    try:
        core = roles.router.core
        ids = core.tokenize(PROMPT)
        p_eng = roles.prefills[0].engine
        evs = _run(core, ValidatedRequest("core-1", PROMPT, ids, params))
        assert [t for e in evs for t in e.token_ids] == want_ids
        assert "".join(e.text for e in evs) == want_text
        assert [lp.token_id for e in evs for lp in e.logprobs] == want_ids
        last = evs[-1]
        assert last.finish_reason == want_reason == "length"
        assert all(e.finish_reason is None and e.usage is None for e in evs[:-1])
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids), 24)
        t = last.timings
        assert 0 < t.ttft_s <= t.total_s and t.decode_s > 0
        # the path taken, from the prefill engine's own admission count (prompt tokens it looked up)
        assert p_eng.prefix_cache_queries == (0 if local else len(ids))
        assert roles.wait_idle(5.0)
        assert core.num_in_flight == 0
    finally:
        roles.close()


def test_core_overload_is_a_flow_error_with_status():
    roles = start_roles(tag="core-o-", router=dict(max_num_requests=1))
    try:
        core = roles.router.core
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        ids = core.tokenize(PROMPT)
        first = core.generate(ValidatedRequest("core-a", PROMPT, ids, params), time.monotonic(), None,
                              lambda cb: None)
        next(first)  # admitted and streaming: the router holds 1 request
        with pytest.raises(FlowError) as e:
            list(core.generate(ValidatedRequest("core-b", PROMPT, ids, params), time.monotonic(), None,
                               lambda cb: None))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "core-b" in e.value.message
        first.close()  # the front end went away: the flow aborts the request on its workers
        assert roles.wait_idle(5.0) and core.num_in_flight == 0
    finally:
        roles.close()
