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

import logging
import time
from collections import OrderedDict, deque

import torch

from kvtransfer.channel import BACKSTOP_S, IDLE_WAIT_S, WINDOW, ChannelHost, PairChannel
from kvtransfer.layout import FramePlan, direct_view, scatter
from kvtransfer.shm import pull_rows
from kvtransfer.transfer import Transfer, TransferState
from kvtransfer.transport import PairBroken, PairGroup
from kvtransfer.wire import (ACK_OK, ACK_REJECTED, HEAD_MSG_BYTES, HEADER_BYTES, KIND_ABORT, KIND_PULL,
                             TAG_ACK, TAG_HEAD, TAG_PAYLOAD, Ack, FrameHeader, FramingError, code_dtype)

log = logging.getLogger(__name__)

UNMATCHED_GRACE_S = 0.5
"""How long a first frame waits for its receive to be posted before it is rejected."""
MAX_CHUNK_BYTES = 256 << 20
"""Larger chunk sizes in a header are treated as garbage (we would have to allocate them to drain)."""
ANSWERED_MEMORY = 4096


SLOT = object()
"""In-flight marker: the chunk is read in place from a shared-memory pair's slot (kvtransfer/shm.py)."""


class RecvChannel(PairChannel):
    """One ordered sender -> receiver channel, receiver side."""

    rank = 1
    role = "recv"

    def __init__(self, host: ChannelHost, peer: str):
        self.posted: dict[str, Transfer] = {}
        self.open: dict[int, Transfer] = {}
        self.answered: OrderedDict[int, None] = OrderedDict()
        self.acks: deque[Ack] = deque()
        super().__init__(host, peer)

    # -- called by the endpoint, under its lock --------------------------------------------------
    def post(self, t: Transfer) -> None:
        if t.request_id in self.posted:
            raise ValueError(f"request_id {t.request_id!r} already has a receive posted from {self.peer!r}")
        self.posted[t.request_id] = t
        self.live[t.transfer_id] = t
        self.cond.notify_all()

    def _answer(self, wire_tid: int, status: int, reason: str = "", sink: list | None = None) -> None:
        """Record the one ack of ``wire_tid``: into ``sink`` (sent by the caller once the lock is
        released) or the ack thread's queue. Caller holds the lock."""
        if wire_tid in self.answered:
            return
        self.answered[wire_tid] = None
        while len(self.answered) > ANSWERED_MEMORY:
            self.answered.popitem(last=False)
        if sink is not None:
            sink.append(Ack(wire_tid, status, reason))
        else:
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
        heads = [torch.empty(HEAD_MSG_BYTES, dtype=torch.uint8) for _ in range(2)]
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
                # a head receive is always posted, so the sender's next header never waits on us
                k = 0
                pending = group.irecv(heads[k], TAG_HEAD)
                while True:
                    pending.wait(IDLE_WAIT_S)
                    buf = heads[k]
                    k ^= 1
                    pending = group.irecv(heads[k], TAG_HEAD)
                    hdr = FrameHeader.unpack(buf)
                    if hdr.chunk_bytes > MAX_CHUNK_BYTES:
                        raise FramingError(f"chunk_bytes {hdr.chunk_bytes} over the {MAX_CHUNK_BYTES} limit")
                    self._on_frame(group, hdr, buf)
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
        if hdr.inline_nbytes not in (0, hdr.payload_nbytes):  # the sender decides (CUDA senders never inline)
            return f"inline_nbytes {hdr.inline_nbytes} is neither 0 nor the payload size"
        if hdr.chunk_bytes % lay.row_bytes:
            return f"chunk_bytes {hdr.chunk_bytes} is not a multiple of the {lay.row_bytes}-byte token row"
        return None

    def _on_frame(self, group: PairGroup, hdr: FrameHeader, head: torch.Tensor) -> None:
        tid = hdr.transfer_id
        t: Transfer | None = None
        ended: list[Transfer] = []
        acks: list[Ack] = []
        completing: Transfer | None = None
        with self.cond:
            if tid in self.open:
                t = self.open[tid]
                why = "aborted by sender" if hdr.kind == KIND_ABORT else self._check(hdr, t)
                if why:
                    del self.open[tid]
                    if t.fail(f"{why} ({self.peer!r})" if hdr.kind == KIND_ABORT else
                              f"rejected frame from {self.peer!r}: {why}"):
                        ended.append(t)
                    self._answer(tid, ACK_REJECTED, why, acks)
                    t = None
            elif tid not in self.answered:
                if hdr.kind == KIND_ABORT:
                    self._answer(tid, ACK_REJECTED, "aborted by sender", acks)
                else:
                    t, why = self._match(hdr)
                    if why:
                        if t is not None:
                            ended.append(t)
                        else:  # nobody on this side will see a handle fail: say it here
                            log.warning("kv recv %s <- %s request_id=%s: frame drained and rejected: %s",
                                        self.host.name, self.peer, hdr.request_id, why)
                        self._answer(tid, ACK_REJECTED, why, acks)
                        t = None
                    else:
                        self.open[tid] = t
            self.current_t = t
        if hdr.kind != KIND_ABORT:
            try:
                self._receive_payload(group, hdr, head, t)
            finally:
                with self.cond:
                    self.current_t = None
            with self.cond:
                if t is not None and self.open.get(tid) is t:
                    t.layers_done.update(range(hdr.layer_lo, hdr.layer_hi))
                    if len(t.layers_done) == t.layout.num_layers and time.monotonic() > t.deadline:
                        # bytes that arrive late (say, we were stalled) do not count: the sender
                        # has given up on them by its own deadline too
                        del self.open[tid]
                        t.fail(f"deadline exceeded after {t.timeout_s:.3f} s (all layers arrived too late)")
                        self._answer(tid, ACK_REJECTED, "receiver deadline exceeded", acks)
                        ended.append(t)
                    elif len(t.layers_done) == t.layout.num_layers:
                        # DONE only once the sender has its ack: a receiver that shuts down right
                        # after DONE must not leave the sender without an answer
                        del self.open[tid]
                        self._answer(tid, ACK_OK, "", acks)
                        completing = t
                    elif hdr.last:
                        del self.open[tid]
                        t.fail(f"sender {self.peer!r} ended the transfer after {len(t.layers_done)} of "
                               f"{t.layout.num_layers} layers")
                        self._answer(tid, ACK_REJECTED, "transfer ended with layers missing", acks)
                        ended.append(t)
        try:
            for ack in acks:
                # sent from this thread: the sender's ack listener always has a receive posted
                group.isend(ack.pack(), TAG_ACK).wait(self.host.timeout_s + BACKSTOP_S)
        except PairBroken as e:
            if completing is not None:
                with self.cond:
                    completing.fail(f"all layers placed, but the acknowledgement to {self.peer!r} failed: {e}")
                self._release(completing)
            raise
        if completing is not None:
            with self.cond:
                completing.complete()
            ended.append(completing)
        for f in ended:
            self._release(f)

    def _receive_payload(self, group: PairGroup, hdr: FrameHeader, head: torch.Tensor, t: Transfer | None) -> None:
        if hdr.kind == KIND_PULL:  # no payload messages: the rows are copied from the sender's cache
            if not getattr(group, "pull", False):
                raise FramingError("a pull frame on a pair that did not agree to pull")
            if t is not None:
                with self.cond:
                    t.mark_wire(0)
                    t.link = "pull"
                pull_rows(group, head[HEADER_BYTES:], hdr.layer_lo, hdr.layer_hi, hdr.num_tokens, hdr.row_bytes,
                          t.kv_caches, t.tokens, t.layout)
                with self.cond:
                    t.mark_wire(hdr.payload_nbytes)
            return
        plan = FramePlan(hdr.row_bytes, hdr.num_tokens, hdr.layer_lo, hdr.layer_hi, hdr.chunk_bytes,
                         hdr.inline_nbytes)
        sizes = plan.sizes
        if t is None:  # drain
            for i, n in enumerate(sizes):
                group.irecv(self._buf(i % WINDOW, n, group.data_device), TAG_PAYLOAD).wait(
                    self.host.timeout_s + BACKSTOP_S)
            return
        timeout = max(t.deadline - time.monotonic(), 0.0) + BACKSTOP_S
        with self.cond:
            t.mark_wire(0)  # the head (with any inline rows) has arrived: the frame is on the wire from here
            t.link = getattr(group, "link", "socket")
        inflight: deque = deque()  # (op, staging buffer or None, segments), in chunk order
        posted = staged = 0

        def post_more() -> None:
            # receives straight into the cache need no buffer, so all of them are posted at once;
            # staged ones are limited to WINDOW buffers, recycled in order
            nonlocal posted, staged
            while posted < len(sizes):
                segs = plan.chunk_segments(posted)
                view = direct_view(t.kv_caches, t.tokens, segs)
                buf = None
                if view is None and sizes[posted] <= getattr(group, "slot_bytes", 0):
                    # a shared-memory pair: scattered straight out of its slot (the sender bounds the slots)
                    inflight.append((group.recv_staged(sizes[posted]), SLOT, segs))
                    posted += 1
                    continue
                if view is None:
                    if sum(1 for x in inflight if x[1] is not None and x[1] is not SLOT) == WINDOW:
                        return
                    buf = view = self._buf(staged % WINDOW, sizes[posted], t.layout.device)
                    staged += 1
                inflight.append((group.irecv(view, TAG_PAYLOAD), buf, segs))
                posted += 1

        post_more()
        if plan.inline_rows:
            inline = head[HEADER_BYTES:HEADER_BYTES + plan.inline_nbytes].to(t.layout.device)
            scatter(t.kv_caches, t.tokens, plan.inline_segments(), inline)
            with self.cond:
                t.mark_wire(plan.inline_nbytes)
        for i in range(len(sizes)):
            op, buf, segs = inflight.popleft()
            got = op.wait(timeout)
            if buf is SLOT:
                scatter(t.kv_caches, t.tokens, segs, got)
                group.release(got, timeout)
            elif buf is not None:
                scatter(t.kv_caches, t.tokens, segs, buf)
            with self.cond:
                t.mark_wire(sizes[i])
            post_more()

    def _gen_main(self, group: PairGroup, gen: int) -> None:
        """Sends the acks the reaper decides (deadline, cancel) while the channel thread waits on the wire."""
        while True:
            with self.cond:
                while self.gen == gen and self.closed is None and not self.acks:
                    self.cond.wait()
                if self.gen != gen or self.closed is not None:
                    return
                ack = self.acks.popleft()
            try:
                group.isend(ack.pack(), TAG_ACK).wait(self.host.timeout_s + BACKSTOP_S)
            except PairBroken as e:
                self.break_pair(gen, f"ack send failed: {e}")
                return

    # -- failure hooks ---------------------------------------------------------------------------
    def _take_generation_locked(self) -> list[Transfer]:
        taken = list(self.open.values())
        self.open.clear()
        self.acks.clear()
        return taken

    def _clear_locked(self) -> None:
        self.posted.clear()
        self.open.clear()
        self.acks.clear()

    def _progress_locked(self, t: Transfer) -> str:
        what = (f"waiting for the sender{self.not_connected_note()}" if t.state == TransferState.PENDING else
                f"{len(t.layers_done)}/{t.layout.num_layers} layers received")
        return f"{what} from {self.peer!r}"
