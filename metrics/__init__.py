"""Prometheus metrics for pdserve components: one registry per component, vLLM names with a ``pdserve:`` prefix."""
from metrics.exporter import serve_registry
from metrics.pdserve_metrics import (
    FINISH_REASONS,
    ITL_BUCKETS,
    KV_TRANSFER_BUCKETS,
    PREFIX,
    REQUEST_LATENCY_BUCKETS,
    ROLES,
    TTFT_BUCKETS,
    PDServeMetrics,
)

__all__ = ["PDServeMetrics", "serve_registry", "PREFIX", "ROLES", "FINISH_REASONS",
           "TTFT_BUCKETS", "ITL_BUCKETS", "REQUEST_LATENCY_BUCKETS", "KV_TRANSFER_BUCKETS"]
