"""A gRPC failure raised without a wire: what an in-process transport (the simulator's workers, tests' fakes)
raises where a real stub would raise ``grpc.RpcError``.

Lifecycle: built and raised per failed call; the caller reads ``code()`` and ``details()`` exactly as it reads
a real call's error, so the router's retry and status-mapping code runs unchanged over it.
"""
from __future__ import annotations

import grpc


class StatusRpcError(grpc.RpcError):
    """A failed call with a status code and details, as the router reads one."""

    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def __repr__(self) -> str:
        return f"StatusRpcError({self._code.name}, {self._details!r})"
