"""router.request_flow over in-process fake workers (tests/router/fakes.py): the pair path, retries before the
first token, migration after it, stop strings, cancellation, conditional disaggregation and the fallback routes,
and that every placement is released and aborted exactly where the flow says (router/attempt.py)."""
from __future__ import annotations

import threading

import grpc
import pytest

from engine import SamplingParams
from proto import worker_pb2
from router.config import RouterConfig
from router.events import FlowError
from router.model_info import load_model_view
from router.request_flow import RequestFlow
from router.validation import ValidatedRequest
from transport.errors import StatusRpcError
from tests.router.fakes import (FakeMetrics, FakeStream, FakeWorker, chunk, first_token, info,
                                router_parts, transfer_done)
from tests.waiting import wait_until

HE, L, LO, WOR, LD, FOO, BAR = 627, 80, 338, 5329, 1247, 5819, 7332
"""Token ids of the tiny model's tokenizer: " he", "l", "lo", " wor", "ld", " foo", " bar"."""
UNAVAILABLE = StatusRpcError(grpc.StatusCode.UNAVAILABLE, "worker went away")


@pytest.fixture(scope="module")
def tok():
    return load_model_view(RouterConfig(serve_metrics=False))[0]


def _flow(deps, rid: str = "r1", n_prompt: int = 40, deadline: float = 1e12, **params) -> RequestFlow:
    params.setdefault("max_tokens", 8)
    vreq = ValidatedRequest(rid, None, list(range(100, 100 + n_prompt)), SamplingParams(**params))
    return RequestFlow(deps, vreq, 0.0, deadline)


def _prefill(*events, error=None):
    return lambda req: FakeStream(events, error=error)


def _held(deps, *wids) -> list[int]:
    return [deps.placer.selector.in_flight(w) for w in wids]


def test_pair_streams_the_first_token_then_decode_and_releases_everything(tok):
    p0 = FakeWorker(info("p0", "prefill"), prefill=_prefill(first_token(HE, cached=32), transfer_done(0.003)))
    d0 = FakeWorker(info("d0", "decode"), decode=lambda req: FakeStream([chunk([]), chunk([L, LO]),
                                                                           chunk([WOR], "length")]))
    deps = router_parts([p0, d0], tok, metrics=FakeMetrics())
    flow = _flow(deps, max_tokens=4)
    evs = list(flow.run())
    assert [e.token_ids for e in evs] == [[HE], [L, LO], [WOR]]
    assert "".join(e.text for e in evs) == " hello wor" and evs[-1].finish_reason == "length"
    u, t = evs[-1].usage, evs[-1].timings
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (40, 4, 32)
    assert t.kv_transfer_s == pytest.approx(0.003) and t.prefill_s == pytest.approx(0.02)
    (resv,), (pre,), (dec,) = d0.called("Reserve"), p0.called("Prefill"), d0.called("Decode")
    assert resv.request_id == pre.request_id == dec.request_id == "r1" and resv.prefill_kv_name == "kv-p0"
    assert (list(pre.dest_block_ids), pre.dest_kv_name, dec.first_token_id) == ([1, 2, 3], "kv-d0", HE)
    assert d0.aborted == p0.aborted == []  # a normal end aborts nothing
    assert _held(deps, "p0", "d0") == [0, 0] and not flow.placement.held
    assert deps.metrics.counts["observe_ttft"] == 1 and deps.metrics.counts["observe_itl"] == 2


def test_a_failed_prefill_retries_on_another_pair_and_aborts_the_first():
    p0 = FakeWorker(info("p0", "prefill"), prefill=_prefill(error=UNAVAILABLE))
    p1 = FakeWorker(info("p1", "prefill", queued=10), prefill=_prefill(first_token(7), transfer_done()))
    d0 = FakeWorker(info("d0", "decode"), decode=lambda req: FakeStream([chunk([8], "length")]))
    deps = router_parts([p0, p1, d0])
    evs = list(_flow(deps, max_tokens=2).run())
    assert [e.token_ids for e in evs] == [[7], [8]] and evs[-1].usage.completion_tokens == 2
    # attempt 1 (id r1) was aborted on both its workers; attempt 2 runs as r1~2 on p1
    assert (p0.aborted, d0.aborted, p1.aborted) == (["r1"], ["r1"], [])
    assert [r.request_id for r in d0.called("Reserve")] == ["r1", "r1~2"]
    assert [r.request_id for r in p1.called("Prefill")] == ["r1~2"]
    assert [w.worker_id for w in deps.placer.source.list("prefill")] == ["p1"]  # p0 looked gone: suspected
    assert _held(deps, "p0", "p1", "d0") == [0, 0, 0]


