"""RouterServer over real gRPC without workers: health lifecycle, Tokenize, GetModelInfo, validation statuses."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import pdserve_pb2, pdserve_pb2_grpc
from router import RouterConfig, RouterServer, StaticWorkerSource


def _health(addr: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="pdserve.v1.PDServe"),
                                                    timeout=5).status


def test_config_validation_names_fields():
    for kw, field in [(dict(mode="both"), "mode"), (dict(max_num_requests=0), "max_num_requests"), (dict(port=-1), "port"),
                      (dict(reserve_timeout_s=0), "reserve_timeout_s"), (dict(max_attempts=0), "max_attempts")]:
        with pytest.raises(ValueError, match=field):
            RouterConfig(**kw)
    with pytest.raises(ValueError, match="workers"):
        RouterServer(RouterConfig(), object())


def test_health_tokenize_model_info_and_invalid_argument_before_any_worker():
    r = RouterServer(RouterConfig(serve_metrics=False, max_new_tokens=100, model_name="tiny-served"),
                     StaticWorkerSource())
    try:
        addr = r.bind()
        assert _health(addr) == health_pb2.HealthCheckResponse.NOT_SERVING
        r.load()
        assert _health(addr) == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(addr) as ch:
            stub = pdserve_pb2_grpc.PDServeStub(ch)
            t = stub.Tokenize(pdserve_pb2.TokenizeRequest(text="def f(x):", add_special_tokens=False), timeout=5)
            assert list(t.token_ids) == r.tokenizer.encode("def f(x):", add_special_tokens=False)
            assert "".join(t.tokens).replace("Ġ", " ") == "def f(x):"
            info = stub.GetModelInfo(pdserve_pb2.GetModelInfoRequest(), timeout=5)
            assert (info.model_name, info.max_new_tokens, info.max_logprobs) == ("tiny-served", 100, 20)
            with pytest.raises(grpc.RpcError) as ei:
                list(stub.Generate(pdserve_pb2.GenerateRequest(prompt="a", max_tokens=101), timeout=5))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in ei.value.details()
            with pytest.raises(grpc.RpcError) as ei:
                list(stub.Generate(pdserve_pb2.GenerateRequest(prompt="a", seed=2**63 + 5), timeout=5))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "seed" in ei.value.details()
        errors = [ln for ln in r.metrics.render().decode().splitlines()
                  if ln.startswith('pdserve:request_errors_total{code="INVALID_ARGUMENT"')]
        assert len(errors) == 1 and errors[0].endswith(" 2.0")
        assert r.drain(1.0) is True
    finally:
        r.stop()


def test_a_constraint_is_compiled_off_the_event_loop(monkeypatch):
    """A token-id request's checks run on the loop (cheap), but one with ``structured_outputs`` compiles a grammar
    (a JSON schema's can take long): that runs on the flow pool, so the loop streams every other request meanwhile.
    A bad constraint is still INVALID_ARGUMENT naming the field."""
    import threading

    import router.server as server

    threads: list[str] = []
    real = server.validate_generate

    def spy(*a, **kw):
        threads.append(threading.current_thread().name)
        return real(*a, **kw)

    monkeypatch.setattr(server, "validate_generate", spy)
    r = RouterServer(RouterConfig(serve_metrics=False), StaticWorkerSource()).start()
    try:
        with grpc.insecure_channel(r.address) as ch:
            stub = pdserve_pb2_grpc.PDServeStub(ch)
            for so in (None, pdserve_pb2.StructuredOutputs(regex="[")):
                req = pdserve_pb2.GenerateRequest(token_ids=[5, 6], max_tokens=2)
                if so is not None:
                    req.structured_outputs.CopyFrom(so)
                with pytest.raises(grpc.RpcError) as ei:
                    list(stub.Generate(req, timeout=10))
                if so is not None:
                    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert "structured_outputs" in ei.value.details()
        assert threads[0] == "router-aio" and threads[1].startswith("router-flow"), threads
    finally:
        r.stop()
