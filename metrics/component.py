"""What every component's metrics share: a private registry holding its role's series, exposition, /metrics.

Lifecycle: a component builds its role's class (``RouterMetrics`` or ``WorkerMetrics``, both built on
``ComponentMetrics``) once when it starts; the instance owns a private ``CollectorRegistry`` (never the
process-global one), so several workers, or two whole clusters, can live in one process without their
series colliding. The component calls the role's small typed ``observe_*`` / ``inc_*`` / ``set_*``
methods on its hot path, exposes the registry over HTTP with ``serve()`` (a free port by default) and
calls the returned ``stop`` when it shuts down. ``render()`` returns the text exposition for tests and
for components that ship metrics some other way. Each registry also has prometheus-client's process,
platform and GC collectors (``process_*``, ``python_*``: per process, unlabelled), as vLLM's server has.

The series registered are exactly ``series_of(role)`` (``metrics.series``), and a role's class has
recording methods for those series only: a wiring bug (a worker recording a router series) is an
``AttributeError`` where it is written, not a second, meaningless copy of the series.
"""
from __future__ import annotations

from typing import Any, Callable

from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram, PlatformCollector,
                               ProcessCollector, generate_latest)

from metrics.exporter import serve_registry
from metrics.series import (LABELS, MODEL_LEN_BUCKETS, OWNER_ROLES, PREFIX, ROLES, SERIES, Labelled, check_label,
                            owner_of, series_of)


class ComponentMetrics:
    """The pdserve series of one component of ``role``, in a registry of its own."""

    def __init__(self, model_name: str, role: str, worker: str, registry: CollectorRegistry | None = None,
                 token_buckets: tuple[int, ...] = (), process_collectors: bool = True) -> None:
        """``token_buckets``: the buckets of the token-count histograms (the router's; see
        ``metrics.series.token_buckets``). ``process_collectors``: register prometheus-client's process,
        platform and GC collectors (``process_*``, ``python_*``) too, as vLLM's server has them."""
        check_label("model_name", model_name)
        check_label("worker", worker)
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.model_name, self.role, self.worker = model_name, role, worker
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        if process_collectors:
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            GCCollector(registry=self.registry)
        self._labels = labels = (model_name, role, worker)
        # name -> the labelled child, or the parent when the series has one more label (see ``_child``)
        self._series: dict[str, Any] = {}
        for name in series_of(role):
            _owner, kind, doc, extra = SERIES[name]
            full = PREFIX + (name[:-len("_total")] if kind == "counter" else name)
            if kind == "histogram" and isinstance(extra, Labelled):
                self._series[name] = Histogram(full, doc, LABELS + extra.labels, buckets=extra.buckets,
                                               registry=self.registry)
            elif kind == "histogram":
                buckets = token_buckets if extra == MODEL_LEN_BUCKETS else extra
                self._series[name] = Histogram(full, doc, LABELS, buckets=buckets,
                                               registry=self.registry).labels(*labels)
            elif kind == "gauge" and extra is None:
                self._series[name] = Gauge(full, doc, LABELS, registry=self.registry).labels(*labels)
            elif kind == "gauge":
                more = extra if isinstance(extra, tuple) else (extra,)
                self._series[name] = Gauge(full, doc, LABELS + more, registry=self.registry)
            elif extra is None:
                self._series[name] = Counter(full, doc, LABELS, registry=self.registry).labels(*labels)
            else:
                more = extra if isinstance(extra, tuple) else (extra,)
                self._series[name] = Counter(full, doc, LABELS + more, registry=self.registry)

    def owns(self, name: str) -> bool:
        """Whether this component registers the series ``name`` (with or without the prefix)."""
        return self.role in OWNER_ROLES[owner_of(name)]

    def _child(self, name: str, *values: str) -> Any:
        """The child of a series with more labels than the identity ones (a reason, a code, a position)."""
        return self._series[name].labels(*self._labels, *values)

    # --- exposition ---
    def render(self) -> bytes:
        """The registry in Prometheus text format, as /metrics serves it."""
        return generate_latest(self.registry)

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, Callable[[], None]]:
        """Serve /metrics over HTTP; returns ("host:port", stop). Port 0 picks a free port."""
        return serve_registry(self.registry, host, port)
