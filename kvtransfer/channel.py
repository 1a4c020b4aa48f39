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

A channel reaches its endpoint only through the ``ChannelHost`` it is given:
the endpoint's lock (every channel's condition is built on it), the
rendezvous, a few settings, and ``finished``, which every transfer that ends
on a channel (DONE or FAILED: deadline, break, close, rejection) is reported
to exactly once, outside the lock. The failure bookkeeping both sides share
lives here: ``reap`` (deadlines), ``break_pair`` and ``close`` fail transfers
with a reason, drop them from ``live`` and report them; each side supplies
only which of its tables a dead generation or a close empties.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from kvtransfer.rendezvous import SHM_MARK, Rendezvous, RendezvousTimeout, StoreUnavailable
from kvtransfer.transfer import Transfer
from kvtransfer.transport import PairBroken, PairGroup, open_pair

log = logging.getLogger(__name__)

IDLE_WAIT_S = 3600.0
"""Listening waits on an idle pair: gloo closes the pair if they time out; it is rebuilt on use."""
WINDOW = 4
"""Payload messages in flight per frame: hides the wake-up latency of the thread that posts the next one
(milliseconds on a loaded host); each side keeps this many staging buffers of chunk_bytes."""
BACKSTOP_S = 2.0
"""Slack past a transfer's deadline for waits on its bytes; the reaper normally acts first."""


@dataclass(frozen=True)
class ChannelHost:
    """What an endpoint hands each of its channels: all a channel may use of it."""

    name: str
    """The endpoint's name (logs, thread names)."""
    backend: str
    """Transport name for the pair groups (see ``transport.BACKENDS``)."""
    timeout_s: float
    """The endpoint's default transfer timeout; bounds waits on bytes no transfer owns (drains, acks)."""
    chunk_bytes: int
    """Payload chunk size a sender asks for."""
    lock: threading.RLock
    """The endpoint's lock: guards every transfer and channel table; channels build their conditions on it."""
    rendezvous: Rendezvous
    """Offers, accepts and group stores for building pair groups."""
    finished: Callable[[Transfer], None]
    """Report a transfer that ended (DONE or FAILED); called without the lock held."""
    bind_host: Optional[str] = None
    """Interface the pair groups listen on and advertise (``KVEndpoint``'s ``host``); None: torch's default."""


