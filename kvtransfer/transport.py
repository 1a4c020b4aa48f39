"""Two-rank pair groups chosen by backend name: gloo, nccl, inproc.

Lifecycle: a channel thread calls ``open_pair(backend, store, prefix, rank,
timeout_s)`` once the rendezvous (rendezvous.py) has agreed on a fresh
``prefix``; it blocks until the peer joins or ``timeout_s`` passes. The group
then carries tagged point-to-point messages: ``isend``/``irecv`` return an op
whose ``wait(timeout_s)`` blocks at most that long. Any error or timeout means
the pair is broken (gloo closes the connection on a timed-out wait, which the
peer sees at once): the channel drops the group with ``close()`` and builds a
new one under a new prefix on next use.

The groups are constructed directly (``ProcessGroupGloo(store, rank, 2, ...)``)
rather than through ``init_process_group``, so a process holds any number of
them and no process-wide default group exists.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from transport.gloo import open_gloo, timedelta_s


KILL_TAG = 0x7FFF  # never sent on; a timed-out receive on it closes the pair


class PairBroken(RuntimeError):
    """The pair group failed (peer gone, timeout, closed); it must be rebuilt."""


class PairOp(Protocol):
    def wait(self, timeout_s: float) -> None: ...


class PairGroup(Protocol):
    """A connected two-rank group: rank 0 sends KV, rank 1 receives it."""

    data_device: torch.device

    def isend(self, t: torch.Tensor, tag: int) -> PairOp: ...
    def irecv(self, t: torch.Tensor, tag: int) -> PairOp: ...
    def close(self) -> None: ...


_td = timedelta_s


class _TorchOp:
    def __init__(self, work, device: torch.device | None = None):
        self._work, self._device = work, device
        self._done = False

    def completed(self) -> bool:
        """Whether ``wait`` would return (or raise) at once: done, or failed."""
        if self._done:
            return True
        try:
            return bool(self._work.is_completed())
        except RuntimeError:
            return True  # failed: its wait raises PairBroken

    def wait(self, timeout_s: float) -> None:
        if self._done:  # waiting twice is allowed (a staging slot, then the frame's end)
            return
        try:
            self._work.wait(_td(timeout_s))
            self._done = True
            if self._device is not None:
                # NCCL completes on a GPU stream; the bytes are read or reused right after
                torch.cuda.current_stream(self._device).synchronize()
        except RuntimeError as e:
            raise PairBroken(str(e).splitlines()[0][:300]) from None


class TorchPair:
    """Two-rank ``torch.distributed`` groups used for tagged p2p only.

    Control messages (head messages, acks) are small CPU tensors and always go over the gloo
    group; with the nccl backend, CUDA payload chunks go over a second, NCCL group built
    under the same rendezvous key. NCCL ignores tags, which is fine: only payload chunks use
    it, and both sides post them in the same order.
    """

    def __init__(self, gloo, rank: int, nccl=None):
        self._pg, self._nccl, self._peer = gloo, nccl, 1 - rank

    @property
    def data_device(self) -> torch.device:
        """Where payload buffers must live for this pair."""
        return torch.device("cuda", torch.cuda.current_device()) if self._nccl is not None else torch.device("cpu")

    def _route(self, t: torch.Tensor):
        if self._pg is None:
            raise PairBroken("pair closed")
        if t.is_cuda:
            if self._nccl is None:
                raise PairBroken("CUDA tensor on a gloo pair: use backend 'nccl'")
            return self._nccl, t.device
        return self._pg, None

    def isend(self, t: torch.Tensor, tag: int) -> PairOp:
        pg, dev = self._route(t)
        try:
            return _TorchOp(pg.send([t], self._peer, tag), dev)
        except RuntimeError as e:
            raise PairBroken(str(e).splitlines()[0][:300]) from None

    def irecv(self, t: torch.Tensor, tag: int) -> PairOp:
        pg, dev = self._route(t)
        try:
            return _TorchOp(pg.recv([t], self._peer, tag), dev)
        except RuntimeError as e:
            raise PairBroken(str(e).splitlines()[0][:300]) from None

    def close(self) -> None:
        """Break the pair now: wakes every thread blocked on it here, and the peer sees EOF.

        ``pg.abort()`` neither wakes blocked gloo waits nor closes the sockets; a wait that
        times out does both (gloo closes the pair on an application timeout), so time out a
        receive on a tag no one sends on.
        """
        pg, self._pg = self._pg, None
        nccl, self._nccl = self._nccl, None
        if pg is None:
            return
        try:
            pg.recv([torch.empty(1, dtype=torch.uint8)], self._peer, KILL_TAG).wait(_td(0.001))
        except RuntimeError:
            pass  # expected: that is the closure
        if nccl is not None:
            try:
                nccl.abort()  # NCCL's abort does unblock pending NCCL work
            except RuntimeError:
                pass


def _open_gloo(store: dist.Store, rank: int, timeout_s: float, host: str | None = None) -> TorchPair:
    return TorchPair(open_gloo(store, rank, 2, timeout_s, host), rank)


def nccl_unavailable() -> str | None:
    """Why the nccl backend cannot run in this process, or None."""
    if not hasattr(dist, "ProcessGroupNCCL"):
        return "this torch build has no NCCL"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    return None


def _open_nccl(store: dist.Store, rank: int, timeout_s: float, host: str | None = None) -> TorchPair:
    # Written against torch 2.13's API but never run here (the project machine has no GPU).
    why = nccl_unavailable()
    if why:
        raise PairBroken(f"backend 'nccl': {why}")
    control = _open_gloo(dist.PrefixStore("gloo", store), rank, timeout_s, host)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = _td(timeout_s)
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, 2, opts)
    return TorchPair(control._pg, rank, nccl)


class _Mailbox:
    """One direction of an in-process pair: tagged FIFO queues of tensor copies."""

    def __init__(self):
        self._qs: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self.closed: str | None = None

    def q(self, tag: int) -> queue.Queue:
        with self._lock:
            return self._qs.setdefault(tag, queue.Queue())


class _InprocOp:
    def __init__(self, fn: Callable[[float], None]):
        self._fn = fn

    def wait(self, timeout_s: float) -> None:
        self._fn(timeout_s)


class InprocPair:
    """Same-process pair over queues: for unit tests of the layers above transports."""

    def __init__(self, out_box: _Mailbox, in_box: _Mailbox):
        self._out, self._in = out_box, in_box
        self.data_device = torch.device("cpu")

    def _check(self) -> None:
        for box in (self._out, self._in):
            if box.closed:
                raise PairBroken(box.closed)

    def isend(self, t: torch.Tensor, tag: int) -> PairOp:
        self._check()
        self._out.q(tag).put(t.clone())
        return _InprocOp(lambda timeout_s: self._check())

    def irecv(self, t: torch.Tensor, tag: int) -> PairOp:
        self._check()

        def wait(timeout_s: float) -> None:
            deadline = time.monotonic() + timeout_s
            while True:
                self._check()
                try:
                    got = self._in.q(tag).get(timeout=min(0.02, max(deadline - time.monotonic(), 0.0)))
                    break
                except queue.Empty:
                    if time.monotonic() >= deadline:
                        self.close("timed out waiting for recv")
                        raise PairBroken(f"timed out after {timeout_s:.3f} s waiting for recv") from None
            if got.numel() != t.numel() or got.dtype != t.dtype:
                self.close("message size mismatch")
                raise PairBroken(f"message of {got.numel()} {got.dtype} into buffer of {t.numel()} {t.dtype}")
            t.copy_(got)
        return _InprocOp(wait)

    def close(self, reason: str = "pair closed") -> None:
        for box in (self._out, self._in):
            if box.closed is None:
                box.closed = reason


class InprocHub:
    """Where in-process pairs meet; lives on an ``InprocStore`` shared by the endpoints."""

    def __init__(self):
        self._lock = threading.Condition()
        self._pairs: dict[str, tuple[_Mailbox, _Mailbox, set[int]]] = {}

    def connect(self, prefix: str, rank: int, timeout_s: float) -> InprocPair:
        with self._lock:
            boxes = self._pairs.setdefault(prefix, (_Mailbox(), _Mailbox(), set()))
            boxes[2].add(rank)
            self._lock.notify_all()
            if not self._lock.wait_for(lambda: len(boxes[2]) == 2, timeout=timeout_s):
                boxes[2].discard(rank)
                raise PairBroken(f"peer did not join pair {prefix!r} within {timeout_s:.3f} s")
            self._pairs.pop(prefix, None) if rank == 1 else None
        to_one, to_zero = boxes[0], boxes[1]
        return InprocPair(to_one, to_zero) if rank == 0 else InprocPair(to_zero, to_one)


BACKENDS = ("gloo", "nccl", "inproc")


def open_pair(backend: str, store: dist.Store, prefix: str, rank: int, timeout_s: float,
              hub: InprocHub | None = None, host: str | None = None, shm_slot_bytes: int | None = None,
              shm_accept: bool = True) -> PairGroup:
    """Build the pair group for ``prefix`` as ``rank`` (0 sender, 1 receiver); PairBroken on failure.

    ``hub`` is the inproc backend's meeting place (``InprocStore.hub``); other backends ignore it.
    ``host``: the interface gloo (also nccl's control group) listens on and advertises; None: torch's
    default (the hostname's address). The pair's traffic is neither authenticated nor encrypted
    (as with every torch.distributed backend): ``host`` must be on a private network.
    ``shm_slot_bytes``: the pair was offered shared memory (kvtransfer/shm.py): both ranks negotiate it on the new
    pair, with gloo rank 0 with slots of this size, used where they share ``/dev/shm``; with nccl CUDA IPC (the
    receiver maps the sender's device memory; NCCL is then never initialised); ``shm_accept`` False makes rank 1
    answer no.
    """
    try:
        if backend == "gloo":
            pair = _open_gloo(dist.PrefixStore(prefix, store), rank, timeout_s, host)
            if shm_slot_bytes is None:
                return pair
            from kvtransfer.shm import negotiate

            try:
                return negotiate(pair, rank, shm_slot_bytes, timeout_s, accept=shm_accept)
            except BaseException:
                pair.close()
                raise
        if backend == "nccl":
            pair = _open_nccl(dist.PrefixStore(prefix, store), rank, timeout_s, host)
            if shm_slot_bytes is None:
                return pair
            from kvtransfer.shm import negotiate_cuda

            try:  # the same node: the receiver may map the sender's device memory (CUDA IPC) instead of NCCL
                return negotiate_cuda(pair, rank, timeout_s, accept=shm_accept)
            except BaseException:
                pair.close()
                raise
        if backend == "inproc":
            if hub is None:
                raise PairBroken("backend 'inproc' needs an InprocStore shared by both endpoints")
            return hub.connect(prefix, rank, timeout_s)
    except PairBroken:
        raise
    except (RuntimeError, ValueError) as e:
        raise PairBroken(f"building {backend} pair failed: {str(e).splitlines()[0][:300]}") from None
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
