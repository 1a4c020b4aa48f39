"""Speculative decoding in the engine: proposals, acceptance, and outputs identical to plain decoding.

Real drafts (n-grams here, the trained draft model in test_draft_model.py) are right only sometimes.
To exercise verification, acceptance and rollback on every path, most engine tests
swap in an *oracle* proposer that drafts the plain engine's own continuation (every draft is right),
optionally with a wrong token at a chosen draft position (everything from there is rejected). Every
output is compared with the plain engine on the same prompts: greedy tokens, seeded sampled tokens and
their logprobs must be identical, and every KV block must be free afterwards.
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from engine import LLM, SamplingParams

from .conftest import outputs_of as _run, same_outputs as _same
from engine.speculative import NgramProposer, SpecDecodeStats, SpeculativeConfig, accept

SRC = '''def walk(root):
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)
'''
PROMPTS = [SRC, SRC[:60], "import os\nimport sys\n", SRC[40:200]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(1)


# ---- units ----------------------------------------------------------------------------------------------
def test_ngram_proposes_the_continuation_of_the_latest_longest_match():
    prop = NgramProposer(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=3))
    #           0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    # suffix (5, 6) occurs at 0 and 4: the latest (4) is continued by 8, 2, 5, 6
    assert prop.propose(tokens, 3) == [8, 2, 5]
    assert prop.propose(tokens, 10) == [8, 2, 5, 6]  # only what follows, never past the end
    # a 3-gram match wins over a later 1-gram match: (1, 2, 3) recurs at 0, continued by 9
    assert prop.propose([1, 2, 3, 9, 3, 4, 1, 2, 3], 2) == [9, 3]
    assert prop.propose([1, 2, 3, 4], 4) == []  # nothing recurs
    assert prop.propose([7], 4) == []
    assert prop.propose(tokens, 0) == []
    strict = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=2))
    assert strict.propose([4, 1, 9, 4], 2) == []  # only a 1-gram recurs


def test_accept_keeps_drafts_until_the_first_disagreement():
    assert accept([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]   # all accepted + the bonus token
    assert accept([1, 2, 3], [1, 9, 3, 4]) == [1, 9]         # the target's token replaces the first miss
    assert accept([1, 2, 3], [8, 2, 3, 4]) == [8]
    assert accept([], [5]) == [5]
    with pytest.raises(ValueError):
        accept([1, 2], [1, 2])


def test_stats():
    s = SpecDecodeStats()
    s.record(4, 2)
    s.record(2, 2)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.accepted_per_pos) == (2, 6, 4, [2, 2, 0, 0])
    assert s.acceptance_rate == pytest.approx(4 / 6)
    assert s.mean_accepted_length == pytest.approx(3.0)


@pytest.mark.parametrize("cfg, match", [
    ({"method": "eagle"}, "method must be one of"),
    ({"method": "draft_model"}, "speculative_config.model must name the draft"),
    ({"method": "ngram", "model": "tiny-draft"}, "only used with method 'draft_model'"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"k": 4}, "unknown key"),
    ("ngram", "must be a dict"),
])
def test_bad_configs_name_the_field(cfg, match):
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=cfg)


# ---- the engine -----------------------------------------------------------------------------------------
class Oracle(NgramProposer):
    """Drafts the plain engine's continuation of each prompt; ``wrong_at``: that draft position is wrong."""

    def __init__(self, refs: dict[tuple, list[int]], vocab: int, wrong_at: Optional[int] = None) -> None:
        self.refs, self.vocab, self.wrong_at = refs, vocab, wrong_at
        self.calls = 0

    def propose(self, token_ids, k: int) -> list[int]:
        self.calls += 1
        for prompt, out in self.refs.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                drafts = list(out[done:done + k])
                if self.wrong_at is not None and len(drafts) > self.wrong_at:
                    drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % self.vocab
                return drafts
        raise AssertionError("unknown prompt")


_BASE: dict = {}


def _base() -> LLM:
    if "llm" not in _BASE:
        _BASE["llm"] = LLM("tiny", num_kv_blocks=256)
    return _BASE["llm"]


