"""Run one worker role in a child process (multiprocessing "spawn") for the cross-process tests.

Lifecycle: the parent starts ``run_worker`` in a child; the child builds and starts the
worker, puts ``(grpc_address, kv_name)`` (or an error string) on ``ready_q``, and serves
until ``stop_evt`` is set, then stops the worker and exits.
"""
from __future__ import annotations

import traceback
from typing import Any


def run_worker(role: str, worker_id: str, kv_store: str, engine_kw: dict, ready_q: Any, stop_evt: Any,
               worker_kw: dict | None = None) -> None:
    """``worker_kw``: more WorkerConfig fields (``transfer_timeout_s`` defaults to 20 s)."""
    import torch

    torch.set_num_threads(1)
    from tests.roles.harness import engine_config

    kw = {"transfer_timeout_s": 20.0, **(worker_kw or {})}
    try:
        if role == "prefill":
            from prefill_worker import PrefillWorker, PrefillWorkerConfig

            w = PrefillWorker(PrefillWorkerConfig(worker_id, engine=engine_config(**engine_kw), kv_store=kv_store,
                                                  serve_metrics=False, **kw))
        elif role == "colocated":
            from decode_worker import ColocatedWorker, ColocatedWorkerConfig

            w = ColocatedWorker(ColocatedWorkerConfig(worker_id, engine=engine_config(**engine_kw),
                                                      serve_metrics=False))
        else:
            from decode_worker import DecodeWorker, DecodeWorkerConfig

            w = DecodeWorker(DecodeWorkerConfig(worker_id, engine=engine_config(**engine_kw), kv_store=kv_store,
                                                serve_metrics=False, **kw))
        w.start()
    except BaseException:
        ready_q.put(("error", traceback.format_exc()))
        return
    ready_q.put((w.address, w.cfg.kv_name))
    try:
        stop_evt.wait(300)
    finally:
        w.stop()
