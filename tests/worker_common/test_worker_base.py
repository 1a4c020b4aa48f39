"""WorkerBase with two request sets on a real tiny engine: outputs, polls and aborts go to the set
that holds the id; ids are unique across sets; drain waits for every set."""
from __future__ import annotations

import queue
import time
from typing import Any

import grpc
import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from worker_common.config import WorkerConfig
from worker_common.request import RequestContext, RequestError, RequestSet, WorkerRequest
from worker_common.worker_base import WorkerBase


class _Whole(RequestSet[WorkerRequest]):
    """Whole requests on the worker's engine; each output goes to the request's stream."""

    def __init__(self, ctx: RequestContext, busy: bool = False) -> None:
        super().__init__(ctx)
        self.busy = busy
        self.polls = 0
        self.seen: list[str] = []

    def add(self, eng: Any, rid: str, max_tokens: int) -> WorkerRequest:
        eng.add_request(rid, [5, 6, 7], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        req = WorkerRequest(rid)
        self.hold(req)
        return req

    def on_output(self, req: WorkerRequest, o: Any, now: float) -> None:
        self.seen.append(o.request_id)
        if o.finish_reason:
            self.release(req)
        req.out.put(o)

    def free(self, req: WorkerRequest) -> None:
        self.ctx.engine.abort_request(req.request_id)

    def poll(self, now: float) -> bool:
        self.polls += 1
        return self.busy


class _TwoSets(WorkerBase):
    role = "colocated"  # a role the metrics know
    needs_kv = False

    def __init__(self, cfg: WorkerConfig) -> None:
        super().__init__(cfg)
        self.a, self.b = _Whole(self.ctx), _Whole(self.ctx)
        self.request_sets = [self.a, self.b]

    def add(self, rs: _Whole, rid: str, max_tokens: int) -> WorkerRequest:
        """What a role's handler does on the loop thread: ids unique across sets, then the set holds it."""
        def add(eng: Any) -> WorkerRequest:
            self.check_new(rid, "running")
            return rs.add(eng, rid, max_tokens)
        return self.loop.call(add)


@pytest.fixture
def worker():
    w = _TwoSets(WorkerConfig("wb0", engine=EngineConfig(model="tiny", num_kv_blocks=16, num_threads=1),
                              serve_metrics=False))
    w.load()  # engine, metrics, loop; no gRPC server needed
    yield w
    w.stop()


def _drain_stream(q: "queue.Queue", timeout_s: float = 30.0) -> list:
    items, end = [], time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            item = q.get(timeout=0.1)
        except queue.Empty:
            continue
        items.append(item)
        if isinstance(item, RequestError) or item.finish_reason:
            return items
    raise AssertionError(f"stream did not end: {items}")


def test_outputs_go_to_the_set_that_holds_the_request(worker):
    ra = worker.add(worker.a, "x", 4)
    rb = worker.add(worker.b, "y", 5)
    xa, yb = _drain_stream(ra.out), _drain_stream(rb.out)
    assert sum(len(o.new_token_ids) for o in xa) == 4 and {o.request_id for o in xa} == {"x"}
    assert sum(len(o.new_token_ids) for o in yb) == 5 and {o.request_id for o in yb} == {"y"}
    assert set(worker.a.seen) == {"x"} and set(worker.b.seen) == {"y"}
    assert worker.num_requests() == 0 and worker.requests == {}


@pytest.mark.parametrize("first, second", [("a", "b"), ("b", "a")])
def test_an_id_held_by_one_set_is_refused_by_the_other(worker, first, second):
    s1, s2 = getattr(worker, first), getattr(worker, second)
    worker.add(s1, "dup", 200)
    with pytest.raises(RequestError) as ei:
        worker.add(s2, "dup", 4)
    assert ei.value.code == grpc.StatusCode.ALREADY_EXISTS and "dup" in ei.value.message
    assert worker.holder("dup") is s1 and set(worker.requests) == {"dup"} and worker.num_requests() == 1
    assert worker.loop.call(lambda e: worker.abort("dup")) is True


def test_abort_goes_to_the_holding_set_and_frees_the_blocks(worker):
    total = worker.engine.num_total_blocks
    rb = worker.add(worker.b, "long", 200)
    assert worker.loop.call(lambda e: worker.abort("unknown")) is False
    assert worker.loop.call(lambda e: worker.abort("long")) is True
    items = _drain_stream(rb.out)
    assert isinstance(items[-1], RequestError) and items[-1].code == grpc.StatusCode.CANCELLED
    assert "long" not in worker.b and worker.num_requests() == 0
    assert worker.loop.call(lambda e: e.num_free_blocks) == total


def test_poll_asks_every_set_and_is_busy_if_any_is(worker):
    worker.a.busy = True
    a0, b0 = worker.a.polls, worker.b.polls
    assert worker.poll() is True
    assert worker.a.polls > a0 and worker.b.polls > b0  # the second set is polled though the first is busy
    worker.a.busy = False
    assert worker.poll() is False


def test_queued_prompt_tokens_sum_over_sets(worker):
    worker.a.queued_prompt_tokens = lambda: 7
    worker.b.queued_prompt_tokens = lambda: 5
    assert worker.queued_prompt_tokens() == 12


def test_drain_waits_for_requests_in_any_set(worker):
    rb = worker.add(worker.b, "late", 40)
    assert worker.drain(30.0) is True
    items = []
    while not rb.out.empty():
        items.append(rb.out.get_nowait())
    assert items and items[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in items) == 40