def _spec_llm(oracle_wrong_at: Optional[int] = "none", params=None, prompts=PROMPTS, **kw) -> LLM:
    llm = LLM("tiny", speculative_config=NGRAM, **{"num_kv_blocks": 256, **kw})
    if oracle_wrong_at != "none":
        base = _base()
        ids = [base.tokenizer.encode(p) for p in prompts]
        refs = {tuple(i): o.token_ids for i, o in zip(ids, base.generate(prompts, params))}
        llm.llm_engine._proposer = Oracle(refs, llm.llm_engine.model_config.vocab_size, oracle_wrong_at)
    return llm


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("wrong_at", [None, 0, 2], ids=["all-right", "first-wrong", "third-wrong"])
def test_outputs_equal_plain_decoding_and_acceptance_matches_the_drafts(params, wrong_at):
    llm = _spec_llm(wrong_at, params)
    eng = llm.llm_engine
    assert _same(_run(llm, PROMPTS, params), _run(_base(), PROMPTS, params))
    st = eng.spec_stats
    assert st.num_drafts > 0
    want = {None: st.num_draft_tokens, 0: 0}.get(wrong_at)
    if want is not None:
        assert st.num_accepted_tokens == want
    else:  # exactly the drafts before the wrong one, every time (or fewer where fewer were drafted)
        assert 0 < st.num_accepted_tokens <= wrong_at * st.num_drafts
        assert st.accepted_per_pos[wrong_at] == 0 and st.accepted_per_pos[0] > 0
    if wrong_at is None:  # all right: about 5 tokens a step instead of 1
        assert eng.num_steps < 40
    assert eng.num_free_blocks == eng.num_total_blocks


@pytest.mark.parametrize("wrong_at", [None, 1], ids=["all-right", "second-wrong"])
def test_verification_is_bit_identical_to_plain_decoding(wrong_at):
    """Each verified position runs as a one-token decode row (engine/model_runner.py), and on the CPU kernels
    a row's bits do not depend on its batch: seeded sampled tokens and every logprob (top-3 included) are
    exactly those of plain decoding, not merely within rounding (verification through the prefill attention
    path differed by ~1e-6)."""
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=5, ignore_eos=True, logprobs=3)
    llm = _spec_llm(wrong_at, params)
    if llm.llm_engine.runner.model.layers[0].fused is None:
        pytest.skip("the exact guarantee needs pdserve's CPU kernels (PDSERVE_CPU_KERNELS=0 here)")
    # a fresh plain engine: the shared one has these prompts in its prefix cache, and a prefill of the rest
    # of a prompt is a differently shaped (oneDNN) product than the whole prompt's
    spec, plain = llm.generate(PROMPTS, params), LLM("tiny", num_kv_blocks=256).generate(PROMPTS, params)
    for a, b in zip(spec, plain, strict=True):
        assert a.token_ids == b.token_ids
        assert [(t.token_id, t.logprob, t.top) for t in a.logprobs] == [(t.token_id, t.logprob, t.top) for t in b.logprobs]
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0


def test_drafts_of_banned_words_are_rejected_and_outputs_equal_plain_decoding():
    """Drafts of the unrestricted continuation verified under bad words and allowed_token_ids: each position's draw
    sees the drafts before it as history, so a banned word's last token is never accepted, and the outputs are
    plain decoding's under the same restrictions."""
    base = _base()
    plain = base.generate(PROMPTS, GREEDY)
    tok = base.get_tokenizer()
    words = [tok.decode(plain[0].token_ids[8:10]).strip(), tok.decode(plain[2].token_ids[2:3]).strip()]
    allowed = sorted(set(range(5, 400)) - {plain[3].token_ids[5]})
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, bad_words=words),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, bad_words=words),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, bad_words=words),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, allowed_token_ids=allowed)]
    llm = _spec_llm(None, GREEDY)  # (the oracle drafts the unrestricted continuation)
    spec, want = llm.generate(PROMPTS, params), base.generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in want]
    changed = [a.token_ids != b.token_ids for a, b in zip(want, plain)]
    assert changed[0] and changed[2] and changed[3], changed  # the restrictions bit where drafts proposed otherwise
    st = llm.llm_engine.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert llm.llm_engine.num_free_blocks == llm.llm_engine.num_total_blocks


