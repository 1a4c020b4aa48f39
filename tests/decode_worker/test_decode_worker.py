"""DecodeWorker over real gRPC: reservation, its errors, abort, drain while busy."""
from __future__ import annotations

import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2, worker_pb2, worker_pb2_grpc
from router.wire import params_to_wire
from tests.roles.harness import engine_config, make_store, start_roles
from tests.waiting import wait_until

PARAMS = params_to_wire(SamplingParams(max_tokens=4))


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def worker():
    w = DecodeWorker(DecodeWorkerConfig("dw0", engine=engine_config(num_kv_blocks=8), kv_store=make_store(),
                                        serve_metrics=False)).start()
    ch = grpc.insecure_channel(w.address)
    yield w, worker_pb2_grpc.DecodeWorkerStub(ch)
    ch.close()
    w.stop()


def _reserve(stub, rid, n, kv_timeout_s=0.0):
    return stub.Reserve(worker_pb2.ReserveRequest(request_id=rid, prompt_token_ids=[1] * n, params=PARAMS,
                                                  prefill_kv_name="some-prefill", kv_timeout_s=kv_timeout_s),
                        timeout=10)


def test_reserve_abort_and_capacity(worker):
    w, stub = worker
    r = _reserve(stub, "a", 40)
    assert len(r.block_ids) == 3 and r.block_size == 16 and r.kv_name == "dw0"
    assert w.info().num_free_blocks == 5
    with pytest.raises(grpc.RpcError) as ei:
        _reserve(stub, "a", 4)
    assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError) as ei:
        _reserve(stub, "b", 100)   # 7 blocks > 5 free
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "b" in ei.value.details()
    assert stub.Abort(worker_pb2.AbortRequest(request_id="a"), timeout=5).found is True
    assert w.info().num_free_blocks == 8
    assert stub.Abort(worker_pb2.AbortRequest(request_id="a"), timeout=5).found is False


def test_reserve_is_answered_while_the_engine_is_inside_a_forward_and_a_twin_is_refused(worker):
    """Reserve does not wait for the step in flight (the first token waits on its reply): it reserves and holds
    the record beside the forward; the same id again is ALREADY_EXISTS."""
    w, stub = worker
    eng = w.engine
    entered, release = threading.Event(), threading.Event()
    inner = eng.runner.execute

    def execute(sched, hook=None):
        entered.set()
        assert release.wait(60)
        return inner(sched, hook)

    eng.runner.execute = execute
    ch = grpc.insecure_channel(w.address)
    colo = worker_pb2_grpc.ColocatedWorkerStub(ch)
    out: list = []
    th = threading.Thread(target=lambda: out.extend(colo.Generate(worker_pb2.ColocatedRequest(
        request_id="busy", prompt_token_ids=[5, 6, 7], params=PARAMS), timeout=60)))
    try:
        th.start()
        assert entered.wait(30)
        r = _reserve(stub, "beside", 20, kv_timeout_s=60.0)
        assert len(r.block_ids) == 2 and not release.is_set()
        with pytest.raises(grpc.RpcError) as ei:
            _reserve(stub, "beside", 4)
        assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS and "beside" in ei.value.details()
        assert w.info().num_free_blocks == 8 - 2 - 1  # the reply's blocks (and the busy prompt's) are in info()
        assert "beside" in w.disagg and not release.is_set()  # held while the forward still runs
    finally:
        release.set()
        eng.runner.execute = inner
        th.join(60)
        ch.close()
    assert sum(len(c.token_ids) for c in out) == 4
    assert stub.Abort(worker_pb2.AbortRequest(request_id="beside"), timeout=5).found is True
    wait_until(lambda: w.info().num_free_blocks == 8 and not w.requests, timeout=10, message="all freed")


def test_a_reserve_the_engine_loop_cannot_take_is_unavailable_and_takes_nothing(worker, monkeypatch):
    """The loop stopped, or stayed inside the engine past the wait: UNAVAILABLE (the router tries another decode
    worker), never UNKNOWN, and no block taken."""
    w, stub = worker
    for exc in (TimeoutError("dw0: the engine stayed busy for 30.0 s"),
                RuntimeError("dw0: engine loop is not running")):
        monkeypatch.setattr(w.loop, "beside", lambda fn, timeout_s=30.0, exc=exc: (_ for _ in ()).throw(exc))
        with pytest.raises(grpc.RpcError) as ei:
            _reserve(stub, "stuck", 20)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "stuck" in ei.value.details()
        monkeypatch.undo()
    assert w.info().num_free_blocks == 8 and "stuck" not in w.disagg


