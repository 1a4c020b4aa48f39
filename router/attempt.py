"""One attempt of a request: a placement while it runs, and the abort and release that end it.

Lifecycle: the request flow gets a ``Placement`` from the ``Placer`` and runs it inside
``with Attempt(...) as at:``. Every worker call of the attempt is ``at.track``ed (the request's
scope tracks it too, so a client cancel reaches it). The block's way out decides the cleanup:
- normal exit (the request finished, or the flow moves on after a failure it chose to retry
  without an abort): the placement's load counts are released;
- an exception (a failure the flow does not recover from, a cancel, the front end closing the
  stream): the attempt's calls are cancelled, its workers abort the request (they free its
  blocks), and its load counts are released.
Inside the block ``at.abort()`` does the cancel-and-abort at once (a stop string ended the
request while the worker would go on; a retry or migration elsewhere), ``at.abort_choice(i)``
ends one finished choice on its worker, and ``at.release(Hold.PREFILL)`` gives back one count
early (the transfer watch, once the KV has moved). Abort and release are each done at most once.
"""
from __future__ import annotations

import threading
from types import TracebackType
from typing import Any, Optional

from router.placement import Placer
from router.placement_records import ALL_HOLDS, Hold, Placement
from router.scope import RequestScope
from router.worker_calls import WorkerCalls


class Attempt:
    """One placement of a request while it runs (see module docstring)."""

    def __init__(self, placer: Placer, calls: WorkerCalls, scope: RequestScope, placement: Placement) -> None:
        self.placer, self.calls, self.scope = placer, calls, scope
        self.placement = placement
        self._lock = threading.Lock()
        self._calls: list[Any] = []
        self._aborted = False

    def __enter__(self) -> "Attempt":
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        try:
            if exc is not None:
                self.abort()
        finally:
            self.release()

    def track(self, call: Any) -> Any:
        """Remember a live worker call of this attempt (and of the request's scope); returns it."""
        with self._lock:
            self._calls.append(call)
        return self.scope.track(call)

    @property
    def aborted(self) -> bool:
        return self._aborted

    def abort(self) -> None:
        """Cancel this attempt's calls and have its workers drop the request (best effort, once)."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            calls = list(self._calls)
        for c in calls:
            c.cancel()
        self.calls.abort(self.placement)

    def abort_choice(self, index: int) -> None:
        """The worker streaming this attempt's tokens ends choice ``index`` alone (best effort)."""
        self.calls.abort_choice(self.placement, index)

    def release(self, *holds: Hold) -> None:
        """Give back the load counts among ``holds`` (all when none given) still held (idempotent, any thread)."""
        self.placer.release(self.placement, self.scope, holds or ALL_HOLDS)