def test_real_ngram_proposer_keeps_outputs_identical():
    prompts = ["a b a b a b a b a b", SRC * 2]
    llm = LLM("tiny", num_kv_blocks=256, speculative_config=NGRAM)
    assert _same(_run(llm, prompts, GREEDY), _run(_base(), prompts, GREEDY))
    assert llm.llm_engine.spec_stats.num_drafts > 0  # the prompts repeat: drafts were made and verified
    assert llm.llm_engine.num_free_blocks == llm.llm_engine.num_total_blocks


def test_stop_token_inside_accepted_drafts_and_max_tokens_cut_exactly():
    base_out = _base().generate([SRC], GREEDY)[0].token_ids
    stop_tok = base_out[6]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_tok])
    llm = _spec_llm(None, GREEDY, prompts=[SRC])
    assert _same(_run(llm, [SRC], params), _run(_base(), [SRC], params))
    for m in (1, 2, 5, 7):
        p = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        got = _run(llm, [SRC], p)
        assert _same(got, _run(_base(), [SRC], p)) and len(got[0][0]) == m
    assert llm.llm_engine.num_free_blocks == llm.llm_engine.num_total_blocks


def test_mixed_batches_preemption_and_prefix_caching():
    # 24 blocks of 16 tokens for 6 requests of ~60-190 tokens: sequences are preempted and recomputed, long
    # prompts prefill in chunks of 48 tokens next to verifying sequences, and repeated prompts hit the cache.
    prompts = PROMPTS + [SRC, SRC[:60]]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    llm = _spec_llm(None, params, prompts=prompts, num_kv_blocks=24, max_num_batched_tokens=48)
    eng = llm.llm_engine
    assert _same(_run(llm, prompts, params), _run(_base(), prompts, params))
    assert eng.num_preemptions > 0
    assert eng.prefix_cache_hits > 0
    assert eng.spec_stats.num_accepted_tokens > 0
    assert eng.num_free_blocks == eng.num_total_blocks


def test_abort_mid_speculation_frees_everything():
    llm = _spec_llm(None, GREEDY)
    eng = llm.llm_engine
    ids = llm.tokenizer.encode(SRC)
    eng.add_request("r", ids, GREEDY)
    for _ in range(3):
        eng.step()
    assert eng.spec_stats.num_drafts > 0
    eng.abort_request("r")
    eng.step()
    assert not eng.has_unfinished_requests()
    assert eng.num_free_blocks == eng.num_total_blocks


def test_rejected_drafts_give_their_blocks_back_at_once():
    # every draft is wrong: each verification takes blocks for 1 + 4 positions, keeps 1 token
    llm = _spec_llm(0, GREEDY, prompts=[SRC[:47]])  # 47 + 1 tokens: the drafts spill into a new block
    eng = llm.llm_engine
    eng.add_request("r", llm.tokenizer.encode(SRC[:47]), GREEDY)
    bm = eng.block_manager
    while eng.has_unfinished_requests():
        eng.step()
        for seq in eng.scheduler.running:
            assert len(seq.block_table) <= bm.blocks_for(seq.num_tokens), (seq.num_tokens, seq.block_table)
            assert eng.num_total_blocks - eng.num_free_blocks == len(seq.block_table)
    assert eng.spec_stats.num_drafts > 0 and eng.spec_stats.num_accepted_tokens == 0


CHI2_DF7_P001 = 24.322  # chi-square critical value, 7 degrees of freedom, p = 0.001 (standard tables)


def _triple_probs(prompt_ids: list[int]) -> dict[tuple, float]:
    """P(t0, t1, t2) under top_k=2, temperature 1: per position, the softmax of the two largest raw logits
    (from the plain engine's top-2 logprobs of each prefix)."""
    base = _base()

    def top2(ids):
        o = base.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, logprobs=2))[0]
        (a, la), (b, lb) = o.logprobs[0].top
        z = torch.tensor([la, lb]).softmax(0).tolist()
        return {a: z[0], b: z[1]}

    out = {}
    for t0, p0 in top2(prompt_ids).items():
        for t1, p1 in top2(prompt_ids + [t0]).items():
            for t2, p2 in top2(prompt_ids + [t0, t1]).items():
                out[(t0, t1, t2)] = p0 * p1 * p2
    return out


def _chi2(counts: dict, probs: dict, n: int) -> float:
    assert set(counts) <= set(probs), set(counts) - set(probs)
    return sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in probs.items())