def test_bad_reserve_and_unknown_decode(worker):
    w, stub = worker
    for req, field in [
        (worker_pb2.ReserveRequest(request_id="c", prompt_token_ids=[], params=PARAMS, prefill_kv_name="p"),
         "prompt_token_ids"),
        (worker_pb2.ReserveRequest(request_id="c", prompt_token_ids=[1], params=PARAMS, prefill_kv_name=""),
         "prefill_kv_name"),
        (worker_pb2.ReserveRequest(request_id="c", prompt_token_ids=[1], prefill_kv_name="p"), "max_tokens"),
        (worker_pb2.ReserveRequest(request_id="", prompt_token_ids=[1], params=PARAMS, prefill_kv_name="p"),
         "request_id"),
    ]:
        with pytest.raises(grpc.RpcError) as ei:
            stub.Reserve(req, timeout=10)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in ei.value.details()
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Decode(worker_pb2.DecodeRequest(request_id="never", first_token_id=3), timeout=10))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND and "never" in ei.value.details()
    assert w.info().num_free_blocks == 8


def test_reservation_whose_kv_never_comes_is_freed_and_decode_learns_why(worker):
    w, stub = worker
    _reserve(stub, "orphan", 20, kv_timeout_s=0.5)
    assert w.info().num_free_blocks == 6
    wait_until(lambda: w.info().num_free_blocks == 8, timeout=10, message="the orphan's blocks freed")
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Decode(worker_pb2.DecodeRequest(request_id="orphan", first_token_id=3), timeout=10))
    # ABORTED, not UNAVAILABLE: the KV failed to arrive, the worker is fine (the router resumes the request here)
    assert ei.value.code() == grpc.StatusCode.ABORTED and "orphan" in ei.value.details()
    with pytest.raises(grpc.RpcError) as ei:
        _reserve(stub, "neg", 4, kv_timeout_s=-1)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kv_timeout_s" in ei.value.details()


def test_reservation_lives_as_long_as_its_receive_deadline():
    w = DecodeWorker(DecodeWorkerConfig("dw1", engine=engine_config(num_kv_blocks=8), kv_store=make_store(),
                                        serve_metrics=False, reserve_timeout_s=0.3)).start()
    try:
        with grpc.insecure_channel(w.address) as ch:
            stub = worker_pb2_grpc.DecodeWorkerStub(ch)
            _reserve(stub, "late", 20, kv_timeout_s=60.0)
            assert w.info().num_free_blocks == 6
            arrived = w.requests["late"].arrived
            # a poll as if reserve_timeout_s (0.3 s) had passed: the KV may still come, the receive deadline rules
            pending, free = w.loop.call(lambda e: (w.disagg.poll(arrived + 0.5), e.num_free_blocks))
            assert (pending, free) == (True, 6) and "late" in w.requests
            # past the receive deadline and its margin: freed
            pending, free = w.loop.call(lambda e: (w.disagg.poll(arrived + 65.5), e.num_free_blocks))
            assert (pending, free) == (False, 8)
    finally:
        w.stop()


@pytest.mark.parametrize("slow_sender", [False, True])
def test_drain_finishes_inflight_request_while_not_serving(slow_sender, monkeypatch):
    """A drain lets the in-flight request finish, its last chunk included. ``slow_sender``: each output stream
    message takes 0.2 s to go (a loaded box), so the request ends, and the drain with it, while the sender still
    sends an earlier message: the drain waits for the last chunk to be taken before it closes the stream (without
    that the router saw the stream end a token early and, with no other decode worker, failed the request)."""
    if slow_sender:
        import time as _time

        from worker_common import output_stream

        real = output_stream.step_message
        monkeypatch.setattr(output_stream, "step_message", lambda items: (_time.sleep(0.2), real(items))[1])
    roles = start_roles(tag=f"drain{int(slow_sender)}-")
    try:
        d = roles.decodes[0]
        s = roles.stub.Generate(pdserve_pb2.GenerateRequest(prompt="a", max_tokens=60, ignore_eos=True,
                                                            temperature=0.0), timeout=30)
        next(s)
        res = []
        t = threading.Thread(target=lambda: res.append(d.drain(20.0)))
        t.start()
        with grpc.insecure_channel(d.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                       == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=10, message="health NOT_SERVING")
        assert d.info().ready is False
        rest = list(s)
        assert rest[-1].finish_reason == "length" and rest[-1].usage.completion_tokens == 60
        t.join(20)
        assert res == [True]
    finally:
        roles.close()


