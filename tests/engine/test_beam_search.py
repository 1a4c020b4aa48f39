"""Beam search (``LLM.beam_search``, engine/beam_search.py) against transformers' own beam search.

Reference: transformers 5.x ``generate(num_beams=W, num_return_sequences=W, ...)`` on the same random
Llama and Qwen2 checkpoints (one prompt at a time; the engine runs the prompts as one batch). The EOS
of each checkpoint is rewritten to the token the model likes best along its greedy continuations, so
hypotheses finish on EOS, compete with longer ones, and the three early_stopping modes give different
results. transformers runs greedy search for num_beams=1, so width 1 is compared with its greedy
output (equal to beam search of width 1 except for early_stopping="never" with a positive length
penalty, which is left out there). Block accounting is checked through the search's ``on_step`` hook
and the engine's free block count.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, BeamSearchParams, SamplingParams
from engine.beam_search import run_beam_search

from .conftest import make_checkpoint, prompts_of

MAX_NEW = 10
LENGTHS = (5, 9, 14)


def hf_search(hf, prompt: list[int], W: int, lp: float, es, eos, n: int = MAX_NEW) -> list[tuple[list[int], float]]:
    """transformers' ranked (prompt + generated tokens, sequences_scores) for one prompt."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), num_beams=W, num_return_sequences=W, length_penalty=lp,
                          early_stopping=es, do_sample=False, output_scores=True, return_dict_in_generate=True,
                          max_new_tokens=n, eos_token_id=eos, pad_token_id=0,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    P = len(prompt)
    if W == 1:  # greedy: no beam_indices / sequences_scores; score it as beam search would
        gen = out.sequences[0, P:].tolist()
        if eos is not None and eos in gen:
            gen = gen[:gen.index(eos) + 1]
        cum = sum(torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, gen))
        return [(prompt + gen, cum / len(gen) ** lp)]
    res = []
    for i in range(W):
        g = int((out.beam_indices[i] >= 0).sum())
        res.append((out.sequences[i, :P + g].tolist(), out.sequences_scores[i].item()))
    return res


def set_eos(d, eos: int) -> None:
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((d / name).read_text())
        cfg["eos_token_id"] = eos
        (d / name).write_text(json.dumps(cfg))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tmp_path_factory):
    d, hf = make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    prompts = prompts_of(LENGTHS, seed=3)
    # EOS := the token the model likes best on average along its greedy continuations of the prompts
    probs = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
            probs.append(torch.softmax(hf(out).logits[0].float(), -1).mean(0))
    eos = int(torch.stack(probs).mean(0).argmax())
    set_eos(d, eos)
    llm = LLM(str(d), num_kv_blocks=128, block_size=4)
    assert llm.llm_engine.eos_token_id == eos
    return SimpleNamespace(arch=request.param, dir=d, hf=hf, llm=llm, prompts=prompts, eos=eos)


def assert_clean(llm: LLM) -> None:
    eng = llm.llm_engine
    assert eng.num_free_blocks == eng.num_total_blocks
    assert not eng.has_unfinished_requests()


def assert_matches(case, outs, W, lp, es, eos, budget=lambda p: MAX_NEW) -> None:
    assert len(outs) == len(case.prompts)
    for p, out in zip(case.prompts, outs):
        assert out.prompt_token_ids == p
        ref = hf_search(case.hf, p, W, lp, es, eos, budget(p))
        got = [(s.tokens, s.score) for s in out.sequences]
        assert [t for t, _ in got] == [t for t, _ in ref], f"{case.arch} W={W} lp={lp} es={es} len={len(p)}"
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, ref)) < 1e-4
        for s in out.sequences:
            n = len(s.tokens) - len(p)
            assert s.finish_reason == ("stop" if s.tokens[-1] == eos else "length")
            assert s.finish_reason == "stop" or n == budget(p)
            assert abs(s.cum_logprob / n ** lp - s.score) < 1e-5


# transformers runs greedy search for num_beams=1, which differs from a width-1 beam search only with
# early_stopping="never" and a positive length penalty: those two combinations have no reference
GRID = [(W, lp, es) for W in (1, 2, 4) for lp in (0.0, 1.0, 2.0) for es in (False, True, "never")
        if not (W == 1 and es == "never" and lp > 0)]


@pytest.mark.parametrize("W, lp, es", GRID)
def test_matches_transformers(case, W, lp, es):
    params = BeamSearchParams(beam_width=W, max_tokens=MAX_NEW, length_penalty=lp, early_stopping=es,
                              include_stop_str_in_output=True)
    assert_matches(case, case.llm.beam_search(case.prompts, params), W, lp, es, case.eos)
    assert_clean(case.llm)