def test_unseeded_sampling_under_speculation_follows_the_target_distribution(monkeypatch):
    """Chi-square of (t0, t1, t2) frequencies against the target's exact distribution (8 outcomes), with
    drafts that are right about half the time; a broken acceptance rule (keep every draft) must fail it."""
    prompt_ids = _base().tokenizer.encode("def walk(root):\n")
    probs = _triple_probs(prompt_ids)
    likely = {}  # prefix -> its most likely next token: the drafts
    for (t0, t1, t2), _ in sorted(probs.items(), key=lambda kv: -kv[1]):
        likely.setdefault((t0,), t1)
        likely.setdefault((t0, t1), t2)

    class Likely(NgramProposer):
        def __init__(self) -> None:
            pass

        def propose(self, token_ids, k):
            gen = tuple(token_ids[len(prompt_ids):])
            drafts = []
            while len(drafts) < k and gen + tuple(drafts) in likely:
                drafts.append(likely[gen + tuple(drafts)])
            return drafts

    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=2, ignore_eos=True)
    n = 1600

    def frequencies() -> dict:
        llm = LLM("tiny", num_kv_blocks=512, max_num_seqs=64, speculative_config=NGRAM, seed=123)
        llm.llm_engine._proposer = Likely()
        counts: dict = {}
        for o in llm.generate([prompt_ids] * n, params):
            counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
        assert llm.llm_engine.spec_stats.num_accepted_tokens > 0
        return counts

    good = _chi2(frequencies(), probs, n)
    assert good < CHI2_DF7_P001  # 5.0 here (the mean of chi2(7) is 7)
    import engine.llm_engine as le

    monkeypatch.setattr(le, "accept", lambda drafts, sampled: [*drafts, sampled[-1]])
    bad = _chi2(frequencies(), probs, n)
    assert bad > CHI2_DF7_P001  # about 1400 here


def test_stop_strings_cut_multi_token_steps_like_plain_decoding():
    base_out = _base().generate([SRC], GREEDY)[0]
    stop = base_out.text[9:13]  # a piece of text the oracle's accepted drafts will carry past
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    llm = _spec_llm(None, GREEDY, prompts=[SRC])
    got, want = llm.generate([SRC], params)[0], _base().generate([SRC], params)[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert want.finish_reason == "stop" and len(want.text) < len(base_out.text)
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0
    assert llm.llm_engine.num_free_blocks == llm.llm_engine.num_total_blocks


def test_drafts_never_take_the_block_another_sequence_needs_for_its_own_token():
    """One free block; sequence A's drafts would need it, sequence B needs it for its next token. B gets it,
    A decodes without drafts, nobody is preempted (drafts used to be given blocks first, which preempted B)."""
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler, SeqStatus, Sequence

    bm = BlockManager(3, 4, enable_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a = Sequence("a", [1, 2, 3], GREEDY, token_ids=[1, 2, 3, 4])  # 4 tokens, 3 computed: 1 block holds them
    b = Sequence("b", [5, 6, 7, 8], GREEDY, token_ids=[5, 6, 7, 8, 9])  # 5 tokens, 4 computed: needs block 2
    for seq, computed in ((a, 3), (b, 4)):
        seq.num_computed = computed
        seq.block_table = bm.allocate(1)
        seq.status = SeqStatus.RUNNING
        sched.running.append(seq)
    a.spec_token_ids = [7, 7, 7]
    out = sched.schedule()
    assert out.preempted == [] and out.verifies == []
    assert [s.request_id for s in out.decodes] == ["a", "b"]
    assert a.spec_token_ids == [] and len(b.block_table) == 2
    # with a block to spare, the same drafts are verified (trimmed to what the budget allows)
    bm2 = BlockManager(4, 4, enable_caching=False)
    sched2 = Scheduler(bm2, max_num_seqs=8, max_num_batched_tokens=4)
    for seq in (a, b):
        seq.block_table = bm2.allocate(1)
        sched2.running.append(seq)
    b.num_computed = 4
    a.spec_token_ids = [7, 7, 7]
    out = sched2.schedule()
    assert out.preempted == [] and [s.request_id for s in out.verifies] == ["a"] and a.spec_token_ids == [7, 7]
