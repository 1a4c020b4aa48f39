"""OpenTelemetry traces of requests across the router and the workers (issue 48 part 1).

Lifecycle: a component started with an OTLP endpoint (``--otlp-traces-endpoint``, as vLLM spells it) builds one
``Tracing(endpoint, service_name)`` when it loads: its own ``TracerProvider`` with a batching OTLP/gRPC exporter (no
process-wide provider, so two clusters in one process export apart) and ``shutdown()``s it when it stops (the
batch is flushed). Without an endpoint ``Tracing(None, ...)`` is off: ``start`` returns None, nothing is imported
from OpenTelemetry, and a request costs one ``if``. The SDK and the exporter are the ``otel`` extra.

A request's context crosses processes as W3C ``traceparent`` (and ``tracestate``): the router reads it from the
client's gRPC metadata or HTTP headers (``carrier``) and starts the request's root span under it, or a new trace;
``metadata(span)`` gives the pairs to send with every worker RPC of the request; a worker ``start``s its span
under what the RPC carried. Phases are recorded as child spans with their measured start and end
(``child(span, name, start, end)``, monotonic seconds, as the roles stamp them), so a span costs no work on the
request path beyond its start and end.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Iterable, Mapping, Optional

log = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
"""The W3C trace-context keys a carrier may hold (lower case: gRPC metadata keys and HTTP headers alike)."""


def _wall_ns(mono_s: float) -> int:
    """A ``time.monotonic()`` instant as Unix nanoseconds (what span times are)."""
    return time.time_ns() - int((time.monotonic() - mono_s) * 1e9)


class Tracing:
    """One component's tracer (see module docstring); ``enabled`` is False without an endpoint."""

    def __init__(self, endpoint: Optional[str], service_name: str, attributes: Optional[Mapping[str, Any]] = None
                 ) -> None:
        self.endpoint = endpoint or None
        self.enabled = self.endpoint is not None
        self._provider: Any = None
        self._tracer: Any = None
        if not self.enabled:
            return
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as e:  # pragma: no cover - the extra is part of [test]
            raise ValueError(f"otlp_traces_endpoint needs the OpenTelemetry SDK and OTLP exporter: "
                             f"pip install 'pdserve[otel]' ({e})") from None
        endpoint_url = self.endpoint
        insecure = not endpoint_url.startswith("https://")
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name,
                                                                  **dict(attributes or {})}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint_url,
                                                                              insecure=insecure),
                                                             schedule_delay_millis=500))
        self._tracer = self._provider.get_tracer("pdserve")

    # ---- context ---------------------------------------------------------------------------------
    @staticmethod
    def carrier(pairs: Optional[Iterable[tuple[str, Any]]]) -> dict[str, str]:
        """The trace-context entries of gRPC metadata or HTTP headers (other keys dropped)."""
        out: dict[str, str] = {}
        for k, v in pairs or ():
            key = str(k).lower()
            if key in TRACE_HEADERS:
                out[key] = v.decode() if isinstance(v, bytes) else str(v)
        return out

    def metadata(self, span: Any) -> tuple[tuple[str, str], ...]:
        """The (key, value) pairs that carry ``span``'s context to a worker RPC (empty when off or no span)."""
        if span is None or not self.enabled:
            return ()
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        out: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(out, context=trace.set_span_in_context(span))
        return tuple(out.items())

    # ---- spans -----------------------------------------------------------------------------------
    def start(self, name: str, carrier: Optional[Mapping[str, str]] = None, start: Optional[float] = None,
              attributes: Optional[Mapping[str, Any]] = None, server: bool = True) -> Any:
        """A span started now (or at monotonic ``start``) under the context in ``carrier`` (none: a new trace);
        None when tracing is off. End it with ``end``."""
        if not self.enabled:
            return None
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        ctx = TraceContextTextMapPropagator().extract(dict(carrier or {}))
        return self._tracer.start_span(name, context=ctx, kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
                                       attributes=dict(attributes or {}),
                                       start_time=None if start is None else _wall_ns(start))

    def child(self, parent: Any, name: str, start: Optional[float], end: Optional[float],
              attributes: Optional[Mapping[str, Any]] = None) -> None:
        """A finished child span of ``parent`` from monotonic ``start`` to ``end`` (skipped when either is
        unknown or tracing is off)."""
        if parent is None or start is None or end is None or not self.enabled:
            return
        from opentelemetry import trace

        span = self._tracer.start_span(name, context=trace.set_span_in_context(parent),
                                       attributes=dict(attributes or {}), start_time=_wall_ns(start))
        span.end(end_time=_wall_ns(max(start, end)))

    @staticmethod
    def end(span: Any, attributes: Optional[Mapping[str, Any]] = None, error: Optional[str] = None,
            end: Optional[float] = None) -> None:
        """End ``span`` (None: nothing) with ``attributes``; ``error``: its status is ERROR with that message."""
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        for k, v in (attributes or {}).items():
            if v is not None:
                span.set_attribute(k, v)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=None if end is None else _wall_ns(end))

    @staticmethod
    def event(span: Any, name: str, attributes: Optional[Mapping[str, Any]] = None) -> None:
        """A point event on ``span`` (a retry, a migration); nothing when it is None."""
        if span is not None:
            span.add_event(name, attributes=dict(attributes or {}))

    def shutdown(self) -> None:
        """Flush and stop the exporter (idempotent)."""
        if self._provider is not None:
            try:
                self._provider.shutdown()
            except Exception as e:  # noqa: BLE001 - a collector that went away must not fail the stop
                log.warning("tracing: shutdown failed: %s", e)
            self._provider = None
            self.enabled = False