def test_local_generate_rejects_bad_input_and_keeps_serving(worker):
    """The colocated Generate a decode worker serves for conditional disaggregation and migration."""
    w, _ = worker
    ch = grpc.insecure_channel(w.address)
    stub = worker_pb2_grpc.ColocatedWorkerStub(ch)
    try:
        bad = worker_pb2.WireSamplingParams()
        bad.CopyFrom(PARAMS)
        bad.temperature = -1.0
        cases = [
            (worker_pb2.ColocatedRequest(request_id="lg1", prompt_token_ids=[5, 6], params=bad), "params"),
            (worker_pb2.ColocatedRequest(request_id="lg2", prompt_token_ids=[5, 99999], params=PARAMS),
             "prompt_token_ids"),
            (worker_pb2.ColocatedRequest(request_id="lg3", prompt_token_ids=[5, 6], params=PARAMS,
                                         resume_token_ids=[1, 2, 3, 4]), "resume_token_ids"),  # max_tokens=4
        ]
        for req, field in cases:
            with pytest.raises(grpc.RpcError) as ei:
                list(stub.Generate(req, timeout=10))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
            assert field in ei.value.details() and req.request_id in ei.value.details()
        out = list(stub.Generate(worker_pb2.ColocatedRequest(request_id="lg4", prompt_token_ids=[5, 6], params=PARAMS,
                                                             resume_token_ids=[7]), timeout=10))
        assert sum(len(c.token_ids) for c in out) == 3 and out[-1].finish_reason == "length"
        # the load record refreshes on the engine loop's next pass
        wait_until(lambda: w.info().num_free_blocks == 8, timeout=10, message="blocks freed")
        assert not w.requests and w.info().num_free_blocks == 8
    finally:
        ch.close()


def test_local_and_disaggregated_requests_are_one_id_space(worker):
    """A reserved id is refused by the local Generate; either service's Abort reaches either kind."""
    w, stub = worker
    ch = grpc.insecure_channel(w.address)
    colo = worker_pb2_grpc.ColocatedWorkerStub(ch)
    try:
        _reserve(stub, "both", 20, kv_timeout_s=60.0)
        assert "both" in w.disagg and "both" not in w.local and set(w.requests) == {"both"}
        with pytest.raises(grpc.RpcError) as ei:
            list(colo.Generate(worker_pb2.ColocatedRequest(request_id="both", prompt_token_ids=[5, 6], params=PARAMS),
                               timeout=10))
        assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS and "both" in ei.value.details()
        assert w.num_requests() == 1
        # AbortChoice names a choice, never the request: a reserved request without choices stays
        assert stub.AbortChoice(worker_pb2.AbortChoiceRequest(request_id="both", choice_index=0), timeout=5).found \
            is False
        assert w.num_requests() == 1
        assert colo.Abort(worker_pb2.AbortRequest(request_id="both"), timeout=5).found is True
        # the load record refreshes on the engine loop's next pass
        wait_until(lambda: w.info().num_free_blocks == 8, timeout=10, message="blocks freed")
        assert w.num_requests() == 0 and w.info().num_free_blocks == 8
    finally:
        ch.close()


def test_send_prefix_serves_only_a_live_reservations_cached_blocks_and_refuses_the_rest_by_field(worker):
    """``SendPrefix`` (a prefill worker fetching the history this worker holds) sends from a reservation's cached
    blocks only: an unknown request is NOT_FOUND, a range beyond what the reservation found cached (a stale belief)
    or an empty one INVALID_ARGUMENT naming the fields, a second ask FAILED_PRECONDITION; nothing leaks."""
    w, stub = worker
    ch = grpc.insecure_channel(w.address)
    colo = worker_pb2_grpc.ColocatedWorkerStub(ch)
    history = [(i * 7) % 300 + 3 for i in range(40)]
    list(colo.Generate(worker_pb2.ColocatedRequest(request_id="hist", prompt_token_ids=history, params=PARAMS),
                       timeout=60))
    ch.close()
    r = stub.Reserve(worker_pb2.ReserveRequest(request_id="turn2", prompt_token_ids=history + [9] * 8, params=PARAMS,
                                               prefill_kv_name="some-prefill", accept_cached_prefix=True,
                                               kv_timeout_s=30.0), timeout=10)
    assert r.num_cached_tokens == 32  # the two full blocks of the history

    def send(rid="turn2", first=0, num=32, dest="some-prefill", tp=0):
        return stub.SendPrefix(worker_pb2.SendPrefixRequest(request_id=rid, dest_kv_name=dest, first_token=first,
                                                            num_tokens=num, dest_tensor_parallel_size=tp), timeout=10)

    for kw, code, words in [({"rid": "nobody"}, grpc.StatusCode.NOT_FOUND, "nobody"),
                            ({"num": 48}, grpc.StatusCode.INVALID_ARGUMENT, "num_tokens"),
                            ({"first": 32}, grpc.StatusCode.INVALID_ARGUMENT, "first_token"),
                            ({"dest": ""}, grpc.StatusCode.INVALID_ARGUMENT, "dest_kv_name"),
                            ({"tp": -1}, grpc.StatusCode.INVALID_ARGUMENT, "dest_tensor_parallel_size")]:
        with pytest.raises(grpc.RpcError) as ei:
            send(**kw)
        assert ei.value.code() == code and words in ei.value.details(), (kw, ei.value.details())
    send(first=16)  # posted: it waits for the (absent) peer until its deadline or an abort
    with pytest.raises(grpc.RpcError) as ei:
        send(first=16)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stub.Abort(worker_pb2.AbortRequest(request_id="turn2"), timeout=5).found is True
    wait_until(lambda: w.info().num_free_blocks == 8, timeout=10, message="every block free again")
