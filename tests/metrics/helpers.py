"""Helpers of the metrics tests: build a role's metrics, read samples back from the text exposition."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from metrics import ComponentMetrics, RouterMetrics, WorkerMetrics

LABELS = {"model_name": "tiny", "role": "decode", "worker": "decode-0"}
ROUTER = {"model_name": "tiny", "role": "router", "worker": "router"}


def component(model_name: str, role: str, worker: str, **kw) -> ComponentMetrics:
    """The metrics class of ``role``, as the router and the workers build theirs."""
    if role == "router":
        return RouterMetrics(model_name, worker, **kw)
    return WorkerMetrics(model_name, role, worker, **kw)


def router(**kw) -> RouterMetrics:
    return RouterMetrics("tiny", "router", **kw)


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from the text exposition."""
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: bytes, name: str, labels: dict | None = None, **extra: str) -> float:
    return samples(text)[(name, tuple(sorted({**(labels or LABELS), **extra}.items())))]


def families(m: ComponentMetrics) -> dict:
    """{family name: family} of the pdserve series ``m`` exports, the prometheus-client ``_created`` gauges and
    the process/Python collectors left out."""
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())
            if f.name.startswith("pdserve:") and not f.name.endswith("_created")}
