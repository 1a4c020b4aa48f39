"""What the benchmark scripts share: machine info, deployments, trace replay and JSON results.

Lifecycle: nothing runs at import. A script builds its workload (``load_rows``, ``trace_requests``,
``workload_requests``), starts a ``Deployment`` (pinned worker processes and a router) or targets a running
cluster, asks the server's limits (``server_limits``), warms it (``warm_up``), replays (``replay``) and writes its
numbers with the machine they ran on (``write_json``, which adds ``machine_info()`` and the command line).
"""
from __future__ import annotations

from benchmarks.harness.deployment import ROLES_BY_MODE, Deployment, pin_threads, usable_cores
from benchmarks.harness.load import (CONVERSATION_TRACE, REPO, SAMPLE_TRACE, client_config, load_rows, replay,
                                     server_limits, trace_requests, warm_up, workload_requests)
from benchmarks.harness.results import machine_info, write_json

__all__ = ["CONVERSATION_TRACE", "REPO", "ROLES_BY_MODE", "SAMPLE_TRACE", "Deployment", "client_config", "load_rows",
           "machine_info", "pin_threads", "replay", "server_limits", "trace_requests", "usable_cores", "warm_up",
           "workload_requests", "write_json"]
