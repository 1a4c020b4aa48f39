"""What every worker role shares: the engine thread, the
request records and sets (``worker_common.request``), wire conversions (``worker_common.wire``),
``WorkerBase`` and the base ``WorkerConfig``.

Lifecycle: nothing runs at import; each role (prefill_worker, decode_worker) builds its worker
on ``WorkerBase``, its requests on ``WorkerRequest``/``RequestSet`` and a config on
``WorkerConfig``. gRPC serving and auth live below, in ``transport``.
"""
from worker_common.config import WorkerConfig
from worker_common.request import RequestError, RequestSet, WorkerRequest
from worker_common.worker_base import WorkerBase

__all__ = ["RequestError", "RequestSet", "WorkerBase", "WorkerConfig", "WorkerRequest"]