def test_eos_hypotheses_finish_and_compete(case):
    """EOS really ends hypotheses here: short finished ones rank among long ones, and ignore_eos or
    include_stop_str_in_output change exactly what they should."""
    base = dict(beam_width=4, max_tokens=MAX_NEW, length_penalty=0.0, early_stopping=True)
    outs = case.llm.beam_search(case.prompts, BeamSearchParams(**base, include_stop_str_in_output=True))
    reasons = [s.finish_reason for o in outs for s in o.sequences]
    assert "stop" in reasons and "length" in reasons
    stripped = case.llm.beam_search(case.prompts, BeamSearchParams(**base))
    for a, b in zip(outs, stripped):
        for x, y in zip(a.sequences, b.sequences):
            assert y.tokens == (x.tokens[:-1] if x.finish_reason == "stop" else x.tokens)
            assert (y.score, y.cum_logprob, y.finish_reason) == (x.score, x.cum_logprob, x.finish_reason)
    ignored = case.llm.beam_search(case.prompts, BeamSearchParams(**base, ignore_eos=True))
    assert {s.finish_reason for o in ignored for s in o.sequences} == {"length"}
    assert_matches(case, ignored, 4, 0.0, True, None)
    assert_clean(case.llm)


def test_short_budgets_match_transformers(case):
    """max_tokens=1 (the prefill's row decides everything) and max_model_len cutting the budget short
    (prompts of 5, 9, 14 tokens get 10, 7, 2 new tokens), with a prompt admitted while another decodes."""
    for W in (2, 4):
        params = BeamSearchParams(W, 1, include_stop_str_in_output=True)
        assert_matches(case, case.llm.beam_search(case.prompts, params), W, 1.0, False, case.eos, lambda p: 1)
    # two prompts' beams at a time: the third is prefilled in the same forward as the first one's decodes
    short = LLM(str(case.dir), num_kv_blocks=128, block_size=4, max_model_len=16, max_num_seqs=6)
    params = BeamSearchParams(3, MAX_NEW, length_penalty=2.0, early_stopping="never", include_stop_str_in_output=True)
    batch = []
    run_beam_search(short.llm_engine, case.prompts, params, on_step=lambda t: batch.append(len(t)))
    mixed = [i for i in range(1, len(batch) - 1) if batch[i - 1:i + 2] == [6, 3, 6]]
    assert mixed, batch
    outs = short.beam_search(case.prompts, params)
    assert max(len(s.tokens) for o in outs for s in o.sequences) == 16
    assert_matches(case, outs, 3, 2.0, "never", case.eos, lambda p: min(MAX_NEW, 16 - len(p)))
    assert_clean(short)


def test_early_stopping_modes_differ_here(case):
    """The parity grid can tell the modes apart: on these checkpoints and prompts True and "never" each
    give other sequences than False for some width and length penalty."""
    differ = {True: False, "never": False}
    for W in (2, 4):
        for lp in (1.0, 2.0):
            runs = {}
            for es in (False, True, "never"):
                outs = case.llm.beam_search(case.prompts, BeamSearchParams(W, MAX_NEW, length_penalty=lp,
                                                                           early_stopping=es))
                runs[str(es)] = [[s.tokens for s in o.sequences] for o in outs]
            for es in differ:
                differ[es] |= runs[str(es)] != runs["False"]
    assert differ == {True: True, "never": True}
    assert_clean(case.llm)


def test_width_one_equals_greedy_generate(case):
    for ignore_eos in (True, False):
        greedy = case.llm.generate(case.prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                                ignore_eos=ignore_eos))
        beams = case.llm.beam_search(case.prompts, BeamSearchParams(1, MAX_NEW, ignore_eos=ignore_eos,
                                                                    include_stop_str_in_output=True))
        for p, g, b in zip(case.prompts, greedy, beams):
            (s,) = b.sequences
            assert s.tokens == p + g.token_ids
            assert s.finish_reason == g.finish_reason
        assert ignore_eos or "stop" in {g.finish_reason for g in greedy}  # EOS ends a greedy run here too
    assert_clean(case.llm)


