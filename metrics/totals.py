"""Counters fed from running totals that something else keeps (an engine's preemptions, prefix-cache
lookups, speculative drafts): the one place that turns "the total is now N" into "the counter moves by
N minus what it saw last".

Lifecycle: a component builds one ``RunningTotals`` per group of totals that restart together (one
engine's), then calls ``advance(values)`` whenever it re-reads them, typically once per engine-loop
pass; each call returns the increments since the previous call and remembers the new values. Totals
only grow while their source lives; a value smaller than last seen, or fewer values than last seen,
means the source was replaced (a new engine), so the base restarts at zero for the whole group and the
new totals count in full: a Prometheus counter never goes back. A rejected call (a negative or non-int
value) raises ``ValueError`` naming the field and changes nothing.

A group may end in a variable-length tail (speculative acceptance per draft position): positions past
the named ones are named ``tail[i]`` and count from zero when they first appear.
"""
from __future__ import annotations

from typing import Optional, Sequence

from metrics.series import check_count


class RunningTotals:
    """Increments, since the last call, of a group of running totals that restart together."""

    def __init__(self, *names: str, tail: Optional[str] = None) -> None:
        """``names``: the fixed totals, in ``advance``'s order; ``tail``: the name of a variable-length
        rest (None: exactly ``len(names)`` values)."""
        if not names and tail is None:
            raise ValueError("names: a RunningTotals needs at least one total (or a tail)")
        self.names = names
        self.tail = tail
        self._seen: tuple[int, ...] = ()

    def _field(self, i: int) -> str:
        return self.names[i] if i < len(self.names) else f"{self.tail}[{i - len(self.names)}]"

    def advance(self, values: Sequence[int]) -> tuple[int, ...]:
        """The increments from the last call's values to ``values`` (each >= 0), then remember ``values``."""
        values = tuple(values)
        if len(values) < len(self.names) or (self.tail is None and len(values) > len(self.names)):
            raise ValueError(f"values: expected {len(self.names)} totals ({', '.join(self.names)})"
                             f"{' and any ' + self.tail if self.tail else ''}, got {len(values)}")
        now = tuple(check_count(self._field(i), v) for i, v in enumerate(values))
        before = self._seen
        if len(now) < len(before) or any(a < b for a, b in zip(now, before)):
            before = ()  # the source restarted: its totals count from zero
        self._seen = now
        return tuple(a - (before[i] if i < len(before) else 0) for i, a in enumerate(now))

    @property
    def seen(self) -> tuple[int, ...]:
        """The values of the last accepted call (empty before the first)."""
        return self._seen
