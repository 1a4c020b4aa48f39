"""The cluster beam search's ranking, checked against the engine's: the router sees only each beam's top 2W.

``router.beam_search`` gives the engine's ``PromptBeamSearch`` each beam's top 2W (token, log-prob) pairs (what
a worker sends) through ``step_top``, which merges them in plain Python (the router never loads torch). The
claims: this changes nothing, and the Python ranking and float32 arithmetic are torch's. Here random searches
with an EOS that is often among the best tokens run side by side: ``_TorchStep`` (the search as it was written
in torch, transformers' iteration op for op) on full rows, ``step`` (the engine's: ``torch.topk``, then the
shared Python update) on full rows, and ``step_top`` on the top-2W pairs: every step's choices and the final
hypotheses, scores and cumulative log-probs bit for bit, must be identical. Truncating to the top W instead (a
plausible bug) must be caught by the same comparison, which shows the searches are hard enough to tell apart.
"""
from __future__ import annotations

import pytest
import torch

from engine import BeamSearchParams, PromptBeamSearch

V, EOS = 40, 0


class _Beam:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens


class _TorchStep(PromptBeamSearch):
    """The reference: ``PromptBeamSearch.step`` as it was in torch (float32 tensors throughout)."""

    def step(self, logprobs, parents):
        from engine.beam_search import NEG, _Hyp

        W, V = logprobs.shape
        pen, es = self.p.length_penalty, self.p.early_stopping
        self.generated += 1
        t = self.generated
        scores = torch.tensor(self.scores, dtype=torch.float32)
        vals, idx = torch.topk((logprobs + scores[:, None]).view(-1), 2 * W)
        src, toks = (idx // V).tolist(), (idx % V).tolist()
        eos = [tok == self.eos for tok in toks]
        hit = [e or t >= self.max_new for e in eos]
        if self.improvable and not (es is True and len(self.finished) == W):
            fin, cums = (vals[:W] / (t ** pen)).tolist(), vals[:W].tolist()
            for j in range(W):
                if hit[j]:
                    self.finished.append(_Hyp(fin[j], cums[j], parents[src[j]].tokens + [toks[j]],
                                              "stop" if eos[j] else "length"))
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[W:]
        shifted = vals + torch.tensor(hit, dtype=torch.float32) * NEG
        keep = torch.topk(shifted, W).indices
        kept = shifted[keep]
        self.scores = kept.tolist()
        nxt = [(parents[src[k]], toks[k]) for k in keep.tolist()]
        if len(self.finished) == W:
            hyp_len = self.max_new if es == "never" and pen > 0.0 else t
            best = (kept[:1] / (hyp_len ** pen)).item()
            self.improvable = self.improvable and best > min(h.score for h in self.finished)
        self.done = (not self.improvable or (es is True and len(self.finished) == W) or t >= self.max_new)
        return [] if self.done else nxt


def _search(seed: int, W: int, keep, penalty: float, early, cls=PromptBeamSearch) -> list:
    """One search on random rows: full rows through ``cls.step`` (keep None), or each row's top ``keep`` pairs
    through ``step_top``; its steps and its results, exactly."""
    g = torch.Generator().manual_seed(seed)
    params = BeamSearchParams(beam_width=W, max_tokens=8, length_penalty=penalty, early_stopping=early)
    s = cls([5, 6, 7], params.max_tokens, params, EOS)
    parents, trace, first = [_Beam([5, 6, 7])], [], True
    while True:
        logits = torch.randn(len(parents), V, generator=g) * 2.5
        logits[:, EOS] += torch.rand(len(parents), generator=g) * 4  # EOS often near the top
        rows = torch.log_softmax(logits, dim=-1)
        vals, idx = rows.topk(keep or 1, dim=-1)
        tops = [list(zip(i.tolist(), v.tolist())) for i, v in zip(idx, vals)]
        if first:
            rows, tops, parents, first = rows.expand(W, -1), tops * W, parents * W, False
        nxt = s.step(rows, parents) if keep is None else s.step_top(tops, parents)
        trace.append([(p.tokens, t) for p, t in nxt])
        if s.done:
            return [trace, [(h.tokens, h.finish_reason, h.score, h.cum_logprob) for h in s.results()]]
        parents = [_Beam(p.tokens + [t]) for p, t in nxt]


def test_top_2w_pairs_ranked_in_python_give_the_torch_search_bit_for_bit():
    for seed in range(40):
        for W, penalty, early in ((1, 1.0, False), (2, 0.0, True), (3, 1.0, False), (4, 2.0, "never"),
                                  (5, 0.37, False), (3, -0.5, "never")):
            ref = _search(seed, W, None, penalty, early, _TorchStep)
            assert _search(seed, W, None, penalty, early) == ref, ("step", seed, W)
            assert _search(seed, W, 2 * W, penalty, early) == ref, ("step_top", seed, W)


def test_top_w_pairs_would_not_be_exact():
    differ = sum(_search(seed, W, W, 1.0, False) != _search(seed, W, None, 1.0, False)
                 for seed in range(60) for W in (2, 3, 4))  # W = 1: one pair is too few to rank (below)
    assert differ > 0


def test_ties_go_to_the_lower_beam_then_the_lower_token():
    params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    s = PromptBeamSearch([1], params.max_tokens, params, None)
    a, b = _Beam([1, 4]), _Beam([1, 5])
    s.scores = [-1.0, -1.0]  # two running beams with equal scores: every candidate below ties across them
    tie = [(9, -0.25), (3, -0.25), (7, -0.5), (2, -0.5)]
    nxt = s.step_top([tie, list(tie)], [a, b])
    assert [(p.tokens, t) for p, t in nxt] == [([1, 4], 3), ([1, 4], 9)]
    assert s.scores == [-1.25, -1.25]


def test_step_top_rejects_rows_it_cannot_rank():
    params = BeamSearchParams(beam_width=2, max_tokens=5)
    s = PromptBeamSearch([1], params.max_tokens, params, 0)
    with pytest.raises(ValueError, match="2 rows and parents"):
        s.step_top([[(3, -0.1)]], [_Beam([1])])
    with pytest.raises(ValueError, match="at least 4 candidates"):
        s.step_top([[(3, -0.1)], [(4, -0.2)]], [_Beam([1]), _Beam([1])])
