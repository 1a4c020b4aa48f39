"""A worker keeps handler threads for its control calls: request calls (each holds a gRPC handler thread for the
request's life) beyond ``max_request_calls`` are refused with RESOURCE_EXHAUSTED at once, and GetInfo and Abort
still answer while the rest are held. Found by ``benchmarks/serving_overhead.py`` (bench, 128 HTTP streams through
one worker whose 128 handler threads were all taken: its GetInfo waited out its 5 s deadline). Real worker, real
gRPC."""
from __future__ import annotations

import threading

import grpc
import pytest
import torch

from decode_worker import ColocatedWorker, ColocatedWorkerConfig
from engine.sampling_params import SamplingParams
from proto import worker_pb2, worker_pb2_grpc
from router.wire import params_to_wire
from tests.roles.harness import engine_config
from tests.waiting import wait_until
from worker_common.config import CONTROL_RPC_THREADS, WorkerConfig

LONG = params_to_wire(SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True))


def _drain(call) -> None:
    try:
        for _ in call:
            pass
    except grpc.RpcError:  # cancelled at the end of the test, or aborted on purpose
        pass


def test_pool_size_and_the_threads_kept_for_control_calls():
    from engine.config import EngineConfig

    auto = WorkerConfig("a", engine=EngineConfig(max_num_seqs=200))
    assert auto.rpc_threads == 2 * 200 + CONTROL_RPC_THREADS  # running + as many waiting, plus control
    assert auto.max_request_calls == 2 * 200
    assert WorkerConfig("b", engine=EngineConfig(max_num_seqs=8)).rpc_threads == 128  # never below 128
    small = WorkerConfig("c", max_rpc_threads=8)
    assert (small.rpc_threads, small.control_rpc_threads, small.max_request_calls) == (8, 2, 6)  # a quarter kept
    for bad in (0, 1, -3, 2.5, True, "64"):
        with pytest.raises(ValueError, match="max_rpc_threads"):
            WorkerConfig("d", max_rpc_threads=bad)


def test_request_calls_beyond_the_limit_are_refused_and_control_calls_still_answer():
    torch.set_num_threads(1)
    w = ColocatedWorker(ColocatedWorkerConfig("rc0", engine=engine_config(num_kv_blocks=128), serve_metrics=False,
                                              max_rpc_threads=8)).start()
    ch = grpc.insecure_channel(w.address)
    stub = worker_pb2_grpc.ColocatedWorkerStub(ch)
    calls: list = []
    try:
        assert w.cfg.max_request_calls == 6
        for i in range(6):
            call = stub.Generate(worker_pb2.ColocatedRequest(request_id=f"held-{i}", prompt_token_ids=[5, 6, 7, 8],
                                                             params=LONG), timeout=120)
            calls.append(call)
            threading.Thread(target=_drain, args=(call,), daemon=True).start()
        wait_until(lambda: w.request_calls == 6 and w.num_requests() == 6, timeout=60, interval=0.02,
                   message="six request calls held by the worker")
        # the seventh is refused at once, naming the limit and the request, and starts nothing
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(worker_pb2.ColocatedRequest(request_id="seventh", prompt_token_ids=[5, 6, 7, 8],
                                                           params=LONG), timeout=30))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "seventh" in e.value.details() and "max_rpc_threads 8" in e.value.details()
        assert w.refused_calls == 1 and w.num_requests() == 6 and w.request_calls == 6
        # control calls still get a thread while every request slot is taken
        info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
        assert info.num_running + info.num_waiting == 6
        assert stub.Abort(worker_pb2.AbortRequest(request_id="held-0"), timeout=5).found is True
        wait_until(lambda: w.request_calls == 5, timeout=30, interval=0.02, message="the aborted call ends")
        # its slot is free again: a new request call is taken
        again = stub.Generate(worker_pb2.ColocatedRequest(request_id="again", prompt_token_ids=[5, 6, 7, 8],
                                                          params=params_to_wire(SamplingParams(
                                                              max_tokens=3, temperature=0.0, ignore_eos=True))),
                              timeout=60)
        assert sum(len(c.token_ids) for c in again) == 3
    finally:
        for c in calls:
            c.cancel()
        total = w.engine.num_total_blocks
        wait_until(lambda: w.request_calls == 0 and w.num_requests() == 0 and w.info().num_free_blocks == total,
                   timeout=30, interval=0.05, message="every call ended and every block free")
        ch.close()
        w.stop()
