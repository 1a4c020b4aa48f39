"""PrefillWorker over real gRPC: health through its lifecycle, drain, bad requests, reflection."""
from __future__ import annotations

import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefill_worker import PrefillWorker, PrefillWorkerConfig
from proto import worker_pb2, worker_pb2_grpc
from router.wire import params_to_wire
from engine.sampling_params import SamplingParams
from tests.roles.harness import engine_config, make_store

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def test_config_validation_names_fields():
    with pytest.raises(ValueError, match="worker_id"):
        PrefillWorkerConfig("", kv_store="x")
    with pytest.raises(ValueError, match="kv_store"):
        PrefillWorkerConfig("p")
    with pytest.raises(ValueError, match="port"):
        PrefillWorkerConfig("p", kv_store="x", port=70000)
    with pytest.raises(ValueError, match="transfer_timeout_s"):
        PrefillWorkerConfig("p", kv_store="x", transfer_timeout_s=0)


def test_health_not_serving_until_loaded_then_serving_then_drain():
    w = PrefillWorker(PrefillWorkerConfig("hp0", engine=engine_config(), kv_store=make_store(),
                                          serve_metrics=False))
    try:
        addr = w.bind()
        assert _health(addr) == NOT_SERVING
        assert _health(addr, "pdserve.internal.v1.PrefillWorker") == NOT_SERVING
        assert w.info().ready is False
        w.load()
        assert _health(addr) == SERVING
        assert _health(addr, "pdserve.internal.v1.PrefillWorker") == SERVING
        info = w.info()
        assert info.ready and info.role == "prefill" and info.grpc_address == addr and info.kv_name == "hp0"
        assert info.num_free_blocks == info.num_total_blocks == 256 and info.block_size == 16
        with grpc.insecure_channel(addr) as ch:
            got = worker_pb2_grpc.PrefillWorkerStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
        assert got.worker_id == "hp0" and got.ready
        # drain: NOT_SERVING at once, then stopped
        seen = []
        t = threading.Thread(target=lambda: seen.append(w.drain(5.0)))
        t.start()
        t.join(10)
        assert seen == [True]
        assert w.info().ready is False
        with pytest.raises(grpc.RpcError):
            _health(addr)
    finally:
        w.stop()


def test_bad_prefill_requests_are_invalid_argument():
    w = PrefillWorker(PrefillWorkerConfig("bp0", engine=engine_config(), kv_store=make_store(),
                                          serve_metrics=False)).start()
    try:
        good = params_to_wire(SamplingParams(max_tokens=4))
        cases = [
            (worker_pb2.PrefillRequest(request_id="r1", prompt_token_ids=[], params=good, dest_kv_name="d",
                                       dest_block_ids=[0], dest_block_size=16), "prompt_token_ids"),
            (worker_pb2.PrefillRequest(request_id="r2", prompt_token_ids=[1, 2], params=good, dest_kv_name="",
                                       dest_block_ids=[0], dest_block_size=16), "dest_kv_name"),
            (worker_pb2.PrefillRequest(request_id="r3", prompt_token_ids=[1] * 40, params=good, dest_kv_name="d",
                                       dest_block_ids=[0, 1], dest_block_size=16), "dest_block_ids"),
            (worker_pb2.PrefillRequest(request_id="r4", prompt_token_ids=[1, 2], dest_kv_name="d",
                                       dest_block_ids=[0], dest_block_size=16), "max_tokens"),
            (worker_pb2.PrefillRequest(request_id="r5", prompt_token_ids=[1, 99999], params=good, dest_kv_name="d",
                                       dest_block_ids=[0], dest_block_size=16), "prompt_token_ids"),
        ]
        with grpc.insecure_channel(w.address) as ch:
            stub = worker_pb2_grpc.PrefillWorkerStub(ch)
            for req, field in cases:
                with pytest.raises(grpc.RpcError) as ei:
                    list(stub.Prefill(req, timeout=10))
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, ei.value)
                assert field in ei.value.details() and req.request_id in ei.value.details()
            assert stub.Abort(worker_pb2.AbortRequest(request_id="nope"), timeout=5).found is False
        assert w.requests == {} and w.info().num_free_blocks == 256
    finally:
        w.stop()


def test_reflection_lists_services():
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    w = PrefillWorker(PrefillWorkerConfig("rp0", engine=engine_config(), kv_store="unused", serve_metrics=False))
    try:
        addr = w.bind()
        with grpc.insecure_channel(addr) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=5))
        names = {s.name for s in resp.list_services_response.service}
        assert {"pdserve.internal.v1.PrefillWorker", "grpc.health.v1.Health"} <= names
    finally:
        w.stop()


def test_engine_loop_death_fails_requests_and_flips_health():
    from worker_common.engine_loop import EngineLoop

    class Boom:
        def has_unfinished_requests(self):
            return True

        def step_result(self):
            raise RuntimeError("device lost")

    died = []
    loop = EngineLoop(Boom(), "boom", on_outputs=lambda outs: None, on_death=died.append)
    loop.start()
    loop._thread.join(5)
    assert not loop.alive and isinstance(loop.error, RuntimeError) and died == [loop.error]
    with pytest.raises(RuntimeError, match="not running"):
        loop.call(lambda e: 1)


def test_engine_loop_runs_commands_in_its_thread_and_reports_errors():
    import threading as th

    from worker_common.engine_loop import EngineLoop

    class Idle:
        def has_unfinished_requests(self):
            return False

    loop = EngineLoop(Idle(), "idle", on_outputs=lambda outs: None)
    loop.start()
    try:
        assert loop.call(lambda e: th.current_thread().name) == "idle-engine"
        with pytest.raises(ValueError, match="bad"):
            loop.call(lambda e: (_ for _ in ()).throw(ValueError("bad")))
        assert loop.alive  # a failing command does not kill the loop
    finally:
        loop.stop()
    assert not loop.alive