def _fetch(first: int = 0, num: int = 32) -> worker_pb2.PrefillEvent:
    return worker_pb2.PrefillEvent(prefix_fetch=worker_pb2.PrefixFetch(first_token=first, num_tokens=num,
                                                                       kv_name="kv-p0", tensor_parallel_size=1,
                                                                       kv_timeout_s=9.0))


def test_a_prefix_fetch_is_answered_by_the_decode_worker_then_the_flow_goes_on():
    """The prefill worker asks for the history its decode worker holds: the router has that worker send it
    (SendPrefix, with the fetch's values, for the reserved request) and then reads the first token."""
    p0 = FakeWorker(info("p0", "prefill"), prefill=_prefill(_fetch(16, 32), first_token(7, cached=32),
                                                             transfer_done()))
    d0 = FakeWorker(info("d0", "decode"), reserve=worker_pb2.ReserveResponse(
        block_ids=[1, 2, 3], block_size=16, kv_name="kv-d0", num_cached_tokens=32),
        decode=lambda req: FakeStream([chunk([8], "length")]))
    deps = router_parts([p0, d0], kv_prefix_fetch_min_tokens=16)
    evs = list(_flow(deps, max_tokens=2).run())
    assert [e.token_ids for e in evs] == [[7], [8]] and evs[-1].usage.cached_tokens == 32
    (pre,), (sp,) = p0.called("Prefill"), d0.called("SendPrefix")
    assert (pre.dest_cached_tokens, pre.fetch_min_tokens) == (32, 16)
    assert (sp.request_id, sp.dest_kv_name, sp.first_token, sp.num_tokens, sp.dest_tensor_parallel_size,
            sp.kv_timeout_s) == ("r1", "kv-p0", 16, 32, 1, 9.0)
    assert d0.aborted == p0.aborted == [] and _held(deps, "p0", "d0") == [0, 0]


@pytest.mark.parametrize("code", [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE])
def test_a_decode_worker_that_cannot_send_the_prefix_ends_the_attempt_and_another_serves(code):
    """SendPrefix refused (the reservation expired: NOT_FOUND) or the decode worker gone: the attempt is aborted
    on both workers (nothing is left waiting for a prefix that will not come) and another attempt serves the request,
    away from that decode worker (which lost the reservation it had just made); the client never sees the refusal."""
    p0 = FakeWorker(info("p0", "prefill"), prefill=_prefill(_fetch(), first_token(7), transfer_done()))
    d0 = FakeWorker(info("d0", "decode"), reserve=worker_pb2.ReserveResponse(
        block_ids=[1, 2, 3], block_size=16, kv_name="kv-d0", num_cached_tokens=32),
        send_prefix=StatusRpcError(code, "request r1 is not reserved"))
    d1 = FakeWorker(info("d1", "decode", running=3), decode=lambda req: FakeStream([chunk([8], "length")]))
    deps = router_parts([p0, d0, d1])
    evs = list(_flow(deps, max_tokens=2).run())
    assert [e.token_ids for e in evs] == [[7], [8]]
    assert (p0.aborted, d0.aborted) == (["r1"], ["r1"])
    assert [r.request_id for r in d1.called("Decode")] == ["r1~2"]
    assert [w.worker_id for w in deps.placer.source.list("decode")] == ["d1"]
    assert _held(deps, "p0", "d0", "d1") == [0, 0, 0]


def test_a_decode_worker_older_than_send_prefix_is_never_asked_again_and_stays_in_routing():
    """Mid-upgrade, SendPrefix is UNIMPLEMENTED on an older decode worker: the attempt is retried without a fetch
    (fetch_min_tokens 0 for pairs with that worker, from then on), and the worker is not taken for lost."""
    def prefill(req):
        if req.fetch_min_tokens:
            return FakeStream([_fetch(), first_token(7), transfer_done()])
        return FakeStream([first_token(7), transfer_done()])

    p0 = FakeWorker(info("p0", "prefill"), prefill=prefill)
    d0 = FakeWorker(info("d0", "decode"), reserve=worker_pb2.ReserveResponse(
        block_ids=[1, 2, 3], block_size=16, kv_name="kv-d0", num_cached_tokens=32),
        send_prefix=StatusRpcError(grpc.StatusCode.UNIMPLEMENTED, "Method not found!"),
        decode=lambda req: FakeStream([chunk([8], "length")]))
    deps = router_parts([p0, d0], kv_prefix_fetch_min_tokens=16)
    for rid in ("r1", "r2"):
        evs = list(_flow(deps, rid=rid, max_tokens=2).run())
        assert [e.token_ids for e in evs] == [[7], [8]]
    assert [r.fetch_min_tokens for r in p0.called("Prefill")] == [16, 0, 0]  # r1, its retry, r2
    assert len(d0.called("SendPrefix")) == 1
    assert [w.worker_id for w in deps.placer.source.list("decode")] == ["d0"]