class PairChannel:
    """Base of SendChannel (rank 0) and RecvChannel (rank 1)."""

    rank = -1
    role = ""

    def __init__(self, host: ChannelHost, peer: str):
        self.host = host
        self.peer = peer
        self.cond = threading.Condition(host.lock)
        self.group: PairGroup | None = None
        self.gen = 0
        self.closed: str | None = None
        self.last_key: str | None = None
        self.build_error: str | None = None
        self.live: dict[int, Transfer] = {}
        """This channel's transfers not yet forgotten (a final one may stay until the side lets go of it)."""
        self.current_t: Transfer | None = None
        """The transfer whose frame is on the wire right now, if any."""
        self._staging: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * WINDOW
        self._threads: list[threading.Thread] = []
        self._spawn(self._main, f"kv-{self.role}-{host.name}-{peer}")

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
            log.exception("kv %s channel %s<->%s crashed", self.role, self.host.name, self.peer)
            self.close(f"channel thread crashed: {e!r}")

    def _main(self) -> None:
        raise NotImplementedError

    def _gen_main(self, group: PairGroup, gen: int) -> None:
        raise NotImplementedError

    def _buf(self, i: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """Staging buffer ``i`` (of WINDOW), grown to ``nbytes`` on ``device``."""
        if self._staging[i].numel() < nbytes or self._staging[i].device != device:
            self._staging[i] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._staging[i][:nbytes]

    # -- generations -----------------------------------------------------------------------------
    def _build(self, deadline: float) -> bool:
        """Try to build a group before ``deadline``; True when one is installed."""
        stop = lambda: self.closed is not None  # noqa: E731
        t0 = time.monotonic()
        remaining = deadline - t0
        if remaining <= 0:
            return False
        try:
            return self._build_once(deadline, remaining, stop)
        finally:
            dt = time.monotonic() - t0
            with self.cond:  # the build's time, to every transfer that waited for it
                for t in self.live.values():
                    if not t.final and not t.started:
                        t.pair_wait_s += dt

    def _build_once(self, deadline: float, remaining: float, stop: Callable[[], bool]) -> bool:
        if self.build_error is None:
            self.build_error = f"rendezvous with {self.peer!r} still in progress"
        try:
            if self.rank == 0:
                key = self.host.rendezvous.offer(self.peer, remaining, stop)
            else:
                key = self.host.rendezvous.accept(self.peer, self.last_key, remaining, stop)
                self.last_key = key
            store, prefix = self.host.rendezvous.group_store(key)
            # One attempt per key, lasting until the work's deadline: gloo cannot retry a key (its
            # published address goes stale), and short attempts with fresh keys can leave the two
            # sides chasing each other's previous key forever.
            wait_s = max(deadline - time.monotonic(), 0.05)
            shm = self.host.chunk_bytes if key.endswith(SHM_MARK) else None
            group = open_pair(self.host.backend, store, prefix, self.rank, wait_s, self.host.rendezvous.hub,
                              self.host.bind_host, shm, self.host.rendezvous.shm)
        except Exception as e:  # noqa: BLE001 - store down, peer gone, gloo refusal: all mean "not now"
            store_down = isinstance(e, StoreUnavailable)
            if not isinstance(e, (PairBroken, RendezvousTimeout)):
                e = f"{type(e).__name__}: {e}"
            log.debug("kv %s %s<->%s: build failed: %s", self.role, self.host.name, self.peer, e)
            self.build_error = str(e)
            if store_down:
                self._fail_waiting(str(e).replace("StoreUnavailable: ", ""))
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
        log.debug("kv %s %s<->%s: pair %s up (gen %d%s)", self.role, self.host.name, self.peer, key, gen,
                  ", shared memory" if getattr(group, "shared", False) else "")
        self._spawn(self._gen_main, f"kv-{self.role}-gen{gen}-{self.host.name}-{self.peer}", group, gen)
        return True

    def _fail_waiting(self, reason: str) -> None:
        """The store is unreachable, so no group can be built now: fail at once (not at their deadlines) the
        transfers that wait for one. None of their bytes went out, so no pair breaks; the next use tries again."""
        with self.cond:
            if self.group is not None or self.closed is not None:
                return
            failed = [t for t in list(self.live.values()) if not t.final and not t.started]
            for t in failed:
                self.expire(t, reason)
                self.live.pop(t.transfer_id, None)
            self.cond.notify_all()
        if failed:
            log.warning("kv %s %s<->%s: %d transfer(s) failed: %s", self.role, self.host.name, self.peer,
                        len(failed), reason)
        self._report(failed)

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
            failed = self._fail_locked(self._take_generation_locked(),
                                       f"pair {self.host.name}<->{self.peer} broken: {reason}")
            self.cond.notify_all()
        log.log(logging.WARNING if failed else logging.INFO, "kv %s %s<->%s: pair broken (%s); %d transfer(s) failed",
                self.role, self.host.name, self.peer, reason, len(failed))
        group.close()
        self._report(failed)

    def close(self, reason: str = "channel closed") -> None:
        """Fail everything in flight on this channel and stop its threads; idempotent."""
        with self.cond:
            if self.closed is not None:
                return
            self.closed = reason
            group, self.group = self.group, None
            self.gen += 1
            failed = self._fail_locked(self.live.values(), reason)
            self.live.clear()
            self._clear_locked()
            self.cond.notify_all()
        if group is not None:
            group.close()
        self._report(failed)

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

    # -- failure bookkeeping shared by both sides ------------------------------------------------
    def _fail_locked(self, transfers: Iterable[Transfer], reason: str) -> list[Transfer]:
        """Fail each of ``transfers`` and drop from ``live`` those this call failed; returns them. Holds the lock."""
        failed = [t for t in transfers if t.fail(reason)]
        for t in failed:
            self.live.pop(t.transfer_id, None)
        return failed

    def _report(self, ended: Iterable[Transfer]) -> None:
        """Tell the host each of ``ended`` is over. Called without the lock."""
        for t in ended:
            self.host.finished(t)

    def _release(self, t: Transfer) -> None:
        """Drop ``t`` (already final) from ``live`` and tell the host. Called without the lock."""
        with self.cond:
            self.live.pop(t.transfer_id, None)
        self.host.finished(t)

    def reap(self, now: float) -> None:
        """Enforce deadlines of this channel's transfers (called by the endpoint's reaper)."""
        breaks: list[tuple[int, str]] = []
        failed: list[Transfer] = []
        with self.cond:
            for tid, t in list(self.live.items()):
                if not t.final:
                    if now < t.deadline:
                        continue
                    why = self.expire(t, f"deadline exceeded after {t.timeout_s:.3f} s ({self._progress_locked(t)})")
                    failed.append(t)
                    if why:
                        breaks.append((self.gen, why))
                if not self._holds_locked(t):
                    del self.live[tid]
            why = self._overdue_locked(now)
            if why:
                breaks.append((self.gen, why))
        self._report(failed)
        for gen, why in breaks:
            self.break_pair(gen, why)

    # -- side hooks ------------------------------------------------------------------------------
    def expire(self, t: Transfer, reason: str) -> str | None:
        """Fail ``t`` (deadline or cancel); returns a reason to break the pair, if it must be. Holds the lock."""
        raise NotImplementedError

    def _take_generation_locked(self) -> list[Transfer]:
        """Empty the tables of what the current generation carried; return those transfers. Holds the lock."""
        raise NotImplementedError

    def _clear_locked(self) -> None:
        """Empty the side's own tables on close (``live`` is already failed and cleared). Holds the lock."""
        raise NotImplementedError

    def _progress_locked(self, t: Transfer) -> str:
        """How far ``t`` got, for its deadline failure (the text in parentheses). Holds the lock."""
        raise NotImplementedError

    def _holds_locked(self, t: Transfer) -> bool:
        """Whether the side still needs final ``t`` in ``live`` (the reaper drops it otherwise). Holds the lock."""
        return False

    def _overdue_locked(self, now: float) -> str | None:
        """A reason to break the current generation for something other than a deadline, else None."""
        return None
