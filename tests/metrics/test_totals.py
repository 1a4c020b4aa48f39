"""Tests of metrics/totals.py: counter increments from running totals kept elsewhere."""
from __future__ import annotations

import pytest

from metrics.totals import RunningTotals


def test_increments_are_differences_since_the_last_call():
    t = RunningTotals("queries", "hits")
    assert t.seen == ()
    assert t.advance((100, 0)) == (100, 0)  # the first call counts the totals in full
    assert t.advance((164, 48)) == (64, 48)
    assert t.advance((164, 48)) == (0, 0)  # nothing new: no movement
    assert t.seen == (164, 48)


def test_a_smaller_total_restarts_the_whole_group():
    """A new engine's totals count from zero: one smaller value restarts every total of the group."""
    t = RunningTotals("queries", "hits")
    t.advance((164, 48))
    assert t.advance((200, 2)) == (200, 2)
    assert t.advance((210, 2)) == (10, 0)


def test_a_tail_grows_and_a_shorter_one_restarts():
    t = RunningTotals("drafts", tail="per_pos")
    assert t.advance((2, 2, 1)) == (2, 2, 1)
    assert t.advance((3, 3, 1, 1)) == (1, 1, 0, 1)  # a new position counts from zero
    assert t.advance((4, 3, 1)) == (4, 3, 1)  # fewer positions: a new source
    with pytest.raises(ValueError, match=r"per_pos\[1\]"):
        t.advance((5, 3, -1))


def test_a_rejected_call_names_the_field_and_changes_nothing():
    t = RunningTotals("num_steps", "num_scheduled_tokens")
    t.advance((2, 43))
    with pytest.raises(ValueError, match="num_scheduled_tokens"):
        t.advance((3, -1))
    with pytest.raises(ValueError, match="num_steps"):
        t.advance((True, 50))  # a bool is no count
    with pytest.raises(ValueError, match="values: expected 2 totals"):
        t.advance((3,))
    with pytest.raises(ValueError, match="values: expected 2 totals"):
        t.advance((3, 50, 1))  # no tail: no extra values
    assert t.seen == (2, 43)
    assert t.advance((3, 50)) == (1, 7)


def test_needs_a_name():
    with pytest.raises(ValueError, match="names"):
        RunningTotals()
