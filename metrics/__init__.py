"""Prometheus metrics for pdserve components: one registry per component, vLLM names with a ``pdserve:`` prefix,
each series registered and recorded only by the role that owns it (``OWNERS``): ``RouterMetrics`` for the
router's request-level series, ``WorkerMetrics`` for a worker's engine-level ones."""
from metrics.component import ComponentMetrics
from metrics.exporter import serve_registry
from metrics.router_metrics import RouterMetrics
from metrics.series import (
    FINISH_REASONS,
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    KV_TRANSFER_BUCKETS,
    OWNERS,
    PARAMS_N_BUCKETS,
    PREFIX,
    REQUEST_LATENCY_BUCKETS,
    ROLES,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    WORKER_ROLES,
    owner_of,
    series_of,
    token_buckets,
)
from metrics.totals import RunningTotals
from metrics.worker_metrics import WorkerMetrics

__all__ = ["RouterMetrics", "WorkerMetrics", "ComponentMetrics", "RunningTotals", "serve_registry", "PREFIX",
           "ROLES", "WORKER_ROLES", "OWNERS", "owner_of", "series_of", "FINISH_REASONS", "TTFT_BUCKETS",
           "ITL_BUCKETS", "REQUEST_LATENCY_BUCKETS", "KV_TRANSFER_BUCKETS", "TPOT_BUCKETS",
           "ITERATION_TOKENS_BUCKETS", "PARAMS_N_BUCKETS", "token_buckets"]
