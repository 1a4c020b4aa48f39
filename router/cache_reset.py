"""vLLM's ``POST /reset_prefix_cache`` across a cluster: every ready worker's engine forgets its cached prompt blocks.

Lifecycle: stateless. The HTTP front end calls ``reset_all(core)`` when ``RouterConfig.allow_prefix_cache_reset`` is
on (off by default, as vLLM serves the route only in its dev mode). Every ready worker of every pool gets
``ResetPrefixCache`` at once (a thread each), each call bounded by ``timeout_s``; the outcome lists the workers
reset, those that refused (a request held blocks there: how many) and those that did not answer. Nothing is
retried: a refused reset is the caller's to repeat once the load is gone (a benchmark between runs, a trainer after
new weights). Each reset engine publishes a CLEARED KV event, so every router's KV index forgets that worker's
blocks as it would after a restart.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from proto import worker_pb2
from router.scope import scrub
from router.worker_source import ROLES


@dataclass
class ResetOutcome:
    """What each ready worker answered, by worker id."""

    reset: list[str] = field(default_factory=list)
    busy: dict[str, int] = field(default_factory=dict)
    """Refused: blocks its requests held."""
    failed: dict[str, str] = field(default_factory=dict)
    """No answer: the call's status and details."""


def reset_all(core: Any, timeout_s: float = 10.0) -> ResetOutcome:
    """``ResetPrefixCache`` on every ready worker ``core`` routes to (its view of the pools), concurrently."""
    stubs = {"prefill": core.clients.prefill, "decode": core.clients.decode, "colocated": core.clients.colocated}
    workers = [w for role in ROLES for w in core.view.list(role) if w.ready and w.role in stubs]

    def one(w: Any) -> Any:
        return stubs[w.role](w.grpc_address).ResetPrefixCache(worker_pb2.ResetPrefixCacheRequest(), timeout=timeout_s)

    out = ResetOutcome()
    if not workers:
        return out
    with ThreadPoolExecutor(len(workers), thread_name_prefix="cache-reset") as pool:
        futures = {w.worker_id: pool.submit(one, w) for w in workers}
    for wid, fut in sorted(futures.items()):
        try:
            answer = fut.result()
        except grpc.RpcError as e:
            out.failed[wid] = f"{e.code().name}: {scrub(e.details() or '')}"
            continue
        if answer.reset:
            out.reset.append(wid)
        else:
            out.busy[wid] = answer.blocks_in_use
    return out
