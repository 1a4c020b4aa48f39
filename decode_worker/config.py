"""Configuration of a decode worker.

Lifecycle: built by the caller, checked once in ``__post_init__`` (``ValueError``
naming the field), read-only for the life of the worker.
"""
from __future__ import annotations

from dataclasses import dataclass

from worker_common.config import WorkerConfig


@dataclass
class DecodeWorkerConfig(WorkerConfig):
    """A decode worker: reserves KV blocks, receives prompts' KV, decodes with continuous batching."""

    reserve_timeout_s: float = 60.0
    """A reservation whose Decode call never comes (router gone) is freed after this long."""

    role = "decode"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_store is None:
            raise ValueError("kv_store is required for a decode worker (the kvtransfer rendezvous)")
        if not self.reserve_timeout_s > 0:
            raise ValueError(f"reserve_timeout_s must be > 0, got {self.reserve_timeout_s}")
