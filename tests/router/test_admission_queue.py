"""AdmissionQueue alone (one layer, threads only): arrival order, wake-ups, stop reasons."""
from __future__ import annotations

import threading
import time

import pytest

from router import RouterConfig
from router.admission import AdmissionQueue, QueueStop


def _never() -> None:
    return None


def test_tickets_keep_arrival_order_not_entry_order():
    changes = []
    q = AdmissionQueue(on_change=changes.append)
    s0, s1, s2 = q.next_seq(), q.next_seq(), q.next_seq()
    t2 = q.enter(s2, "c")   # the later arrival enters first (it lost the fast-path race)
    t0 = q.enter(s0, "a")
    t1 = q.enter(s1, "b")
    assert len(q) == 3 and changes == [1, 2, 3]
    until = time.monotonic() + 1
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
    a = q.enter(q.next_seq(), "a")
    b = q.enter(q.next_seq(), "b")
    got = {}

    def waiter():
        q.wait_turn(b, time.monotonic() + 5, _never)
        got["t"] = time.monotonic()

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.1)
    assert "t" not in got
    t_leave = time.monotonic()
    q.leave(a)
    th.join(2)
    assert got["t"] - t_leave < 0.2   # woken by the notify, not by the 0.5 s re-check


def test_capacity_freed_ends_the_backoff_early_and_cancel_stops():
    q = AdmissionQueue()
    epoch = q.epoch
    threading.Timer(0.05, q.capacity_freed).start()
    t = time.monotonic()
    q.wait_capacity(epoch, timeout_s=3.0, until=time.monotonic() + 5, stop=_never)
    assert time.monotonic() - t < 1.0 and q.epoch == epoch + 1
    t = time.monotonic()   # no event: the backoff elapses
    q.wait_capacity(q.epoch, timeout_s=0.05, until=time.monotonic() + 5, stop=_never)
    assert 0.04 < time.monotonic() - t < 1.0

    flag = {"stop": None}
    tk = q.enter(q.next_seq(), "x")
    other = q.enter(-1, "ahead")   # someone ahead, so tk waits

    def cancel():
        flag["stop"] = "cancelled"
        q.wake()

    threading.Timer(0.05, cancel).start()
    t = time.monotonic()
    with pytest.raises(QueueStop) as ei:
        q.wait_turn(tk, time.monotonic() + 5, lambda: flag["stop"])
    assert ei.value.reason == "cancelled" and time.monotonic() - t < 0.3
    q.leave(tk)
    q.leave(other)
    assert len(q) == 0


def test_queue_timeout_config_is_validated():
    assert RouterConfig().queue_timeout_s > 0
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="queue_timeout_s"):
            RouterConfig(queue_timeout_s=bad)
