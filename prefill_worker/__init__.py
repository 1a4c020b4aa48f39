"""The prefill role: gRPC servicer, prefill loop on the engine, hand-off of KV to kvtransfer.

What every role shares (gRPC serving, the engine thread, ``WorkerBase``, ``WorkerConfig``) lives in
``worker_common``.
"""
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.worker import PrefillWorker

__all__ = ["PrefillWorker", "PrefillWorkerConfig"]
