"""Async scheduling (``EngineConfig.async_scheduling``, engine/llm_engine.py): a decode-graph step is scheduled and
launched before the step in flight is read back, its input ids taken from that step's sampled ids on the device.

On CPU the path runs through the decode graphs' static buffers (``static_decode_buffers``): the forward is
synchronous there, so nothing overlaps, but every piece of bookkeeping a GPU run needs is the same: the placeholders
a run-ahead schedule gives each sequence, the ids carried on the device (a placeholder reaching the model would
fail: it is -1), the wasted token of a sequence that stopped while the next step ran, its blocks freed only after
that step, and the fallbacks to a waited step. The tests demand the synchronous engine's outputs bit for bit and
that the engine really ran ahead (``ahead_steps``). tests/engine/test_async_cuda.py runs it on a GPU.
"""
from __future__ import annotations

import pytest

from engine import LLM, LLMEngine, EngineConfig, SamplingParams, bad_words_token_ids
from engine.llm_engine import PLACEHOLDER

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n", "x = [", "def binary_search(items, target):\n", "while True:", "# a",
           "print(", "y", "with open(path) as f:\n", "try:\n    pass\n", "lambda"]


def _llm(async_: bool, **kw) -> LLM:
    return LLM("tiny", max_num_seqs=8, static_decode_buffers=True, async_scheduling=async_,
               enable_prefix_caching=True, **kw)


def _params(ref: list) -> list[SamplingParams]:
    """Greedy with logprobs (some with prompt logprobs), seeded draws, min_tokens, and stop tokens that end requests
    mid-stream (each the reference's 4th..9th token, so a request stops while the step after it already runs
    ahead)."""
    out = []
    for i, r in enumerate(ref):
        stop = [r.token_ids[3 + i % 6]] if i % 3 else []
        if i % 4 == 1:
            out.append(SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=100 + i, logprobs=2,
                                      stop_token_ids=stop))
        else:
            out.append(SamplingParams(max_tokens=18 + i, temperature=0.0, logprobs=1, min_tokens=2,
                                      stop_token_ids=stop, prompt_logprobs=1 if i % 4 == 2 else None))
    return out


def _step_until(done, step, limit: int = 500) -> None:
    """``step()`` until ``done()``: at most ``limit`` steps (a state the engine never reaches fails, never hangs)."""
    for _ in range(limit):
        if done():
            return
        step()
    raise AssertionError(f"not reached in {limit} steps")


def _same(a: list, b: list, tol: float = 0.0) -> None:
    """The same tokens and finish reasons; logprobs (and prompt logprobs) equal to ``tol`` with the same top ids."""
    def lps(xs: list) -> list:
        return [(t.token_id, [i for i, _ in t.top]) for t in xs]

    for x, y in zip(a, b, strict=True):
        assert (x.token_ids, x.finish_reason) == (y.token_ids, y.finish_reason)
        assert lps(x.logprobs or []) == lps(y.logprobs or [])
        assert [t.logprob for t in x.logprobs or []] == pytest.approx([t.logprob for t in y.logprobs or []],
                                                                      abs=tol, rel=0)
        assert (x.prompt_logprobs is None) == (y.prompt_logprobs is None)
        if x.prompt_logprobs is not None:
            assert [t.token_id for t in x.prompt_logprobs[1:]] == [t.token_id for t in y.prompt_logprobs[1:]]
            assert [t.logprob for t in x.prompt_logprobs[1:]] == pytest.approx(
                [t.logprob for t in y.prompt_logprobs[1:]], abs=tol, rel=0)


