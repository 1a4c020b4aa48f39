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
"""
from __future__ import annotations

import time
from typing import Callable, Optional, TypeVar, Union

T = TypeVar("T")

_NOTHING = object()


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
    raise AssertionError(f"{message} (waited {timeout:g}s, {attempts} tries; {seen})") from last_error
