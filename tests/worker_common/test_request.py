"""The shared request record, the request set's bookkeeping and abort path, and request_params."""
from __future__ import annotations

import time

import grpc
import pytest

from engine.sampling_params import SamplingParams
from proto import worker_pb2
from worker_common.request import RequestContext, RequestError, RequestSet, WorkerRequest, request_params


class _Freeing(RequestSet[WorkerRequest]):
    """A set that records what it frees (the real roles free engine blocks and KV handles)."""

    def __init__(self) -> None:
        super().__init__(RequestContext("w0"))
        self.freed: list[str] = []

    def free(self, req: WorkerRequest) -> None:
        self.freed.append(req.request_id)


def test_record_has_its_own_stream_and_arrival_time():
    before = time.monotonic()
    a, b = WorkerRequest("a"), WorkerRequest("b")
    after = time.monotonic()
    assert a.out is not b.out and a.out.empty()
    assert before <= a.arrived <= b.arrived <= after


def test_fail_and_cancel_end_the_stream_with_a_request_error():
    r = WorkerRequest("r1")
    err = RequestError(grpc.StatusCode.UNAVAILABLE, "peer lost")
    r.fail(err)
    assert r.out.get_nowait() is err
    r.cancel()
    got = r.out.get_nowait()
    assert isinstance(got, RequestError) and got.code == grpc.StatusCode.CANCELLED
    assert "r1" in got.message and "aborted" in got.message and str(got) == got.message


def test_set_holds_by_id_and_snapshot_is_a_copy():
    s = _Freeing()
    r = WorkerRequest("x")
    s.hold(r)
    assert "x" in s and "y" not in s and len(s) == 1 and s.get("x") is r and s.get("y") is None
    snap = s.snapshot()
    assert snap == {"x": r}
    snap.clear()
    assert "x" in s and s.records() == [r]
    with pytest.raises(ValueError, match="x"):
        s.hold(WorkerRequest("x"))


def test_release_forgets_without_freeing_or_ending_the_stream():
    s = _Freeing()
    r = WorkerRequest("done")
    s.hold(r)
    s.release(r)
    assert "done" not in s and s.freed == [] and r.out.empty()


def test_drop_frees_and_fails_once():
    s = _Freeing()
    r = WorkerRequest("d")
    s.hold(r)
    err = RequestError(grpc.StatusCode.UNAVAILABLE, "KV did not arrive")
    s.drop(r, err)
    assert "d" not in s and s.freed == ["d"]
    assert r.out.get_nowait() is err and r.out.empty()


def test_abort_frees_and_cancels_only_what_it_holds():
    s = _Freeing()
    r = WorkerRequest("a1")
    s.hold(r)
    assert s.abort("nope") is False and s.freed == []
    assert s.abort("a1") is True
    assert "a1" not in s and s.freed == ["a1"]
    got = r.out.get_nowait()
    assert isinstance(got, RequestError) and got.code == grpc.StatusCode.CANCELLED
    assert s.abort("a1") is False and s.freed == ["a1"]


def test_request_params_gives_engine_params():
    wire = worker_pb2.WireSamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, typical_p=1.0,
                                         repetition_penalty=1.0, seed=11)
    p = request_params(wire, "ok")
    assert isinstance(p, SamplingParams)
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.logprobs) == (7, 0.5, 0.9, 11, None)


@pytest.mark.parametrize("change, field", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_request_params_bad_values_are_invalid_argument_naming_params(change, field):
    base = dict(max_tokens=4, temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0)
    base.update(change)
    with pytest.raises(RequestError) as ei:
        request_params(worker_pb2.WireSamplingParams(**base), "req-9")
    e = ei.value
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.message.startswith("params: ") and field in e.message and "req-9" in e.message


def test_request_params_refuse_an_adapter_not_served_here_or_with_other_weights():
    """A request under a LoRA adapter the worker does not serve is NOT_FOUND naming ``lora_name``; one the router
    admitted under other weights of that name (``lora_root``: the adapter was reloaded meanwhile) is NOT_FOUND too,
    rather than run a prompt's prefill and decode under two versions. 0 (a caller that did not say) is unchecked."""
    wire = worker_pb2.WireSamplingParams(max_tokens=4, temperature=0.0, top_p=1.0, typical_p=1.0,
                                         repetition_penalty=1.0, lora_name="sql", lora_root=7)
    assert request_params(wire, "r", {"sql": 7}).lora_name == "sql"
    assert request_params(wire, "r").lora_name == "sql"  # (no roots given: the engine checks the name)
    for roots, what in (({"chat": 7}, "serves no LoRA adapter 'sql'"), ({"sql": 8}, "reloaded with other weights")):
        with pytest.raises(RequestError) as e:
            request_params(wire, "r", roots)
        assert e.value.code == grpc.StatusCode.NOT_FOUND and what in e.value.message
        assert e.value.message.startswith("params.lora_name")
    wire.lora_root = 0
    assert request_params(wire, "r", {"sql": 8}).lora_name == "sql"
