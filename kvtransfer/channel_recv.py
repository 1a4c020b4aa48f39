"""The receiving end of a pair channel (rank 1): frames in, acknowledgements out.

Lifecycle: ``KVEndpoint.recv`` posts a transfer here (PENDING) when the decode
worker reserves blocks. Once anything is posted for this sender the channel
thread accepts the sender's pair offer and, from then on, always has a header
receive posted. Each header is matched to a posted receive by request id (the
first frame of a transfer) or to an open transfer by transfer id (later
frames), checked against the destination cache, and its payload is received
chunk by chunk straight into the destination blocks (receiving chunk i+1 while
scattering chunk i). When all layers are in, the transfer is DONE and the
generation's ack thread tells the sender.

Failure: a header that does not fit (no posted receive, dtype, shape, layers,
token count) is answered with a rejection and its payload drained, so the
channel keeps working; every transfer id gets exactly one answer, and ids
already answered are drained silently. Past its deadline a transfer fails
here; if its payload was being received at that moment the sender has stalled
mid-frame, so the pair is broken.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque

import torch

from kvtransfer.channel import BACKSTOP_S, IDLE_WAIT_S, PairChannel
from kvtransfer.layout import FramePlan, direct_view, scatter
from kvtransfer.transfer import Transfer, TransferState
from kvtransfer.transport import PairBroken, PairGroup
from kvtransfer.wire import (ACK_OK, ACK_REJECTED, HEADER_BYTES, KIND_ABORT, Ack, FrameHeader, FramingError,
                             code_dtype)

UNMATCHED_GRACE_S = 0.5
"""How long a first frame waits for its receive to be posted before it is rejected."""
MAX_CHUNK_BYTES = 256 << 20
"""Larger chunk sizes in a header are treated as garbage (we would have to allocate them to drain)."""
ANSWERED_MEMORY = 4096


class RecvChannel(PairChannel):
    """One ordered sender -> receiver channel, receiver side."""

    rank = 1
    role = "recv"

    def __init__(self, ep, peer: str):
        self.posted: dict[str, Transfer] = {}
        self.open: dict[int, Transfer] = {}
        self.answered: OrderedDict[int, None] = OrderedDict()
        self.acks: deque[Ack] = deque()
        self.live: dict[int, Transfer] = {}
        self.current_t: Transfer | None = None
        self._staging: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * 2
        super().__init__(ep, peer)

    # -- called by the endpoint, under its lock --------------------------------------------------
    def post(self, t: Transfer) -> None:
        if t.request_id in self.posted:
            raise ValueError(f"request_id {t.request_id!r} already has a receive posted from {self.peer!r}")
        self.posted[t.request_id] = t
        self.live[t.transfer_id] = t
        self.cond.notify_all()

    def _answer(self, wire_tid: int, status: int, reason: str = "") -> None:
        """Queue the one ack of ``wire_tid``. Caller holds the lock."""
        if wire_tid in self.answered:
            return
        self.answered[wire_tid] = None
        while len(self.answered) > ANSWERED_MEMORY:
            self.answered.popitem(last=False)
        self.acks.append(Ack(wire_tid, status, reason))
        self.cond.notify_all()

    def expire(self, t: Transfer, reason: str) -> str | None:
        """Fail ``t`` (deadline or cancel); returns a reason to break the pair, if it must be."""
        if not t.fail(reason):
            return None
        if self.posted.get(t.request_id) is t:
            del self.posted[t.request_id]
        wire = next((tid for tid, o in self.open.items() if o is t), None)
        if wire is not None:
            del self.open[wire]
            if self.current_t is t:
                return f"sender {self.peer!r} stalled in the middle of {t.request_id!r}'s frame"
            self._answer(wire, ACK_REJECTED, f"receiver gave up: {reason}")
        return None

    # -- threads ---------------------------------------------------------------------------------
    def _main(self) -> None:
        hdr_buf = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        while True:
            with self.cond:
                while self.closed is None and self.group is None and not self.posted:
                    self.cond.wait()
                if self.closed is not None:
                    return
                group, gen = self.group, self.gen
                deadline = max((t.deadline for t in self.posted.values()), default=0.0)
            if group is None:
                if not self._build(deadline):
                    with self.cond:
                        self.cond.wait(0.02)
                continue
            try:
                group.irecv(hdr_buf, 0).wait(IDLE_WAIT_S)
                hdr = FrameHeader.unpack(hdr_buf)
                if hdr.chunk_bytes > MAX_CHUNK_BYTES:
                    raise FramingError(f"chunk_bytes {hdr.chunk_bytes} over the {MAX_CHUNK_BYTES} limit")
                self._on_frame(group, hdr)
            except PairBroken as e:
                self.break_pair(gen, f"connection to sender lost: {e}")
            except FramingError as e:
                self.break_pair(gen, f"bad frame from {self.peer!r}: {e}")

    def _match(self, hdr: FrameHeader) -> tuple[Transfer | None, str | None]:
        """First frame of a transfer: find its posted receive and check the header. Holds the lock."""
        t = self.posted.get(hdr.request_id)
        if t is None:
            self.cond.wait_for(lambda: hdr.request_id in self.posted or self.closed is not None,
                               timeout=UNMATCHED_GRACE_S)
            t = self.posted.get(hdr.request_id)
        if t is None:
            return None, f"no receive posted for request {hdr.request_id!r} from {self.peer!r}"
        del self.posted[hdr.request_id]
        why = self._check(hdr, t)
        if why:
            t.fail(f"rejected frame from {self.peer!r}: {why}")
            return t, why
        t.state = TransferState.TRANSFERRING
        return t, None

    def _check(self, hdr: FrameHeader, t: Transfer) -> str | None:
        """Why this header cannot land in ``t``'s destination, or None."""
        lay = t.layout
        theirs = code_dtype(hdr.dtype)
        if theirs != lay.dtype:
            return f"dtype mismatch: sender {theirs or f'code {hdr.dtype}'}, receiver {lay.dtype}"
        if hdr.num_layers != lay.num_layers:
            return f"num_layers mismatch: sender {hdr.num_layers}, receiver {lay.num_layers}"
        if (hdr.num_kv_heads, hdr.head_dim) != (lay.num_kv_heads, lay.head_dim):
            return (f"shape mismatch: sender [*, {hdr.num_kv_heads}, {hdr.head_dim}], "
                    f"receiver [*, {lay.num_kv_heads}, {lay.head_dim}] (num_kv_heads, head_dim)")
        if hdr.num_tokens != t.tokens.num_tokens:
            return f"num_tokens mismatch: sender {hdr.num_tokens}, receiver {t.tokens.num_tokens}"
        if not 0 <= hdr.layer_lo < hdr.layer_hi <= lay.num_layers:
            return f"bad layer range [{hdr.layer_lo}, {hdr.layer_hi}) for {lay.num_layers} layers"
        if t.layers_done.intersection(range(hdr.layer_lo, hdr.layer_hi)):
            return f"layers [{hdr.layer_lo}, {hdr.layer_hi}) sent twice"
        want = (hdr.layer_hi - hdr.layer_lo) * 2 * hdr.num_tokens * lay.row_bytes
        if hdr.payload_nbytes != want:
            return f"payload_nbytes {hdr.payload_nbytes} != {want} for this layer range"
        if hdr.chunk_bytes % lay.row_bytes:
            return f"chunk_bytes {hdr.chunk_bytes} is not a multiple of the {lay.row_bytes}-byte token row"
        return None

    def _on_frame(self, group: PairGroup, hdr: FrameHeader) -> None:
        tid = hdr.transfer_id
        t: Transfer | None = None
        failed: list[Transfer] = []
        with self.cond:
            if tid in self.open:
                t = self.open[tid]
                why = "aborted by sender" if hdr.kind == KIND_ABORT else self._check(hdr, t)
                if why:
                    del self.open[tid]
                    if t.fail(f"{why} ({self.peer!r})" if hdr.kind == KIND_ABORT else
                              f"rejected frame from {self.peer!r}: {why}"):
                        failed.append(t)
                    self._answer(tid, ACK_REJECTED, why)
                    t = None
            elif tid not in self.answered:
                if hdr.kind == KIND_ABORT:
                    self._answer(tid, ACK_REJECTED, "aborted by sender")
                else:
                    t, why = self._match(hdr)
                    if why:
                        if t is not None:
                            failed.append(t)
                        self._answer(tid, ACK_REJECTED, why)
                        t = None
                    else:
                        self.open[tid] = t
            self.current_t = t
        for f in failed:
            self.ep._finished(f)
        if hdr.kind == KIND_ABORT:
            return
        try:
            self._receive_payload(group, hdr, t)
        finally:
            with self.cond:
                self.current_t = None
        with self.cond:
            if t is None or self.open.get(tid) is not t:
                return  # drained, or failed meanwhile (its answer is already queued)
            t.layers_done.update(range(hdr.layer_lo, hdr.layer_hi))
            if len(t.layers_done) == t.layout.num_layers:
                del self.open[tid]
                t.complete()
                self._answer(tid, ACK_OK)
            elif hdr.last:
                del self.open[tid]
                t.fail(f"sender {self.peer!r} ended the transfer after {len(t.layers_done)} of "
                       f"{t.layout.num_layers} layers")
                self._answer(tid, ACK_REJECTED, "transfer ended with layers missing")
            else:
                return
            self.live.pop(t.transfer_id, None)
        self.ep._finished(t)

    def _buf(self, i: int, nbytes: int) -> torch.Tensor:
        if self._staging[i].numel() < nbytes:
            self._staging[i] = torch.empty(nbytes, dtype=torch.uint8)
        return self._staging[i][:nbytes]

    def _receive_payload(self, group: PairGroup, hdr: FrameHeader, t: Transfer | None) -> None:
        sizes = hdr.chunks()
        if t is None:  # drain
            for i, n in enumerate(sizes):
                group.irecv(self._buf(i % 2, n), 0).wait(self.ep.timeout_s + BACKSTOP_S)
            return
        timeout = max(t.deadline - time.monotonic(), 0.0) + BACKSTOP_S
        plan = FramePlan(t.layout, hdr.num_tokens, hdr.layer_lo, hdr.layer_hi, hdr.chunk_bytes)
        inflight: deque = deque()

        def post(i: int) -> None:
            segs = plan.chunk_segments(i)
            view = direct_view(t.kv_caches, t.tokens, segs)
            buf = None if view is not None else self._buf(i % 2, sizes[i])
            inflight.append((group.irecv(view if view is not None else buf, 0), buf, segs))

        for i in range(min(2, len(sizes))):
            post(i)
        for i in range(len(sizes)):
            op, buf, segs = inflight.popleft()
            op.wait(timeout)
            if buf is not None:
                scatter(t.kv_caches, t.tokens, segs, buf)
            with self.cond:
                t.mark_wire(sizes[i])
            if i + 2 < len(sizes):
                post(i + 2)

    def _gen_main(self, group: PairGroup, gen: int) -> None:
        """Ack sender of one generation."""
        while True:
            with self.cond:
                while self.gen == gen and self.closed is None and not self.acks:
                    self.cond.wait()
                if self.gen != gen or self.closed is not None:
                    return
                ack = self.acks.popleft()
            try:
                group.isend(ack.pack(), 1).wait(self.ep.timeout_s + BACKSTOP_S)
            except PairBroken as e:
                self.break_pair(gen, f"ack send failed: {e}")
                return

    # -- failure hooks ---------------------------------------------------------------------------
    def _on_break_locked(self, reason: str) -> list:
        failed = [t for t in self.open.values() if t.fail(reason)]
        self.open.clear()
        self.acks.clear()
        for t in failed:
            self.live.pop(t.transfer_id, None)
        return failed

    def _on_close_locked(self, reason: str) -> list:
        failed = [t for t in self.live.values() if t.fail(reason)]
        self.live.clear()
        self.posted.clear()
        self.open.clear()
        self.acks.clear()
        return failed

    def reap(self, now: float) -> None:
        breaks: list[tuple[int, str]] = []
        failed: list[Transfer] = []
        with self.cond:
            for tid, t in list(self.live.items()):
                if t.final:
                    del self.live[tid]
                    continue
                if now >= t.deadline:
                    what = ("waiting for the sender" if t.state == TransferState.PENDING else
                            f"{len(t.layers_done)}/{t.layout.num_layers} layers received")
                    why = self.expire(t, f"deadline exceeded after {t.timeout_s:.3f} s ({what} from {self.peer!r})")
                    failed.append(t)
                    del self.live[tid]
                    if why:
                        breaks.append((self.gen, why))
        for t in failed:
            self.ep._finished(t)
        for gen, why in breaks:
            self.break_pair(gen, why)

