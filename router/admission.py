"""The router's wait queue for decode KV capacity (disaggregated mode).

Lifecycle: one ``AdmissionQueue`` per router. A request whose prompt blocks no decode
worker can reserve right now does not fail: it takes a ``ticket`` (ordered by its
arrival, so requests that raced to the fast path keep their arrival order), waits
until it is at the head of the queue, retries the reservation, and between tries
sleeps on a condition that ``capacity_freed()`` wakes (this router's requests
finishing or aborting on a decode worker) or a backoff timer fires (blocks freed by
other routers, or a decode worker's reservation expiring). The head leaving, with
or without blocks, lets the next one try at once. A request that arrives while
others wait joins the tail instead of trying, so it cannot overtake them (FIFO). With the router's
"priority" scheduling policy the order is (priority, arrival): a request of a better (lower) priority than every
waiter tries at once, and otherwise queues ahead of the worse ones.
``wake()`` (client cancel) makes every waiter re-check its stop condition.
The queue itself holds no worker resources: leaving it (``leave``, always in a
``finally``) is all the clean-up a cancelled or timed-out waiter needs.

``RequestBound`` is the router-wide bound in front of it (``max_num_requests``: requests held, running or
queued; RESOURCE_EXHAUSTED at once past it). The simulator (simulator/cluster_sim.py) holds one of each, as a
router does, and drives the queue without blocking: ``enter``, ``head``, ``leave`` on its virtual clock.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass(order=True)
class Ticket:
    """One request's place in the queue; ordered by priority (lower first), then arrival number."""

    priority: int
    """The request's ``priority`` (0 unless the router's scheduling policy is "priority")."""
    seq: int
    """Arrival number (``next_seq()`` when the request arrived)."""
    request_id: str = field(compare=False)
    """For logs and errors."""
    entered_at: float = field(compare=False, default=0.0)
    """time.monotonic() when it joined the queue."""


class QueueStop(Exception):
    """A waiter stopped waiting: ``reason`` is "cancelled", "deadline" or "timeout"."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RequestBound:
    """At most ``limit`` requests held by a router at once (see module docstring). Thread-safe."""

    def __init__(self, limit: int) -> None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"limit must be an integer >= 1, got {limit!r}")
        self.limit = limit
        self._lock = threading.Lock()
        self._held = 0

    @property
    def held(self) -> int:
        return self._held

    def try_take(self) -> bool:
        """Hold one more request; False (hold nothing) if ``limit`` are held."""
        with self._lock:
            if self._held >= self.limit:
                return False
            self._held += 1
            return True

    def give_back(self) -> None:
        """A held request ended."""
        with self._lock:
            if self._held <= 0:
                raise RuntimeError("give_back without a matching try_take")
            self._held -= 1


class AdmissionQueue:
    """Requests waiting for decode KV blocks, FIFO within a priority (see module docstring)."""

    def __init__(self, on_change: Optional[Callable[[int], None]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: what a ticket's ``entered_at`` is read from (the simulator passes its virtual clock; the
        blocking waits always run on ``time.monotonic``)."""
        self._clock = clock
        self._cond = threading.Condition()
        self._waiters: list[Ticket] = []  # sorted (priority, seq); short, so a list beats a heap here
        self._seq = itertools.count()
        self._epoch = 0  # bumped by capacity_freed: a waiter that saw it change retries at once
        self._on_change = on_change

    def next_seq(self) -> int:
        """An arrival number; take it when the request arrives, before any reservation attempt."""
        return next(self._seq)

    def __len__(self) -> int:
        with self._cond:
            return len(self._waiters)

    def has_waiters(self, priority: Optional[int] = None) -> bool:
        """Whether anyone waits (with ``priority``: anyone a request of that priority would queue behind)."""
        with self._cond:
            if priority is None:
                return bool(self._waiters)
            return bool(self._waiters) and self._waiters[0].priority <= priority

    def head(self) -> Optional[Ticket]:
        """The waiter whose turn it is (the best priority's earliest arrival), or None."""
        with self._cond:
            return self._waiters[0] if self._waiters else None

    def enter(self, seq: int, request_id: str, priority: int = 0) -> Ticket:
        """Join the queue in (priority, arrival) order."""
        t = Ticket(priority, seq, request_id, self._clock())
        with self._cond:
            i = len(self._waiters)
            while i > 0 and self._waiters[i - 1] > t:
                i -= 1
            self._waiters.insert(i, t)
            n = len(self._waiters)
            self._cond.notify_all()
        self._changed(n)
        return t

    def leave(self, ticket: Ticket) -> None:
        """Leave the queue (served, failed or gave up); the next waiter may try at once. Idempotent."""
        with self._cond:
            try:
                self._waiters.remove(ticket)
            except ValueError:
                return
            n = len(self._waiters)
            self._cond.notify_all()
        self._changed(n)

    def capacity_freed(self) -> None:
        """Some decode blocks were (probably) freed: the head retries now instead of after its backoff."""
        with self._cond:
            self._epoch += 1
            self._cond.notify_all()

    def wake(self) -> None:
        """Make every waiter re-check its stop condition (a client cancelled)."""
        with self._cond:
            self._cond.notify_all()

    @property
    def epoch(self) -> int:
        with self._cond:
            return self._epoch

    def wait_turn(self, ticket: Ticket, until: float, stop: Callable[[], Optional[str]]) -> None:
        """Block until ``ticket`` is at the head. ``stop()`` returning a reason, or ``until`` passing, raises QueueStop."""
        with self._cond:
            while True:
                self._check(until, stop)
                if self._waiters and self._waiters[0] is ticket:
                    return
                self._cond.wait(timeout=max(0.0, min(0.5, until - time.monotonic())))

    def wait_capacity(self, seen_epoch: int, timeout_s: float, until: float,
                      stop: Callable[[], Optional[str]]) -> None:
        """Sleep up to ``timeout_s`` (the backoff) or until capacity is freed after ``seen_epoch``."""
        end = min(until, time.monotonic() + timeout_s)
        with self._cond:
            while self._epoch == seen_epoch:
                self._check(until, stop)
                left = end - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(timeout=left)
            self._check(until, stop)

    @staticmethod
    def _check(until: float, stop: Callable[[], Optional[str]]) -> None:
        reason = stop()
        if reason:
            raise QueueStop(reason)
        if time.monotonic() >= until:
            raise QueueStop("timeout")

    def _changed(self, n: int) -> None:
        if self._on_change is not None:
            self._on_change(n)
