"""Wire format of a pair channel: fixed-size frame headers and acknowledgements.

Lifecycle: for every frame the sender packs a ``FrameHeader`` into the first
256 bytes of a fixed-size head message (``HEAD_MSG_BYTES``) on ``TAG_HEAD``;
the rest of that message carries the first ``inline_nbytes`` of the payload,
so a small frame is one message. The remaining payload follows in
``chunk_bytes`` messages on ``TAG_PAYLOAD``. The receiver keeps a head receive
posted at all times and unpacks each header before it posts any payload
receive, so it never guesses a size. Every transfer the receiver has seen a
frame of is answered by exactly one ``Ack`` (success or rejection) on
``TAG_ACK``.

Framing (what a receiver needs to stay in step: magic, version, kind, payload
byte count and chunk size) is separated from meaning (request id, layers,
dtype, shape). A frame whose framing is wrong cannot be skipped, so the pair is
broken and rebuilt; a frame whose meaning does not match the posted receive is
drained and rejected, and the channel keeps working.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

HEADER_BYTES = 256
INLINE_BYTES = 32 << 10
"""Payload bytes carried inside the head message itself."""
HEAD_MSG_BYTES = HEADER_BYTES + INLINE_BYTES
TAG_HEAD, TAG_ACK, TAG_PAYLOAD = 0, 1, 2
ACK_BYTES = 256
MAGIC = 0x4B565431  # "KVT1"
ACK_MAGIC = 0x4B565441  # "KVTA"
VERSION = 1
MAX_REQUEST_ID_BYTES = 160
MAX_REASON_BYTES = 200

KIND_DATA = 1
KIND_ABORT = 2
KIND_PULL = 3
"""A data frame whose rows the receiver copies from the sender's cache in shared memory (kvtransfer/shm.py): no
payload messages follow; the head message's inline area holds the pull descriptor. Sent only on a pair whose
receiver said at negotiation that it can map the sender's memory."""
FLAG_LAST = 1

ACK_OK = 0
ACK_REJECTED = 1

# Codes are part of the wire format: append, never renumber.
_DTYPES: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.float16,
    3: torch.bfloat16,
    4: torch.float64,
    5: torch.int8,
    6: torch.uint8,
    7: torch.float8_e4m3fn,
    8: torch.float8_e5m2,
}
_CODES = {v: k for k, v in _DTYPES.items()}