def test_prompt_blocks_are_shared_and_partial_blocks_copied(case):
    """The prompt's full blocks are held once by every beam (refcount W); the block each beam writes
    into is its own (copy-on-write), and everything is freed at the end."""
    eng = case.llm.llm_engine
    start = eng.num_free_blocks
    W, prompt = 4, case.prompts[1]  # 9 tokens in blocks of 4: two full prompt blocks, one partial
    full = len(prompt) // eng.block_size
    seen = []

    def on_step(tables):
        if not tables:  # the prompt's prefill
            return
        assert len(tables) == W
        bm = eng.block_manager
        shared = {tuple(t[:full]) for t in tables}
        assert len(shared) == 1
        assert all(bm.ref_count(b) == W for b in next(iter(shared)))
        pos = len(prompt) + len(seen)  # the position every beam writes this step
        own = [t[pos // eng.block_size] for t in tables]
        assert len(set(own)) == W and all(bm.ref_count(b) == 1 for b in own)
        seen.append(eng.num_total_blocks - eng.num_free_blocks)

    params = BeamSearchParams(W, MAX_NEW, ignore_eos=True)
    (got,) = run_beam_search(eng, [prompt], params, on_step=on_step)
    assert len(seen) == MAX_NEW - 1
    # sharing keeps the footprint under W private copies of the prompt
    assert max(seen) < W * eng.block_manager.blocks_for(len(prompt) + MAX_NEW)
    assert eng.num_free_blocks == start
    (ref,) = case.llm.beam_search([prompt], params)
    assert [s.tokens for s in got] == [s.tokens for s in ref.sequences]


def test_blocks_come_back_when_the_search_raises(case):
    eng = case.llm.llm_engine
    start = eng.num_free_blocks
    steps = []

    def boom(tables):
        steps.append(len(tables))
        if len(steps) == 3:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_beam_search(eng, case.prompts, BeamSearchParams(4, MAX_NEW, ignore_eos=True), on_step=boom)
    assert steps[-1] == 4 * len(case.prompts)  # every prompt's beams were live in one batch
    assert eng.num_free_blocks == start
    assert_clean(case.llm)


def test_admission_waves_give_the_same_result(case):
    """Few blocks and a small max_num_seqs make prompts wait for others to finish: same outputs."""
    params = BeamSearchParams(4, MAX_NEW, length_penalty=1.0, include_stop_str_in_output=True)
    ref = case.llm.beam_search(case.prompts, params)
    for kw in ({"max_num_seqs": 4}, {"num_kv_blocks": 24}):
        small = LLM(str(case.dir), block_size=4, **{"num_kv_blocks": 128, **kw})
        batch = []
        got = run_beam_search(small.llm_engine, case.prompts, params, on_step=lambda t: batch.append(len(t)))
        assert max(batch) == 4  # one prompt's beams at a time
        assert [[s.tokens for s in o] for o in got] == [[s.tokens for s in o.sequences] for o in ref]
        # other batch shapes round differently in the last float32 bits
        assert max(abs(a.score - b.score) for x, y in zip(got, ref) for a, b in zip(x, y.sequences)) < 1e-5
        assert_clean(small)


def test_text_and_string_prompts(tmp_path):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers

    d, _ = make_checkpoint(tmp_path / "tok", "llama")
    vocab = {f"w{i}": i for i in range(512)}
    t = RustTokenizer(models.WordLevel(vocab, unk_token="w0"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(d / "tokenizer.json"))
    llm = LLM(str(d), num_kv_blocks=64, block_size=4)
    params = BeamSearchParams(2, 6, ignore_eos=True)
    (by_text,) = llm.beam_search("w5 w9 w13", params)
    (by_ids,) = llm.beam_search([[5, 9, 13]], params)
    assert by_text.prompt == "w5 w9 w13" and by_ids.prompt is None
    assert [s.tokens for s in by_text.sequences] == [s.tokens for s in by_ids.sequences]
    for s in by_text.sequences:
        assert s.tokens[:3] == [5, 9, 13]
        assert s.text == " ".join(f"w{i}" for i in s.tokens[3:])
    assert_clean(llm)


def test_params_validation():
    ok = dict(beam_width=2, max_tokens=4)
    bad = [({"beam_width": 0}, "beam_width"), ({"beam_width": 65}, "beam_width"), ({"beam_width": True}, "beam_width"),
           ({"beam_width": 2.0}, "beam_width"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "4"}, "max_tokens"),
           ({"temperature": 0.7}, "temperature"), ({"temperature": float("nan")}, "temperature"),
           ({"length_penalty": float("inf")}, "length_penalty"), ({"length_penalty": "1"}, "length_penalty"),
           ({"early_stopping": "always"}, "early_stopping"), ({"early_stopping": 1}, "early_stopping"),
           ({"early_stopping": None}, "early_stopping"), ({"ignore_eos": 1}, "ignore_eos"),
           ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output")]
    for over, field in bad:
        with pytest.raises(ValueError, match=field):
            BeamSearchParams(**{**ok, **over})
    p = BeamSearchParams(beam_width=64, max_tokens=1, length_penalty=-1, early_stopping="never")
    assert p.length_penalty == -1.0 and p.temperature == 0.0 and p.early_stopping == "never"
    assert BeamSearchParams(2, 3).early_stopping is False  # transformers' and vLLM's default


def test_bad_calls_raise_and_leave_the_engine_clean(case):
    llm, eng = case.llm, case.llm.llm_engine
    params = BeamSearchParams(2, 4)
    with pytest.raises(ValueError, match="params"):
        llm.beam_search(case.prompts, SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        llm.beam_search([[5, 6], [10**6]], params)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([[5] * eng.max_model_len], params)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.beam_search([[5] * 300], BeamSearchParams(64, 200))
    assert_clean(llm)
    eng.add_request("busy", case.prompts[0], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="unfinished"):
        llm.beam_search(case.prompts, params)
    eng.abort_request("busy")
    assert_clean(llm)
