"""router.core over in-process fake workers (tests/router/fakes.py): admission against max_num_requests, the
serving states, the front end's cancel hook, and the request metrics it keeps (read as /metrics serves them)."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams
from router.config import RouterConfig
from router.core import RouterCore
from router.events import FlowError
from router.validation import ValidatedRequest
from router.worker_source import StaticWorkerSource
from tests.router.fakes import FakeClients, FakeStream, FakeWorker, chunk, first_token, info, transfer_done
from tests.waiting import wait_until


def _core(workers, **cfg) -> RouterCore:
    core = RouterCore(RouterConfig(serve_metrics=False, **cfg), StaticWorkerSource([w.info for w in workers]))
    core.calls.clients = FakeClients(workers)
    core.load()
    return core


def _vreq(rid: str, max_tokens: int = 3) -> ValidatedRequest:
    return ValidatedRequest(rid, None, list(range(100, 140)), SamplingParams(max_tokens=max_tokens))


def _value(core: RouterCore, sample: str, **labels: str) -> float:
    """The value of ``sample`` (e.g. "pdserve:prompt_tokens_total") with ``labels``, as /metrics serves it."""
    found = [s.value for fam in text_string_to_metric_families(core.metrics.render().decode()) for s in fam.samples
             if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    if len(found) != 1:
        raise AssertionError(f"{sample} {labels}: {len(found)} samples")
    return found[0]


class Hook:
    """A front end's ``on_cancel``: keeps the flow's cancel to call it later."""

    def __init__(self) -> None:
        self.cancel = None

    def __call__(self, cb) -> None:
        self.cancel = cb


@pytest.fixture
def pair():
    p0 = FakeWorker(info("p0", "prefill"), prefill=lambda req: FakeStream([first_token(7, cached=16),
                                                                           transfer_done()]))
    d0 = FakeWorker(info("d0", "decode"), decode=lambda req: FakeStream([chunk([8, 9], "length")]))
    return p0, d0


def test_a_request_is_counted_and_leaves_no_trace(pair):
    core = _core(pair)
    try:
        hook = Hook()
        evs = list(core.generate(_vreq("a"), time.monotonic(), None, hook))
        assert [e.token_ids for e in evs] == [[7], [8, 9]] and evs[-1].usage.cached_tokens == 16
        assert callable(hook.cancel)  # the front end got the flow's cancel before the first event
        assert _value(core, "pdserve:prompt_tokens_total") == 40
        assert _value(core, "pdserve:generation_tokens_total") == 3
        assert _value(core, "pdserve:request_success_total", finished_reason="length") == 1
        assert core.num_in_flight == 0 and _value(core, "pdserve:router_requests_in_flight") == 0
        core.count_error(grpc.StatusCode.INVALID_ARGUMENT)
        assert _value(core, "pdserve:request_errors_total", code="INVALID_ARGUMENT") == 1
    finally:
        core.close()


def test_past_max_num_requests_a_request_is_refused_at_once_and_a_cancel_ends_the_held_one(pair):
    p0, d0 = pair
    d_stream = FakeStream([chunk([8])], block=True)
    d0.decode = lambda req: d_stream
    core = _core(pair, max_num_requests=1)
    try:
        hook, seen, failure = Hook(), [], []

        def first() -> None:
            try:
                for ev in core.generate(_vreq("held", max_tokens=50), time.monotonic(), None, hook):
                    seen.append(ev)
            except FlowError as e:
                failure.append(e)

        t = threading.Thread(target=first)
        t.start()
        wait_until(lambda: len(seen) == 2, timeout=10, message="the first request streams")
        assert core.num_in_flight == 1
        with pytest.raises(FlowError) as e:
            next(core.generate(_vreq("extra"), time.monotonic(), None, Hook()))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "router queue is full (1 requests in flight, 0 of them waiting" in e.value.message
        hook.cancel()  # the client of the first one cancels
        t.join(10)
        assert failure and failure[0].code == grpc.StatusCode.CANCELLED and d_stream.cancelled
        assert core.num_in_flight == 0 and d0.aborted == p0.aborted == ["held"]
    finally:
        core.close()


def test_a_cancel_before_the_flow_runs_ends_it_cancelled(pair):
    core = _core(pair)
    try:
        def cancel_at_once(cb) -> None:  # the RPC already ended when the flow registered its cancel
            cb()

        with pytest.raises(FlowError) as e:
            list(core.generate(_vreq("gone"), time.monotonic(), None, cancel_at_once))
        assert e.value.code == grpc.StatusCode.CANCELLED and core.num_in_flight == 0
        assert pair[1].called("Decode") == []
    finally:
        core.close()


def test_not_serving_before_load_and_while_draining(pair):
    core = RouterCore(RouterConfig(serve_metrics=False), StaticWorkerSource())
    with pytest.raises(FlowError) as e:
        next(core.generate(_vreq("early"), time.monotonic(), None, Hook()))
    assert (e.value.code, e.value.message) == (grpc.StatusCode.UNAVAILABLE, "router is not serving")
    core = _core(pair)
    try:
        core.draining = True
        with pytest.raises(FlowError) as e:
            next(core.generate(_vreq("late"), time.monotonic(), None, Hook()))
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and core.num_in_flight == 0
    finally:
        core.close()


def test_the_request_deadline_is_the_nearer_of_the_clients_and_request_timeout_s(pair):
    p0, d0 = pair
    seen = []
    d0.reserve = lambda req: seen.append(req.kv_timeout_s)  # None: the default reservation
    core = _core(pair, request_timeout_s=100.0, first_token_timeout_s=60.0, transfer_timeout_s=30.0)
    try:
        list(core.generate(_vreq("soon"), time.monotonic(), 5.0, Hook()))
        list(core.generate(_vreq("later"), time.monotonic(), None, Hook()))
        assert 0 < seen[0] <= 5.0 and seen[1] == pytest.approx(90.0, abs=1.0)
    finally:
        core.close()
