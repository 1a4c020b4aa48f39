"""The sending end of a pair channel (rank 0): frames out, acknowledgements in.

Lifecycle: ``KVEndpoint.send`` registers a transfer here; each ``layer_ready``
queues a data frame for that layer (``all_layers_ready`` one frame for the
rest), in the order the producer finishes them, whatever the request. The
channel thread takes frames in order, builds the pair on first need, sends the
header then the payload in chunks (gathering chunk i+1 from the source blocks
while chunk i is on the wire), and marks the frame that completes a transfer
as its last. The generation's ack thread listens for the receiver's one answer
per transfer: DONE on success, FAILED with the receiver's reason otherwise.

Failure: past its deadline a transfer fails here; if its frame is on the wire
at that moment the receiver is not taking bytes, so the pair is broken; if it
had started but is between frames an abort frame tells the receiver at once.
A transfer whose very first frame hit a broken pair is retried on the next
generation (the receiver cannot have placed any of it).
"""
from __future__ import annotations

import time
from collections import deque

import torch

from kvtransfer.channel import BACKSTOP_S, IDLE_WAIT_S, WINDOW, ChannelHost, PairChannel
from kvtransfer.layout import FramePlan, direct_view, gather
from kvtransfer.shm import pull_descriptor
from kvtransfer.transfer import Transfer, TransferState
from kvtransfer.transport import PairBroken, PairGroup
from kvtransfer.wire import (ACK_BYTES, ACK_OK, FLAG_LAST, HEAD_MSG_BYTES, HEADER_BYTES, INLINE_BYTES,
                             KIND_ABORT, KIND_DATA, KIND_PULL, TAG_ACK, TAG_HEAD, TAG_PAYLOAD, Ack, FrameHeader,
                             FramingError, dtype_code)

ACK_GRACE_S = 1.0
"""How long past a transfer's deadline its acknowledgement may still come before the pair is declared hung."""


