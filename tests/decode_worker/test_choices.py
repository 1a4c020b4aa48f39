"""n > 1 on a worker over real gRPC: AbortChoice ends one choice by (request id, index) on the wire, an older
router's per-choice Abort ends that choice alone too, and Abort of the request ends them all."""
from __future__ import annotations

from typing import Iterator

import grpc
import pytest
import torch

from decode_worker import ColocatedWorker, ColocatedWorkerConfig
from decode_worker.choices import MAX_CHOICES, choice_request_id
from engine.sampling_params import SamplingParams
from proto import worker_pb2, worker_pb2_grpc
from router.wire import params_to_wire
from tests.roles.harness import engine_config
from tests.waiting import wait_until

LONG = params_to_wire(SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True))


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def colocated():
    w = ColocatedWorker(ColocatedWorkerConfig("cw0", engine=engine_config(num_kv_blocks=64),
                                              serve_metrics=False)).start()
    ch = grpc.insecure_channel(w.address)
    yield w, worker_pb2_grpc.ColocatedWorkerStub(ch)
    ch.close()
    w.stop()


def _generate(stub, rid: str, n: int) -> Iterator[worker_pb2.DecodeChunk]:
    return stub.Generate(worker_pb2.ColocatedRequest(request_id=rid, prompt_token_ids=[5, 6, 7, 8, 9], params=LONG,
                                                     siblings=[LONG] * (n - 1)), timeout=60)


def _until(stream, pred) -> list:
    """Chunks read from ``stream`` up to and including the first that satisfies ``pred``."""
    seen = []
    for ch in stream:
        seen.append(ch)
        if pred(ch, seen):
            return seen
    raise AssertionError(f"stream ended first: {[(c.index, c.finish_reason) for c in seen[-5:]]}")


def _idle(w) -> None:
    total = w.engine.num_total_blocks
    wait_until(lambda: w.num_requests() == 0 and w.info().num_free_blocks == total, timeout=10,
               message="worker idle with every block free")


def test_choice_ids_are_built_in_one_place():
    assert choice_request_id("r", 0) == "r" and choice_request_id("r", 3) == "r#3"
    with pytest.raises(ValueError, match="index"):
        choice_request_id("r", -1)


def test_abort_choice_ends_one_choice_and_the_others_go_on(colocated):
    w, stub = colocated
    s = _generate(stub, "n3", 3)
    _until(s, lambda ch, seen: {c.index for c in seen if c.token_ids} == {0, 1, 2})

    def abort_choice(index: int) -> bool:
        return stub.AbortChoice(worker_pb2.AbortChoiceRequest(request_id="n3", choice_index=index), timeout=5).found

    assert abort_choice(1) is True
    seen = _until(s, lambda ch, seen: ch.index == 1 and ch.finish_reason)
    assert seen[-1].finish_reason == "abort" and not seen[-1].token_ids
    after = _until(s, lambda ch, seen: {c.index for c in seen if c.token_ids} == {0, 2})  # both still decode
    assert 1 not in {c.index for c in after}
    assert abort_choice(1) is False  # already ended: nothing else is touched
    # a router older than AbortChoice names the choice by its engine id: that choice alone ends
    assert stub.Abort(worker_pb2.AbortRequest(request_id="n3#2"), timeout=5).found is True
    _until(s, lambda ch, seen: ch.index == 2 and ch.finish_reason == "abort")
    _until(s, lambda ch, seen: ch.index == 0 and bool(ch.token_ids))
    assert abort_choice(0) is True  # the request's own choice, the last open one: the stream ends cleanly
    rest = list(s)
    assert rest[-1].index == 0 and rest[-1].finish_reason == "abort"
    _idle(w)


def test_abort_of_the_request_ends_every_choice(colocated):
    w, stub = colocated
    s = _generate(stub, "all3", 3)
    _until(s, lambda ch, seen: {c.index for c in seen if c.token_ids} == {0, 1, 2})
    assert stub.Abort(worker_pb2.AbortRequest(request_id="all3"), timeout=5).found is True
    with pytest.raises(grpc.RpcError) as ei:
        list(s)
    assert ei.value.code() == grpc.StatusCode.CANCELLED
    _idle(w)


def test_abort_choice_of_a_request_without_choices_touches_nothing(colocated):
    w, stub = colocated
    s = _generate(stub, "one", 1)
    _until(s, lambda ch, seen: bool(ch.token_ids))
    for index in (0, 1):
        assert stub.AbortChoice(worker_pb2.AbortChoiceRequest(request_id="one", choice_index=index),
                                timeout=5).found is False
    assert "one" in w.requests  # still decoding
    assert stub.AbortChoice(worker_pb2.AbortChoiceRequest(request_id="nope", choice_index=1), timeout=5).found is False
    assert stub.Abort(worker_pb2.AbortRequest(request_id="one"), timeout=5).found is True
    with pytest.raises(grpc.RpcError):
        list(s)
    _idle(w)


@pytest.mark.parametrize("request_id, index, field", [
    ("", 1, "request_id"),
    ("x", -1, "choice_index"),
    ("x", MAX_CHOICES, "choice_index"),
])
def test_abort_choice_refuses_a_bad_request(colocated, request_id, index, field):
    _, stub = colocated
    with pytest.raises(grpc.RpcError) as ei:
        stub.AbortChoice(worker_pb2.AbortChoiceRequest(request_id=request_id, choice_index=index), timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details().startswith(field)