# every path a step can take ahead: decode graph buckets and the piecewise graphs' static buffers (default), the
# eager model (enforce_eager: no graphs), and chunked prefill in 12-token steps with 8-token blocks (most steps mix
# a chunk with decodes, through the pieces). There a run-ahead step is not always the synchronous one: a request that
# stopped still takes its wasted row of the budget, and one that finished keeps its place in the batch until it is
# read back, so a prompt may be admitted a step later or cut into other chunks, and a chunk's attention sums in
# another order: the tokens are the same, logprobs agree to float rounding (as any change of batching gives)
PATHS = {"graphs": {}, "eager": {"enforce_eager": True}, "chunked": {"max_num_batched_tokens": 12, "block_size": 8}}
TOL = {"graphs": 0.0, "eager": 0.0, "chunked": 1e-5}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_async_scheduling_gives_the_sync_engine_outputs_bit_for_bit(path):
    sync, run_ahead = _llm(False, **PATHS[path]), _llm(True, **PATHS[path])
    ref = sync.generate(PROMPTS, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    params = _params(ref)
    eng, sync_eng = run_ahead.llm_engine, sync.llm_engine
    computed = sync_eng.num_scheduled_tokens
    a = sync.generate(PROMPTS, params)
    b = run_ahead.generate(PROMPTS, params)
    _same(a, b, TOL[path])
    assert sum(o.finish_reason == "stop" for o in a) >= 6  # the stop tokens really ended requests mid-stream
    assert eng.ahead_steps >= 20, eng.ahead_steps
    ran = {"graphs": eng.graph_steps, "eager": eng.num_steps - eng.graph_steps - eng.piecewise_steps,
           "chunked": eng.piecewise_steps}[path]
    assert ran >= 10 and (path != "eager" or eng.graph_steps == eng.piecewise_steps == 0)
    # a request that stopped while the next step ran had that step compute one token for nothing
    assert eng.num_scheduled_tokens > sync_eng.num_scheduled_tokens - computed
    assert eng.num_free_blocks == eng.num_total_blocks and not eng.has_unfinished_requests()
    # prompts that continue the outputs hit the blocks the first pass named, generated tokens included (a run-ahead
    # step names its blocks only once the tokens the step before sampled are in place)
    more = [{"prompt_token_ids": o.prompt_token_ids + o.token_ids} for o in a]
    hits = (sync_eng.prefix_cache_hits, eng.prefix_cache_hits)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    _same(sync.generate(more, params), run_ahead.generate(more, params), TOL[path])
    assert eng.prefix_cache_hits - hits[1] == sync_eng.prefix_cache_hits - hits[0] >= 16 * 8


def test_requests_that_end_by_length_cost_no_wasted_token():
    """A step that may be a sequence's last by length is never run ahead: nothing past max_tokens is computed."""
    sync, run_ahead = _llm(False), _llm(True)
    params = [SamplingParams(max_tokens=5 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(PROMPTS))]
    _same(sync.generate(PROMPTS, params), run_ahead.generate(PROMPTS, params))
    assert run_ahead.llm_engine.ahead_steps >= 10
    assert run_ahead.llm_engine.num_scheduled_tokens == sync.llm_engine.num_scheduled_tokens


def test_an_abort_while_a_step_runs_ahead_frees_the_blocks_once_that_step_is_done():
    eng = LLMEngine(EngineConfig(model="tiny", max_num_seqs=4, static_decode_buffers=True, async_scheduling=True))
    ids = [[5 + i, 40 + i, 41, 42, 43] for i in range(3)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(ids):
        eng.add_request(f"r{i}", p, params)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}

    def step() -> None:
        for out in eng.step():
            got[out.request_id] += out.new_token_ids

    _step_until(lambda: eng.ahead_steps >= 3, step)
    assert eng._inflight is not None and len(got["r1"]) >= 3
    held = len(eng.get_block_table("r1"))
    free = eng.num_free_blocks
    eng.abort_request("r1")
    assert eng.num_free_blocks == free  # the step in flight still writes r1's next K/V
    n = len(got["r1"])
    step()
    assert eng.num_free_blocks >= free + held - 3  # back (less what the other two took meanwhile)
    _step_until(lambda: not eng.has_unfinished_requests(), step)
    assert len(got["r1"]) == n and eng.num_free_blocks == eng.num_total_blocks
    ref = LLM("tiny").generate([{"prompt_token_ids": p} for p in ids], params)
    assert [got["r0"], got["r2"]] == [ref[0].token_ids, ref[2].token_ids]
    assert got["r1"] == ref[1].token_ids[:n]


def test_an_abort_mid_prefill_while_a_step_runs_ahead_frees_after_that_step():
    """A prompt being prefilled in chunks has its K/V written by the step in flight too: aborted meanwhile, its
    blocks go back only once that step is done."""
    eng = LLMEngine(EngineConfig(model="tiny", max_num_seqs=4, max_num_batched_tokens=8, block_size=8,
                                 static_decode_buffers=True, async_scheduling=True))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    eng.add_request("short", [5, 6, 7], params)
    _step_until(lambda: eng.num_running and eng.get_block_table("short"), eng.step)
    eng.add_request("long", [9 + i % 50 for i in range(60)], params)
    long, computed = eng._seqs["long"], [0]

    def step() -> None:  # (records how far "long" had been computed before the step)
        computed[0] = long.num_computed
        eng.step()

    # the step just launched (in flight) took a chunk of "long", which is still prefilling
    _step_until(lambda: (eng.ahead_steps and eng._inflight is not None and long.num_computed > computed[0]
                         and len(long.block_table) >= 3), step)
    free, held = eng.num_free_blocks, len(eng.get_block_table("long"))
    assert eng._seqs["long"].num_computed < 60  # still prefilling
    eng.abort_request("long")
    assert eng.num_free_blocks == free  # the step in flight is still writing its chunk
    eng.step()
    assert eng.num_free_blocks >= free + held - 1
    _step_until(lambda: not eng.has_unfinished_requests(), eng.step)
    assert eng.num_free_blocks == eng.num_total_blocks


@pytest.mark.parametrize("case", ["penalty", "grammar", "bad_words"])
def test_rows_that_need_the_unread_token_run_ahead_and_draw_after_it(case):
    """A penalty over the outputs, a multi-token bad word, or a grammar, needs the token the step in flight samples:
    the next step's forward still runs ahead, and its draw waits until that token is read back (the histories and
    the grammar's state are then the synchronous engine's)."""
    if case == "penalty":
        special = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.8,
                                 presence_penalty=0.4, logprobs=1)
    elif case == "bad_words":
        # "import os" is two tokens; "import os\nimport sys\n" greedily continues with it again and again, so its
        # second token is banned exactly when the token before (unread while the next step runs) is "import"
        special = SamplingParams(max_tokens=16, temperature=0.0, bad_words=["import os"], logprobs=1)
    else:
        special = SamplingParams(max_tokens=16, temperature=0.0, structured_outputs={"regex": "[a-z ]{4,12}"},
                                 logprobs=1)
    # (the odd prompts: "import os ..." is one whose greedy continuation repeats its last token, which a penalty
    # missing that token lets through: the draw made before the token is read back would differ)
    params = [special if i % 2 == 1 else SamplingParams(max_tokens=12, temperature=0.0) for i in range(8)]
    sync, run_ahead = _llm(False), _llm(True)
    a, b = sync.generate(PROMPTS[:8], params), run_ahead.generate(PROMPTS[:8], params)
    _same(a, b)
    assert all(o.finish_reason in ("stop", "length") for o in b)  # (a grammar that lost its state would "abort")
    assert run_ahead.llm_engine.ahead_steps >= 8
    if case == "bad_words":  # the ban fired: the unrestricted continuation has the word's tokens, the banned never
        words = bad_words_token_ids(["import os"], sync.get_tokenizer(), sync.llm_engine.model_config.vocab_size)
        assert any(len(w) > 1 for w in words)

        def has_word(ids: list[int]) -> bool:
            return any(ids[i:i + len(w)] == w for w in words for i in range(len(ids)))

        plain = sync.generate([PROMPTS[1]], SamplingParams(max_tokens=16, temperature=0.0))[0]
        assert has_word(plain.token_ids) and not any(has_word(o.token_ids) for o in a[1::2])