def test_a_prefill_failure_without_attempts_left_fails_with_its_status_and_frees_everything():
    p0 = FakeWorker(info("p0", "prefill"), prefill=_prefill(error=UNAVAILABLE))
    d0 = FakeWorker(info("d0", "decode"))
    deps = router_parts([p0, d0], max_attempts=1)
    with pytest.raises(FlowError) as e:
        list(_flow(deps).run())
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "prefill on p0 failed" in e.value.message
    assert (p0.aborted, d0.aborted) == (["r1"], ["r1"]) and _held(deps, "p0", "d0") == [0, 0]


def test_a_lost_decode_worker_migrates_with_the_streamed_tokens():
    p0 = FakeWorker(info("p0", "prefill"), prefill=_prefill(first_token(11), transfer_done()))
    d0 = FakeWorker(info("d0", "decode"), decode=lambda req: FakeStream([chunk([12, 13])], error=UNAVAILABLE))
    d1 = FakeWorker(info("d1", "decode", running=5), generate=lambda req: FakeStream([chunk([14], "length")]))
    deps = router_parts([p0, d0, d1], metrics=FakeMetrics())
    evs = list(_flow(deps, max_tokens=4).run())
    assert [e.token_ids for e in evs] == [[11], [12, 13], [14]] and evs[-1].usage.completion_tokens == 4
    (gen,) = d1.called("Generate")
    assert (list(gen.resume_token_ids), gen.request_id) == ([11, 12, 13], "r1~2")
    assert (d0.aborted, p0.aborted, d1.aborted) == (["r1"], ["r1"], [])
    assert deps.metrics.counts["inc_migration"] == 1
    assert _held(deps, "p0", "d0", "d1") == [0, 0, 0]


def test_a_stop_string_ends_the_request_and_aborts_its_workers(tok):
    d_stream = FakeStream([chunk([LD, FOO, BAR])], block=True)
    p0 = FakeWorker(info("p0", "prefill"), prefill=_prefill(first_token(WOR), transfer_done()))
    d0 = FakeWorker(info("d0", "decode"), decode=lambda req: d_stream)
    deps = router_parts([p0, d0], tok)
    evs = list(_flow(deps, stop=[" foo"]).run())
    assert "".join(e.text for e in evs) == " world" and evs[-1].finish_reason == "stop"
    assert d_stream.cancelled and (d0.aborted, p0.aborted) == (["r1"], ["r1"])
    assert _held(deps, "p0", "d0") == [0, 0]


def test_a_stop_string_in_the_first_token_needs_no_decode(tok):
    p0 = FakeWorker(info("p0", "prefill"), prefill=_prefill(first_token(FOO), transfer_done()))
    d0 = FakeWorker(info("d0", "decode"))
    deps = router_parts([p0, d0], tok)
    evs = list(_flow(deps, stop=["foo"]).run())
    assert [e.finish_reason for e in evs] == ["stop"] and evs[0].text == " "
    assert d0.called("Decode") == [] and (d0.aborted, p0.aborted) == (["r1"], ["r1"])
    assert _held(deps, "p0", "d0") == [0, 0]


def test_a_stop_string_in_one_of_two_choices_aborts_that_choice_only(tok):
    stream = FakeStream([chunk([WOR], index=1), chunk([FOO], index=1), chunk([LD, WOR], "length", index=0)])
    c0 = FakeWorker(info("c0", "colocated"), generate=lambda req: stream)
    deps = router_parts([c0], tok, mode="colocated")
    flow = RequestFlow(deps, ValidatedRequest("r1", None, list(range(100, 140)),
                                              SamplingParams(max_tokens=2, stop=[" foo"]), n=2), 0.0, 1e12)
    evs = list(flow.run())
    assert [(e.index, e.finish_reason) for e in evs if e.finish_reason] == [(1, "stop"), (0, "length")]
    assert (c0.choices_aborted, c0.aborted) == ([("r1", 1)], []) and evs[-1].usage.completion_tokens == 4


