"""vLLM's priority scheduling on the engine (engine/scheduler.py, ``SamplingParams.priority``): lower first in the
waiting queue, the worst priority preempted first, first-come-first-served within a priority, and the tokens of
every request the same whatever the order."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

PROMPTS = ["def parse(argv):", "import os\nimport sys\n", "class Foo:\n    ", "x = [", "while True:"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    torch.set_num_threads(1)
    return LLM("tiny", num_kv_blocks=128, block_size=16, num_threads=1, max_num_seqs=1)


def greedy(n: int = 4, priority: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, priority=priority)


def _first_outputs(eng, limit: int = 400) -> list[str]:
    """Step until idle; the request ids in the order they produced their first token."""
    order: list[str] = []
    for _ in range(limit):
        if not eng.has_unfinished_requests():
            return order
        for out in eng.step():
            if out.new_token_ids and out.request_id not in order:
                order.append(out.request_id)
    raise AssertionError("engine not idle")


def test_waiting_requests_start_in_priority_then_arrival_order(llm):
    eng = llm.llm_engine
    tok = llm.get_tokenizer()
    prios = {"a": 0, "b": 0, "c": -1, "d": 5, "e": -1}
    for rid, prompt in zip(prios, PROMPTS):
        eng.add_request(rid, tok.encode(prompt), greedy(priority=prios[rid]))
    # one sequence at a time (max_num_seqs=1): the best priority first, arrival order within one
    assert _first_outputs(eng) == ["c", "e", "a", "b", "d"]
    assert eng.num_free_blocks == eng.num_total_blocks


def test_outputs_do_not_depend_on_priority(llm):
    plain = llm.generate(PROMPTS, greedy(6))
    ranked = llm.generate(PROMPTS, greedy(6), priority=[3, -2, 0, 7, -2])
    assert [o.token_ids for o in ranked] == [o.token_ids for o in plain]
    with pytest.raises(ValueError, match="priority has 2 entries"):
        llm.generate(PROMPTS, greedy(), priority=[1, 2])
    with pytest.raises(ValueError, match="priority"):
        SamplingParams(priority=2**31)


def test_when_blocks_run_out_the_worst_priority_is_preempted_though_admitted_first():
    """Two decoding sequences that cannot both finish in 9 blocks: first-come-first-served preempts the one admitted
    last; with priorities the low-priority one goes, though it was admitted first, and comes back after."""
    torch.set_num_threads(1)
    llm = LLM("tiny", num_kv_blocks=9, block_size=16, num_threads=1, max_num_seqs=4)
    eng = llm.llm_engine
    tok = llm.get_tokenizer()
    victims: list[str] = []
    real = eng.scheduler._preempt

    def spy(seq):
        victims.append(seq.request_id)
        real(seq)

    eng.scheduler._preempt = spy
    prompt = tok.encode(PROMPTS[0] * 2)
    want = llm.generate([prompt], greedy(60))[0].token_ids
    for priorities, victim in (((0, 0), "second"), ((5, 0), "first")):
        victims.clear()
        eng.add_request("first", prompt, greedy(60, priorities[0]))
        got: dict[str, list[int]] = {"first": [], "second": []}
        for out in eng.step():  # "first" is admitted (and prefilled) before "second" arrives
            got[out.request_id] += out.new_token_ids
        eng.add_request("second", prompt, greedy(60, priorities[1]))
        for _ in range(1000):
            if not eng.has_unfinished_requests():
                break
            for out in eng.step():
                got[out.request_id] += out.new_token_ids
        assert victims and set(victims) == {victim}, (priorities, victims)
        assert got == {"first": want, "second": want}
        assert eng.num_free_blocks == eng.num_total_blocks
