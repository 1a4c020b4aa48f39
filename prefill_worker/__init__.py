"""The prefill role: gRPC servicer, prefill loop on the engine, hand-off of KV to kvtransfer.

Also home of what every worker role shares (``serving``, ``engine_loop``, ``worker_base``, ``config``).
"""
from prefill_worker.config import PrefillWorkerConfig, WorkerConfig
from prefill_worker.worker import PrefillWorker

__all__ = ["PrefillWorker", "PrefillWorkerConfig", "WorkerConfig"]
