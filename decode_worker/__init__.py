"""The decode role: gRPC servicer, KV reservation and receipt, decode loop, token streaming."""
from decode_worker.config import DecodeWorkerConfig
from decode_worker.worker import DecodeWorker

__all__ = ["DecodeWorker", "DecodeWorkerConfig"]
