"""The one way tests wait for a condition: ``wait_until``.

Lifecycle: a test calls ``wait_until(predicate, timeout=..., message=...)``; it calls
``predicate()`` at once, then every ``interval`` seconds, until it returns something
truthy (which ``wait_until`` returns) or ``timeout`` seconds have passed. The predicate
is always tried once more at the deadline, so a condition that became true while the
last sleep ran still counts. At the deadline it raises ``AssertionError`` naming the
message, the last value the predicate returned and the last exception it raised (that
exception is also chained as the cause), so a failure says what was waited for and
what was seen instead.

An exception from the predicate counts as "not yet" (a server not listening yet, a key
not written yet): the wait goes on. Use it instead of fixed sleeps as synchronisation
and instead of private deadline loops; give deadlines generous enough for a loaded
machine, since a wait that succeeds returns as soon as the condition holds.

A deadline stretches with the machine's load: when it comes while more processes want
to run than there are cores (``load_scale``: the 1-minute load average over this
process's cores, at most ``MAX_LOAD_SCALE``), the wait goes on for ``timeout`` x
(scale - 1) more, once, and the failure message says so. A test's deadline is a bound
on the code under test on the machine the test was written for (2 idle cores); beside
a compile or another suite the same code takes longer, and a wait that fails only
because other work took the cores is a false alarm. Tests that measure a latency
bound of the product (a request's extra latency while Redis is away) do not use this:
they time the product directly.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional, TypeVar, Union

T = TypeVar("T")

_NOTHING = object()

MAX_LOAD_SCALE = 4.0
"""The most a deadline stretches for load (4x: a 2-core machine running the suite's two workers beside two CPU
hogs reads a load of about 6-8)."""


def load_scale() -> float:
    """How oversubscribed the machine is now: the 1-minute load average over the cores this process may use,
    clamped to [1, ``MAX_LOAD_SCALE``] (1 where the load cannot be read)."""
    try:
        load = os.getloadavg()[0]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    except OSError:
        return 1.0
    return min(MAX_LOAD_SCALE, max(1.0, load / max(1, cores)))


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.05,
               message: Union[str, Callable[[], str]] = "condition not met") -> T:
    """Poll ``predicate`` until it returns a truthy value and return that value.

    Raises ``AssertionError`` with ``message``, the last value and the last exception
    seen once ``timeout`` seconds have passed; ``ValueError`` for a negative ``timeout``
    or a non-positive ``interval``. ``message`` may be a function, called only at the
    deadline, to describe the state the wait gave up on.
    """
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0, got {timeout!r}")
    if interval <= 0:
        raise ValueError(f"interval must be > 0, got {interval!r}")
    deadline = time.monotonic() + timeout
    last_value: object = _NOTHING
    last_error: Optional[BaseException] = None
    attempts = 0
    stretched = 0.0
    while True:
        attempts += 1
        try:
            value = predicate()
        except Exception as e:  # not yet: keep the last one for the report
            last_error = e
        else:
            if value:
                return value
            last_value = value
        remaining = deadline - time.monotonic()
        if remaining <= 0 and not stretched:
            stretched = timeout * (load_scale() - 1.0)
            deadline += stretched
            remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        time.sleep(min(interval, remaining))
    if callable(message):
        try:
            message = message()
        except Exception as e:  # the description must not hide the timeout
            message = f"(message failed: {type(e).__name__}: {e})"
    seen = "no value returned" if last_value is _NOTHING else f"last value {last_value!r}"
    if last_error is not None:
        seen += f"; last exception {type(last_error).__name__}: {last_error}"
    waited = f"{timeout:g}s" + (f" + {stretched:.0f}s for the machine's load" if stretched > 0 else "")
    raise AssertionError(f"{message} (waited {waited}, {attempts} tries; {seen})") from last_error
