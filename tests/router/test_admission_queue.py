"""AdmissionQueue alone (one layer, threads only): arrival order, wake-ups, stop reasons."""
from __future__ import annotations

import threading
import time

import pytest

from router import RouterConfig
from router.admission import AdmissionQueue, QueueStop


def _never() -> None:
    return None


class _NotifyOnly(threading.Condition):
    """The queue's condition with the timeouts taken off its waits: a waiter wakes only when notified. A waiter
    that wakes at all was then woken by the notify, not by the queue's 0.5 s re-check or a backoff timer, so
    "woken promptly" needs no wall clock. ``waiting`` is set once some thread waits on it: a notify sent after
    that reaches the waiter (the condition's lock orders the two)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout=None):
        self.waiting.set()
        return super().wait()


def _notify_only(q: AdmissionQueue) -> _NotifyOnly:
    q._cond = _NotifyOnly()
    return q._cond


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    """Run ``fn`` on a daemon thread (one that never wakes must not keep the test run alive); its result or
    exception lands in the dict."""
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except Exception as e:
            box["err"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


def test_tickets_keep_arrival_order_not_entry_order():
    changes = []
    q = AdmissionQueue(on_change=changes.append)
    s0, s1, s2 = q.next_seq(), q.next_seq(), q.next_seq()
    t2 = q.enter(s2, "c")   # the later arrival enters first (it lost the fast-path race)
    t0 = q.enter(s0, "a")
    t1 = q.enter(s1, "b")
    assert len(q) == 3 and changes == [1, 2, 3]
    until = time.monotonic() + 60
    q.wait_turn(t0, until, _never)          # the head returns at once
    with pytest.raises(QueueStop) as ei:    # t1 is behind t0: it times out
        q.wait_turn(t1, time.monotonic() + 0.05, _never)
    assert ei.value.reason == "timeout"
    q.leave(t0)
    q.wait_turn(t1, until, _never)
    q.leave(t1)
    q.leave(t1)                             # idempotent
    q.wait_turn(t2, until, _never)
    q.leave(t2)
    assert len(q) == 0 and not q.has_waiters() and changes[-1] == 0


def test_head_leaving_wakes_the_next_waiter_promptly():
    q = AdmissionQueue()
    cond = _notify_only(q)
    a = q.enter(q.next_seq(), "a")
    b = q.enter(q.next_seq(), "b")
    th, box = _in_thread(lambda: q.wait_turn(b, time.monotonic() + 60, _never))
    assert cond.waiting.wait(30), "the waiter never waited"
    assert th.is_alive() and box == {}   # b is behind a
    q.leave(a)
    th.join(30)   # woken by leave's notify: with no timeouts on the waits, nothing else wakes it
    assert not th.is_alive(), "leave() did not wake the next waiter"
    assert box == {"out": None}


def test_capacity_freed_ends_the_backoff_early_and_cancel_stops():
    q = AdmissionQueue()
    cond = _notify_only(q)
    epoch = q.epoch
    th, box = _in_thread(lambda: q.wait_capacity(epoch, timeout_s=3.0, until=time.monotonic() + 60, stop=_never))
    assert cond.waiting.wait(30), "the waiter never waited"
    q.capacity_freed()
    th.join(30)   # woken by the notify, not its 3 s backoff (no timeouts on the waits)
    assert not th.is_alive(), "capacity_freed() did not end the backoff"
    assert box == {"out": None} and q.epoch == epoch + 1

    q._cond = threading.Condition()   # the real timeouts again: with no event, the backoff elapses
    t = time.monotonic()
    q.wait_capacity(q.epoch, timeout_s=0.05, until=time.monotonic() + 60, stop=_never)   # returns, no raise
    assert time.monotonic() - t >= 0.05

    flag = {"stop": None}
    tk = q.enter(q.next_seq(), "x")
    other = q.enter(-1, "ahead")   # someone ahead, so tk waits
    cond = _notify_only(q)
    th, box = _in_thread(lambda: q.wait_turn(tk, time.monotonic() + 60, lambda: flag["stop"]))
    assert cond.waiting.wait(30), "the waiter never waited"
    flag["stop"] = "cancelled"
    q.wake()
    th.join(30)   # woken by wake()'s notify, not the 0.5 s re-check
    assert not th.is_alive(), "wake() did not wake the waiter"
    assert isinstance(box.get("err"), QueueStop) and box["err"].reason == "cancelled", box
    q.leave(tk)
    q.leave(other)
    assert len(q) == 0


def test_queue_timeout_config_is_validated():
    assert RouterConfig().queue_timeout_s > 0
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="queue_timeout_s"):
            RouterConfig(queue_timeout_s=bad)


def test_request_bound_holds_at_most_its_limit_and_refuses_bad_use():
    from router.admission import RequestBound

    b = RequestBound(2)
    assert b.try_take() and b.try_take() and not b.try_take() and b.held == 2
    b.give_back()
    assert b.held == 1 and b.try_take() and not b.try_take()
    b.give_back()
    b.give_back()
    with pytest.raises(RuntimeError, match="give_back"):
        b.give_back()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="limit"):
            RequestBound(bad)


def test_head_is_the_earliest_arrival_and_entered_at_reads_the_clock():
    t = [5.0]
    q = AdmissionQueue(clock=lambda: t[0])
    assert q.head() is None
    late = q.enter(7, "late")
    t[0] = 6.0
    early = q.enter(3, "early")
    assert q.head() is early and (early.entered_at, late.entered_at) == (6.0, 5.0)
    q.leave(early)
    assert q.head() is late


def test_a_better_priority_queues_ahead_and_only_waits_behind_its_equals_or_betters():
    """The "priority" scheduling policy: (priority, arrival) order; ``has_waiters(p)`` says whether a request of
    priority p would queue behind anyone (placement tries at once when it would not)."""
    q = AdmissionQueue()
    low1 = q.enter(q.next_seq(), "low1", 5)
    low2 = q.enter(q.next_seq(), "low2", 5)
    assert q.has_waiters() and q.has_waiters(5) and q.has_waiters(9) and not q.has_waiters(0)
    high = q.enter(q.next_seq(), "high", 0)
    mid = q.enter(q.next_seq(), "mid", 3)
    assert [t.request_id for t in (q.head(),)] == ["high"]
    order = []
    while q.head() is not None:
        order.append(q.head().request_id)
        q.leave(q.head())
    assert order == ["high", "mid", "low1", "low2"]
    assert (low1 < low2 and high < mid < low1)  # the tickets compare as (priority, arrival)