# magic, version, kind, flags, transfer id, layer_lo, layer_hi, num_layers,
# num_tokens, num_kv_heads, head_dim, dtype code, chunk_bytes, payload_nbytes,
# inline_nbytes, request id length; then the request id bytes.
_HEAD = struct.Struct("<IHHIQIIIIIIIQQIH")
_ACK = struct.Struct("<IIQIH")


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of a torch dtype; ValueError for dtypes the wire cannot carry."""
    try:
        return _CODES[dtype]
    except KeyError:
        raise ValueError(f"kv_caches dtype {dtype} is not supported on the wire") from None


def code_dtype(code: int) -> torch.dtype | None:
    """The torch dtype of a wire code, None if unknown."""
    return _DTYPES.get(code)


class FramingError(ValueError):
    """A frame the receiver cannot skip: the pair must be rebuilt."""


@dataclass
class FrameHeader:
    """The fixed-size header sent before every frame's payload."""

    kind: int
    transfer_id: int
    request_id: str
    layer_lo: int = 0
    """First layer in this frame."""
    layer_hi: int = 0
    """One past the last layer in this frame."""
    num_layers: int = 0
    """Layers in the whole transfer."""
    num_tokens: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: int = 0
    """Wire dtype code (see dtype_code)."""
    chunk_bytes: int = 0
    """Payload is sent as messages of this many bytes (the last may be shorter)."""
    payload_nbytes: int = 0
    inline_nbytes: int = 0
    """The first payload bytes, carried in the head message after the header."""
    flags: int = 0

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer, as the sender laid it out."""
        dt = _DTYPES.get(self.dtype)
        return self.num_kv_heads * self.head_dim * (dt.itemsize if dt is not None else 0)

    @property
    def last(self) -> bool:
        """True on the last frame of a transfer (final data frame, or an abort)."""
        return bool(self.flags & FLAG_LAST)

    def pack(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Serialize into a HEADER_BYTES uint8 tensor (``out`` if given)."""
        rid = self.request_id.encode()
        if not rid or len(rid) > MAX_REQUEST_ID_BYTES:
            raise ValueError(f"request_id must be 1..{MAX_REQUEST_ID_BYTES} bytes of UTF-8, got {len(rid)}")
        if self.payload_nbytes > self.inline_nbytes and self.chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive when the payload does not fit inline")
        if self.inline_nbytes not in (0, self.payload_nbytes) or self.inline_nbytes > INLINE_BYTES:
            raise ValueError(f"inline_nbytes must be 0 or the whole payload (at most {INLINE_BYTES})")
        raw = _HEAD.pack(MAGIC, VERSION, self.kind, self.flags, self.transfer_id, self.layer_lo,
                         self.layer_hi, self.num_layers, self.num_tokens, self.num_kv_heads,
                         self.head_dim, self.dtype, self.chunk_bytes, self.payload_nbytes, self.inline_nbytes,
                         len(rid)) + rid
        buf = out if out is not None else torch.empty(HEADER_BYTES, dtype=torch.uint8)
        head = buf[:HEADER_BYTES]
        head.zero_()
        head[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return buf

    @classmethod
    def unpack(cls, buf: torch.Tensor) -> "FrameHeader":
        """Parse a received header; FramingError if it cannot be trusted to skip the payload."""
        if buf.numel() < HEADER_BYTES:
            raise FramingError(f"header must be {HEADER_BYTES} bytes, got {buf.numel()}")
        raw = bytes(buf[:HEADER_BYTES].numpy().tobytes())
        (magic, version, kind, flags, tid, lo, hi, nl, nt, nh, hd, dt, chunk, nbytes, inline,
         rid_len) = _HEAD.unpack_from(raw)
        if magic != MAGIC:
            raise FramingError(f"bad header magic 0x{magic:08x} (expected 0x{MAGIC:08x})")
        if version != VERSION:
            raise FramingError(f"unsupported wire version {version} (this side speaks {VERSION})")
        if kind not in (KIND_DATA, KIND_ABORT, KIND_PULL):
            raise FramingError(f"unknown frame kind {kind}")
        if inline not in (0, nbytes) or inline > INLINE_BYTES:
            raise FramingError(f"inline_nbytes={inline} is neither 0 nor payload_nbytes={nbytes}")
        elt = _DTYPES[dt].itemsize if dt in _DTYPES else 0
        if kind in (KIND_DATA, KIND_PULL) and (elt == 0 or nbytes != (hi - lo) * 2 * nt * nh * hd * elt or hi < lo):
            # without a trustworthy byte count the payload messages cannot even be drained
            raise FramingError(f"payload_nbytes={nbytes} does not match layers [{lo}, {hi}), {nt} tokens, "
                               f"{nh}x{hd} of dtype code {dt}")
        if nbytes > inline and chunk <= 0:
            raise FramingError(f"frame has payload_nbytes={nbytes} but chunk_bytes={chunk}")
        if rid_len == 0 or rid_len > MAX_REQUEST_ID_BYTES:
            raise FramingError(f"bad request id length {rid_len}")
        start = _HEAD.size
        try:
            rid = raw[start:start + rid_len].decode()
        except UnicodeDecodeError:
            raise FramingError("request id is not UTF-8") from None
        return cls(kind=kind, transfer_id=tid, request_id=rid, layer_lo=lo, layer_hi=hi,
                   num_layers=nl, num_tokens=nt, num_kv_heads=nh, head_dim=hd, dtype=dt,
                   chunk_bytes=chunk, payload_nbytes=nbytes, inline_nbytes=inline, flags=flags)


@dataclass
class Ack:
    """The receiver's one answer per transfer: placed (ok) or rejected with a reason."""

    transfer_id: int
    status: int
    reason: str = ""

    def pack(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Serialize into an ACK_BYTES uint8 tensor; long reasons are truncated."""
        reason = self.reason.encode()[:MAX_REASON_BYTES]
        raw = _ACK.pack(ACK_MAGIC, self.status, self.transfer_id, 0, len(reason)) + reason
        buf = out if out is not None else torch.empty(ACK_BYTES, dtype=torch.uint8)
        buf.zero_()
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return buf

    @classmethod
    def unpack(cls, buf: torch.Tensor) -> "Ack":
        """Parse a received ack; FramingError if it is not one."""
        raw = bytes(buf.numpy().tobytes())
        magic, status, tid, _, n = _ACK.unpack_from(raw)
        if magic != ACK_MAGIC:
            raise FramingError(f"bad ack magic 0x{magic:08x}")
        return cls(transfer_id=tid, status=status,
                   reason=raw[_ACK.size:_ACK.size + n].decode(errors="replace"))
