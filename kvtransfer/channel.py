"""What both ends of a pair channel share: the group's generations and their breaking.

Lifecycle: a channel is created by its endpoint on first use of a peer and
lives until ``close``. It holds at most one pair group at a time; each group is
a *generation*. A channel thread builds a generation when it has work
(``_build``), runs the per-generation helper thread (``_gen_main``: the
sender's ack listener, the receiver's ack sender), and any error on that group
ends the generation through ``break_pair``: the group is closed (which wakes
every thread blocked on it and makes the peer see EOF at once), the transfers
that had bytes on it fail, and the next use builds a new one. Threads of an
old generation notice the generation number moved and exit.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from kvtransfer.rendezvous import RendezvousTimeout
from kvtransfer.transport import PairBroken, PairGroup, open_pair

if TYPE_CHECKING:
    from kvtransfer.endpoint import KVEndpoint

log = logging.getLogger(__name__)

IDLE_WAIT_S = 3600.0
"""Listening waits on an idle pair: gloo closes the pair if they time out; it is rebuilt on use."""
WINDOW = 4
"""Payload messages in flight per frame: hides the wake-up latency of the thread that posts the next one
(milliseconds on a loaded host); each side keeps this many staging buffers of chunk_bytes."""
BACKSTOP_S = 2.0
"""Slack past a transfer's deadline for waits on its bytes; the reaper normally acts first."""


class PairChannel:
    """Base of SendChannel (rank 0) and RecvChannel (rank 1)."""

    rank = -1
    role = ""

    def __init__(self, ep: "KVEndpoint", peer: str):
        self.ep = ep
        self.peer = peer
        self.cond = threading.Condition(ep._lock)
        self.group: PairGroup | None = None
        self.gen = 0
        self.closed: str | None = None
        self.last_key: str | None = None
        self.build_error: str | None = None
        self._threads: list[threading.Thread] = []
        self._spawn(self._main, f"kv-{self.role}-{ep.name}-{peer}")

    # -- threads ---------------------------------------------------------------------------------
    def _spawn(self, fn, name: str, *args) -> None:
        th = threading.Thread(target=self._guard, args=(fn, *args), name=name, daemon=True)
        with self.cond:
            self._threads = [t for t in self._threads if t.is_alive()] + [th]
        th.start()

    def _guard(self, fn, *args) -> None:
        try:
            # engines allocate their caches (and call send/recv) under torch.inference_mode; inference
            # tensors may only be written inside it, and it is a per-thread mode
            with torch.inference_mode():
                fn(*args)
        except Exception as e:  # noqa: BLE001 - a channel thread must never die silently
            log.exception("kv %s channel %s<->%s crashed", self.role, self.ep.name, self.peer)
            self.close(f"channel thread crashed: {e!r}")

    def _main(self) -> None:
        raise NotImplementedError

    def _gen_main(self, group: PairGroup, gen: int) -> None:
        raise NotImplementedError

    # -- generations -----------------------------------------------------------------------------
    def _build(self, deadline: float) -> bool:
        """Try to build a group before ``deadline``; True when one is installed."""
        stop = lambda: self.closed is not None  # noqa: E731
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if self.build_error is None:
            self.build_error = f"rendezvous with {self.peer!r} still in progress"
        try:
            if self.rank == 0:
                key = self.ep._rdv.offer(self.peer, remaining, stop)
            else:
                key = self.ep._rdv.accept(self.peer, self.last_key, remaining, stop)
                self.last_key = key
            store, prefix = self.ep._rdv.group_store(key)
            # One attempt per key, lasting until the work's deadline: gloo cannot retry a key (its
            # published address goes stale), and short attempts with fresh keys can leave the two
            # sides chasing each other's previous key forever.
            wait_s = max(deadline - time.monotonic(), 0.05)
            group = open_pair(self.ep.backend, store, prefix, self.rank, wait_s, self.ep._rdv.hub)
        except Exception as e:  # noqa: BLE001 - store down, peer gone, gloo refusal: all mean "not now"
            if not isinstance(e, (PairBroken, RendezvousTimeout)):
                e = f"{type(e).__name__}: {e}"
            log.debug("kv %s %s<->%s: build failed: %s", self.role, self.ep.name, self.peer, e)
            self.build_error = str(e)
            return False
        with self.cond:
            if self.closed is not None:
                group.close()
                return False
            self.group = group
            self.build_error = None
            self.gen += 1
            gen = self.gen
            self.cond.notify_all()
        log.debug("kv %s %s<->%s: pair %s up (gen %d)", self.role, self.ep.name, self.peer, key, gen)
        self._spawn(self._gen_main, f"kv-{self.role}-gen{gen}-{self.ep.name}-{self.peer}", group, gen)
        return True

    def current(self) -> tuple[PairGroup | None, int]:
        with self.cond:
            return self.group, self.gen

    def break_pair(self, gen: int, reason: str) -> None:
        """End generation ``gen`` (no-op if already ended); fails the transfers with bytes on it."""
        with self.cond:
            if gen != self.gen or self.group is None:
                return
            group, self.group = self.group, None
            self.gen += 1
            failed = self._on_break_locked(f"pair {self.ep.name}<->{self.peer} broken: {reason}")
            self.cond.notify_all()
        log.log(logging.WARNING if failed else logging.INFO, "kv %s %s<->%s: pair broken (%s); %d transfer(s) failed",
                self.role, self.ep.name, self.peer, reason, len(failed))
        group.close()
        for t in failed:
            self.ep._finished(t)

    def _on_break_locked(self, reason: str) -> list:
        """Fail what the dead generation carried; return those transfers. Caller holds the lock."""
        raise NotImplementedError

    def close(self, reason: str = "channel closed") -> None:
        """Fail everything in flight on this channel and stop its threads; idempotent."""
        with self.cond:
            if self.closed is not None:
                return
            self.closed = reason
            group, self.group = self.group, None
            self.gen += 1
            failed = self._on_close_locked(reason)
            self.cond.notify_all()
        if group is not None:
            group.close()
        for t in failed:
            self.ep._finished(t)

    def _on_close_locked(self, reason: str) -> list:
        raise NotImplementedError

    def join(self, timeout_s: float) -> None:
        """Wait for this channel's threads to end (after close)."""
        end = time.monotonic() + timeout_s
        for th in list(self._threads):
            if th is not threading.current_thread():
                th.join(max(end - time.monotonic(), 0.0))

    def not_connected_note(self) -> str:
        """'; pair not connected: <why>' while no group is up and the last build failed, else ''."""
        if self.group is None and self.build_error:
            return f"; pair not connected: {self.build_error}"
        return ""

    # -- reaper hook -----------------------------------------------------------------------------
    def reap(self, now: float) -> None:
        """Enforce deadlines of this channel's transfers (called by the endpoint's reaper)."""
        raise NotImplementedError
