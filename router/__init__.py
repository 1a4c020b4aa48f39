"""The router: public gRPC API, validation, tokenization, worker selection, streaming, cancellation."""
from router.config import RouterConfig
from router.server import RouterServer
from router.worker_source import Pool, StaticWorkerSource, WorkerList, WorkerSource

__all__ = ["Pool", "RouterConfig", "RouterServer", "StaticWorkerSource", "WorkerList", "WorkerSource"]
