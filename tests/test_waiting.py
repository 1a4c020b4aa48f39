"""Tests for tests/waiting.py's ``wait_until``: returns the truthy value, keeps polling
through falsy values and exceptions, and fails at the deadline with a message that
names what it waited for and what it last saw."""
from __future__ import annotations

import threading
import time

import pytest

from tests import waiting
from tests.waiting import wait_until


@pytest.fixture(autouse=True)
def idle_machine(monkeypatch):
    """These tests time the deadlines themselves: the machine reads idle unless a test says otherwise."""
    monkeypatch.setattr(waiting.os, "getloadavg", lambda: (0.0, 0.0, 0.0))


def test_returns_the_first_truthy_value():
    values = iter([0, None, "", [], {"ready": 1}, "later"])
    assert wait_until(lambda: next(values), timeout=5.0, interval=0.001) == {"ready": 1}


def test_returns_at_once_when_already_true():
    calls = []

    def predicate():
        calls.append(1)
        return 42

    start = time.monotonic()
    assert wait_until(predicate, timeout=30.0, interval=10.0) == 42
    assert calls == [1]
    assert time.monotonic() - start < 5.0


def test_waits_for_a_condition_set_by_another_thread():
    done = threading.Event()
    timer = threading.Timer(0.2, done.set)
    timer.start()
    try:
        assert wait_until(done.is_set, timeout=30.0, interval=0.01, message="timer fired") is True
    finally:
        timer.cancel()


def test_exceptions_count_as_not_yet():
    attempts = []

    def predicate():
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionError("not listening yet")
        return "up"

    assert wait_until(predicate, timeout=5.0, interval=0.001) == "up"
    assert len(attempts) == 3


def test_times_out_with_message_and_last_value():
    values = iter(range(100000))

    def predicate():
        return [] if next(values) >= 0 else None

    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        wait_until(predicate, timeout=0.2, interval=0.01, message="the list filled")
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert text.startswith("the list filled (waited 0.2s, ")
    assert "last value []" in text
    assert "exception" not in text
    assert elapsed >= 0.2


def test_times_out_with_last_exception_chained():
    def predicate():
        raise KeyError("worker-7")

    with pytest.raises(AssertionError) as info:
        wait_until(predicate, timeout=0.1, interval=0.01, message="worker registered")
    text = str(info.value)
    assert text.startswith("worker registered (")
    assert "no value returned" in text
    assert "last exception KeyError: 'worker-7'" in text
    assert isinstance(info.value.__cause__, KeyError)


def test_checks_once_more_at_the_deadline():
    """A condition that turns true during the last sleep still counts."""
    start = time.monotonic()
    assert wait_until(lambda: time.monotonic() - start >= 0.3, timeout=0.3, interval=10.0) is True


def test_zero_timeout_tries_once():
    calls = []
    with pytest.raises(AssertionError, match=r"nothing \(waited 0s, 1 tries; last value False\)"):
        wait_until(lambda: calls.append(1) or False, timeout=0, message="nothing")
    assert calls == [1]


def test_does_not_swallow_keyboard_interrupt():
    def predicate():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        wait_until(predicate, timeout=5.0)


@pytest.mark.parametrize("kwargs, field", [({"timeout": -1.0}, "timeout"),
                                           ({"timeout": 1.0, "interval": 0}, "interval")])
def test_rejects_bad_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        wait_until(lambda: True, **kwargs)


def test_never_sleeps_past_the_deadline():
    """A long interval is cut to the time left: the failure comes at the deadline."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match="never"):
        wait_until(lambda: False, timeout=0.2, interval=30.0, message="never")
    assert time.monotonic() - start < 10.0


def test_a_message_function_describes_the_state_at_the_deadline():
    state = {"busy": ["w0"]}
    calls = []

    def describe() -> str:
        calls.append(1)
        return f"idle (still busy: {state['busy']})"

    assert wait_until(lambda: True, timeout=1.0, message=describe) is True
    assert calls == []  # not called when the wait succeeds
    with pytest.raises(AssertionError, match=r"^idle \(still busy: \['w0', 'w1'\]\) \(waited"):
        state["busy"].append("w1")
        wait_until(lambda: False, timeout=0.05, interval=0.01, message=describe)
    with pytest.raises(AssertionError, match=r"^\(message failed: RuntimeError: boom\) \(waited"):
        wait_until(lambda: False, timeout=0.01, message=lambda: (_ for _ in ()).throw(RuntimeError("boom")))


def test_a_deadline_stretches_once_with_the_machines_load(monkeypatch):
    import os

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(waiting.os, "getloadavg", lambda: (3.0 * cores, 0.0, 0.0))  # 3 runnable per core
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"waited 0.3s \+ 1s for the machine's load"):
        wait_until(lambda: False, timeout=0.3, interval=0.01)
    assert time.monotonic() - start >= 0.3 * 3 - 0.01  # the deadline, then twice it more (scale 3)
    monkeypatch.setattr(waiting.os, "getloadavg", lambda: (100.0 * cores, 0.0, 0.0))
    assert waiting.load_scale() == waiting.MAX_LOAD_SCALE  # bounded: a stuck wait still ends
    monkeypatch.setattr(waiting.os, "getloadavg", lambda: (0.5 * cores, 0.0, 0.0))
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"waited 0.3s,"):  # an idle machine: no stretch
        wait_until(lambda: False, timeout=0.3, interval=0.01)
    assert time.monotonic() - start < 0.3 * 2
