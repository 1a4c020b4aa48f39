"""Frame header and ack encoding: round trips, and rejection of frames that cannot be trusted."""
import struct

import pytest
import torch

from kvtransfer.wire import (ACK_REJECTED, FLAG_LAST, HEADER_BYTES, KIND_ABORT, KIND_DATA, MAGIC, Ack,
                             FrameHeader, FramingError, code_dtype, dtype_code)


def _header(**kw) -> FrameHeader:
    # layers 2..4, 100 tokens, 8 heads x 128 bf16: 3 * 2 * 100 * 2048 bytes
    base = dict(kind=KIND_DATA, transfer_id=(7 << 40) + 3, request_id="req-é-1", layer_lo=2, layer_hi=5,
                num_layers=24, num_tokens=100, num_kv_heads=8, head_dim=128, dtype=dtype_code(torch.bfloat16),
                chunk_bytes=4096, payload_nbytes=3 * 2 * 100 * 2048, flags=FLAG_LAST)
    base.update(kw)
    return FrameHeader(**base)


def test_header_round_trip_is_fixed_size():
    h = _header()
    buf = h.pack()
    assert buf.dtype == torch.uint8 and buf.numel() == HEADER_BYTES
    back = FrameHeader.unpack(buf)
    assert back == h and back.last
    assert code_dtype(back.dtype) is torch.bfloat16 and back.row_bytes == 2048
    # first bytes are the little-endian magic, so a hex dump of a frame is recognisable
    assert struct.unpack("<I", bytes(buf[:4].tolist()))[0] == MAGIC


def test_abort_header_has_no_payload():
    h = FrameHeader(KIND_ABORT, 5, "r", flags=FLAG_LAST)
    back = FrameHeader.unpack(h.pack())
    assert back.kind == KIND_ABORT and back.payload_nbytes == 0


@pytest.mark.parametrize("offset,value,match", [
    (0, 0x00, "magic"),          # corrupt the first magic byte
    (4, 0x09, "version"),        # version 9
    (6, 0x07, "kind"),           # kind 7
])
def test_corrupt_framing_is_refused(offset, value, match):
    buf = _header().pack()
    buf[offset] = value
    with pytest.raises(FramingError, match=match):
        FrameHeader.unpack(buf)


def test_payload_without_chunk_size_is_refused():
    buf = _header(chunk_bytes=4096).pack()
    raw = bytearray(buf.numpy().tobytes())
    struct.pack_into("<Q", raw, 4 + 2 + 2 + 4 + 8 + 4 * 7, 0)  # chunk_bytes field -> 0
    with pytest.raises(FramingError, match="chunk_bytes"):
        FrameHeader.unpack(torch.frombuffer(raw, dtype=torch.uint8))


def test_payload_size_must_match_the_shape_fields():
    # a byte count that disagrees with layers x tokens x heads x head_dim cannot be drained safely
    with pytest.raises(FramingError, match="payload_nbytes"):
        FrameHeader.unpack(_header(payload_nbytes=12345).pack())
    with pytest.raises(FramingError, match="dtype code 99"):
        FrameHeader.unpack(_header(dtype=99).pack())


def test_request_id_limits_raise_value_error():
    with pytest.raises(ValueError, match="request_id"):
        _header(request_id="x" * 161).pack()
    with pytest.raises(ValueError, match="request_id"):
        _header(request_id="").pack()


def test_unsupported_dtype_names_kv_caches():
    with pytest.raises(ValueError, match="kv_caches dtype"):
        dtype_code(torch.complex64)


def test_ack_round_trip_truncates_long_reason():
    a = Ack(123, ACK_REJECTED, "dtype mismatch " + "z" * 500)
    back = Ack.unpack(a.pack())
    assert back.transfer_id == 123 and back.status == ACK_REJECTED
    assert back.reason.startswith("dtype mismatch") and len(back.reason.encode()) == 200
    bad = a.pack()
    bad[0] ^= 0xFF
    with pytest.raises(FramingError):
        Ack.unpack(bad)
