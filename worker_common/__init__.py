"""What every worker role shares: gRPC serving (health, reflection), the engine thread, the
request bookkeeping of ``WorkerBase`` and the base ``WorkerConfig``.

Lifecycle: nothing runs at import; each role (prefill_worker, decode_worker) builds its worker
on ``WorkerBase`` and a config on ``WorkerConfig``; the router reuses ``GrpcServing``.
"""
from worker_common.config import WorkerConfig
from worker_common.worker_base import RequestError, WorkerBase

__all__ = ["RequestError", "WorkerBase", "WorkerConfig"]