def test_preemption_falls_back_and_agrees():
    """Few blocks: running sequences preempt one another (a step a schedule ahead cannot take: the preempted one
    would re-prefill its placeholder) and waiting ones are admitted mid-run; between them the engine runs ahead."""
    kw = dict(num_kv_blocks=14, max_num_batched_tokens=64)
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True) for _ in PROMPTS]
    sync, run_ahead = _llm(False, **kw), _llm(True, **kw)
    sch = run_ahead.llm_engine.scheduler
    schedule, ahead_preemptions = sch.schedule, []

    def watched():  # a schedule made ahead (placeholders in the batch) must never preempt: the step in flight
        ahead = any(s.token_ids[-1] == PLACEHOLDER for s in sch.running)  # still writes the victim's blocks
        out = schedule()
        if ahead and out.preempted:
            ahead_preemptions.append(len(out.preempted))
        return out

    sch.schedule = watched
    a, b = sync.generate(PROMPTS, params), run_ahead.generate(PROMPTS, params)
    _same(a, b)
    assert not ahead_preemptions
    assert sync.llm_engine.num_preemptions > 0 and run_ahead.llm_engine.num_preemptions > 0
    assert run_ahead.llm_engine.ahead_steps >= 10
    assert run_ahead.llm_engine.num_free_blocks == run_ahead.llm_engine.num_total_blocks


@pytest.mark.parametrize("kw, named", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"static_decode_buffers": False}, "device 'cpu'"),
    ({"async_scheduling": "yes"}, "async_scheduling must be a bool"),
])
def test_async_scheduling_refuses_what_it_cannot_run_ahead(kw, named):
    base = {"model": "tiny", "static_decode_buffers": True, "async_scheduling": True}
    with pytest.raises(ValueError, match="async_scheduling") as e:
        EngineConfig(**{**base, **kw})
    assert named in str(e.value)


def test_the_flag_reaches_the_engine_overrides_and_needs_a_gpu():
    # (that prefill workers drop it, as they run eagerly: tests/cluster/test_device.py)
    from cluster.cli import build_parser
    from cluster.up_checks import check_up_args
    from cluster.up_flags import engine_overrides

    args = build_parser().parse_args(["up", "--async-scheduling", "--device", "cuda"])
    check_up_args(args)
    assert engine_overrides(args) == {"async_scheduling": True}
    assert engine_overrides(build_parser().parse_args(["up"])) == {}
    with pytest.raises(ValueError, match="--async-scheduling needs --device cuda"):
        check_up_args(build_parser().parse_args(["up", "--async-scheduling"]))
    with pytest.raises(ValueError, match="--async-scheduling does not work with speculative decoding"):
        check_up_args(build_parser().parse_args(["up", "--async-scheduling", "--device", "cuda",
                                                 "--speculative-method", "ngram"]))
