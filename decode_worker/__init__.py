"""The decode role: gRPC servicer, KV reservation and receipt, decode loop, token streaming.

Also the colocated role (one engine prefills and decodes), which streams the same DecodeChunks.
"""
from decode_worker.colocated import ColocatedWorker, ColocatedWorkerConfig
from decode_worker.config import DecodeWorkerConfig
from decode_worker.worker import DecodeWorker

__all__ = ["ColocatedWorker", "ColocatedWorkerConfig", "DecodeWorker", "DecodeWorkerConfig"]
