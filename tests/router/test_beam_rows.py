"""The cluster beam search's one approximation, checked: the router sees only each beam's top 2W log-probs.

``router.beam_search`` feeds the engine's ``PromptBeamSearch`` rows that are -inf outside each beam's top 2W
(what a worker sends). The claim is that this changes nothing. Here random searches with an EOS that is often
among the best tokens run side by side on full rows and on the truncated rows: every step's choices and the
final ranked hypotheses must be identical. Truncating to the top W instead (a plausible bug) must be caught by
the same comparison, which shows the searches are hard enough to tell the two apart.
"""
from __future__ import annotations

import torch

from engine import BeamSearchParams, PromptBeamSearch
from router.beam_search import sparse_rows

V, EOS = 40, 0


class _Beam:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens


def _search(seed: int, W: int, keep: int, penalty: float, early) -> list:
    """Run one search on random rows, each row cut to its top ``keep`` (None: full): its steps and results."""
    g = torch.Generator().manual_seed(seed)
    params = BeamSearchParams(beam_width=W, max_tokens=8, length_penalty=penalty, early_stopping=early)
    s = PromptBeamSearch([5, 6, 7], params.max_tokens, params, EOS)
    parents, trace, first = [_Beam([5, 6, 7])], [], True
    while True:
        logits = torch.randn(len(parents), V, generator=g) * 2.5
        logits[:, EOS] += torch.rand(len(parents), generator=g) * 4  # EOS often near the top
        rows = torch.log_softmax(logits, dim=-1)
        if keep is not None:
            vals, idx = rows.topk(keep, dim=-1)
            rows = sparse_rows([list(zip(i.tolist(), v.tolist())) for i, v in zip(idx, vals)], V)
        if first:
            rows, parents, first = rows.expand(W, -1), parents * W, False
        nxt = s.step(rows, parents)
        trace.append([(p.tokens, t) for p, t in nxt])
        if s.done:
            return [trace, [(h.tokens, h.finish_reason, round(h.score, 5)) for h in s.results()]]
        parents = [_Beam(p.tokens + [t]) for p, t in nxt]


def test_top_2w_rows_give_the_exact_search():
    for seed in range(60):
        for W, penalty, early in ((1, 1.0, False), (2, 0.0, True), (3, 1.0, False), (4, 2.0, "never")):
            assert _search(seed, W, 2 * W, penalty, early) == _search(seed, W, None, penalty, early), (seed, W)


def test_top_w_rows_would_not_be_exact():
    differ = sum(_search(seed, W, W, 1.0, False) != _search(seed, W, None, 1.0, False)
                 for seed in range(60) for W in (1, 2, 3, 4))
    assert differ > 0


def test_sparse_rows_shape_and_values():
    rows = sparse_rows([[(3, -0.5), (1, -1.0)], [(0, -0.1)]], 5)
    assert rows.shape == (2, 5) and rows.dtype == torch.float32
    assert rows[0].tolist() == [float("-inf"), -1.0, float("-inf"), -0.5, float("-inf")]
    assert rows[1, 0].item() == torch.tensor(-0.1).item() and torch.isinf(rows[1, 1:]).all()
