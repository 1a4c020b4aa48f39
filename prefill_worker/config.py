"""Configuration of the prefill role.

Lifecycle: built by the caller (the cluster's Ray actor, a test, a CLI), checked
once in ``__post_init__`` (``ValueError`` naming the field), then read-only for
the life of the worker.
"""
from __future__ import annotations

from dataclasses import dataclass

from worker_common.config import WorkerConfig


@dataclass
class PrefillWorkerConfig(WorkerConfig):
    """A prefill worker: prefills prompts and ships their KV to decode workers."""

    role = "prefill"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_store is None:
            raise ValueError("kv_store is required for a prefill worker (the kvtransfer rendezvous)")