def test_a_cancel_mid_stream_stops_the_calls_and_frees_the_workers():
    d_stream = FakeStream([chunk([5])], block=True)
    p0 = FakeWorker(info("p0", "prefill"), prefill=_prefill(first_token(4), transfer_done()))
    d0 = FakeWorker(info("d0", "decode"), decode=lambda req: d_stream)
    deps = router_parts([p0, d0])
    flow = _flow(deps)
    seen, failure = [], []

    def consume() -> None:
        try:
            for ev in flow.run():
                seen.append(ev)
        except FlowError as e:
            failure.append(e)

    t = threading.Thread(target=consume)
    t.start()
    wait_until(lambda: len(seen) == 2, timeout=10, message="two events streamed")
    flow.cancel()
    t.join(10)
    assert failure and failure[0].code == grpc.StatusCode.CANCELLED
    assert d_stream.cancelled and (d0.aborted, p0.aborted) == (["r1"], ["r1"]) and _held(deps, "p0", "d0") == [0, 0]


def test_closing_the_event_stream_aborts_and_releases():
    """A front end that stops reading (its client went away) closes the generator: the attempt's cleanup runs."""
    p0 = FakeWorker(info("p0", "prefill"), prefill=_prefill(first_token(4), transfer_done()))
    d0 = FakeWorker(info("d0", "decode"), decode=lambda req: FakeStream([chunk([5]), chunk([6])], block=True))
    deps = router_parts([p0, d0])
    events = _flow(deps).run()
    assert next(events).token_ids == [4] and next(events).token_ids == [5]
    assert _held(deps, "d0") == [1]  # (P is released once its KV moved)
    events.close()
    assert (d0.aborted, p0.aborted) == (["r1"], ["r1"]) and _held(deps, "p0", "d0") == [0, 0]


def test_whole_retry_before_any_token_goes_elsewhere_without_an_abort_and_a_final_failure_aborts():
    c0 = FakeWorker(info("c0", "colocated"), generate=lambda req: FakeStream(error=UNAVAILABLE))
    c1 = FakeWorker(info("c1", "colocated", running=3), generate=lambda req: FakeStream([chunk([9], "length")]))
    deps = router_parts([c0, c1], mode="colocated")
    evs = list(_flow(deps, max_tokens=1).run())
    assert [e.token_ids for e in evs] == [[9]] and evs[-1].usage.completion_tokens == 1
    assert (c0.aborted, c1.aborted) == ([], []) and _held(deps, "c0", "c1") == [0, 0]
    # every attempt fails: the last one is aborted on its worker
    bad = [FakeWorker(info(f"c{i}", "colocated"), generate=lambda req: FakeStream(error=UNAVAILABLE)) for i in (0, 1)]
    deps = router_parts(bad, mode="colocated")
    with pytest.raises(FlowError) as e:
        list(_flow(deps).run())
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    # equal-load workers are tried in random order (no herding): the one tried last is aborted
    assert sorted([bad[0].aborted, bad[1].aborted]) == [[], ["r1~2"]] and _held(deps, "c0", "c1") == [0, 0]


def test_conditional_disaggregation_and_the_fallback_when_the_prefill_pool_is_empty():
    d0 = FakeWorker(info("d0", "decode"), generate=lambda req: FakeStream([chunk([3], "length", cached=16)]))
    p0 = FakeWorker(info("p0", "prefill"))
    deps = router_parts([p0, d0], metrics=FakeMetrics(), local_prefill_max_tokens=64)
    evs = list(_flow(deps, max_tokens=1).run())  # 40 prompt tokens <= 64: prefilled on the decode worker
    assert evs[-1].usage.cached_tokens == 16 and p0.calls == [] and d0.called("Reserve") == []
    assert deps.metrics.counts == {"inc_local_prefill": 1, "observe_ttft": 1, "observe_ttft_phases": 1}
    # no prefill worker at all: the decode pool serves it whole, counted as degraded ("no_prefill")
    d1 = FakeWorker(info("d1", "decode"), generate=lambda req: FakeStream([chunk([3], "length")]))
    deps = router_parts([d1], metrics=FakeMetrics())
    assert [e.token_ids for e in _flow(deps, max_tokens=1).run()] == [[3]]
    assert deps.metrics.args["inc_degraded"] == [("no_prefill",)] and d1.called("Reserve") == []


def test_an_empty_decode_pool_fails_unavailable_after_the_bounded_wait():
    p0 = FakeWorker(info("p0", "prefill"))
    deps = router_parts([p0], pool_wait_s=0.05)
    with pytest.raises(FlowError) as e:
        list(_flow(deps).run())
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "no ready decode worker" in e.value.message
    assert p0.calls == [] and _held(deps, "p0") == [0]