class SendChannel(PairChannel):
    """One ordered sender -> receiver channel, sender side."""

    rank = 0
    role = "send"

    def __init__(self, host: ChannelHost, peer: str):
        self.queue: deque[tuple[str, Transfer, int, int, bool]] = deque()
        self.unacked: dict[int, Transfer] = {}
        self._hdr = torch.empty(HEAD_MSG_BYTES, dtype=torch.uint8)
        super().__init__(host, peer)

    # -- called by the endpoint, under its lock --------------------------------------------------
    def add(self, t: Transfer) -> None:
        self.live[t.transfer_id] = t

    def enqueue(self, t: Transfer, lo: int, hi: int, last: bool) -> None:
        self.queue.append(("data", t, lo, hi, last))
        self.cond.notify_all()

    def expire(self, t: Transfer, reason: str) -> str | None:
        """Fail ``t`` (deadline or cancel); returns a reason to break the pair, if it must be."""
        if not t.fail(reason):
            return None
        if self.current_t is t:
            return f"receiver {self.peer!r} did not take {t.request_id!r}'s bytes in time"
        if t.started and t.started_gen == self.gen and not t.last_sent:
            self.queue.append(("abort", t, 0, 0, True))
            self.cond.notify_all()
        return None

    # -- threads ---------------------------------------------------------------------------------
    def _main(self) -> None:
        while True:
            with self.cond:
                while self.closed is None and not self.queue:
                    self.cond.wait()
                if self.closed is not None:
                    return
                item = self.queue[0]
                kind, t, lo, hi, last = item
                # layers that became ready back to back go out as one frame
                taken = 1
                while kind == "data" and taken < len(self.queue):
                    k2, t2, lo2, hi2, last2 = self.queue[taken]
                    if k2 != "data" or t2 is not t or lo2 != hi:
                        break
                    hi, last = hi2, last2
                    taken += 1
                group, gen = self.group, self.gen
                if kind == "data" and t.final:
                    # a failed transfer sends no more data; one abort frame if the receiver saw some
                    if t.started and t.started_gen == gen and group is not None and not t.last_sent:
                        kind, last = "abort", True
                    else:
                        for _ in range(taken):
                            self.queue.popleft()
                        continue
                if kind == "abort" and (t.last_sent or t.started_gen != gen or group is None):
                    self.queue.popleft()
                    continue
                if group is None:
                    pending = [x[1].deadline for x in self.queue if not x[1].final]
                    deadline = max(pending, default=0.0)
            if group is None:
                if not self._build(deadline):
                    with self.cond:
                        self.cond.wait(0.02)
                continue
            first = False
            with self.cond:
                if kind == "data" and not t.started:
                    first = True
                    t.started, t.started_gen = True, gen
                    t.state = TransferState.TRANSFERRING
                    self.unacked[t.transfer_id] = t
                self.current_t = t
            try:
                self._send_frame(group, kind, t, lo, hi, last)
            except PairBroken as e:
                with self.cond:
                    self.current_t = None
                    if first and not t.final:
                        # never fully seen by this receiver generation: retry it on the next one
                        t.started = False
                        t.state = TransferState.PENDING
                        self.unacked.pop(t.transfer_id, None)
                self.break_pair(gen, f"send failed: {e}")
                continue
            with self.cond:
                self.current_t = None
                if self.queue and self.queue[0] is item:
                    for _ in range(taken if kind == "data" else 1):
                        self.queue.popleft()
                if last:
                    t.last_sent = True
                if kind == "data":
                    t.layers_done.update(range(lo, hi))

    def _send_frame(self, group: PairGroup, kind: str, t: Transfer, lo: int, hi: int, last: bool) -> None:
        timeout = max(t.deadline - time.monotonic(), 0.0) + BACKSTOP_S
        if kind == "abort":
            hdr = FrameHeader(KIND_ABORT, t.transfer_id, t.request_id, flags=FLAG_LAST)
            group.isend(hdr.pack(self._hdr), TAG_HEAD).wait(timeout)
            return
        lay = t.layout
        if getattr(group, "pull", False):
            # a shared-memory pair whose receiver maps our memory: it copies the rows from our cache itself
            desc = pull_descriptor(t.kv_caches, t.tokens, lo, hi, INLINE_BYTES, layout=t.layout)
            if desc is not None:
                if lay.device.type == "cuda":
                    # the receiver reads our device memory once it has the head: the layers' kernels, queued on
                    # this device's stream before layer_ready, must be done
                    torch.cuda.current_stream(lay.device).synchronize()
                nbytes = (hi - lo) * 2 * t.tokens.num_tokens * lay.row_bytes
                hdr = FrameHeader(KIND_PULL, t.transfer_id, t.request_id, lo, hi, lay.num_layers,
                                  t.tokens.num_tokens, lay.num_kv_heads, lay.head_dim, dtype_code(lay.dtype),
                                  lay.row_bytes, nbytes, 0, FLAG_LAST if last else 0)
                hdr.pack(self._hdr)
                self._hdr[HEADER_BYTES:HEADER_BYTES + len(desc)] = torch.frombuffer(bytearray(desc), dtype=torch.uint8)
                with self.cond:
                    t.mark_wire(nbytes)
                    t.link = "pull"
                group.isend(self._hdr, TAG_HEAD).wait(timeout)
                with self.cond:
                    t.mark_wire(0)
                return
        # the head message is a CPU tensor: CUDA caches (nccl) send every payload byte as chunks
        inline = INLINE_BYTES if lay.device.type == "cpu" else 0
        plan = FramePlan(lay.row_bytes, t.tokens.num_tokens, lo, hi, self.host.chunk_bytes, inline)
        hdr = FrameHeader(KIND_DATA, t.transfer_id, t.request_id, lo, hi, lay.num_layers, t.tokens.num_tokens,
                          lay.num_kv_heads, lay.head_dim, dtype_code(lay.dtype), plan.chunk_bytes,
                          plan.payload_nbytes, plan.inline_nbytes, FLAG_LAST if last else 0)
        hdr.pack(self._hdr)
        if plan.inline_rows:
            gather(t.kv_caches, t.tokens, plan.inline_segments(),
                   self._hdr[HEADER_BYTES:HEADER_BYTES + plan.inline_nbytes])
        # bytes are counted as each send is posted, not after: the receiver can take the last chunk and
        # acknowledge (completing t and snapshotting its stats) before this thread would count them
        with self.cond:
            t.mark_wire(plan.inline_nbytes)
            t.link = getattr(group, "link", "socket")
        ops = [group.isend(self._hdr, TAG_HEAD)]
        slot_ops: list = [None] * WINDOW  # the send that last used each staging buffer
        staged = 0
        for i in range(plan.num_chunks):
            segs = plan.chunk_segments(i)
            view = direct_view(t.kv_caches, t.tokens, segs)  # straight from the cache: no buffer to recycle
            slot = None
            if view is None and plan.sizes[i] <= getattr(group, "slot_bytes", 0):
                # a shared-memory pair: gather straight into its slot, which the receiver reads in place
                view = gather(t.kv_caches, t.tokens, segs, group.stage(plan.sizes[i], timeout))
            elif view is None:
                slot = staged % WINDOW
                staged += 1
                if slot_ops[slot] is not None:
                    slot_ops[slot].wait(timeout)  # its bytes must be gone before we refill the buffer
                view = gather(t.kv_caches, t.tokens, segs, self._buf(slot, plan.sizes[i], lay.device))
            with self.cond:
                t.mark_wire(view.numel())
            op = group.isend(view, TAG_PAYLOAD)
            if slot is not None:
                slot_ops[slot] = op
            ops.append(op)
        for op in ops:
            op.wait(timeout)
        with self.cond:
            t.mark_wire(0)  # the frame's last byte is gone: its wire time ends now, not when it was posted

    def _gen_main(self, group: PairGroup, gen: int) -> None:
        """Ack listener of one generation: one answer per transfer that put a frame on it."""
        buf = torch.empty(ACK_BYTES, dtype=torch.uint8)
        while True:
            with self.cond:
                if self.gen != gen or self.closed is not None:
                    return
            try:
                group.irecv(buf, TAG_ACK).wait(IDLE_WAIT_S)
                ack = Ack.unpack(buf)
            except (PairBroken, FramingError) as e:
                self.break_pair(gen, f"ack receive failed: {e}")
                return
            with self.cond:
                t = self.unacked.pop(ack.transfer_id, None)
                if t is None:
                    continue
                if ack.status == ACK_OK:
                    changed = t.complete()
                else:
                    changed = t.fail(f"rejected by receiver {self.peer!r}: {ack.reason}")
                    if changed and not t.last_sent:
                        self.queue.append(("abort", t, 0, 0, True))
                        self.cond.notify_all()
                self.live.pop(t.transfer_id, None)
            if changed:
                self.host.finished(t)

    # -- failure hooks ---------------------------------------------------------------------------
    def _take_generation_locked(self) -> list[Transfer]:
        taken = list(self.unacked.values())
        self.unacked.clear()
        return taken

    def _clear_locked(self) -> None:
        self.unacked.clear()
        self.queue.clear()

    def _progress_locked(self, t: Transfer) -> str:
        return f"{len(t.layers_done)}/{t.layout.num_layers} layers sent to {self.peer!r}{self.not_connected_note()}"

    def _holds_locked(self, t: Transfer) -> bool:
        # a transfer stays until its acknowledgement comes (or its generation ends)
        return t.transfer_id in self.unacked

    def _overdue_locked(self, now: float) -> str | None:
        for t in self.unacked.values():
            if now > t.deadline + ACK_GRACE_S:
                return f"no acknowledgement from {self.peer!r} for {t.request_id!r}"
        return None
