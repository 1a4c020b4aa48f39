"""OpenTelemetry traces across the split (issue 48 part 1), against a real OTLP/gRPC receiver on loopback.

The receiver is a ``TraceService`` gRPC server built from the official OTLP protos (``opentelemetry-proto``):
the router and both workers export to it with the real SDK and OTLP exporter. A client sends a request with its
own W3C ``traceparent``; one connected trace must come back: the router's ``llm_request`` span under the client's
span, its phases under it, and each worker's span (prefill, decode) under the router's request span, with their
own phases (queue, prefill, the KV send with its bytes; the decode's wait for the KV and its decode).
"""
from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from proto import pdserve_pb2
from tests.roles.harness import start_roles
from tests.waiting import wait_until

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every exported span as (service.name, span)."""

    def __init__(self) -> None:
        self.spans: list = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    self.spans.extend((service, sp) for sp in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: str) -> list:
        with self._lock:
            return [(svc, sp) for svc, sp in self.spans if sp.trace_id.hex() == trace_id]


@pytest.fixture
def collector():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    c = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(c, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield c, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def _attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = next(getattr(v, f) for f in ("string_value", "int_value", "double_value", "bool_value")
                          if v.HasField(f)) if v.WhichOneof("value") != "array_value" else \
            [x.string_value for x in v.array_value.values]
    return out


def test_one_request_yields_one_connected_trace_under_the_clients_span(collector):
    c, endpoint = collector
    roles = start_roles(tag="otel-", router={"otlp_traces_endpoint": endpoint},
                        worker={"otlp_traces_endpoint": endpoint})
    try:
        traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
        resps = list(roles.stub.Generate(pdserve_pb2.GenerateRequest(prompt="def fib(n):", max_tokens=6,
                                                                     temperature=0.0),
                                         metadata=(("traceparent", traceparent),), timeout=60))
        assert sum(len(r.token_ids) for r in resps) == 6
        # a request untouched by a client's trace gets a trace of its own
        list(roles.stub.Generate(pdserve_pb2.GenerateRequest(prompt="import os", max_tokens=2, temperature=0.0),
                                 timeout=60))
    finally:
        roles.close()  # each component flushes its exporter when it stops
    want = {"llm_request", "router.placement", "worker.queue", "prefill", "first_token.delivery", "kv_transfer",
            "decode", "prefill_worker.request", "prefill_worker.queue", "prefill_worker.prefill", "kv_transfer.send",
            "decode_worker.request", "decode_worker.reserved", "decode_worker.kv_wait", "decode_worker.decode"}
    spans = wait_until(lambda: (lambda got: got if want <= {sp.name for _s, sp in got} else None)(
        c.of_trace(CLIENT_TRACE)), timeout=30, message=lambda: f"spans: {[sp.name for _s, sp in c.of_trace(CLIENT_TRACE)]}")
    by_name: dict = {}
    for svc, sp in spans:
        by_name.setdefault(sp.name, []).append((svc, sp))
    [(svc, root)] = by_name["llm_request"]
    assert svc == "pdserve-router" and root.parent_span_id.hex() == CLIENT_SPAN
    a = _attrs(root)
    assert a["gen_ai.usage.completion_tokens"] == 6 and a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.latency.time_to_first_token"] > 0 and a["gen_ai.request.max_tokens"] == 6
    for name in ("router.placement", "worker.queue", "prefill", "first_token.delivery", "kv_transfer", "decode"):
        [(s, sp)] = by_name[name]
        assert s == "pdserve-router" and sp.parent_span_id == root.span_id, name
    # each worker's span continues the router's request span (the trace context the worker RPCs carried)
    [(ps, prefill)] = by_name["prefill_worker.request"]
    [(ds, decode)] = by_name["decode_worker.request"]
    assert (ps, ds) == ("pdserve-prefill", "pdserve-decode")
    assert prefill.parent_span_id == decode.parent_span_id == root.span_id
    for name, parent in (("prefill_worker.queue", prefill), ("prefill_worker.prefill", prefill),
                         ("kv_transfer.send", prefill),
                         ("decode_worker.reserved", decode), ("decode_worker.kv_wait", decode),
                         ("decode_worker.decode", decode)):
        [(_s, sp)] = by_name[name]
        assert sp.parent_span_id == parent.span_id, name
    [(_s, send)] = by_name["kv_transfer.send"]
    kv = _attrs(send)
    assert kv["pdserve.kv.bytes"] > 0 and kv["pdserve.kv.state"] == "done" and kv["pdserve.kv.backend"] == "gloo"
    # the whole trace is one tree: every span's parent is in it, but the root's (the client's)
    ids = {sp.span_id for _s, sp in spans}
    assert all(sp.parent_span_id in ids for _s, sp in spans if sp is not root)
    others = {sp.trace_id.hex() for _s, sp in c.spans} - {CLIENT_TRACE}
    assert len(others) == 1  # the second request: one trace of its own


@pytest.mark.parametrize("bad", ["", "  ", 4317])
def test_a_bad_otlp_endpoint_is_refused_by_the_router_and_worker_configs(bad):
    from prefill_worker import PrefillWorkerConfig
    from router import RouterConfig

    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        RouterConfig(otlp_traces_endpoint=bad)
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        PrefillWorkerConfig("p0", otlp_traces_endpoint=bad)
