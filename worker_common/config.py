"""Settings every worker role shares (prefill, decode and colocated configs extend ``WorkerConfig``).

Lifecycle: built by the caller (the cluster's Ray actor, a test, a CLI), checked
once in ``__post_init__`` (``ValueError`` naming the field), then read-only for
the life of the worker.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from transport.ports import check_port


CONTROL_RPC_THREADS = 16
"""gRPC handler threads a worker keeps from request calls, for Reserve, Abort, GetInfo and the routers' output
streams, so those never wait behind requests that hold a thread for their whole life. An output stream holds one
of them for its router's life (one per router): with more than about 12 routers per worker fewer than 4 are left
for the short calls (not made configurable: deployments run a handful of routers)."""


def _default_engine_config() -> Any:
    from engine.config import EngineConfig  # imported lazily: building a config must not load torch models

    return EngineConfig()


@dataclass
class WorkerConfig:
    """Settings every worker role shares."""

    worker_id: str
    """Unique id of this worker in its cluster (also the default kvtransfer endpoint name)."""
    engine: Any = field(default_factory=_default_engine_config)
    """engine.config.EngineConfig of the engine this worker runs."""
    kv_store: Any = None
    """kvtransfer rendezvous: "tcp://host:port", "redis://host:port/db", a StoreConfig or a torch Store."""
    kv_backend: str = "gloo"
    """kvtransfer backend by name: "gloo", "nccl", or "inproc" (same-process tests)."""
    kv_shm: bool = True
    """With gloo: KV to and from a worker on the same host (one ``/dev/shm``) moves through shared memory
    (kvtransfer/shm.py) instead of the loopback socket; False: always the socket."""
    kv_name: Optional[str] = None
    """kvtransfer endpoint name; None means worker_id."""
    host: str = "127.0.0.1"
    """Interface the gRPC server binds."""
    port: int = 0
    """gRPC port; 0 picks a free one."""
    transfer_timeout_s: float = 30.0
    """Deadline of one KV transfer, from submission (covers queueing behind other prompts)."""
    model_name: Optional[str] = None
    """Served model name in WorkerInfo; None means engine.model."""
    max_rpc_threads: Optional[int] = None
    """gRPC handler threads. Each request call (Prefill, Decode, Generate) holds one for the request's life, so
    ``CONTROL_RPC_THREADS`` of them (at most a quarter) are kept for the short calls (Reserve, Abort, GetInfo,
    output streams, health), and a request call beyond the rest is refused with RESOURCE_EXHAUSTED (the router
    tries another worker) instead of waiting for a thread while control calls starve. None: room for twice the
    engine's ``max_num_seqs`` requests (running and as many waiting) plus the control threads, at least 128."""
    serve_metrics: bool = True
    """Serve this worker's Prometheus /metrics on ``host``."""
    metrics_port: int = 0
    """Port of that /metrics; 0 picks a free one (several workers per node). Kubernetes, with one worker per
    pod, sets a fixed one (``PDSERVE_WORKER_METRICS_PORT``) so a PodMonitor can scrape it."""
    node_id: str = ""
    """Where the worker runs (informational, copied into WorkerInfo)."""
    cluster_secret: Optional[str] = field(default=None, repr=False)
    """When set, every call to this worker's gRPC API (Reserve, Prefill, Decode, Generate, Abort, GetInfo) must
    carry it as ``authorization: Bearer <secret>``, else UNAUTHENTICATED before any work; health and reflection
    stay open. Never logged (kept out of repr)."""
    cluster_tls: Optional[Any] = field(default=None, repr=False)
    """A ``transport.cluster_tls.ClusterTls``: serve the gRPC API over TLS, requiring a client certificate the
    cluster CA signed (mutual TLS). None: plaintext (behind the cluster secret)."""

    kv_events_url: Optional[str] = field(default=None, repr=False)
    """Redis the worker publishes its prefix cache's KV events to (``worker_common.kv_events``: stream
    ``{kv_events_namespace}:kvev:{worker_id}``), for the routers' cache-aware routing; None: no events. May carry
    a password, so it is kept out of repr."""
    kv_events_namespace: str = "pdserve"
    """The deployment's namespace (the registry's) the event keys live under."""
    otlp_traces_endpoint: Optional[str] = None
    """OpenTelemetry: export each request's span on this worker (and its phases) to this OTLP/gRPC collector,
    under the router's trace (``transport.tracing``); None: no tracing."""
    stall_timeout_s: float = 60.0
    """A worker whose engine has requests but schedules no token for this long (a hung step, a scheduler that
    admits nothing) reports not ready and leaves routing until it schedules again (``WorkerBase.stalled``). Above
    the longest step the engine can take (a full prefill chunk of the largest model on the slowest device)."""
    engine_process: bool = False
    """Run the engine core in a process of its own (``worker_common.engine_process``): its steps no longer share
    this process's GIL with the gRPC and streaming threads; the OS places both processes. The prefill and decode
    roles' engine process keeps its KV cache in shared memory this process maps (CPU engines only)."""

    role = "worker"

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id or not self.worker_id.isprintable():
            raise ValueError(f"worker_id must be a non-empty printable string, got {self.worker_id!r}")
        if self.kv_name is None:
            self.kv_name = self.worker_id
        check_port(self.port, "port")
        check_port(self.metrics_port, "metrics_port")
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
        if isinstance(self.stall_timeout_s, bool) or not isinstance(self.stall_timeout_s, (int, float)) \
                or not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be a number > 0, got {self.stall_timeout_s!r}")
        if self.max_rpc_threads is not None and (isinstance(self.max_rpc_threads, bool)
                                                 or not isinstance(self.max_rpc_threads, int)
                                                 or self.max_rpc_threads < 2):
            raise ValueError(f"max_rpc_threads must be None or an integer >= 2, got {self.max_rpc_threads!r}")
        if self.cluster_secret is not None and (not isinstance(self.cluster_secret, str) or
                                                len(self.cluster_secret) < 16):
            raise ValueError("cluster_secret must be a string of at least 16 characters (its value is not shown)")
        if self.kv_events_url is not None and (not isinstance(self.kv_events_url, str) or
                                               not self.kv_events_url.startswith(("redis://", "rediss://", "unix://"))):
            raise ValueError("kv_events_url must be None or a redis://, rediss:// or unix:// URL")
        if self.otlp_traces_endpoint is not None and (not isinstance(self.otlp_traces_endpoint, str)
                                                      or not self.otlp_traces_endpoint.strip()):
            raise ValueError(f"otlp_traces_endpoint must be a host:port or URL, got {self.otlp_traces_endpoint!r}")
        if not isinstance(self.kv_events_namespace, str) or not self.kv_events_namespace:
            raise ValueError(f"kv_events_namespace must be a non-empty string, got {self.kv_events_namespace!r}")
        if not isinstance(self.engine_process, bool):
            raise ValueError(f"engine_process must be a bool, got {self.engine_process!r}")
        device = str(getattr(self.engine, "device", "cpu"))
        if self.engine_process and self.role in ("prefill", "decode") and device != "cpu":
            raise ValueError(f"engine_process for the {self.role} role needs a CPU engine, not device "
                             f"{device!r}: its KV cache is shared memory the worker's transfers map (a "
                             "GPU's would need CUDA IPC, which is not built)")
        if not isinstance(self.kv_shm, bool):
            raise ValueError(f"kv_shm must be a bool, got {self.kv_shm!r}")
        if not isinstance(self.kv_backend, str) or not self.kv_backend:
            raise ValueError(f"kv_backend must be a backend name, got {self.kv_backend!r}")

    @property
    def rpc_threads(self) -> int:
        """The gRPC handler threads this worker runs (``max_rpc_threads``, or its automatic size)."""
        if self.max_rpc_threads is not None:
            return self.max_rpc_threads
        seqs = int(getattr(self.engine, "max_num_seqs", 64) or 64)
        return max(128, 2 * seqs + CONTROL_RPC_THREADS)

    @property
    def control_rpc_threads(self) -> int:
        """Handler threads request calls may not take (kept for control calls): ``CONTROL_RPC_THREADS``, at most a
        quarter of the pool, at least 1."""
        return max(1, min(CONTROL_RPC_THREADS, self.rpc_threads // 4))

    @property
    def max_request_calls(self) -> int:
        """Request calls (Prefill, Decode, Generate) held at once before the next is refused."""
        return self.rpc_threads - self.control_rpc_threads

    @property
    def served_model_name(self) -> str:
        from engine import default_served_model_name

        return self.model_name or default_served_model_name(str(getattr(self.engine, "model", "unknown")))
