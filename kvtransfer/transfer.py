"""One KV transfer's state, its handle, and its measurements.

Lifecycle: ``KVEndpoint.send``/``recv`` validate their arguments into a
``Transfer`` (PENDING) and hand the caller a ``TransferHandle``. The channel
thread moves it to TRANSFERRING when its first frame goes on (or comes off)
the wire, and to DONE when every layer is placed and acknowledged. Anything
else (deadline, cancel, rejection, broken pair, closed channel) moves it to
FAILED with a reason; the first terminal state wins and never changes. The
endpoint keeps a reference only while the transfer is in flight, so a dropped
handle leaks nothing.
"""
from __future__ import annotations

import enum
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from kvtransfer.layout import CacheLayout, TokenRows


class TransferState(str, enum.Enum):
    """Where a transfer is; DONE and FAILED are final."""

    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


@dataclass
class TransferStats:
    """Measurements of one transfer, for logs and Prometheus."""

    transfer_id: int
    request_id: str
    peer: str
    direction: str
    """'send' or 'recv'."""
    state: TransferState
    num_bytes: int
    """Payload bytes that crossed the wire for this transfer so far."""
    seconds: float
    """Submission to DONE/FAILED (or to now, while in flight)."""
    wire_seconds: float
    """The frames' time on the wire: from the first frame posted (send) or its head arrived (recv) to the last
    frame's bytes gone (send) or placed (recv); 0 if no frame moved."""
    num_layers: int
    layers_done: int
    failure: str | None
    pair_wait_seconds: float = 0.0
    """Time spent waiting for the pair group to be built (rendezvous with the peer); 0 when one was up."""
    queue_seconds: float = 0.0
    """Submission to the first payload byte, less ``pair_wait_seconds``: waiting for the layers to be computed
    (send) or for the sender to start (recv), and behind other transfers' frames on the channel."""
    ack_seconds: float = 0.0
    """Last payload byte to DONE/FAILED: the receiver's acknowledgement (send), scattering the last chunk (recv)."""
    link: str = ""
    """What its last frame's bytes took: "socket" (gloo or NCCL), "ring" (a same-host pair's shared slots), "pull"
    (the receiver copied them from the sender's cache in place); "" while no frame moved (kvtransfer/shm.py)."""

    def phases(self) -> dict[str, float]:
        """The parts of ``seconds``: pair_wait + queue + wire + ack (the ``kv_transfer_phase_seconds`` phases)."""
        return {"pair_wait": self.pair_wait_seconds, "queue": self.queue_seconds, "wire": self.wire_seconds,
                "ack": self.ack_seconds}


class Transfer:
    """Internal state of one transfer; mutated only under ``lock``."""

    def __init__(self, transfer_id: int, direction: str, peer: str, request_id: str,
                 kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], layout: CacheLayout,
                 tokens: TokenRows, deadline: float, lock: threading.RLock):
        self.transfer_id = transfer_id
        self.direction = direction
        self.peer = peer
        self.request_id = request_id
        self.kv_caches = kv_caches
        self.layout = layout
        self.tokens = tokens
        self.deadline = deadline
        self.timeout_s = deadline - time.monotonic()
        self.lock = lock
        self.state = TransferState.PENDING
        self.failure: str | None = None
        self.submitted = time.monotonic()
        self.finished: float | None = None
        self.wire_start: float | None = None
        self.wire_end: float | None = None
        self.num_bytes = 0
        self.pair_wait_s = 0.0
        self.link = ""
        """Seconds this transfer waited for its channel's pair group to be built (the channel adds them)."""
        self.layers_done: set[int] = set()
        # sender: whether (and on which pair generation) its frames went out, and which layers are queued
        self.started = False
        self.started_gen = -1
        self.last_sent = False
        self.layers_queued: set[int] = set()
        self.done_event = threading.Event()

    @property
    def final(self) -> bool:
        return self.state in (TransferState.DONE, TransferState.FAILED)

    def fail(self, reason: str) -> bool:
        """Move to FAILED unless already final; True if this call did it. Caller holds lock."""
        if self.final:
            return False
        self.state = TransferState.FAILED
        self.failure = reason
        self._finish()
        return True

    def complete(self) -> bool:
        """Move to DONE unless already final. Caller holds lock."""
        if self.final:
            return False
        self.state = TransferState.DONE
        self._finish()
        return True

    def _finish(self) -> None:
        self.finished = time.monotonic()
        self.done_event.set()

    def mark_wire(self, nbytes: int) -> None:
        """Account payload bytes moved now. Caller holds lock."""
        now = time.monotonic()
        if self.wire_start is None:
            self.wire_start = now
        self.wire_end = now
        self.num_bytes += nbytes

    def stats(self) -> TransferStats:
        with self.lock:
            end = self.finished if self.finished is not None else time.monotonic()
            wire = (self.wire_end - self.wire_start) if self.wire_start is not None else 0.0
            first = self.wire_start if self.wire_start is not None else end
            queue = max(0.0, first - self.submitted - self.pair_wait_s)
            ack = max(0.0, end - self.wire_end) if self.wire_end is not None else 0.0
            return TransferStats(self.transfer_id, self.request_id, self.peer, self.direction, self.state,
                                 self.num_bytes, end - self.submitted, wire, self.layout.num_layers,
                                 len(self.layers_done), self.failure, self.pair_wait_s, queue, ack, self.link)


class TransferHandle:
    """What send()/recv() return: an opaque ticket for poll/failure/stats/cancel."""

    __slots__ = ("_t", "_owner")

    def __init__(self, transfer: Transfer, owner: object):
        self._t = transfer
        self._owner = owner

    @property
    def transfer_id(self) -> int:
        return self._t.transfer_id

    @property
    def request_id(self) -> str:
        return self._t.request_id

    @property
    def peer(self) -> str:
        return self._t.peer

    @property
    def direction(self) -> str:
        return self._t.direction

    def __repr__(self) -> str:
        return (f"TransferHandle({self._t.direction} {self._t.request_id!r} peer={self._t.peer!r} "
                f"id={self._t.transfer_id} {self._t.state.value})")


class TransferGroup:
    """What send_shards()/recv_shards() return: the pieces of one request's KV between two tensor-parallel
    layouts (kvtransfer/sharding.py), one handle to the endpoint's poll/failure/stats/cancel/layer_ready. DONE
    when every piece is, FAILED as soon as one is (the others are then cancelled by the endpoint's poll)."""

    __slots__ = ("handles", "request_id", "peer", "direction")

    def __init__(self, handles: list, request_id: str, peer: str, direction: str):
        self.handles, self.request_id, self.peer, self.direction = handles, request_id, peer, direction

    def __repr__(self) -> str:
        return f"TransferGroup({self.direction} {self.request_id!r} peer={self.peer!r} pieces={len(self.handles)})"


def id_source(seed: int):
    """Transfer ids unique within an endpoint incarnation (the seed keeps restarts apart)."""
    return itertools.count((seed & 0xFFFF_FFFF) << 24)
