"""``router.output_streams.StreamedCall`` alone, with an in-process stand-in for the worker's stream and call: the
orderings the real-process tests (tests/roles/test_output_streams.py) cannot force."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from proto import worker_pb2
from router.output_streams import StreamedCall, _Sink


class _Stream:
    address = "stand-in:0"

    def __init__(self) -> None:
        self.unregistered: list[str] = []

    def unregister(self, request_id: str, sink: _Sink) -> None:
        self.unregistered.append(request_id)


class _Call:
    """A request's call that has already ended OK (the worker finished; the last chunk may still be on its way)."""

    def __init__(self) -> None:
        self.cancelled = False

    def add_done_callback(self, fn) -> None:
        fn(self)  # grpc calls it at once for a call that already ended

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK

    def cancel(self) -> bool:
        self.cancelled = True
        return False  # an ended call: nothing to cancel, no callback


def test_a_cancel_wakes_a_reader_whose_call_already_ended():
    """The flow waits for the last chunk after the call ended OK; a client cancel then must end the wait at once
    (before the fix it waited the 10 s grace, and a cancelled beam search held the router for 10 s)."""
    stream, sink, call = _Stream(), _Sink(), _Call()
    sc = StreamedCall(stream, "r1", sink, lambda: call)
    sink.q.put(worker_pb2.RequestOutput(request_id="r1", chunk=worker_pb2.DecodeChunk(token_ids=[7])))
    assert next(sc).token_ids == [7]
    out: list = []

    def read() -> None:
        try:
            next(sc)
        except grpc.RpcError as e:
            out.append(e.code())

    t = threading.Thread(target=read)
    t.start()
    time.sleep(0.2)  # the reader is waiting on the queue (this ordering is the point of the test)
    t0 = time.monotonic()
    sc.cancel()
    t.join(5)
    assert out == [grpc.StatusCode.CANCELLED] and time.monotonic() - t0 < 2.0
    assert call.cancelled and set(stream.unregistered) == {"r1"}
    with pytest.raises(StopIteration):
        next(sc)


def test_the_last_chunk_ends_the_iteration_and_an_error_output_raises_its_code():
    stream, sink, call = _Stream(), _Sink(), _Call()
    sc = StreamedCall(stream, "r2", sink, lambda: call)
    sink.q.put(worker_pb2.RequestOutput(request_id="r2", chunk=worker_pb2.DecodeChunk(token_ids=[1], finish_reason="length"),
                                        last=True))
    assert [c.token_ids for c in sc] == [[1]] and stream.unregistered == ["r2"]
    sink2 = _Sink()
    sc2 = StreamedCall(stream, "r3", sink2, lambda: _Call())
    sink2.q.put(worker_pb2.RequestOutput(request_id="r3", last=True, error_code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                         error_message="params: bad"))
    with pytest.raises(grpc.RpcError) as e:
        next(sc2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == "params: bad"


def test_after_a_cancel_the_next_read_says_cancelled_not_a_silent_end():
    """A flow that reads after its call was cancelled (a client disconnect woke it) must see CANCELLED: a plain end
    of iteration read as "the stream ended without a finish reason", i.e. a lost worker (UNAVAILABLE), which the
    HTTP front end then counted in request_errors_total. Said once; an iteration that ended with its last chunk
    stays ended."""
    stream, sink, call = _Stream(), _Sink(), _Call()
    sc = StreamedCall(stream, "r2", sink, lambda: call)
    sink.q.put(worker_pb2.RequestOutput(request_id="r2", chunk=worker_pb2.DecodeChunk(token_ids=[7])))
    assert next(sc).token_ids == [7]
    sc.cancel()
    with pytest.raises(grpc.RpcError) as e:
        next(sc)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    with pytest.raises(StopIteration):  # said once, as a cancelled call's stream does
        next(sc)
    done = StreamedCall(stream, "r3", _Sink(), lambda: _Call())
    done._sink.q.put(worker_pb2.RequestOutput(request_id="r3", chunk=worker_pb2.DecodeChunk(token_ids=[1],
                                                                                             finish_reason="length"),
                                              last=True))
    assert next(done).finish_reason == "length"
    done.cancel()  # (a request's end cancels every call it tracked)
    with pytest.raises(StopIteration):
        next(done)
