"""A reasoning block at the start of an answer, as the engine sees it: token sequences, no text.

Lifecycle: stateless functions over a sequence's output token ids, read wherever a token is drawn or accepted.
A request whose ``SamplingParams.reasoning_end_token_ids`` is set starts its answer inside a reasoning block (a
thinking model's ``<think>...</think>``, as a reasoning parser reads it): the block ends at the first
occurrence of that token sequence in the output (``find_end``). Two things follow from it:

* ``structured_outputs`` constrains only what follows the block (vLLM's rule with a reasoning parser: the model
  thinks freely, the answer keeps the schema). The engine makes the sequence's grammar matcher when the block
  closes (``LLMEngine``), and a speculative draft never runs past the close (``drafts_before_end``), so the
  first token under the grammar is always drawn with its mask.
* ``thinking_token_budget`` (vLLM's): once the block holds that many tokens (a leading
  ``reasoning_start_token_ids``, the model writing its own ``<think>``, not counted), the end sequence is forced
  one token at a time (``forced_token``; the sampler makes every other logit -inf, over any other restriction).

Everything is a function of the output so far, so a prefill worker (the first token), a decode worker (the
rest), a migrated or preempted sequence and each position of a speculative verification (its drafts before it
as history) agree without shipping any state.
"""
from __future__ import annotations

from typing import Optional, Sequence


def find_end(out: Sequence[int], end: Sequence[int]) -> Optional[int]:
    """The index just past the first occurrence of ``end`` in ``out`` (None: none)."""
    k = len(end)
    if not k:
        return None
    first = end[0]
    i = 0
    n = len(out) - k
    while i <= n:
        if out[i] == first and list(out[i:i + k]) == list(end):
            return i + k
        i += 1
    return None


def ends_with(out: Sequence[int], end: Sequence[int]) -> bool:
    """Whether ``out`` ends with the end sequence (checked after each token while a block is open, this is the
    block closing: an earlier occurrence would have closed it then)."""
    k = len(end)
    return len(out) >= k and list(out[-k:]) == list(end)


def forced_token(out: Sequence[int], end: Sequence[int], start: Optional[Sequence[int]],
                 budget: Optional[int]) -> Optional[int]:
    """The token a ``thinking_token_budget`` forces at the next position of ``out`` (None: nothing forced). The
    block's tokens are counted from the output's start, after a leading ``start`` sequence (while the output may
    still be writing it, nothing is forced); at ``budget`` of them the end sequence begins, one forced token a
    position. Only those positions look further back (whether the model closed the block itself): the work per
    draw is bounded by the markers' lengths, not the output's."""
    if budget is None:
        return None
    skip = earliest = 0
    if start:
        m = 0
        for a, b in zip(out, start):
            if a != b:
                break
            m += 1
        if m == len(start):
            skip = m
        elif m == len(out):
            return None  # (the start sequence may be what comes next)
        else:
            earliest = m + 1  # (the draws up to the diverging token came while the start could still come)
    j = len(out) - max(skip + budget, earliest)
    if j < 0 or j >= len(end):
        return None
    if find_end(out[skip:], end) is not None:
        return None
    return end[j]


def drafts_before_end(tokens: Sequence[int], drafts: Sequence[int], end: Sequence[int]) -> list[int]:
    """``drafts`` cut before the one that would close the reasoning block of ``tokens + drafts`` (``tokens``: the
    output so far, the block still open): the token that closes it is then drawn last in its step, and the first
    token after it is drawn under the grammar."""
    lo = max(0, len(tokens) - len(end) + 1)  # (an occurrence closing within the drafts starts here or later)
    at = find_end(list(tokens[lo:]) + list(drafts), end)
    if at is None:
        return list(drafts)
    return list(drafts)[:max(0, lo + at - 1 - len(tokens))]
